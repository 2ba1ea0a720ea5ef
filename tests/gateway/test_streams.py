"""Streams that outlive their connection: resume on another gateway after a SIGKILL, cancel on a
closed stream, and a retried POST (same Idempotency-Key) that attaches to the same generation."""

from __future__ import annotations

import http.client
import json
import uuid

import openai
import pytest

from producer_sdk.protocol import Finished, Started
from tests.gateway.gateway_proc import SSE, GatewayProc, chunk_text, request
from tests.service.worker_proc import response_events, wait_until

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Tell me a long story about queues."}]
LONG = {"model": "default", "messages": MESSAGES, "max_tokens": 80, "temperature": 0, "ignore_eos": True}


def joined(events) -> str:
    return "".join(chunk_text(data) for _, data in events if data != "[DONE]")


def event_ids(events) -> list[int]:
    return [int(i) for i, _ in events if i is not None]


def test_sigkill_mid_stream_then_resume_on_another_gateway(gateway, gw_redis_url):
    reference = list(SSE(gateway.port, "POST", CHAT, {**LONG, "stream": True}).events())
    assert reference[-1][1] == "[DONE]"
    assert event_ids(reference) == list(range(len(event_ids(reference))))  # one id per event, from 0

    doomed = GatewayProc(gw_redis_url).start()
    try:
        s = SSE(doomed.port, "POST", CHAT, {**LONG, "stream": True}, headers={"pagedq-resumable": "true"})
        rid = s.headers["pagedq-request-id"]
        seen = []
        for event in s.events():
            seen.append(event)
            if len(seen) == 6:
                break
        doomed.kill()
        assert not any(isinstance(e, Finished) for e in response_events(gw_redis_url, rid)), "killed too late"
    finally:
        doomed.stop()
    last = seen[-1][0]
    resumed = SSE(gateway.port, "GET", f"{CHAT}/chatcmpl-{rid}?stream=true", headers={"Last-Event-ID": last})
    assert resumed.status == 200
    rest = list(resumed.events())
    assert rest[-1][1] == "[DONE]"
    ids = event_ids(seen + rest)
    assert ids == list(range(len(ids))), "every event exactly once, in order"
    assert joined(seen + rest) == joined(reference)
    assert json.loads(rest[-2][1])["choices"][0]["finish_reason"] == "length"

    # Without stream=true: the finished object, from any gateway; the bare request id works too.
    status, _, body = request(gateway.port, "GET", f"{CHAT}/{rid}")
    whole = json.loads(body)
    assert status == 200 and whole["id"] == f"chatcmpl-{rid}" and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == joined(reference)
    # A resume from the very start replays everything; past the end only [DONE] is left.
    assert joined(SSE(gateway.port, "GET", f"{CHAT}/{rid}?stream=true").events()) == joined(reference)
    tail = list(SSE(gateway.port, "GET", f"{CHAT}/{rid}?stream=true", headers={"Last-Event-ID": str(ids[-1])}).events())
    assert tail == [(None, "[DONE]")]
    assert request(gateway.port, "GET", f"/v1/completions/{rid}")[0] == 404  # a chat id is no completion
    assert request(gateway.port, "GET", f"{CHAT}/chatcmpl-{uuid.uuid4().hex}")[0] == 404


def test_a_closed_stream_cancels_its_request(gateway, gw_worker, gw_redis_url):
    aborts = gw_worker.metric("pagedq_request_success_total", finished_reason="abort")
    body = {"model": "default", "prompt": "cancel me", "max_tokens": 400, "ignore_eos": True, "stream": True}
    s = SSE(gateway.port, "POST", "/v1/completions", body)
    rid = s.headers["pagedq-request-id"]
    for n, _ in enumerate(s.events()):
        if n == 3:
            break
    s.close()
    wait_until(
        lambda: gw_worker.metric("pagedq_request_success_total", finished_reason="abort") == aborts + 1,
        what="the worker to abort the request",
    )
    events = response_events(gw_redis_url, rid)
    assert events[-1].finish_reason == "abort" and events[-1].usage.completion_tokens < 400
    wait_until(lambda: gw_worker.metric("pagedq_kv_cache_usage_perc") == 0.0, what="KV blocks to be freed")
    assert gw_worker.metric("pagedq_num_requests_running") == 0
    assert gateway.metric("pagedq_gateway_disconnect_cancels_total") >= 1

    # A non-streamed request whose client gives up is cancelled too.
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=0.5)
    conn.request(
        "POST", "/v1/completions", body=json.dumps({**body, "stream": False}), headers={"X-Request-Id": rid + "x"}
    )
    with pytest.raises(TimeoutError):  # a 400-token answer does not come within 0.5 s
        conn.getresponse()
    conn.close()
    wait_until(
        lambda: gw_worker.metric("pagedq_request_success_total", finished_reason="abort") == aborts + 2,
        what="the worker to abort the non-streamed request",
    )
    assert response_events(gw_redis_url, rid + "x")[-1].finish_reason == "abort"


def test_a_retried_post_with_the_same_idempotency_key_runs_one_generation(gateway, gw_worker, gw_redis_url):
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
    call = {k: v for k, v in LONG.items() if k != "ignore_eos"} | {"extra_body": {"ignore_eos": True}}
    before = gw_worker.metric("pagedq_request_success_total")
    reference = client.chat.completions.create(**call).choices[0].message.content
    # (a request is counted once its entry is acked, a round trip after the final event the client saw)
    wait_until(lambda: gw_worker.metric("pagedq_request_success_total") >= before + 1, what="the reference")
    finished = gw_worker.metric("pagedq_request_success_total")
    key = f"retry-{uuid.uuid4().hex}"
    # The first attempt breaks off mid-stream, as on a network error ...
    first = SSE(gateway.port, "POST", CHAT, {**LONG, "stream": True}, headers={"Idempotency-Key": key})
    assert first.headers["pagedq-request-id"] == key
    for n, _ in enumerate(first.events()):
        if n == 3:
            break
    first.close()
    # ... and the retries attach to the same generation, which went on (an idempotent request is
    # not cancelled by its client leaving).
    second = client.chat.completions.create(**call, extra_headers={"Idempotency-Key": key})
    third = client.chat.completions.create(**call, extra_headers={"Idempotency-Key": key})
    assert second.id == third.id == f"chatcmpl-{key}"
    assert second.choices[0].message.content == third.choices[0].message.content == reference
    assert second.choices[0].finish_reason == "length" and second.created == third.created
    events = response_events(gw_redis_url, key)
    assert sum(isinstance(e, Started) for e in events) == 1
    wait_until(lambda: gw_worker.metric("pagedq_request_success_total") == finished + 1, what="one generation")
    # A key that is no valid request id is hashed into one, the same one each time.
    odd = "not a valid id: spaces & symbols"
    a = client.completions.create(model="default", prompt="x", max_tokens=2, extra_headers={"Idempotency-Key": odd})
    b = client.completions.create(model="default", prompt="x", max_tokens=2, extra_headers={"Idempotency-Key": odd})
    assert a.id == b.id and a.id.startswith("cmpl-idem-")
