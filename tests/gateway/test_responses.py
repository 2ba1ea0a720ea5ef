"""`/v1/responses` through the gateway, read with the official `openai` client: a response equals the
chat completion of the same conversation (greedy), whole and streamed; `previous_response_id` chains
turns with their tool calls and tool outputs; background responses are fetched, resumed with
`starting_after`, cancelled and deleted; bad input is a 4xx naming the parameter."""

from __future__ import annotations

import json

import openai
import pytest

from tests.engine.structured_cases import TOOL_MESSAGES
from tests.gateway.gateway_proc import SSE, GatewayProc, request
from tests.service.worker_proc import wait_until

MODEL = "default"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
FORCE = {"type": "function", "name": "get_weather"}
GREEDY = dict(model=MODEL, temperature=0)
COLOUR = {
    "type": "json_schema",
    "name": "colour",
    "schema": {
        "type": "object",
        "properties": {"c": {"enum": ["red", "blue"]}},
        "required": ["c"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)


def _chat(client, messages, max_tokens, **kw) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY, **kw)


def test_a_response_is_the_chat_completion_of_its_input(client):
    r = client.responses.create(input="Tell me about Oslo.", instructions="Be brief.", max_output_tokens=12, **GREEDY)
    chat = _chat(
        client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about Oslo."}], 12
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # 12 tokens, no EOS
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.store is True
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.status == r.status


def test_a_streamed_response_equals_the_whole_one(client):
    """A JSON answer (text.format) so that it completes: the client's stream helper wants
    response.completed."""
    ask = dict(
        input=[{"role": "user", "content": "A colour."}], text={"format": COLOUR}, max_output_tokens=40, **GREEDY
    )
    whole = client.responses.create(**ask)
    assert whole.status == "completed" and json.loads(whole.output_text)["c"] in ("red", "blue")
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(input="My name is Ada.", max_output_tokens=6, **GREEDY)
    second = client.responses.create(
        input="What is my name?", previous_response_id=first.id, max_output_tokens=6, **GREEDY
    )
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.output_text == _chat(client, history, 6).choices[0].message.content
    assert second.previous_response_id == first.id
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "What is my name?"


def test_a_tool_loop_through_previous_response_id(client):
    """A forced call, its output sent back by call_id: the next turn sees the call and its output
    (the chain keeps function_call and function_call_output items)."""
    ask = TOOL_MESSAGES[-1]["content"]
    called = client.responses.create(input=ask, tools=[WEATHER], tool_choice=FORCE, max_output_tokens=200, **GREEDY)
    calls = [o for o in called.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and called.status == "completed"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city", "unit"}
    chat = _chat(
        client,
        [{"role": "user", "content": ask}],
        200,
        tools=[CHAT_WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert chat.choices[0].message.tool_calls[0].function.arguments == calls[0].arguments
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 21}'}
    answer = client.responses.create(
        input=[result],
        previous_response_id=called.id,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
        **GREEDY,
    )
    history = [
        {"role": "user", "content": ask},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": calls[0].arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": '{"temp": 21}'},
    ]
    direct = _chat(client, history, 8, tools=[CHAT_WEATHER], tool_choice="none")
    assert answer.output_text == direct.choices[0].message.content
    # The same loop with the items sent in full, as the agents SDK does (no previous_response_id).
    full = [{"role": "user", "content": ask}, *[o.model_dump(exclude_none=True) for o in called.output], result]
    resent = client.responses.create(input=full, tools=[WEATHER], tool_choice="none", max_output_tokens=8, **GREEDY)
    assert resent.output_text == answer.output_text


def test_background_fetch_resume_and_delete(client, gateway):
    r = client.responses.create(input="Write a story.", background=True, max_output_tokens=24, **GREEDY)
    assert r.status in ("queued", "in_progress") and r.background is True
    wait_until(lambda: client.responses.retrieve(r.id).status == "incomplete", timeout=60, what="completion")
    done = client.responses.retrieve(r.id)
    whole = client.responses.create(input="Write a story.", max_output_tokens=24, **GREEDY)
    assert done.output_text == whole.output_text
    events = list(client.responses.retrieve(r.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    tail = list(client.responses.retrieve(r.id, stream=True, starting_after=5))
    assert [e.model_dump() for e in tail] == [e.model_dump() for e in events[6:]]
    status, _, body = request(gateway.port, "GET", f"/v1/responses/{r.id}?stream=true&starting_after={len(events) - 1}")
    assert status == 400 and json.loads(body)["error"]["param"] == "starting_after"
    deleted = client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_cancel_a_background_response(client):
    r = client.responses.create(
        input="Go on forever.", background=True, max_output_tokens=900, extra_body={"ignore_eos": True}, **GREEDY
    )
    wait_until(lambda: client.responses.retrieve(r.id).status == "in_progress", timeout=60, what="start")
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    plain = client.responses.create(input="hi", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)


def test_store_false_keeps_nothing(client):
    r = client.responses.create(input="hi", store=False, max_output_tokens=2, **GREEDY)
    assert r.output_text is not None and r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="again", previous_response_id=r.id, max_output_tokens=2, **GREEDY)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0].type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]}, "input[0].call_id"),
        ({"input": "hi", "previous_response_id": "resp_doesnotexist"}, "previous_response_id"),
        ({"input": "hi", "background": True, "store": False}, "store"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "hi", "frobnicate": 1}, "frobnicate"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_parameter(gateway, body, param):
    status, _, raw = request(gateway.port, "POST", "/v1/responses", {"model": MODEL, **body})
    error = json.loads(raw)["error"]
    assert status in (400, 404) and error["param"] == param, (status, error)
    assert status == (404 if param == "previous_response_id" else 400)


