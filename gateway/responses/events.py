"""Responses API objects and streaming events from the SDK's `Chunk`s and their outcome.

Determinism: a client that lost its stream reconnects with ``starting_after=N``; the gateway reads
the response stream again from the start, renders every event again and sends those after N. So the
events are a pure function of (view, chunks, outcome): `sequence_number` counts from 0 in this
renderer (never from a clock or a chunk's batch), and item ids derive from the response id
(``msg_<rid>``, ``fc_<rid>_<call index>``).

Items open in the order the generation shows them and only one is open at a time: message content
opens (or continues) a message, a tool call's first delta closes what is open and opens its
``function_call``. Content after a call opens a new message (``msg_<rid>_<output index>``); the
parsers rarely give any, as they skip the whitespace between and after calls. An item closed by the
next one is ``completed``; the last one takes the response's outcome (``incomplete`` unless it
completed). `response_object(view, status, done)` builds the same output from the Completion alone,
except that content after a call joins the first message there.

Outcomes: finish_reason stop / tool_calls (and any other) -> ``completed``; length -> ``incomplete``
(reason max_output_tokens); abort -> ``cancelled``, announced by ``response.incomplete`` (the API has
no cancelled event); deadline -> ``failed`` (the chat endpoints answer it with an error too, and
``incomplete_details.reason`` has no word for it); a worker's error -> ``failed``. `error.code` must
be one of OpenAI's words, so pagedq's own code travels in `error.type`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from gateway.errors import CLIENT_ERROR_CODES
from producer_sdk.protocol import Usage
from producer_sdk.results import Chunk, Completion

_json = msgspec.json.Encoder()

COMPLETED, INCOMPLETE, CANCELLED, FAILED = "completed", "incomplete", "cancelled", "failed"
TERMINAL_EVENT = {
    COMPLETED: "response.completed",
    INCOMPLETE: "response.incomplete",
    CANCELLED: "response.incomplete",
    FAILED: "response.failed",
}
RATE_CODES = ("queue_full", "rate_limited", "rate_limit_exceeded")

# The Response object's request fields where the request did not set them (OpenAI's defaults).
DEFAULTS: dict[str, Any] = {
    "background": False,
    "completed_at": None,
    "instructions": None,
    "max_output_tokens": None,
    "max_tool_calls": None,
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "prompt_cache_key": None,
    "reasoning": None,
    "safety_identifier": None,
    "service_tier": "default",
    "store": True,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_logprobs": 0,
    "top_p": 1.0,
    "truncation": "disabled",
    "user": None,
    "metadata": {},
}


class ResponseView(msgspec.Struct):
    """Everything about a response that is not its generation."""

    id: str  # "resp_<request id>"
    created_at: int
    model: str
    echo: dict[str, Any] = {}  # request fields as the Response object shows them (over DEFAULTS)

    @property
    def rid(self) -> str:
        return self.id.removeprefix("resp_")


# --- the Response object --------------------------------------------------------------------------


def status_of(done: Completion) -> str:
    reason = done.finish_reason
    if reason == "length":
        return INCOMPLETE
    if reason == "abort":
        return CANCELLED
    return FAILED if reason == "deadline" else COMPLETED


def error_object(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """`Response.error` for pagedq's error `code` (kept in `type`; `code` takes OpenAI's word)."""
    word = "invalid_prompt" if code in CLIENT_ERROR_CODES else "server_error"
    if code in RATE_CODES:
        word = "rate_limit_exceeded"
    return {"code": word, "message": message, "param": param, "type": code}


def usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def item_status(status: str) -> str:
    """The status of the item a response ended with."""
    return COMPLETED if status == COMPLETED else INCOMPLETE


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """`text` None: the item as just opened, before its content part."""
    content = [] if text is None else [text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def output_items(view: ResponseView, done: Completion, status: str) -> list[dict[str, Any]]:
    """The output of a finished generation, from its Completion alone: the content as one message,
    then the calls (the order of the stream, unless the model wrote content after a call)."""
    calls = done.tool_calls or []
    items = []
    if done.content or (not calls and status in (COMPLETED, INCOMPLETE)):
        items.append(message_item(f"msg_{view.rid}", done.content, COMPLETED))
    for k, c in enumerate(calls):
        items.append(call_item(f"fc_{view.rid}_{k}", c.id, c.function.name, c.function.arguments, COMPLETED))
    if items:
        items[-1]["status"] = item_status(status)
    return items


def response_object(
    view: ResponseView,
    status: str,
    done: Completion | None = None,
    *,
    error: dict[str, Any] | None = None,
    output: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The whole Response object. `output` None: built from `done` (`output_items`), else empty.
    A deadline's error and a length finish's incomplete_details come from `done`."""
    if output is None:
        output = output_items(view, done, status) if done is not None else []
    if error is None and done is not None and done.finish_reason == "deadline":
        error = error_object("deadline_exceeded", f"Response {view.id} reached its deadline.")
    incomplete = done is not None and done.finish_reason == "length"
    head = {"id": view.id, "object": "response", "created_at": view.created_at, "status": status}
    return {
        **head,
        **DEFAULTS,
        **view.echo,
        **head,  # the echo cannot override these
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": view.model,
        "output": output,
        "usage": usage(done.usage) if done is not None else None,
    }


# --- the streamed events --------------------------------------------------------------------------


