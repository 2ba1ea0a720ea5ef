"""Prometheus metrics of a gateway process (`GET /metrics`), and the ASGI middleware that counts
requests by route and status."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pagedq_gateway_requests", "HTTP requests answered, by route and status", ["route", "status"], registry=r
        )
        self.open_streams = Gauge("pagedq_gateway_open_streams", "SSE responses being streamed now", registry=r)
        self.ttfb = Histogram(
            "pagedq_gateway_time_to_first_byte_seconds",
            "Request received to the first byte of generated output written (streams) or to the whole "
            "answer (non-streamed)",
            ["route"],
            buckets=_TTFB_BUCKETS,
            registry=r,
        )
        self.cancels = Counter(
            "pagedq_gateway_disconnect_cancels", "Requests cancelled because their client went away", registry=r
        )
        # Limits on what one client can hold (docs/gateway.md, "Limits").
        self.open_connections = Gauge("pagedq_gateway_open_connections", "HTTP connections open now", registry=r)
        self.stalled_connections = Gauge(
            "pagedq_gateway_stalled_connections",
            "Connections whose client is not reading: their write buffer is over --write-buffer-bytes",
            registry=r,
        )
        self.limit_closes = Counter(
            "pagedq_gateway_limit_closes",
            "Connections the gateway closed at a limit, by reason: header_timeout, headers_too_large, "
            "body_timeout, send_timeout, too_many_connections",
            ["reason"],
            registry=r,
        )
        self.streams_refused = Counter(
            "pagedq_gateway_streams_refused",
            "Streams refused with a 429 because their API key had --max-streams-per-key open",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountRequests:
    """ASGI middleware: one count per HTTP response, labelled with the route's path template."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "other"
            self.metrics.requests.labels(label, str(status[0])).inc()
