"""The Responses API renderer (gateway.responses.events), no processes: every event and object parsed
by the official client's models, streams read by the official client itself (its SSE parser and its
accumulator, over an in-process transport), determinism across batching and re-rendering, and the
status of each outcome."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.responses.events import (
    ResponseEvents,
    ResponseView,
    all_events,
    error_object,
    frames,
    response_object,
    sse,
    status_of,
)
from producer_sdk.chat import FunctionCall, ToolCall, ToolCallDelta
from producer_sdk.protocol import Usage
from producer_sdk.results import Chunk, Completion

EVENT = TypeAdapter(ResponseStreamEvent)
RID = "01J0RESPONSETEST"
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": False}]


def view(**echo: Any) -> ResponseView:
    return ResponseView(id=f"resp_{RID}", created_at=1_700_000_000, model="tiny", echo=echo)


def tok(text: str, content: str | None = None) -> Chunk:
    return Chunk(text, [len(text)], content=content)


def call(index: int, arguments: str = "", *, name: str | None = None) -> Chunk:
    first = name is not None
    delta = ToolCallDelta(index=index, id=f"call_{index}" if first else None, name=name, arguments=arguments)
    return Chunk("", [], content="", tool_calls=[delta])


def numbered(chunks: list[Chunk]) -> list[Chunk]:
    """The chunks with the seq of the response stream (1 is the first after Started)."""
    return [
        Chunk(c.text, c.token_ids, 0, seq=i + 1, content=c.content, tool_calls=c.tool_calls)
        for i, c in enumerate(chunks)
    ]


def outcome(chunks: list[Chunk], finish_reason: str = "stop", usage: Usage | None = None) -> Completion:
    """The Completion the SDK builds from these chunks (content joined, call fragments joined by index)."""
    text = "".join(c.text for c in chunks)
    content = "".join(c.text if c.content is None else c.content for c in chunks)
    names: dict[int, tuple[str, str]] = {}
    args: dict[int, str] = {}
    for c in chunks:
        for d in c.tool_calls or []:
            if d.id is not None:
                names[d.index] = (d.id, d.name or "")
            args[d.index] = args.get(d.index, "") + d.arguments
    calls = [
        ToolCall(id=names[i][0], function=FunctionCall(name=names[i][1], arguments=args[i])) for i in sorted(names)
    ]
    return Completion(
        request_id=RID,
        text=text,
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=finish_reason,
        usage=usage or Usage(prompt_tokens=11, completion_tokens=len(chunks), cached_tokens=4),
        content=content,
        tool_calls=calls or None,
    )


def check(events: list[dict[str, Any]]) -> list[Any]:
    """Every event parsed by the client's discriminated union; sequence numbers 0, 1, 2..."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return [EVENT.validate_python(e) for e in events]


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


TEXT = [tok("Hello"), tok(", "), tok("world")]
TEXT_THEN_CALLS = [
    tok("Let me check.", "Let me check."),
    tok("<tool_call>", ""),  # markup only: no event
    call(0, '{"city": ', name="get_weather"),
    call(0, '"Paris"}'),
    call(1, '{"city": "Rome"}', name="get_weather"),
]
CALLS_ONLY = [call(0, name="get_weather"), call(0, '{"city": "Oslo"}')]


# --- the events and the object parse with the client's models --------------------------------------


def test_text_answer_events_in_openai_order_and_shape():
    chunks = numbered(TEXT)
    events = all_events(view(), chunks, outcome(chunks))
    parsed = check(events)
    assert types(events) == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.delta",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "completed",
    ]
    assert parsed[0].response.status == "in_progress" and parsed[0].response.output == []
    assert parsed[2].item.id == f"msg_{RID}" and parsed[2].item.status == "in_progress"
    assert [p.delta for p in parsed[4:7]] == ["Hello", ", ", "world"]
    assert {p.item_id for p in parsed[3:9]} == {f"msg_{RID}"}
    assert parsed[7].text == "Hello, world" and parsed[8].part.text == "Hello, world"
    final = parsed[-1].response
    assert final.status == "completed" and final.output_text == "Hello, world"
    assert final.output[0].status == "completed" and final.usage.total_tokens == 14