class _Item:
    """One output item being streamed: a message (`parts` text) or a call (`parts` arguments)."""

    def __init__(self, kind: str, item_id: str, index: int, call_id: str = "", name: str = "") -> None:
        self.kind, self.id, self.index, self.call_id, self.name = kind, item_id, index, call_id, name
        self.parts: list[str] = []
        self.status = "in_progress"

    def render(self, *, opening: bool = False) -> dict[str, Any]:
        joined = "".join(self.parts)
        if self.kind == "message":
            return message_item(self.id, None if opening else joined, self.status)
        return call_item(self.id, self.call_id, self.name, "" if opening else joined, self.status)


class ResponseEvents:
    """The events of one response, in order, each a dict with `type` and `sequence_number`.
    Call `start`, then `chunk` for each chunk, then `finish` (a Completion) or `fail` (an error)."""

    def __init__(self, view: ResponseView) -> None:
        self.view = view
        self.seq = 0
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # by tool-call index
        self.response: dict[str, Any] | None = None  # the final object, once finished

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _where(self, item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index}

    def start(self, status: str = "in_progress") -> list[dict[str, Any]]:
        """response.created (`status`: "queued" for a background response), then response.in_progress."""
        return [
            self._event("response.created", response=response_object(self.view, status)),
            self._event("response.in_progress", response=response_object(self.view, "in_progress")),
        ]

    def chunk(self, c: Chunk) -> list[dict[str, Any]]:
        """The events of one chunk (none for tool-call markup, empty text or another sample)."""
        if c.index != 0:
            return []
        out: list[dict[str, Any]] = []
        text = c.text if c.content is None else c.content
        if text:
            item = self.open
            if item is None or item.kind != "message":
                rid, n = self.view.rid, len(self.items)
                item = self._open(out, "message", f"msg_{rid}" if n == 0 else f"msg_{rid}_{n}")
            item.parts.append(text)
            where = self._where(item)
            out.append(self._event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]))
        for d in c.tool_calls or []:
            item = self.calls.get(d.index)
            if item is None:
                call_id = d.id or f"call_{self.view.rid}_{d.index}"
                item = self._open(out, "function_call", f"fc_{self.view.rid}_{d.index}", call_id, d.name or "")
                self.calls[d.index] = item
            elif item is not self.open:
                continue  # a closed call: the worker's parsers never go back to one
            if d.arguments:
                item.parts.append(d.arguments)
                where = self._where(item)
                out.append(self._event("response.function_call_arguments.delta", **where, delta=d.arguments))
        return out

    def _open(self, out: list[dict[str, Any]], kind: str, item_id: str, call_id: str = "", name: str = "") -> _Item:
        if self.open is not None:
            self._close(out, COMPLETED)
        item = _Item(kind, item_id, len(self.items), call_id, name)
        self.items.append(item)
        self.open = item
        out.append(self._event("response.output_item.added", output_index=item.index, item=item.render(opening=True)))
        if kind == "message":
            where = self._where(item)
            out.append(self._event("response.content_part.added", **where, content_index=0, part=text_part("")))
        return item

    def _close(self, out: list[dict[str, Any]], status: str) -> None:
        item, self.open = self.open, None
        assert item is not None
        item.status = status
        joined, where = "".join(item.parts), self._where(item)
        if item.kind == "message":
            out.append(self._event("response.output_text.done", **where, content_index=0, text=joined, logprobs=[]))
            out.append(self._event("response.content_part.done", **where, content_index=0, part=text_part(joined)))
        else:
            out.append(self._event("response.function_call_arguments.done", **where, arguments=joined))
        out.append(self._event("response.output_item.done", output_index=item.index, item=item.render()))

    def _end(
        self, status: str, done: Completion | None, error: dict[str, Any] | None, out: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        if not self.items and status in (COMPLETED, INCOMPLETE):
            self._open(out, "message", f"msg_{self.view.rid}")  # an empty answer is still a message
        if self.open is not None:
            self._close(out, item_status(status))
        output = [item.render() for item in self.items]
        self.response = response_object(self.view, status, done, error=error, output=output)
        out.append(self._event(TERMINAL_EVENT[status], response=self.response))
        return out

    def finish(self, done: Completion) -> list[dict[str, Any]]:
        """Close what is open, then the terminal event of the Completion's status (see module doc)."""
        return self._end(status_of(done), done, None, [])

    def fail(self, code: str, message: str, param: str | None = None) -> list[dict[str, Any]]:
        """For `RequestFailed` (its `code` and `error_message`): close what is open, then response.failed."""
        return self._end(FAILED, None, error_object(code, message, param), [])

    def snapshot(self, status: str = "in_progress") -> dict[str, Any]:
        """The Response object as it stands (GET of a running response): the final one once ended,
        else the items so far, the open one in_progress."""
        if self.response is not None:
            return self.response
        return response_object(self.view, status, output=[item.render() for item in self.items])


def all_events(
    view: ResponseView,
    chunks: Iterable[Chunk],
    done: Completion | None = None,
    *,
    failure: tuple[str, str] | None = None,
    start: str = "in_progress",
) -> list[dict[str, Any]]:
    """Every event of a response at once: start, chunks, then `done` or `failure` (code, message);
    with neither, the events so far of one still running."""
    r = ResponseEvents(view)
    events = r.start(start)
    for c in chunks:
        events += r.chunk(c)
    if done is not None:
        events += r.finish(done)
    elif failure is not None:
        events += r.fail(*failure)
    return events


def sse(event: dict[str, Any]) -> bytes:
    """One event as a server-sent event; its id is the sequence number (what starting_after takes)."""
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (event["sequence_number"], event["type"].encode(), _json.encode(event))


def frames(events: Iterable[dict[str, Any]], after: int = -1) -> bytes:
    """The server-sent events of those with sequence_number > `after` (``starting_after``)."""
    return b"".join(sse(e) for e in events if e["sequence_number"] > after)
