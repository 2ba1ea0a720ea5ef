"""Every endpoint of the gateway's own OpenAPI document, fuzzed (schemathesis: bodies, paths and query
strings inside and outside the schemas) against a real gateway and worker: no answer is a 5xx, every
error is OpenAI's shape, and the worker still serves afterwards. Derandomized and bounded, so each run
sends the same requests. Generation lengths are clamped (the fuzz is about input, not long answers)."""

from __future__ import annotations

import json

import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from gateway.openapi import document
from tests.gateway.gateway_proc import request

schema = schemathesis.openapi.from_dict(document())
LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")
EXAMPLES_PER_OPERATION = 12
NOT_FUZZED = ("/metrics", "/health", "/ready")


def _tame(body: object) -> None:
    """Short generations on the served model, so that a valid request reaches the worker and ends soon."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = "default"
    for name in LENGTHS:
        if isinstance(body.get(name), int) and body[name] > 4:
            body[name] = 4
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    body.pop("ignore_eos", None)


@pytest.fixture(scope="module")
def base(gateway):
    return f"http://127.0.0.1:{gateway.port}"


@schema.exclude(path=list(NOT_FUZZED)).parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_input_gets_a_5xx(case, base):
    _tame(case.body)
    response = case.call(base_url=base, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        error = json.loads(response.text)["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert {"type", "param", "code"} <= set(error), error


def test_the_worker_still_serves_after_the_fuzz(gateway):
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    done = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert done.choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/batches"])
def test_a_body_nested_too_deep_is_a_400(gateway, path):
    """A JSON schema (or any value) nested 800 or 70 levels: a 400, never a 500."""
    bodies = {
        "/v1/chat/completions": '{"model":"default","messages":[{"role":"user","content":"x"}],'
        '"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":%s}}}',
        "/v1/completions": '{"model":"default","prompt":%s}',
        "/v1/responses": '{"model":"default","input":"x","text":{"format":{"type":"json_schema","name":"x",'
        '"schema":%s}}}',
        "/v1/batches": '{"input_file_id":"file-x","endpoint":"/v1/responses","completion_window":"24h","metadata":%s}',
    }
    for levels in (800, 70):  # past the decoder's recursion; past MAX_JSON_DEPTH only
        deep = '{"type":"object","properties":{"a":' * levels + '{"type":"object"}' + "}}" * levels
        status, _, raw = request(gateway.port, "POST", path, (bodies[path] % deep).encode())
        error = json.loads(raw)["error"]
        assert status == 400 and error["code"] == "json_too_deep", (levels, status, error)
