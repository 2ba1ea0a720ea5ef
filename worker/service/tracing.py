"""Request tracing: whether it is on, what it needs, and the one object the service calls.

Tracing is on when a worker is given somewhere to send spans: `--otlp-traces-endpoint` (or the
standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) and/or `--otel-traces-file`; OTEL_SDK_DISABLED=true
turns it off. Off, nothing imports OpenTelemetry and the service holds `None` instead of a tracer,
so the request path only tests `tracer is not None`. On, `worker.service.otel` builds the spans
from the timings the worker already records (docs/observability.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from producer_sdk.protocol import GenerateRequest
    from worker.engine.outputs import RequestOutput
    from worker.service.config import ServiceConfig
    from worker.service.inflight import Entry, InFlight

OTLP_PROTOCOLS = {  # OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL -> (module of its span exporter, its package)
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "opentelemetry-exporter-otlp-proto-grpc"),
    "http/protobuf": (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "opentelemetry-exporter-otlp-proto-http",
    ),
}


class TracingUnavailable(RuntimeError):
    """Tracing is configured but cannot run here (a package is missing, a setting is wrong)."""


@dataclass(frozen=True)
class TracingSettings:
    otlp: bool  # export over OTLP
    otlp_endpoint: str | None  # None: the exporter reads OTEL_EXPORTER_OTLP_TRACES_ENDPOINT itself
    otlp_protocol: str  # a key of OTLP_PROTOCOLS
    file: str | None  # JSON lines of finished spans (worker.service.otel.JsonLinesSpanExporter)


def tracing_settings(cfg: ServiceConfig, environ: Mapping[str, str] = os.environ) -> TracingSettings | None:
    """What the options and the environment ask for; None when tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint = cfg.otlp_traces_endpoint or None
    otlp = endpoint is not None or bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    if not otlp and not cfg.otel_traces_file:
        return None
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()
    if otlp and protocol not in OTLP_PROTOCOLS:
        raise TracingUnavailable(
            f"OTLP protocol {protocol!r} is not supported for traces: use one of {', '.join(OTLP_PROTOCOLS)} "
            "(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL)"
        )
    return TracingSettings(otlp, endpoint, protocol, cfg.otel_traces_file or None)


def check_tracing(settings: TracingSettings | None) -> None:
    """Raise TracingUnavailable, naming what to install, when the packages tracing needs are missing.
    Run at start-up, before the model loads."""
    if settings is None:
        return
    import importlib.util

    if importlib.util.find_spec("opentelemetry") is None or importlib.util.find_spec("opentelemetry.sdk") is None:
        raise TracingUnavailable(
            "tracing is configured (--otlp-traces-endpoint, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
            "--otel-traces-file) but the OpenTelemetry SDK is not installed: pip install 'pagedq[otel]'"
        )
    if settings.otlp:
        module, package = OTLP_PROTOCOLS[settings.otlp_protocol]
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise TracingUnavailable(
                f"OTLP trace export ({settings.otlp_protocol}) is configured but its exporter is not "
                f"installed: pip install {package}"
            )


class RequestTracer(Protocol):
    """What the service reports; each call writes the spans of one attempt of one request."""

    def finished(self, rec: InFlight, out: RequestOutput) -> None:
        """Its final event (Finished or Error) is written."""

    def handed_over(self, rec: InFlight, out: RequestOutput) -> None:
        """Stopped here and released for another worker to resume (shutdown)."""

    def ended_early(
        self,
        req: GenerateRequest,
        e: Entry,
        attempt: int,
        *,
        finish_reason: str | None = None,
        error_code: str | None = None,
        message: str = "",
    ) -> None:
        """Answered at intake without compute (`finish_reason`: cancelled, past its deadline) or
        refused there (`error_code`, `message`)."""

    def shutdown(self) -> None:
        """Export what is buffered and stop (blocks, up to the exporters' timeouts)."""


def make_tracer(cfg: ServiceConfig, *, model: str, consumer: str) -> RequestTracer | None:
    """The service's tracer, or None when tracing is off (nothing of OpenTelemetry is imported then)."""
    settings = tracing_settings(cfg)
    if settings is None:
        return None
    check_tracing(settings)
    import importlib

    from worker.service.otel import JsonLinesSpanExporter, OtelTracer

    exporters = []
    if settings.otlp:
        module = importlib.import_module(OTLP_PROTOCOLS[settings.otlp_protocol][0])
        kwargs = {"endpoint": settings.otlp_endpoint} if settings.otlp_endpoint else {}
        exporters.append(module.OTLPSpanExporter(**kwargs))
    if settings.file:
        exporters.append(JsonLinesSpanExporter(settings.file))
    return OtelTracer(exporters, model=model, consumer=consumer)
