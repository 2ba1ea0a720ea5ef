"""Tool calling and structured outputs through the gateway, read with the official `openai` client: a
forced call's arguments validate against the tool's parameters, whole and streamed (the same call for
greedy decoding); a tool turn sent back reaches the worker exactly as the SDK sends it; JSON answers
follow their schema; a grammar the worker cannot compile is a 400 naming the parameter."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from producer_sdk import Client
from tests.engine.structured_cases import TOOL_MESSAGES
from tests.gateway.gateway_proc import SSE, request

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
PARAMS = WEATHER["function"]["parameters"]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
FORCED = dict(
    model="default", messages=TOOL_MESSAGES, tools=[WEATHER], tool_choice=NAMED, temperature=0, max_tokens=200
)
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "temp": {"type": "integer", "minimum": -50, "maximum": 50},
    },
    "required": ["city", "temp"],
}
ASK = [{"role": "user", "content": "The weather in Oslo as JSON."}]


class City(BaseModel):
    city: str = Field(min_length=1, max_length=10)
    temp: int = Field(ge=-50, le=50)


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused")


@pytest.fixture(scope="module")
def forced(client):
    """The whole answer to a forced, named call (greedy)."""
    return client.chat.completions.create(**FORCED)


def test_a_forced_named_call_whole_and_streamed(client, forced):
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)

    # Streamed: OpenAI's delta.tool_calls, assembled by hand ...
    chunks = list(client.chat.completions.create(**FORCED, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    # (call ids are derived from the request id: each request has its own)
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather"
    assert all(d.index == 0 for d in deltas) and all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""  # no markup as content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # ... and by the client's own accumulator
    with client.chat.completions.stream(**FORCED) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(t.type, t.function.name, t.function.arguments) for t in final.message.tool_calls] == [
        ("function", call.function.name, call.function.arguments)
    ]


def test_a_tool_turn_sent_back_reaches_the_worker_as_the_sdk_sends_it(client, forced, gw_redis_url):
    call = forced.choices[0].message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}
    # The assistant turn as the client returned it (the openai object itself), then the tool's answer.
    got = client.chat.completions.create(
        model="default",
        messages=[*TOOL_MESSAGES, forced.choices[0].message, result],
        tools=[WEATHER],
        temperature=0,
        max_tokens=8,
    )
    wire_call = {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": call.function.arguments},
    }
    with Client(gw_redis_url) as sdk:
        want = sdk.generate(
            messages=[*TOOL_MESSAGES, {"role": "assistant", "tool_calls": [wire_call]}, result],
            tools=[WEATHER],
            temperature=0,
            max_tokens=8,
        )
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.choices[0].finish_reason == want.finish_reason
    assert (got.choices[0].message.content or "") == want.content


def test_json_answers_follow_their_schema(client, gateway, offline, gw_redis_url):
    from worker import SamplingParams, StructuredOutputsParams

    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    whole = client.chat.completions.create(
        model="default", messages=ASK, response_format=fmt, temperature=0, max_tokens=80
    )
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), CITY_SCHEMA)
    # Greedy: the same answer offline, through the SDK and through the gateway
    params = SamplingParams(
        temperature=0,
        max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=CITY_SCHEMA, disable_any_whitespace=True),
    )
    want = offline.chat(ASK, params, use_tqdm=False)[0].outputs[0]
    with Client(gw_redis_url) as sdk:
        got = sdk.generate(messages=ASK, response_format=fmt, temperature=0, max_tokens=80)
    assert whole.choices[0].message.content == got.text == want.text
    assert whole.usage.completion_tokens == len(got.token_ids) == len(want.token_ids)
    chunks = client.chat.completions.create(
        model="default", messages=ASK, response_format=fmt, temperature=0, max_tokens=80, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content

    # The client's parse(): a pydantic model as a strict json_schema, the answer parsed into it
    parsed = client.chat.completions.parse(
        model="default", messages=ASK, response_format=City, temperature=1.0, seed=7, max_tokens=80
    )
    assert isinstance(parsed.choices[0].message.parsed, City)

    # vLLM's structured_outputs, also for a plain prompt
    picked = client.completions.create(
        model="default",
        prompt="Is it sunny?",
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert picked.choices[0].text in ("yes", "no")


def test_a_grammar_the_worker_cannot_compile_is_a_400_naming_the_param(gateway):
    body = {"model": "default", "messages": ASK, "structured_outputs": {"grammar": "root ::= ( unclosed"}}
    status, _, reply = request(gateway.port, "POST", "/v1/chat/completions", body)
    err = json.loads(reply)["error"]
    assert (status, err["code"], err["param"], err["type"]) == (
        400,
        "invalid_grammar",
        "structured_outputs",
        "invalid_request_error",
    )
    events = list(SSE(gateway.port, "POST", "/v1/chat/completions", {**body, "stream": True}).events())
    assert events[-1] == (None, "[DONE]")
    streamed = json.loads(events[-2][1])["error"]
    assert (streamed["code"], streamed["param"]) == ("invalid_grammar", "structured_outputs")
