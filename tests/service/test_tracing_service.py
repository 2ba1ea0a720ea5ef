"""Traces across the queue: a producer's span, the request's W3C trace context in Redis, and the spans
of real worker processes (written by their `--otel-traces-file` exporter, the product's own)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from producer_sdk import Client
from producer_sdk.protocol import Tokens
from tests.service.worker_proc import WorkerProc, response_events, wait_until

PHASES = ["pagedq.queue", "pagedq.admission", "pagedq.waiting", "pagedq.prefill", "pagedq.decode", "pagedq.publish"]
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # the batch processor's delay, ms


def read_spans(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def request_spans(path: Path, request_id: str) -> dict[str, dict] | None:
    """The request span of `request_id` and its children by name, once all of them are exported."""
    spans = read_spans(path)
    roots = [s for s in spans if s["attributes"].get("pagedq.request_id") == request_id]
    if not roots:
        return None
    root = roots[-1]
    children = {s["name"]: s for s in spans if s["parent_span_id"] == root["span_id"]}
    return {"pagedq.request": root, **children} if children else None


def producer_tracer() -> tuple[InMemorySpanExporter, object]:
    """A producer's own OpenTelemetry setup (not the global provider: tests share the process)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider.get_tracer("agent")


def test_the_producers_span_is_the_parent_of_the_workers_request_span(llama_dir, redis_url, tmp_path):
    path = tmp_path / "spans.jsonl"
    w = WorkerProc(llama_dir, redis_url, "--otel-traces-file", str(path), metrics=False, env=FAST_EXPORT)
    exporter, tracer = producer_tracer()
    try:
        with Client(redis_url) as client:
            with tracer.start_as_current_span("cancelled step"):  # cancelled while no worker runs
                client.submit("never run", max_tokens=4, request_id="cancelled-01").cancel()
            w.start()
            with tracer.start_as_current_span("agent step"):
                done = client.generate(
                    "trace me", max_tokens=6, temperature=0, ignore_eos=True, request_id="traced-001"
                )
            client.generate("not traced", max_tokens=2, request_id="untraced-01")
            finished_at = time.time()
        got = wait_until(lambda: request_spans(path, "traced-001"), 30, "the worker's spans")
        plain = wait_until(lambda: request_spans(path, "untraced-01"), 30, "the untraced request's spans")
        answered = wait_until(lambda: request_spans(path, "cancelled-01"), 30, "the cancelled request's spans")
    finally:
        w.stop()

    cancelled_step, producer = exporter.get_finished_spans()
    root = got["pagedq.request"]
    assert root["trace_id"] == f"{producer.context.trace_id:032x}"
    assert root["parent_span_id"] == f"{producer.context.span_id:016x}"
    assert root["kind"] == "CONSUMER" and root["status"]["code"] == "UNSET"
    attrs = root["attributes"]
    assert attrs["pagedq.attempt"] == 1 and attrs["pagedq.worker"] == "w1" and attrs["pagedq.model"] == "default"
    assert attrs["pagedq.finish_reason"] == "length" == done.finish_reason
    assert attrs["gen_ai.usage.output_tokens"] == 6
    assert attrs["gen_ai.usage.input_tokens"] == done.usage.prompt_tokens
    assert "pagedq.resumed_tokens" not in attrs
    assert root["resource"]["service.name"] == "pagedq-worker"

    # Every phase happened, in order, end to end inside the request span and inside the producer's.
    assert sorted(got) == sorted(["pagedq.request", *PHASES])
    spans = [got[name] for name in PHASES]
    assert all(s["trace_id"] == root["trace_id"] for s in spans)
    assert spans[0]["start_time_unix_nano"] == root["start_time_unix_nano"]
    assert spans[-1]["end_time_unix_nano"] == root["end_time_unix_nano"]
    for a, b in itertools.pairwise(spans):
        assert a["end_time_unix_nano"] == b["start_time_unix_nano"]
    for s in spans:
        assert s["end_time_unix_nano"] >= s["start_time_unix_nano"]
    assert producer.start_time - 1e9 <= root["start_time_unix_nano"]  # enqueued in the producer's span
    assert root["end_time_unix_nano"] <= finished_at * 1e9 + 1e6  # the final event was written before the read
    total_s = (root["end_time_unix_nano"] - root["start_time_unix_nano"]) / 1e9
    assert 0 < total_s < 60

    # A request submitted outside any span starts a trace of its own.
    assert plain["pagedq.request"]["parent_span_id"] is None
    assert plain["pagedq.request"]["trace_id"] != root["trace_id"]

    # Answered at intake without compute: a span in its producer's trace, with no engine phase.
    assert answered["pagedq.request"]["parent_span_id"] == f"{cancelled_step.context.span_id:016x}"
    assert answered["pagedq.request"]["attributes"]["pagedq.outcome"] == "answered"
    assert answered["pagedq.request"]["attributes"]["pagedq.finish_reason"] == "abort"
    assert sorted(answered) == ["pagedq.admission", "pagedq.queue", "pagedq.request"]


