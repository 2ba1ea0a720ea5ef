"""Protocol v2: rich messages, tools, response formats, structured outputs, tool-call events; v1 requests
still decode; bad schemas are refused with a typed error before anything is enqueued."""

from __future__ import annotations

import msgspec
import pytest

from producer_sdk._core import build_request
from producer_sdk._stream import CompletionBuilder
from producer_sdk.chat import FunctionCall as Fn
from producer_sdk.chat import (
    FunctionDefinition,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsParams,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolCalls,
    ToolChoiceFunction,
    structured_outputs_for,
)
from producer_sdk.errors import ValidationError
from producer_sdk.protocol import (
    EVENT_TYPES,
    GenerateRequest,
    Message,
    SamplingParams,
    Tokens,
    UnknownEvent,
    decode_event,
    encode_event,
)
from producer_sdk.protocol import Finished as Fin
from producer_sdk.request_codec import decode_request, encode_request

RID = "req_0123456789abcdef"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": PARAMS}}
CHAT = [{"role": "user", "content": "weather in Paris?"}]


def test_a_v2_request_round_trips_with_every_chat_feature():
    req = GenerateRequest(
        v=2,
        request_id=RID,
        messages=[
            Message("developer", [TextPart("be "), TextPart("brief")]),
            Message("user", "weather?", name="ann"),
            Message("assistant", None, tool_calls=[ToolCall(id="c1", function=Fn("get_weather", '{"city": "x"}'))]),
            Message("tool", '{"t": 21}', tool_call_id="c1"),
        ],
        tools=[Tool(function=FunctionDefinition(name="get_weather", parameters=PARAMS, strict=True))],
        tool_choice=NamedToolChoice(function=ToolChoiceFunction("get_weather")),
        parallel_tool_calls=False,
        sampling=SamplingParams(structured_outputs=None),
    )
    assert decode_request(encode_request(req)) == req
    assert req.messages[0].text == "be brief"


def test_the_sdk_writes_the_lowest_version_a_request_needs():
    assert build_request("hi").request.v == 1
    assert build_request(messages=CHAT).request.v == 1
    assert build_request(messages=CHAT, tools=[TOOL]).request.v == 2
    assert build_request("hi", structured_outputs={"regex": "a+"}).request.v == 2
    assert build_request(messages=[{"role": "developer", "content": "x"}]).request.v == 2
    plain = msgspec.msgpack.decode(build_request("hi").payload)
    assert plain["v"] == 1 and decode_request(build_request("hi").payload).v == 1


def test_a_v1_request_with_a_v2_field_is_refused():
    raw = {"v": 1, "request_id": RID, "messages": CHAT, "tools": [TOOL]}
    with pytest.raises(ValidationError, match="version 2") as info:
        decode_request(msgspec.msgpack.encode(raw))
    assert info.value.field == "v"


def test_tool_call_events_round_trip_and_older_readers_skip_them():
    ev = ToolCalls(seq=4, index=1, tool_calls=[ToolCallDelta(index=0, id="call_1", name="f", arguments='{"a"')])
    assert decode_event(encode_event(ev)) == ev and "tool_calls" in EVENT_TYPES
    tokens = Tokens(seq=3, token_ids=[1], text="<tool_call>", content="")
    assert decode_event(encode_event(tokens)) == tokens
    novel = msgspec.msgpack.encode({"type": "citations", "seq": 9})
    assert decode_event(novel) == UnknownEvent(seq=9, type="citations")


def test_the_completion_assembles_content_and_tool_calls_from_the_events():
    b = CompletionBuilder(RID)
    b.add(Tokens(seq=1, token_ids=[1, 2], text="Sure. <tool_call>", content="Sure. "))
    b.add_tool_calls(ToolCalls(seq=2, tool_calls=[ToolCallDelta(index=0, id="c0", name="add", arguments='{"a": ')]))
    b.add(Tokens(seq=3, token_ids=[3], text="1}}</tool_call>", content=""))
    b.add_tool_calls(ToolCalls(seq=4, tool_calls=[ToolCallDelta(index=0, arguments="1}")]))
    done = b.build(Fin(seq=5, finish_reason="tool_calls", finish_reasons=["tool_calls"]))
    assert done.content == "Sure. " and done.finish_reason == "tool_calls"
    assert done.tool_calls == [ToolCall(id="c0", function=Fn("add", '{"a": 1}'))]
    plain = CompletionBuilder(RID)
    plain.add(Tokens(seq=1, token_ids=[5], text='{"x": [1, 2]}'))
    assert plain.build(Fin(seq=2, finish_reason="stop")).json() == {"x": [1, 2]}
    assert plain.build(None).content == '{"x": [1, 2]}' and plain.build(None).tool_calls is None


