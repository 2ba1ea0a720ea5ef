"""OpenTelemetry spans of requests, built from the timings the worker already records.

Imported only when tracing is on (`worker.service.tracing.make_tracer`). Nothing is timed here: when
an attempt ends, its spans are written at once with the timestamps taken along the way (the entry
read from Redis, the request handed to the engine, and the engine's own `RequestMetrics`), so the
engine's loop carries no tracing code. One attempt of one request is

    pagedq.request      (CONSUMER; its parent: the producer's span, from the request's traceparent)
      pagedq.queue      enqueued (the request's created_ms) -> read from the lane stream (attempt 1)
      pagedq.admission  read -> handed to the engine (decode, checks, chat template, tokenize)
      pagedq.waiting    in the engine's waiting queue -> first scheduled
      pagedq.prefill    first scheduled -> first token (prompt chunks; a resumed attempt's context)
      pagedq.decode     first token -> the engine finished it
      pagedq.publish    finished -> its final event written to Redis and its entry acked

A phase that did not happen (a request cancelled before it was scheduled) is left out. Spans go to
the exporters through a BatchSpanProcessor (OTEL_BSP_* settings), off the event loop. A failure here
is logged and never touches the request.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from worker.service.logging import get_logger

if TYPE_CHECKING:
    from producer_sdk.protocol import GenerateRequest
    from worker.engine.outputs import RequestOutput
    from worker.service.inflight import Entry, InFlight

DEFAULT_SERVICE_NAME = "pagedq-worker"


class JsonLinesSpanExporter(SpanExporter):
    """Writes each finished span as one JSON line (`span_record`) to a file, appending. For debugging
    and tests (`--otel-traces-file`); use OTLP in production."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open until shutdown)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A span as plain data: ids in lowercase hex, times in unix nanoseconds."""
    ctx, parent = span.get_span_context(), span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}" if ctx else None,
        "span_id": f"{ctx.span_id:016x}" if ctx else None,
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "kind": span.kind.name,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()},
        "resource": dict(span.resource.attributes),
    }


def _ns(t: float) -> int:
    return int(t * 1e9)


def _enqueued(req: GenerateRequest, attempt: int, read_at: float) -> float | None:
    """When the request was enqueued (the producer's clock), for a first attempt; never after the
    worker read it (clock skew)."""
    if attempt != 1 or not req.created_ms:
        return None
    return min(req.created_ms / 1000, read_at)