def test_whole_object_parses_with_echoed_request_fields():
    echo = {
        "instructions": "be brief",
        "tools": TOOLS,
        "tool_choice": "auto",
        "temperature": 0.2,
        "metadata": {"k": "v"},
    }
    chunks = numbered(TEXT_THEN_CALLS)
    obj = response_object(view(**echo, id="resp_other", status="x"), "completed", outcome(chunks))
    r = Response.model_validate(obj)
    assert r.id == f"resp_{RID}" and r.status == "completed"  # the echo cannot override these
    assert r.instructions == "be brief" and r.temperature == 0.2 and r.metadata == {"k": "v"}
    assert r.tools[0].name == "get_weather" and r.parallel_tool_calls is True and r.top_p == 1.0
    assert r.text.format.type == "text" and r.truncation == "disabled" and r.error is None
    assert "output_text" not in obj  # the client computes it
    assert r.output_text == "Let me check."
    assert [(o.type, o.id, o.status) for o in r.output] == [
        ("message", f"msg_{RID}", "completed"),
        ("function_call", f"fc_{RID}_0", "completed"),
        ("function_call", f"fc_{RID}_1", "completed"),
    ]
    assert (r.output[1].call_id, r.output[1].name, r.output[1].arguments) == (
        "call_0",
        "get_weather",
        '{"city": "Paris"}',
    )


def test_usage_fields():
    done = outcome(numbered(TEXT), usage=Usage(prompt_tokens=30, completion_tokens=7, cached_tokens=16))
    u = Response.model_validate(response_object(view(), "completed", done)).usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (30, 7, 37)
    assert u.input_tokens_details.cached_tokens == 16 and u.input_tokens_details.cache_write_tokens == 0
    assert u.output_tokens_details.reasoning_tokens == 0
    assert response_object(view(), "queued")["usage"] is None


# --- the official client reads the stream (SSE parser, accumulator, resumption) ------------------------


