"""Answers other than 200, in OpenAI's error shape with the right status; API keys and tenants;
the operational endpoints."""

from __future__ import annotations

import json

import msgspec
import openai
import pytest

from producer_sdk import Client
from producer_sdk.contract import keys
from producer_sdk.contract.keys import ENTRY_DATA_FIELD
from producer_sdk.protocol import GenerateRequest, now_ms
from tests.gateway.gateway_proc import SSE, GatewayProc, request
from tests.service.worker_proc import wait_until

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def error_of(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_unknown_model_is_404_at_once_and_no_worker_is_503(gateway, r):
    # The 1 s client timeout is the check that the gateway answers without waiting for a worker.
    status, _, body = request(gateway.port, "POST", CHAT, {"model": "defualt", "messages": HI}, timeout=1.0)
    err = error_of(body)
    assert status == 404 and err["param"] == "model" and err["code"] == "model_not_found"
    assert "served: default" in err["message"]
    r.zadd(keys.models(), {"ghost": now_ms()})  # served once, no live worker now
    try:
        # The gateway rereads the registry for a name it does not know at most every 0.1 s.
        ask = lambda: request(gateway.port, "POST", CHAT, {"model": "ghost", "messages": HI}, timeout=2.0)
        status, headers, body = wait_until(lambda: (reply := ask())[0] != 404 and reply, what="ghost to be known")
        assert status == 503 and error_of(body)["code"] == "no_live_worker" and headers["retry-after"]
    finally:
        r.zrem(keys.models(), "ghost")


def test_full_queue_is_429_with_retry_after(gateway, gw_redis_url, r):
    r.hset(keys.config("default"), "max_queue_len", 1)
    with Client(gw_redis_url) as sdk:
        busy = sdk.submit("keep the queue busy", max_tokens=400, ignore_eos=True)
        try:
            status, headers, body = request(gateway.port, "POST", CHAT, {"model": "default", "messages": HI})
            assert status == 429 and int(headers["retry-after"]) >= 1
            assert error_of(body)["code"] == "queue_full"
        finally:
            r.hdel(keys.config("default"), "max_queue_len")
            busy.cancel()
        assert busy.result(timeout=30, partial_ok=True).finish_reason == "abort"


def test_a_deadline_is_504_whole_and_an_error_event_streamed(gateway):
    body = {"model": "default", "messages": HI, "max_tokens": 300, "ignore_eos": True}
    status, _, reply = request(gateway.port, "POST", CHAT, body, headers={"pagedq-timeout": "0.3"})
    err = error_of(reply)
    assert (status, err["code"], err["type"]) == (504, "deadline_exceeded", "timeout")
    events = list(SSE(gateway.port, "POST", CHAT, {**body, "stream": True}, headers={"pagedq-timeout": "0.3"}).events())
    assert events[-1] == (None, "[DONE]")
    final_id, final = events[-2]
    assert json.loads(final)["error"]["code"] == "deadline_exceeded" and final_id is not None
    assert request(gateway.port, "POST", CHAT, body, headers={"pagedq-timeout": "soon"})[0] == 400


@pytest.mark.parametrize(
    ("change", "param", "code"),
    [
        ({"top_p": 3}, "top_p", "invalid_value"),
        ({"temperature": "hot"}, "temperature", "invalid_value"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
        ({"n": 0}, "n", "invalid_value"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages[0].colour", "unknown_parameter"),
        ({"frobnicate": True}, "frobnicate", "unknown_parameter"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "invalid_value",
        ),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        (
            {"tools": [{**TOOL, "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
            "tools[0].function.parameters",
            "invalid_value",
        ),
        ({"tools": [TOOL, TOOL]}, "tools[1].function.name", "invalid_value"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "response_format.json_schema.schema",
            "invalid_value",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
            "structured_outputs",
            "invalid_value",
        ),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "invalid_value"),
        ({"structured_outputs": {"json": '{"type": "object"'}}, "structured_outputs.json", "invalid_value"),
        ({"messages": [{"role": "tool", "tool_call_id": "c1"}]}, "messages[0].content", "invalid_value"),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_call_id": "c1"}]},
            "messages[0].tool_call_id",
            "invalid_value",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "unsupported_parameter"),
    ],
)
def test_invalid_fields_are_400_naming_the_param(gateway, change, param, code):
    status, _, body = request(gateway.port, "POST", CHAT, {"model": "default", "messages": HI, **change})
    err = error_of(body)
    assert (status, err["param"], err["code"], err["type"]) == (400, param, code, "invalid_request_error")


def test_official_client_sees_the_param_and_413(gateway):
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt=["one", "two"], max_tokens=2)
    assert e.value.body["param"] == "prompt"
    status, _, body = request(gateway.port, "POST", "/v1/completions", {"model": "default", "prompt": "x" * (5 << 20)})
    assert status == 413 and error_of(body)["code"] == "request_too_large"


def test_api_keys_tenants_and_allowed_models(gw_redis_url, r, tmp_path):
    key_file = tmp_path / "keys.json"
    key_file.write_text(
        json.dumps(
            {"sk-a": {"tenant": "team-a", "models": ["default", "ghost"]}, "sk-b": {"tenant": "team-b", "models": []}}
        )
    )
    r.zadd(keys.models(), {"ghost": now_ms()})
    g = GatewayProc(gw_redis_url, "--api-keys", str(key_file), "--queue-without-workers").start()
    try:
        assert request(g.port, "GET", "/v1/models")[0] == 401
        assert request(g.port, "GET", "/v1/models", headers={"Authorization": "Bearer sk-wrong"})[0] == 401
        status, headers, _ = request(g.port, "POST", CHAT, {"model": "default", "messages": HI})
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=g.base_url, api_key="sk-wrong").models.list()
        a = openai.OpenAI(base_url=g.base_url, api_key="sk-a")
        assert [m.id for m in a.models.list().data] == ["default"]  # ghost has no live worker
        assert openai.OpenAI(base_url=g.base_url, api_key="sk-b").models.list().data == []
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=g.base_url, api_key="sk-b").chat.completions.create(model="default", messages=HI)
        done = a.chat.completions.create(model="default", messages=HI, max_tokens=3)
        rid = done.id.removeprefix("chatcmpl-")
        auth_b = {"Authorization": "Bearer sk-b"}
        assert request(g.port, "GET", f"{CHAT}/{done.id}", headers=auth_b)[0] == 404  # another tenant's
        assert request(g.port, "GET", f"{CHAT}/{rid}", headers={"Authorization": "Bearer sk-a"})[0] == 200

        # The tenant travels with the request (queued for "ghost", which has no worker).
        s = SSE(
            g.port,
            "POST",
            CHAT,
            {"model": "ghost", "messages": HI, "stream": True, "user": "u1"},
            headers={"Authorization": "Bearer sk-a", "pagedq-resumable": "true"},
        )
        assert s.status == 200
        s.close()
        entries = wait_until(lambda: r.xrange(keys.lane_stream("ghost")), what="the queued request")
        queued = msgspec.msgpack.decode(entries[0][1][ENTRY_DATA_FIELD.encode()], type=GenerateRequest)
        assert queued.metadata == {"tenant": "team-a", "user": "u1"}
        assert queued.messages[0].content == "hi"
    finally:
        g.stop()
        r.zrem(keys.models(), "ghost")
        r.delete(*(keys.lane_stream("ghost", lane) for lane in keys.LANES))


def test_health_ready_metrics_and_docs(gateway):
    assert request(gateway.port, "POST", CHAT, {"model": "default", "messages": HI, "max_tokens": 2})[0] == 200
    assert request(gateway.port, "POST", CHAT, {"model": "nothing", "messages": HI})[0] == 404
    assert request(gateway.port, "GET", "/health")[0] == 200
    status, _, body = request(gateway.port, "GET", "/ready")
    assert status == 200 and json.loads(body)["models"] == ["default"]
    assert gateway.metric("pagedq_gateway_requests_total", route="/v1/chat/completions", status="200") >= 1
    assert gateway.metric("pagedq_gateway_requests_total", route="/v1/chat/completions", status="404") >= 1
    assert gateway.metric("pagedq_gateway_time_to_first_byte_seconds_count") >= 1
    assert gateway.metric("pagedq_gateway_open_streams") == 0
    status, _, body = request(gateway.port, "GET", "/openapi.json")
    doc = json.loads(body)
    assert (
        status == 200
        and "/v1/chat/completions" in doc["paths"]
        and "ChatCompletionRequest" in doc["components"]["schemas"]
    )
    assert request(gateway.port, "GET", "/docs")[0] == 200
    status, _, body = request(gateway.port, "GET", "/v2/nothing")
    assert status == 404 and error_of(body)["type"] == "invalid_request_error"
