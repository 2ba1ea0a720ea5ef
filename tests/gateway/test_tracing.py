"""The gateway carries an HTTP caller's W3C trace context to the worker: the worker's request span
(written by the shared worker's own `--otel-traces-file` exporter) sits under the caller's span."""

from __future__ import annotations

import openai

from tests.service.test_tracing_service import read_spans
from tests.service.worker_proc import wait_until

HI = [{"role": "user", "content": "hello"}]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def _request_span(path, request_id: str) -> dict:
    found: list[dict] = []

    def exported() -> bool:
        found[:] = [s for s in read_spans(path) if s["attributes"].get("pagedq.request_id") == request_id]
        return bool(found)

    wait_until(exported, 30, f"the worker's span of {request_id}")
    return found[-1]


def test_a_callers_traceparent_is_the_parent_of_the_workers_span(gateway, gw_spans):
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="default",
        messages=HI,
        max_tokens=4,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": "vendor=abc"},
    )
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
    span = _request_span(gw_spans, raw.headers["pagedq-request-id"])
    assert (span["trace_id"], span["parent_span_id"]) == (TRACE_ID, PARENT_ID)


def test_a_malformed_traceparent_is_ignored_not_refused(gateway, gw_spans):
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=HI, max_tokens=4, extra_headers={"traceparent": "00-not-a-trace-01"}
    )
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
    span = _request_span(gw_spans, raw.headers["pagedq-request-id"])
    assert span["trace_id"] != TRACE_ID and not span["parent_span_id"]