class OtelTracer:
    """`worker.service.tracing.RequestTracer` on the OpenTelemetry SDK, with its own TracerProvider
    (the process-wide one is left alone)."""

    def __init__(self, exporters: Sequence[SpanExporter], *, model: str, consumer: str) -> None:
        resource = Resource.create({"service.instance.id": consumer, "pagedq.model": model})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
        self.provider = TracerProvider(resource=resource)
        for exporter in exporters:
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("pagedq.worker")
        self.propagator = TraceContextTextMapPropagator()
        self.model, self.consumer = model, consumer
        self.log = get_logger("pagedq.tracing", worker=consumer)
        self._failures = 0

    # --- RequestTracer ------------------------------------------------------------------------

    def finished(self, rec: InFlight, out: RequestOutput) -> None:
        self._guarded(self._attempt, rec, out, "finished")

    def handed_over(self, rec: InFlight, out: RequestOutput) -> None:
        self._guarded(self._attempt, rec, out, "handover")

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
        self._guarded(self._early, req, e, attempt, finish_reason, error_code, message)

    def shutdown(self) -> None:
        self.provider.shutdown()

    # --- spans --------------------------------------------------------------------------------

    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as err:  # tracing must never fail a request
            self._failures += 1
            if self._failures <= 3 or self._failures % 1000 == 0:
                self.log.warning("could not record spans", error=f"{type(err).__name__}: {err}", count=self._failures)

    def _attempt(self, rec: InFlight, out: RequestOutput, outcome: str) -> None:
        req, m, now = rec.request, out.metrics, time.time()
        if out.error and outcome == "finished":
            outcome = "error"
        created = _enqueued(req, rec.attempt, rec.read_at)
        added = rec.added_at
        if added is not None and m.first_scheduled is not None:
            added = min(added, m.first_scheduled)  # the engine may schedule it before add_request returns
        phases = [
            ("pagedq.queue", created),
            ("pagedq.admission", rec.read_at),
            ("pagedq.waiting", added),
            ("pagedq.prefill", m.first_scheduled),
            ("pagedq.decode", m.first_token),
            ("pagedq.publish", m.finished),
        ]
        attrs = self._request_attributes(req, rec.stream, rec.entry_id, rec.attempt)
        attrs["pagedq.deliveries"] = rec.deliveries
        attrs["pagedq.outcome"] = outcome
        attrs["gen_ai.usage.input_tokens"] = len(out.prompt_token_ids)
        attrs["gen_ai.usage.output_tokens"] = sum(len(c.token_ids) for c in out.outputs)
        attrs["pagedq.cached_tokens"] = m.num_cached_tokens
        attrs["pagedq.preemptions"] = m.num_preemptions
        if rec.resumed_tokens:
            attrs["pagedq.resumed_tokens"] = rec.resumed_tokens
        status = None
        if out.error:
            code = out.error_code or "engine_error"
            attrs["error.type"] = code
            status = Status(StatusCode.ERROR, f"{code}: {out.error}"[:500])
        elif outcome == "finished":
            reasons = [c.finish_reason or "abort" for c in out.outputs]
            attrs["pagedq.finish_reason"] = reasons[0]
            attrs["gen_ai.response.finish_reasons"] = reasons
        self._write(req, phases, now, attrs, status)

    def _early(
        self, req: GenerateRequest, e: Entry, attempt: int, finish_reason: str | None, code: str | None, message: str
    ) -> None:
        created = _enqueued(req, attempt, e.read_at)
        attrs = self._request_attributes(req, e.stream, e.entry_id, attempt)
        attrs["pagedq.deliveries"] = e.deliveries
        status = None
        if code is not None:
            attrs["pagedq.outcome"] = "refused"
            attrs["error.type"] = code
            status = Status(StatusCode.ERROR, f"{code}: {message}"[:500])
        else:
            attrs["pagedq.outcome"] = "answered"
            attrs["pagedq.finish_reason"] = finish_reason or "abort"
            attrs["gen_ai.response.finish_reasons"] = [finish_reason or "abort"]
        self._write(req, [("pagedq.queue", created), ("pagedq.admission", e.read_at)], time.time(), attrs, status)

    def _request_attributes(self, req: GenerateRequest, stream: str, entry_id: str, attempt: int) -> dict[str, Any]:
        sp = req.sampling
        attrs: dict[str, Any] = {
            "pagedq.request_id": req.request_id,
            "pagedq.model": self.model,
            "pagedq.worker": self.consumer,
            "pagedq.attempt": attempt,
            "pagedq.priority": req.priority,
            "messaging.system": "redis",
            "messaging.operation.type": "process",
            "messaging.destination.name": stream,
            "messaging.message.id": entry_id,
            "gen_ai.request.model": self.model,
            "gen_ai.request.choice.count": sp.n,
        }
        for name, value in (("temperature", sp.temperature), ("top_p", sp.top_p)):
            if value is not None:  # unset: the model's default, applied on the engine thread
                attrs[f"gen_ai.request.{name}"] = value
        if sp.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = sp.max_tokens
        return attrs

    def _parent(self, req: GenerateRequest) -> Context:
        if req.traceparent is None:
            return Context()
        carrier = {"traceparent": req.traceparent}
        if req.tracestate:
            carrier["tracestate"] = req.tracestate
        return self.propagator.extract(carrier)

    def _write(
        self,
        req: GenerateRequest,
        phases: list[tuple[str, float | None]],
        end: float,
        attrs: dict[str, Any],
        status: Status | None,
    ) -> None:
        """The request span and its phases: each phase lasts from its start to the next phase's (the
        last one to `end`); phases without a start are left out, and times never run backwards."""
        marks: list[tuple[str, float]] = []
        for name, t in phases:
            if t is not None:
                marks.append((name, max(t, marks[-1][1]) if marks else t))
        start = marks[0][1] if marks else end
        end = max(end, start)
        span = self.tracer.start_span(
            "pagedq.request", context=self._parent(req), kind=SpanKind.CONSUMER, attributes=attrs, start_time=_ns(start)
        )
        inside = trace.set_span_in_context(span)
        for i, (name, t) in enumerate(marks):
            until = marks[i + 1][1] if i + 1 < len(marks) else end
            self.tracer.start_span(name, context=inside, start_time=_ns(t)).end(end_time=_ns(until))
        if status is not None:
            span.set_status(status)
        span.end(end_time=_ns(end))


__all__ = ["DEFAULT_SERVICE_NAME", "JsonLinesSpanExporter", "OtelTracer", "span_record"]
