"""The `pagedq-request-id` header names the request on every answer about one: the answer itself and
the errors that come once the gateway has given the request its id (docs/gateway.md, "Errors");
errors found before that (a bad body, an unknown model) name none."""

from __future__ import annotations

import json

from producer_sdk import Client
from producer_sdk.constants import REQUEST_ID_PATTERN
from producer_sdk.contract import keys
from tests.gateway.gateway_proc import request

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
HEADER = "pagedq-request-id"


def code_of(body: bytes) -> str:
    return json.loads(body)["error"]["code"]


def test_errors_before_the_request_has_an_id_name_none(gateway):
    status, headers, body = request(gateway.port, "POST", CHAT, {"model": "defualt", "messages": HI})
    assert (status, code_of(body)) == (404, "model_not_found") and HEADER not in headers
    status, headers, body = request(gateway.port, "POST", CHAT, {"model": "default", "messages": HI, "top_q": 1})
    assert (status, code_of(body)) == (400, "unknown_parameter") and HEADER not in headers


def test_a_full_queue_names_the_request_it_refused(gateway, gw_redis_url, r):
    key = "retry-me-0123456789"  # a valid request id: the gateway uses it as it is
    r.hset(keys.config("default"), "max_queue_len", 1)
    with Client(gw_redis_url) as sdk:
        busy = sdk.submit("keep the queue busy", max_tokens=400, ignore_eos=True)
        try:
            status, headers, body = request(
                gateway.port, "POST", CHAT, {"model": "default", "messages": HI}, headers={"Idempotency-Key": key}
            )
            assert (status, code_of(body)) == (429, "queue_full")
            assert headers[HEADER] == key
        finally:
            r.hdel(keys.config("default"), "max_queue_len")
            busy.cancel()
        assert busy.result(timeout=30, partial_ok=True).finish_reason == "abort"


def test_a_deadline_and_a_worker_refusal_name_the_request(gateway):
    body = {"model": "default", "messages": HI, "max_tokens": 300, "ignore_eos": True}
    status, headers, reply = request(gateway.port, "POST", CHAT, body, headers={"pagedq-timeout": "0.3"})
    assert (status, code_of(reply)) == (504, "deadline_exceeded")
    assert REQUEST_ID_PATTERN.fullmatch(headers[HEADER])
    # longer than the shared worker's --max-model-len (1024): the worker refuses it
    too_long = {"model": "default", "messages": [{"role": "user", "content": "word " * 2000}], "max_tokens": 4}
    status, headers, reply = request(gateway.port, "POST", CHAT, too_long)
    assert (status, code_of(reply)) == (400, "prompt_too_long")
    assert REQUEST_ID_PATTERN.fullmatch(headers[HEADER])


def test_a_lost_answer_is_404_request_lost_naming_the_request(gateway, r):
    status, headers, _ = request(gateway.port, "POST", CHAT, {"model": "default", "messages": HI, "max_tokens": 2})
    assert status == 200
    rid = headers[HEADER]
    assert r.exists(keys.gateway_record(rid))
    # Redis loses the answer (a restart without persistence, say) while the gateway's record stays.
    r.delete(keys.response_stream(rid), keys.submitted_marker("default", rid))
    # The reader finds nothing after one idle slice (the gateway's: 10 s) and checks that the request exists.
    status, headers, reply = request(gateway.port, "GET", f"{CHAT}/chatcmpl-{rid}", timeout=60)
    assert (status, code_of(reply)) == (404, "request_lost")
    assert headers[HEADER] == rid
    r.delete(keys.gateway_record(rid))