def client_serving(events: list[dict[str, Any]], seen: list[httpx2.Request] | None = None) -> openai.OpenAI:
    """An openai client whose server answers every request with these events (those after
    `starting_after` when the query names it), as the gateway will."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        if seen is not None:
            seen.append(request)
        after = int(request.url.params.get("starting_after", -1))
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=frames(events, after))

    http = httpx2.Client(transport=httpx2.MockTransport(handler))
    return openai.OpenAI(api_key="sk-test", base_url="http://gateway/v1", http_client=http, max_retries=0)


@pytest.mark.parametrize("chunks", [TEXT, TEXT_THEN_CALLS, CALLS_ONLY], ids=["text", "text+calls", "calls"])
def test_client_accumulator_builds_the_object_we_render(chunks):
    chunks = numbered(chunks)
    done = outcome(chunks, "tool_calls" if chunks[-1].tool_calls else "stop")
    client = client_serving(all_events(view(tools=TOOLS), chunks, done))
    with client.responses.stream(model="tiny", input="hi", tools=TOOLS) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    expected = Response.model_validate(response_object(view(tools=TOOLS), status_of(done), done))
    assert final.output_text == expected.output_text == "".join(deltas) == done.content
    fields = {"type", "id", "status", "call_id", "name", "arguments"}
    assert [o.model_dump(include=fields) for o in final.output] == [
        o.model_dump(include=fields) for o in expected.output
    ]
    calls = [(o.call_id, json.loads(o.arguments)) for o in final.output if o.type == "function_call"]
    assert calls == [(t.id, json.loads(t.function.arguments)) for t in done.tool_calls or []]


def test_client_resumes_a_stream_after_a_sequence_number():
    chunks = numbered(TEXT_THEN_CALLS)
    events = all_events(view(), chunks, outcome(chunks, "tool_calls"))
    seen: list[httpx2.Request] = []
    client = client_serving(events, seen)
    n = 6
    # The stream helper reads the whole stream again (it needs response.created) and drops the head itself.
    with client.responses.stream(response_id=f"resp_{RID}", starting_after=n) as stream:
        tail = list(stream)
        assert stream.get_final_response().output[2].arguments == '{"city": "Rome"}'
    assert seen[-1].method == "GET" and seen[-1].url.path == f"/v1/responses/resp_{RID}"
    assert [e.sequence_number for e in tail] == list(range(n + 1, len(events)))
    # The raw retrieve passes starting_after to the server: exactly the tail comes back.
    raw = list(client.responses.retrieve(f"resp_{RID}", stream=True, starting_after=n))
    assert [e.model_dump(mode="json", exclude_unset=True) for e in raw] == events[n + 1 :]


def test_sse_framing():
    event = all_events(view(), [])[0]
    frame = sse(event).decode()
    assert frame.endswith("\n\n") and frame.count("\n\n") == 1
    head, kind, data = frame.rstrip("\n").split("\n")
    assert (head, kind) == ("id: 0", "event: response.created")
    assert json.loads(data.removeprefix("data: ")) == event
    assert frames([event], after=0) == b""


# --- determinism ------------------------------------------------------------------------------------


def incremental(v: ResponseView, chunks: list[Chunk], sizes: list[int], done: Completion) -> list[dict[str, Any]]:
    """The events as a streaming reader renders them, reading the chunks in batches of these sizes."""
    r = ResponseEvents(v)
    out = r.start("in_progress")
    i = 0
    for size in sizes:
        for c in chunks[i : i + size]:
            out += r.chunk(c)
        i += size
    return out + r.finish(done)


@pytest.mark.parametrize("sizes", [[1, 1, 1, 1, 1], [5], [2, 3], [0, 4, 1]])
def test_events_do_not_depend_on_batching(sizes):
    chunks = numbered(TEXT_THEN_CALLS)
    done = outcome(chunks, "tool_calls")
    reference = all_events(view(), chunks, done)
    again = incremental(view(), chunks, sizes, done)
    assert again == reference
    assert frames(again) == frames(reference)


@pytest.mark.parametrize("n", [-1, 0, 1, 5, 12, 13])
def test_rerendering_and_filtering_gives_exactly_the_tail(n):
    chunks = numbered(TEXT_THEN_CALLS)
    done = outcome(chunks, "tool_calls")
    first = all_events(view(), chunks, done)
    check(first)
    tail = [e for e in all_events(view(), chunks, done) if e["sequence_number"] > n]
    assert tail == first[n + 1 :]
    assert frames(first, n) == b"".join(sse(e) for e in first[n + 1 :])


def test_a_running_response_renders_a_prefix_of_the_finished_one():
    chunks = numbered(TEXT)
    running = all_events(view(), chunks[:2])
    finished = all_events(view(), chunks, outcome(chunks))
    assert finished[: len(running)] == running


def test_text_split_differently_gives_the_same_object():
    a = numbered([tok("Hel"), tok("lo, wor"), tok("ld")])
    b = numbered([tok("Hello, world")])
    ra, rb = ResponseEvents(view()), ResponseEvents(view())
    for r, chunks in ((ra, a), (rb, b)):
        r.start()
        for c in chunks:
            r.chunk(c)
        r.finish(outcome(chunks, usage=Usage(prompt_tokens=1, completion_tokens=3)))
    assert ra.response == rb.response


# --- outcomes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "status", "terminal", "details", "error_type", "item"),
    [
        ("stop", "completed", "completed", None, None, "completed"),
        ("tool_calls", "completed", "completed", None, None, "completed"),
        ("length", "incomplete", "incomplete", {"reason": "max_output_tokens"}, None, "incomplete"),
        ("abort", "cancelled", "incomplete", None, None, "incomplete"),
        ("deadline", "failed", "failed", None, "deadline_exceeded", "incomplete"),
    ],
)
def test_finish_reason_decides_the_status(reason, status, terminal, details, error_type, item):
    chunks = numbered(TEXT)
    done = outcome(chunks, reason)
    events = all_events(view(), chunks, done)
    last = check(events)[-1]
    assert last.type == f"response.{terminal}"
    r = last.response
    assert r.status == status
    assert (r.incomplete_details.model_dump() if r.incomplete_details else None) == details
    assert (r.error.type if r.error else None) == error_type
    assert r.error is None or r.error.code == "server_error"
    assert r.output[0].status == item and r.output_text == "Hello, world"
    assert r.usage is not None
    assert events[-1]["response"] == response_object(view(), status, done)  # whole == streamed


def test_request_failed_closes_the_open_item_then_fails():
    chunks = numbered(TEXT_THEN_CALLS[:3])
    events = all_events(view(), chunks, failure=("engine_error", "the engine died"))
    parsed = check(events)
    assert types(events)[-3:] == ["function_call_arguments.done", "output_item.done", "failed"]
    r = parsed[-1].response
    assert r.status == "failed" and r.usage is None
    assert (r.error.code, r.error.message, r.error.type) == ("server_error", "the engine died", "engine_error")
    assert [(o.type, o.status) for o in r.output] == [("message", "completed"), ("function_call", "incomplete")]
    assert r.output[1].arguments == '{"city": '


def test_request_failed_before_any_output():
    events = all_events(view(), [], failure=("prompt_too_long", "the prompt is over the model's length"))
    r = check(events)[-1].response
    assert types(events) == ["created", "in_progress", "failed"]
    assert r.output == [] and r.error.code == "invalid_prompt" and r.error.type == "prompt_too_long"


def test_error_codes_map_to_openai_words():
    assert error_object("invalid", "m")["code"] == "invalid_prompt"
    assert error_object("queue_full", "m")["code"] == "rate_limit_exceeded"
    assert error_object("dead_letter", "m", "input") == {
        "code": "server_error",
        "message": "m",
        "param": "input",
        "type": "dead_letter",
    }


def test_background_response_starts_queued():
    events = all_events(view(background=True), [], start="queued")
    parsed = check(events)
    assert [(p.type, p.response.status) for p in parsed] == [
        ("response.created", "queued"),
        ("response.in_progress", "in_progress"),
    ]
    assert parsed[0].response.background is True


# --- items --------------------------------------------------------------------------------------------


def test_text_then_tool_calls():
    chunks = numbered(TEXT_THEN_CALLS)
    done = outcome(chunks, "tool_calls")
    events = all_events(view(), chunks, done)
    parsed = check(events)
    assert types(events)[2:] == [
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        # the first call closes the message
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        # the second call closes the first
        "function_call_arguments.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    added = [p for p in parsed if p.type == "response.output_item.added"]
    assert [(p.output_index, p.item.type, p.item.id) for p in added] == [
        (0, "message", f"msg_{RID}"),
        (1, "function_call", f"fc_{RID}_0"),
        (2, "function_call", f"fc_{RID}_1"),
    ]
    assert added[1].item.arguments == "" and added[1].item.call_id == "call_0" and added[1].item.status == "in_progress"
    args_done = [p for p in parsed if p.type == "response.function_call_arguments.done"]
    assert [(p.item_id, p.output_index, p.arguments) for p in args_done] == [
        (f"fc_{RID}_0", 1, '{"city": "Paris"}'),
        (f"fc_{RID}_1", 2, '{"city": "Rome"}'),
    ]
    assert events[-1]["response"] == response_object(view(), "completed", done)


def test_tool_calls_only_have_no_message():
    chunks = numbered(CALLS_ONLY)
    done = outcome(chunks, "tool_calls")
    events = all_events(view(), chunks, done)
    r = check(events)[-1].response
    assert [o.type for o in r.output] == ["function_call"] and r.output_text == ""
    assert "content_part.added" not in types(events)
    assert events[-1]["response"] == response_object(view(), "completed", done)


def test_empty_answer_is_an_empty_message():
    chunks = numbered([tok("")])
    done = outcome(chunks)
    events = all_events(view(), chunks, done)
    r = check(events)[-1].response
    assert [(o.type, o.status, o.content[0].text) for o in r.output] == [("message", "completed", "")]
    assert "output_text.delta" not in types(events)
    assert events[-1]["response"] == response_object(view(), "completed", done)


def test_cancelled_before_any_output_has_no_items():
    done = outcome([], "abort")
    events = all_events(view(), [], done)
    assert types(events) == ["created", "in_progress", "incomplete"]
    assert check(events)[-1].response.output == [] == response_object(view(), "cancelled", done)["output"]


def test_length_cut_call_is_incomplete():
    chunks = numbered([*CALLS_ONLY[:1], call(0, '{"ci')])
    done = outcome(chunks, "length")
    r = check(all_events(view(), chunks, done))[-1].response
    assert (r.status, r.output[0].status, r.output[0].arguments) == ("incomplete", "incomplete", '{"ci')


def test_content_after_a_call_opens_a_new_message():
    chunks = numbered([*CALLS_ONLY, tok("\n\nDone.", "Done.")])
    events = all_events(view(), chunks, outcome(chunks, "stop"))
    r = check(events)[-1].response
    assert [(o.type, o.id, o.status) for o in r.output] == [
        ("function_call", f"fc_{RID}_0", "completed"),
        ("message", f"msg_{RID}_1", "completed"),
    ]
    assert r.output_text == "Done."


def test_markup_and_other_samples_give_no_events():
    r = ResponseEvents(view())
    r.start()
    assert r.chunk(Chunk("<tool_call>", [5], seq=1, content="")) == []
    assert r.chunk(Chunk("other", [6], index=1, seq=2)) == []
    assert r.seq == 2


def test_snapshot_of_a_running_response():
    chunks = numbered(TEXT_THEN_CALLS)
    r = ResponseEvents(view())
    r.start()
    for c in chunks[:3]:
        r.chunk(c)
    now = Response.model_validate(r.snapshot())
    assert now.status == "in_progress" and now.usage is None
    assert [(o.type, o.status) for o in now.output] == [("message", "completed"), ("function_call", "in_progress")]
    assert now.output[1].arguments == '{"city": '
    for c in chunks[3:]:
        r.chunk(c)
    r.finish(outcome(chunks, "tool_calls"))
    assert r.snapshot() is r.response and r.snapshot()["status"] == "completed"
