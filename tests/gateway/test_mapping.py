"""The gateway's pure parts, no processes: OpenAI bodies to submit arguments, response shapes,
request ids from idempotency keys, the API key file."""

from __future__ import annotations

import json

import pytest

from gateway import mapping, records
from gateway.auth import KeyFileError, KeyRing
from gateway.errors import ApiError
from gateway.render import DONE, Renderer, request_id_of
from producer_sdk.constants import REQUEST_ID_PATTERN
from producer_sdk.protocol import Usage
from producer_sdk.results import Choice, Chunk, Completion


def chat(**body):
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}).encode()
    return mapping.map_chat(mapping.decode(mapping.CHAT, raw))


def completion(**body):
    raw = json.dumps({"model": "m", **body}).encode()
    return mapping.map_completion(mapping.decode(mapping.COMPLETION, raw))


def test_chat_maps_openai_and_vllm_names():
    m = chat(
        max_completion_tokens=7,
        temperature=0.5,
        stop="x",
        seed=3,
        n=2,
        logprobs=True,
        top_logprobs=4,
        top_k=5,
        min_p=0.1,
        priority=3,
        user="u",
        stream=True,
        stream_options={"include_usage": True},
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
    )
    assert m.submit == {
        "max_tokens": 7,
        "temperature": 0.5,
        "stop": ["x"],
        "seed": 3,
        "n": 2,
        "logprobs": 4,
        "top_k": 5,
        "min_p": 0.1,
        "priority": -3,  # vLLM: lower is earlier; pagedq: higher is earlier
        "metadata": {"user": "u"},
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}],
    }
    assert m.stream and m.include_usage and m.logprobs and m.kind == "chat"
    assert mapping.param_of(m, "sampling.max_tokens") == "max_completion_tokens"
    assert mapping.param_of(m, "sampling.logprobs") == "top_logprobs"
    assert mapping.param_of(m, "messages[1].role") == "messages[1].role"
    assert chat().submit["max_tokens"] is None  # chat: up to the model's length, as OpenAI