def test_the_trace_context_survives_a_worker_crash_and_the_resume(llama_dir, redis_url, tmp_path):
    """The doomed worker dies right before its final write; the rescuer resumes the request from
    Redis, and its span (attempt 2) joins the producer's trace."""
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    doomed_spans, rescuer_spans = tmp_path / "doomed.jsonl", tmp_path / "rescuer.jsonl"
    doomed = WorkerProc(
        llama_dir,
        redis_url,
        "--otel-traces-file",
        str(doomed_spans),
        name="doomed",
        metrics=False,
        env={**FAST_EXPORT, "PAGEDQ_FAULT_EXIT_BEFORE_FINAL_PUBLISH": "1"},
    ).start()
    rescuer = WorkerProc(
        llama_dir,
        redis_url,
        "--otel-traces-file",
        str(rescuer_spans),
        "--claim-idle-ms",
        "1000",
        name="rescuer",
        metrics=False,
        env=FAST_EXPORT,
    )
    try:
        with Client(redis_url) as client:
            handle = client.submit(
                "resume me",
                max_tokens=24,
                temperature=0,
                ignore_eos=True,
                request_id="resumed-001",
                traceparent=f"00-{trace_id}-{parent_id}-01",
                tracestate="vendor=opaque",
            )
            assert doomed.wait(60) == 137
            rescuer.start()
            assert len(handle.result(timeout=60).token_ids) == 24
        got = wait_until(lambda: request_spans(rescuer_spans, "resumed-001"), 30, "the rescuer's spans")
    finally:
        rescuer.stop()
        doomed.stop()
    root = got["pagedq.request"]
    assert (root["trace_id"], root["parent_span_id"]) == (trace_id, parent_id)
    assert root["attributes"]["pagedq.attempt"] == 2 and root["attributes"]["pagedq.worker"] == "rescuer"
    assert "pagedq.queue" not in got and {"pagedq.admission", "pagedq.decode", "pagedq.publish"} <= set(got)
    assert request_spans(doomed_spans, "resumed-001") is None  # it died before its final event
    before = sum(
        len(e.token_ids) for e in response_events(redis_url, "resumed-001") if isinstance(e, Tokens) and e.attempt == 1
    )
    assert root["attributes"].get("pagedq.resumed_tokens", 0) == before


@pytest.mark.skipif(
    importlib.util.find_spec("opentelemetry.exporter") is not None, reason="an OTLP exporter is installed here"
)
def test_otlp_without_its_exporter_stops_the_worker_before_the_model_loads(llama_dir):
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "worker.cli", "worker", "--model", str(llama_dir), "--device", "cpu"),
            *("--otlp-traces-endpoint", "http://127.0.0.1:4317"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "pip install opentelemetry-exporter-otlp-proto-grpc" in proc.stderr
    assert "loading model" not in proc.stderr
