"""The worker's spans, built from recorded timings (worker.service.otel), and when tracing is on."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from producer_sdk.contract import keys
from producer_sdk.protocol import GenerateRequest, SamplingParams
from worker.engine.outputs import CompletionOutput, RequestOutput
from worker.engine.request import RequestMetrics
from worker.service.config import ServiceConfig
from worker.service.inflight import Entry, InFlight
from worker.service.otel import OtelTracer
from worker.service.tracing import TracingUnavailable, check_tracing, make_tracer, tracing_settings

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TP = f"00-{TRACE_ID}-{PARENT_ID}-01"
T0 = 1_700_000_000.0
PHASES = ["pagedq.queue", "pagedq.admission", "pagedq.waiting", "pagedq.prefill", "pagedq.decode", "pagedq.publish"]


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    tracer = OtelTracer([exporter], model="tiny", consumer="w1")

    def spans():
        tracer.provider.force_flush()
        return {s.name: s for s in exporter.get_finished_spans()}

    yield tracer, spans
    tracer.shutdown()


def request(traceparent: str | None = TP, **kw) -> GenerateRequest:
    return GenerateRequest(
        v=1,
        request_id="trace-req-0001",
        prompt="hi",
        created_ms=int(T0 * 1000),
        traceparent=traceparent,
        sampling=SamplingParams(max_tokens=8, temperature=0.0),
        **kw,
    )


def in_flight(req: GenerateRequest, *, attempt: int = 1, added: float | None = T0 + 0.2) -> InFlight:
    return InFlight(
        request_id=req.request_id,
        lane="normal",
        stream=keys.lane_stream("tiny"),
        entry_id="1700000000000-0",
        request=req,
        max_events=100,
        attempt=attempt,
        read_at=T0 + 0.1,
        added_at=added,
    )


def output(req: GenerateRequest, metrics: RequestMetrics, *, error: str | None = None) -> RequestOutput:
    done = CompletionOutput(index=0, text="ab", token_ids=[5, 6, 7], finish_reason="length")
    return RequestOutput(req.request_id, req.prompt, [1, 2, 3, 4], [done], True, metrics, error=error)


def full_metrics() -> RequestMetrics:
    return RequestMetrics(arrival=T0, first_scheduled=T0 + 0.3, first_token=T0 + 0.4, finished=T0 + 0.6)


def test_a_finished_request_is_one_span_under_the_producers_with_its_phases(traced):
    tracer, spans = traced
    req = request(tracestate="congo=t61rcWkgMzE")
    tracer.finished(in_flight(req), output(req, full_metrics()))
    got = spans()
    assert sorted(got) == sorted(["pagedq.request", *PHASES])
    root = got["pagedq.request"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == PARENT_ID and root.parent.is_remote
    assert root.context.trace_state.get("congo") == "t61rcWkgMzE"
    assert root.kind.name == "CONSUMER"
    starts = [T0, T0 + 0.1, T0 + 0.2, T0 + 0.3, T0 + 0.4, T0 + 0.6]
    for name, start in zip(PHASES, starts):
        span = got[name]
        assert span.parent.span_id == root.context.span_id and span.context.trace_id == root.context.trace_id
        assert span.start_time == pytest.approx(start * 1e9, abs=1e3)
    for a, b in itertools.pairwise(PHASES):
        assert got[a].end_time == got[b].start_time
    assert root.start_time == got["pagedq.queue"].start_time and root.end_time == got["pagedq.publish"].end_time
    attrs = root.attributes
    assert attrs["pagedq.request_id"] == "trace-req-0001" and attrs["pagedq.model"] == "tiny"
    assert attrs["pagedq.attempt"] == 1 and attrs["pagedq.outcome"] == "finished"
    assert attrs["gen_ai.usage.input_tokens"] == 4 and attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["pagedq.finish_reason"] == "length" and list(attrs["gen_ai.response.finish_reasons"]) == ["length"]
    assert attrs["messaging.destination.name"] == keys.lane_stream("tiny")
    assert root.resource.attributes["service.name"] == "pagedq-worker"
    assert root.resource.attributes["service.instance.id"] == "w1"


def test_times_never_run_backwards(traced):
    """The engine may schedule a request before add_request returns on the tokenizer thread."""
    tracer, spans = traced
    req = request()
    tracer.finished(in_flight(req, added=T0 + 0.35), output(req, full_metrics()))
    got = spans()
    assert got["pagedq.waiting"].end_time == got["pagedq.waiting"].start_time == got["pagedq.prefill"].start_time
    for span in got.values():
        assert span.end_time >= span.start_time


def test_a_resumed_attempt_starts_when_its_worker_took_it(traced):
    tracer, spans = traced
    req = request()
    rec = in_flight(req, attempt=2)
    rec.delivered = [[5, 6, 7]]  # everything published so far, this attempt's token included
    rec.resumed_tokens = 2
    tracer.finished(rec, output(req, full_metrics()))
    got = spans()
    assert "pagedq.queue" not in got
    root = got["pagedq.request"]
    assert root.start_time == pytest.approx((T0 + 0.1) * 1e9, abs=1e3)
    assert root.attributes["pagedq.attempt"] == 2 and root.attributes["pagedq.resumed_tokens"] == 2
    assert f"{root.parent.span_id:016x}" == PARENT_ID


def test_an_engine_error_and_a_request_never_scheduled(traced):
    tracer, spans = traced
    req = request()
    metrics = RequestMetrics(arrival=T0, finished=T0 + 0.25)  # aborted while waiting
    tracer.finished(in_flight(req), output(req, metrics, error="boom"))
    got = spans()
    assert sorted(got) == sorted(
        ["pagedq.request", "pagedq.queue", "pagedq.admission", "pagedq.waiting", "pagedq.publish"]
    )
    root = got["pagedq.request"]
    assert root.status.status_code is StatusCode.ERROR and root.attributes["error.type"] == "engine_error"
    assert root.attributes["pagedq.outcome"] == "error"


def test_answered_and_refused_at_intake(traced):
    tracer, spans = traced
    req = request()
    entry = Entry("normal", keys.lane_stream("tiny"), "1-0", {}, read_at=T0 + 0.1)
    tracer.ended_early(req, entry, 1, finish_reason="deadline")
    got = spans()
    assert sorted(got) == ["pagedq.admission", "pagedq.queue", "pagedq.request"]
    assert got["pagedq.request"].attributes["pagedq.finish_reason"] == "deadline"
    tracer.ended_early(req, entry, 1, error_code="duplicate", message="already running")
    refused = [s for s in spans().values() if s.attributes.get("pagedq.outcome") == "refused"]
    assert refused and refused[0].status.status_code is StatusCode.ERROR


def test_without_traceparent_the_request_starts_a_trace_and_unsampled_parents_are_honoured(traced):
    tracer, spans = traced
    req = request(traceparent=None)
    tracer.finished(in_flight(req), output(req, full_metrics()))
    assert spans()["pagedq.request"].parent is None
    exporter_spans = len(spans())
    req = request(traceparent=f"00-{TRACE_ID}-{PARENT_ID}-00")  # the producer did not sample it
    tracer.finished(in_flight(req), output(req, full_metrics()))
    assert len(spans()) == exporter_spans


def test_a_tracing_failure_never_reaches_the_request(traced):
    tracer, spans = traced
    req = request()
    tracer.finished(in_flight(req), None)  # type: ignore[arg-type]
    assert spans() == {}


# --- when tracing is on ---------------------------------------------------------------------------


def test_tracing_is_off_unless_configured(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    cfg = ServiceConfig()
    assert tracing_settings(cfg, {}) is None
    assert make_tracer(cfg, model="m", consumer="c") is None
    on = tracing_settings(ServiceConfig(otlp_traces_endpoint="http://collector:4317"), {})
    assert on is not None and on.otlp and on.otlp_endpoint == "http://collector:4317" and on.otlp_protocol == "grpc"
    env = tracing_settings(
        cfg,
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        },
    )
    assert env is not None and env.otlp and env.otlp_endpoint is None and env.otlp_protocol == "http/protobuf"
    assert tracing_settings(ServiceConfig(otel_traces_file="/tmp/x"), {"OTEL_SDK_DISABLED": "true"}) is None
    with pytest.raises(TracingUnavailable, match="not supported"):
        tracing_settings(cfg, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "x", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


@pytest.mark.skipif(
    importlib.util.find_spec("opentelemetry.exporter") is not None, reason="an OTLP exporter is installed here"
)
def test_a_missing_otlp_exporter_is_named_at_startup():
    settings = tracing_settings(ServiceConfig(otlp_traces_endpoint="http://collector:4317"), {})
    with pytest.raises(TracingUnavailable, match="pip install opentelemetry-exporter-otlp-proto-grpc"):
        check_tracing(settings)


def test_the_json_lines_exporter(tmp_path):
    path = tmp_path / "spans.jsonl"
    tracer = make_tracer(ServiceConfig(otel_traces_file=str(path)), model="tiny", consumer="w9")
    assert tracer is not None
    req = request()
    tracer.finished(in_flight(req), output(req, full_metrics()))
    tracer.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_name = {r["name"]: r for r in lines}
    root = by_name["pagedq.request"]
    assert root["trace_id"] == TRACE_ID and root["parent_span_id"] == PARENT_ID
    assert by_name["pagedq.decode"]["parent_span_id"] == root["span_id"]
    assert root["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    assert root["resource"]["service.instance.id"] == "w9" and root["status"]["code"] == "UNSET"
    assert isinstance(root["start_time_unix_nano"], int) and root["end_time_unix_nano"] > root["start_time_unix_nano"]


def test_a_producer_clock_ahead_of_the_worker_never_starts_the_queue_after_the_read(traced):
    tracer, spans = traced
    req = request()
    req.created_ms = int((T0 + 5) * 1000)  # the producer's clock runs 5 s ahead
    tracer.finished(in_flight(req), output(req, full_metrics()))
    got = spans()
    assert got["pagedq.queue"].start_time == got["pagedq.queue"].end_time == got["pagedq.admission"].start_time
    assert got["pagedq.admission"].start_time == pytest.approx((T0 + 0.1) * 1e9, abs=1e3)


def test_tracing_off_imports_no_opentelemetry():
    code = (
        "import sys; import worker.service.server; from worker.service.config import ServiceConfig; "
        "from worker.service.tracing import make_tracer; "
        "assert make_tracer(ServiceConfig(), model='m', consumer='c') is None; "
        "assert not any(m.startswith('opentelemetry') for m in sys.modules), 'imported'"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PAGEDQ_OT"))}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