def test_completion_prompt_kinds_and_defaults():
    assert completion(prompt="hi").submit == {"prompt": "hi", "max_tokens": 16}
    assert completion(prompt=[1, 2, 3]).submit["prompt_token_ids"] == [1, 2, 3]
    assert completion(prompt=["hi"]).submit["prompt"] == "hi"
    assert completion(prompt=[[4, 5]], logprobs=0).submit == {
        "prompt_token_ids": [4, 5],
        "max_tokens": 16,
        "logprobs": 0,
    }
    m = completion(prompt="x", max_tokens=0)
    assert mapping.param_of(m, "sampling.max_tokens") == "max_tokens"
    assert mapping.param_of(m, "prompt_token_ids") == "prompt"


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (lambda: chat(tools=[{}]), "tools[0].function"),
        (lambda: chat(tools=[{"type": "custom", "custom": {}}]), "tools[0].custom"),
        (lambda: chat(tool_choice=3), "tool_choice"),
        (
            lambda: chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
            "response_format.json_schema.name",
        ),
        (lambda: chat(structured_outputs={"json": {}, "backend": "x"}), "structured_outputs.backend"),
        (lambda: chat(functions=[{"name": "f"}]), "functions"),
        (lambda: chat(modalities=["audio"]), "modalities"),
        (lambda: chat(max_tokens=3, max_completion_tokens=4), "max_completion_tokens"),
        (
            lambda: chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages[0].content[0]",
        ),
        (lambda: chat(messages=[{"role": "assistant", "content": None}]), "messages[0].content"),
        (lambda: chat(messages=[{"role": "assistant", "content": None, "tool_calls": []}]), "messages[0].content"),
        (
            lambda: chat(messages=[{"role": "assistant", "content": "x", "function_call": {}}]),
            "messages[0].function_call",
        ),
        (
            lambda: chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (lambda: chat(stream_options={"include_usage": True}), "stream_options"),
        (lambda: chat(metadata={"tenant": "me"}), "metadata.tenant"),
        (lambda: completion(prompt="x", echo=True), "echo"),
        (lambda: completion(prompt="x", suffix="y"), "suffix"),
        (lambda: completion(prompt="x", best_of=3), "best_of"),
        (lambda: completion(prompt=["a", "b"]), "prompt"),
        (lambda: completion(), "prompt"),
        (lambda: completion(prompt={"a": 1}), "prompt"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(make, param):
    with pytest.raises(ApiError) as e:
        make()
    assert e.value.status == 400 and e.value.body.param == param


def test_values_that_ask_for_nothing_stay_out_of_the_request():
    m = chat(tools=[], tool_choice="none", response_format={"type": "text"}, parallel_tool_calls=False)
    assert set(m.submit) == {"max_tokens", "messages"} and m.constraint is None


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def test_tools_tool_turns_and_formats_map_onto_the_wire_names():
    history = [
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "assistant", "content": "Sunny.", "tool_calls": []},  # an answer without calls, sent back
    ]
    m = chat(
        messages=history,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    assert m.submit["messages"] == [
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert m.submit["tools"] == [WEATHER]
    assert m.submit["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert m.submit["parallel_tool_calls"] is False and m.constraint == "tools"
    assert chat(tools=[WEATHER], tool_choice="none").constraint is None
    assert "parallel_tool_calls" not in chat(tools=[WEATHER], parallel_tool_calls=True).submit
    assert chat(tool_choice="auto").submit["tool_choice"] == "auto"  # without tools: the SDK refuses it

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    m = chat(response_format=fmt)
    assert m.submit["response_format"] == fmt and m.constraint == "response_format"
    m = completion(prompt="x", structured_outputs={"choice": ["yes", "no"]})
    assert m.submit["structured_outputs"] == {"choice": ["yes", "no"]} and m.constraint == "structured_outputs"
    assert mapping.param_of(m, "sampling.structured_outputs.choice") == "structured_outputs.choice"
    assert completion(prompt="x", response_format={"type": "json_object"}).submit["response_format"] == {
        "type": "json_object"
    }
    assert m.failure_param("invalid_grammar") == "structured_outputs" and m.failure_param("engine_error") is None
    assert m.failure_param("prompt_too_long") == "prompt" and chat().failure_param("tools_unsupported") == "tools"


def _done(text="ab", reason="stop", texts=False) -> Completion:
    choice = Choice(
        index=0,
        text=text,
        token_ids=[1, 2],
        finish_reason=reason,
        logprobs=[-0.5, -0.25],
        top_logprobs=[[(1, -0.5), (7, -2.0)], [(2, -0.25), (8, -3.0)]],
        content=text,
    )
    if texts:  # "é" split over two byte-level tokens
        choice.text = choice.content = "é"
        choice.token_texts, choice.token_bytes = ["", "é"], [b"\xc3", b"\xa9"]
        choice.top_token_texts, choice.top_token_bytes = [["", "x"], ["é", "y"]], [[b"\xc3", b"x"], [b"\xa9", b"y"]]
    return Completion("r", text, [1, 2], reason, stop_reason="\n", usage=Usage(5, 2, 3), choices=[choice])


def test_shapes_of_chat_objects_and_chunks():
    r = Renderer("chat", "abcdefgh", "m", 123, include_usage=True)
    whole = json.loads(r.whole(_done()))
    assert whole["id"] == "chatcmpl-abcdefgh" and whole["object"] == "chat.completion" and whole["created"] == 123
    assert whole["choices"][0]["message"]["content"] == "ab" and whole["choices"][0]["stop_reason"] == "\n"
    assert whole["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    lp = whole["choices"][0]["logprobs"]["content"]
    assert lp[0] == {
        "token": "token_id:1",  # a worker that sends no texts (older than them)
        "logprob": -0.5,
        "bytes": None,
        "top_logprobs": [
            {"token": "token_id:1", "logprob": -0.5, "bytes": None},
            {"token": "token_id:7", "logprob": -2.0, "bytes": None},
        ],
    }
    lp = json.loads(r.whole(_done(texts=True)))["choices"][0]["logprobs"]["content"]
    assert lp[0] == {
        "token": "",  # the first byte of "é": nothing decodes yet
        "logprob": -0.5,
        "bytes": [0xC3],
        "top_logprobs": [
            {"token": "", "logprob": -0.5, "bytes": [0xC3]},
            {"token": "x", "logprob": -2.0, "bytes": [0x78]},
        ],
    }
    assert lp[1]["token"] == "é" and lp[1]["bytes"] == [0xA9]
    named = Renderer("chat", "abcdefgh", "m", 123, token_ids=True).whole(_done(texts=True))
    lp = json.loads(named)["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in lp] == ["token_id:1", "token_id:2"] and lp[0]["bytes"] == [0xC3]
    assert lp[0]["top_logprobs"][1] == {"token": "token_id:7", "logprob": -2.0, "bytes": [0x78]}
    frame = r.token_frame(Chunk("é", [1, 2], 0, [-0.5, -0.25], [[], []], 3, None, None, ["", "é"], [b"\xc3", b"\xa9"]))
    obj = json.loads(frame.decode().split("data: ", 1)[1])
    assert [e["token"] for e in obj["choices"][0]["logprobs"]["content"]] == ["", "é"]
    frame = r.token_frame(Chunk("a", [1], 0, seq=4)).decode()
    assert frame.startswith("id: 4\ndata: ") and frame.endswith("\n\n")
    obj = json.loads(frame.split("data: ", 1)[1])
    assert obj["object"] == "chat.completion.chunk" and obj["usage"] is None
    assert obj["choices"] == [{"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}]
    finish, usage = r.finish_frames(9, _done()).decode().strip().split("\n\n")
    assert json.loads(finish.split("data: ", 1)[1])["choices"][0]["finish_reason"] == "stop"
    assert usage.startswith("id: 9\n") and json.loads(usage.split("data: ", 1)[1])["choices"] == []
    assert DONE == b"data: [DONE]\n\n"
    assert request_id_of("chat", "chatcmpl-abcdefgh") == request_id_of("chat", "abcdefgh") == "abcdefgh"


def test_shapes_of_completion_objects():
    r = Renderer("completion", "abcdefgh", "m", 1)
    whole = json.loads(r.whole(_done()))
    assert whole["id"] == "cmpl-abcdefgh" and whole["object"] == "text_completion"
    assert whole["choices"][0]["logprobs"] == {
        "tokens": ["token_id:1", "token_id:2"],  # a worker that sends no texts (older than them)
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"token_id:1": -0.5, "token_id:7": -2.0}, {"token_id:2": -0.25, "token_id:8": -3.0}],
        "text_offset": None,
    }
    assert json.loads(r.whole(_done(texts=True)))["choices"][0]["logprobs"] == {
        "tokens": ["", "é"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"": -0.5, "x": -2.0}, {"é": -0.25, "y": -3.0}],
        "text_offset": [0, 0],
    }
    streamed = Renderer("completion", "abcdefgh", "m", 1)
    offsets = []
    for texts in (["a", "bc"], ["d"]):
        chunk = Chunk("".join(texts), [1] * len(texts), 0, [-1.0] * len(texts), None, 1, None, None, texts)
        offsets += json.loads(streamed.token_frame(chunk).decode().split("data: ", 1)[1])["choices"][0]["logprobs"][
            "text_offset"
        ]
    assert offsets == [0, 1, 3]
    obj = json.loads(r.token_frame(Chunk("a", [1], 0, seq=1)).decode().split("data: ", 1)[1])
    assert "usage" not in obj and obj["choices"][0]["text"] == "a"


def test_request_ids_from_idempotency_keys():
    assert REQUEST_ID_PATTERN.fullmatch(records.request_id_for(None, None))
    assert records.request_id_for("my-key-123", None) == "my-key-123"
    odd = records.request_id_for("spaces and ünïcode", None)
    assert REQUEST_ID_PATTERN.fullmatch(odd) and odd == records.request_id_for("spaces and ünïcode", None)
    a, b = records.request_id_for("my-key-123", "team-a"), records.request_id_for("my-key-123", "team-b")
    assert a != b and REQUEST_ID_PATTERN.fullmatch(a), "two tenants' keys never name the same request"
    rec = records.Record(kind="chat", model="m", created=5, n=2, include_usage=True, tenant="t")
    assert records.decode(records.encode(rec)) == rec and records.decode(b"\xc1") is None


def test_key_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-1": {"tenant": "a", "models": ["x"]}, "sk-2": {"tenant": "b", "models": ["*"]}}))
    ring = KeyRing.load(path)
    a, b = ring.caller("Bearer sk-1"), ring.caller("bearer  sk-2")
    assert (a.tenant, a.allowed("x"), a.allowed("y")) == ("a", True, False)
    assert (b.tenant, b.allowed("anything"), b.allowed_or_none) == ("b", True, None)
    for header in (None, "", "Basic sk-1", "Bearer sk-3", "Bearer "):
        with pytest.raises(ApiError) as e:
            ring.caller(header)
        assert e.value.status == 401
    path.write_text(json.dumps({"sk-1": {"tenant": "a", "colour": "red"}}))
    with pytest.raises(KeyFileError, match="colour"):
        KeyRing.load(path)
    with pytest.raises(KeyFileError):
        KeyRing.load(tmp_path / "missing.json")


def test_tool_calls_whole_and_streamed_as_the_openai_client_reads_them():
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from producer_sdk.chat import FunctionCall, ToolCall, ToolCallDelta

    call = ToolCall(id="call_r_0_0", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
    text = '<tool_call>{"name": ...}</tool_call>'
    choice = Choice(0, text, [1, 2], "tool_calls", content="", tool_calls=[call])
    done = Completion("r", choice.text, [1, 2], "tool_calls", usage=Usage(5, 2, 0), choices=[choice])
    r = Renderer("chat", "abcdefgh", "m", 1)
    whole = ChatCompletion.model_validate_json(r.whole(done))
    message = whole.choices[0].message
    assert message.content is None and whole.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls[0].id == "call_r_0_0" and message.tool_calls[0].type == "function"
    assert message.tool_calls[0].function.name == "get_weather"
    assert message.tool_calls[0].function.arguments == '{"city": "Paris"}'

    markup = Chunk("<tool_call>", [1], 0, seq=1, content="")
    assert r.token_frame(markup) == b""  # nothing to say
    deltas = [
        Chunk("", [], 0, seq=2, content="", tool_calls=[ToolCallDelta(index=0, id="call_r_0_0", name="get_weather")]),
        Chunk("", [], 0, seq=3, content="", tool_calls=[ToolCallDelta(index=0, arguments='{"city": ')]),
        Chunk("", [], 0, seq=4, content="", tool_calls=[ToolCallDelta(index=0, arguments='"Paris"}')]),
    ]
    frames = [r.role_frame(1), *(r.token_frame(c) for c in deltas), r.finish_frames(5, done)]
    first = json.loads(frames[1].decode().split("data: ", 1)[1])["choices"][0]["delta"]
    assert first == {
        "tool_calls": [
            {"index": 0, "id": "call_r_0_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        ]
    }
    state = ChatCompletionStreamState()
    for frame in frames:
        for event in frame.decode().strip().split("\n\n"):
            list(state.handle_chunk(ChatCompletionChunk.model_validate_json(event.split("data: ", 1)[1])))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and len(final.message.tool_calls) == 1
    assert final.message.tool_calls[0].id == "call_r_0_0"
    assert final.message.tool_calls[0].function.name == "get_weather"
    assert final.message.tool_calls[0].function.arguments == '{"city": "Paris"}'