def test_response_formats_map_to_structured_outputs():
    assert structured_outputs_for(None) is None and structured_outputs_for(ResponseFormat(type="text")) is None
    assert structured_outputs_for(ResponseFormat(type="json_object")).json_object
    rf = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="w", schema=PARAMS))
    so = structured_outputs_for(rf)
    assert so.json == PARAMS and so.disable_any_whitespace and so.kinds == ["json"]


DEEP: dict = {"type": "object"}
for _ in range(40):
    DEEP = {"type": "object", "properties": {"x": DEEP}}


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"structured_outputs": {"json": {"type": "objekt"}}}, "sampling.structured_outputs.json", "not a JSON type"),
        ({"structured_outputs": {"json": DEEP}}, "sampling.structured_outputs.json", "nested deeper"),
        ({"structured_outputs": {"json": {"enum": ["x" * 70_000]}}}, "sampling.structured_outputs.json", "bytes"),
        ({"structured_outputs": {"json": "{not json"}}, "sampling.structured_outputs.json", "not JSON"),
        ({"structured_outputs": {"json": {"$ref": "http://x"}}}, "sampling.structured_outputs.json", "$ref"),
        ({"structured_outputs": {"json": {"properties": {"a": {"maxLength": -1}}}}}, None, "maxLength"),
        ({"structured_outputs": {"json": {"minimum": 5, "maximum": 1}}}, None, "above"),
        ({"structured_outputs": {"regex": "(a"}}, "sampling.structured_outputs.regex", "regular expression"),
        ({"structured_outputs": {"choice": []}}, "sampling.structured_outputs.choice", "1.."),
        ({"structured_outputs": {"grammar": "start ::= 'a'"}}, "sampling.structured_outputs.grammar", "root"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "sampling.structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "sampling.structured_outputs", "exactly one"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "exactly when"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "not one of"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": 3}}}},
            "response_format.json_schema.schema",
            "not a JSON type",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "not one of"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "names no",
        ),
        ({"tools": [TOOL, TOOL]}, "tools[1].function.name", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "match"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
            "tools[0].function.parameters",
            "nested",
        ),
        ({"tools": [TOOL], "response_format": {"type": "json_object"}}, "tools", "both constrain"),
        ({"tools": [TOOL], "structured_outputs": {"regex": "a"}}, "tools", "both constrain"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "not one of"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "missing"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls", "assistant"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id", "tool"),
    ],
)
def test_bad_chat_features_are_refused_before_anything_is_sent(kwargs, field, words):
    kwargs = {"messages": CHAT, **kwargs}
    with pytest.raises(ValidationError) as info:
        build_request(**kwargs)
    if field is not None:
        assert info.value.field is not None and info.value.field.startswith(field), info.value
    if words is not None:
        assert words in str(info.value)


def test_tools_need_a_chat():
    with pytest.raises(ValidationError, match="send messages"):
        build_request("a prompt", tools=[TOOL])


def test_every_structured_kind_passes_when_well_formed():
    for so in (
        {"json": PARAMS},
        {"json": '{"type": "object"}'},
        {"regex": r"\d{3}"},
        {"choice": ["a", "b"]},
        {"grammar": 'root ::= "a" | "b"'},
        {"json_object": True, "disable_any_whitespace": True},
    ):
        req = build_request("x", structured_outputs=so).request
        assert isinstance(req.sampling.structured_outputs, StructuredOutputsParams)
        assert decode_request(encode_request(req)) == req