def test_another_tenants_response_is_not_found(gw_worker, gw_redis_url, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"sk-a": {"tenant": "team-a"}, "sk-b": {"tenant": "team-b"}}))
    g = GatewayProc(gw_redis_url, "--api-keys", str(keys_file)).start()
    try:
        a = openai.OpenAI(base_url=g.base_url, api_key="sk-a", max_retries=0)
        b = openai.OpenAI(base_url=g.base_url, api_key="sk-b", max_retries=0)
        mine = a.responses.create(input="secret", max_output_tokens=2, **GREEDY)
        assert a.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(input="x", previous_response_id=mine.id, max_output_tokens=2, **GREEDY)
    finally:
        g.stop()


def test_a_raw_stream_frames_its_events(gateway):
    """The SSE wire: `event:` names the type, `id:` the sequence number."""
    body = {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 3, "temperature": 0}
    sse = SSE(gateway.port, "POST", "/v1/responses", body)
    try:
        frames = list(sse.events())
    finally:
        sse.close()
    seqs = [json.loads(data)["sequence_number"] for _, data in frames]
    assert seqs == list(range(len(frames))) and [int(i) for i, _ in frames] == seqs


def test_a_refused_response_is_a_400_and_stores_nothing(gateway):
    """The worker refuses a prompt over the model's length: the POST that waits answers 400 (as chat
    does), and nothing is kept (GET: 404), as OpenAI creates nothing for a 400."""
    body = {"model": MODEL, "input": "word " * 3000, "max_output_tokens": 2}
    status, headers, raw = request(gateway.port, "POST", "/v1/responses", body)
    assert status == 400 and json.loads(raw)["error"]["code"] == "prompt_too_long"
    rid = headers["pagedq-request-id"]
    assert request(gateway.port, "GET", f"/v1/responses/resp_{rid}")[0] == 404


def test_an_idempotency_key_of_another_endpoint_is_a_409(gateway):
    key = {"Idempotency-Key": "shared-key-0001"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert request(gateway.port, "POST", "/v1/chat/completions", chat, headers=key)[0] == 200
    status, _, raw = request(gateway.port, "POST", "/v1/responses", {"model": MODEL, "input": "hi"}, headers=key)
    assert status == 409 and json.loads(raw)["error"]["code"] == "idempotency_key_reused"
    again = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    first = request(gateway.port, "POST", "/v1/responses", again, headers={"Idempotency-Key": "resp-key-0001"})
    retry = request(gateway.port, "POST", "/v1/responses", again, headers={"Idempotency-Key": "resp-key-0001"})
    assert first[0] == retry[0] == 200 and json.loads(first[2])["id"] == json.loads(retry[2])["id"]
    status, _, _ = request(
        gateway.port, "POST", "/v1/chat/completions", chat, headers={"Idempotency-Key": "resp-key-0001"}
    )
    assert status == 409
