"""Tool-call parsing while text streams in: the common machinery of the parsers.

A `ToolParser` is one sample's parser. `feed(text)` takes the next detokenized text and returns what
it adds: message content (the text outside tool-call markup) and tool-call deltas (a call's id and
name once, then fragments of its arguments as raw JSON text). A parser walks its buffer with a small
state machine (one per format, in the subclasses), never re-reading what it consumed, and holds back
only the text that may still turn out to be markup (a partial marker).

Each format also names its grammar: `forced_tag` is the xgrammar structural tag that makes the model
write one or more valid calls (tool_choice "required" or a named function).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from producer_sdk.chat import FunctionCall, ToolCall, ToolCallDelta
from worker.engine.structured.spec import fix_bounded_strings
from worker.engine.tool_parsers.json_scan import JsonCallScanner

_WS = " \t\r\n"


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def call_id(request_id: str, sample: int, index: int) -> str:
    """The same on every worker that runs the request (a resumed stream keeps its ids)."""
    return "call_" + hashlib.sha256(f"{request_id}/{sample}/{index}".encode()).hexdigest()[:24]


class _Call:
    """One tool call being scanned, and how much of it has been handed out."""

    def __init__(self, index: int, id_: str, args_keys: tuple[str, ...]) -> None:
        self.index = index
        self.id = id_
        self.scanner = JsonCallScanner(args_keys)
        self.name_sent = False
        self.args_sent = 0  # characters of the raw arguments handed out
        self.arguments: list[str] = []
        self.closed_out = False  # everything handed out, the call is complete

    def delta(self) -> ToolCallDelta | None:
        s = self.scanner
        if s.name is None:
            return None
        d = ToolCallDelta(index=self.index)
        if not self.name_sent:
            d.id, d.name, self.name_sent = self.id, s.name, True
        if s.args_open:
            d.arguments = s.raw(s.args_start + self.args_sent, len(s.text))
        elif s.args_end >= 0:
            complete = s.arguments() or ""
            d.arguments = complete[self.args_sent :] if self.args_sent else complete
        elif s.done:  # closed without arguments
            d.arguments = "" if self.args_sent else "{}"
        self.args_sent += len(d.arguments)
        self.arguments.append(d.arguments)
        return d if d.name is not None or d.arguments else None

    def tool_call(self) -> ToolCall:
        return ToolCall(
            id=self.id, function=FunctionCall(name=self.scanner.name or "", arguments="".join(self.arguments))
        )


class ToolParser:
    """Base of the per-format parsers. Subclasses set `name`, `markers` and `args_keys`, implement
    `_advance` (one move of their state machine) and `forced_tag`."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # markup strings (may be special tokens of a tokenizer)
    args_keys: ClassVar[tuple[str, ...]] = ("arguments",)

    def __init__(self, request_id: str = "", sample: int = 0) -> None:
        self.request_id = request_id
        self.sample = sample
        self.buf = ""
        self.i = 0  # consumed up to here
        self.mode = "text"
        self.calls: list[_Call] = []
        self._content: list[str] = []

    # --- the stream -------------------------------------------------------------------------------

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        out = ParsedDelta()
        while self.i < len(self.buf) and self._advance(out):
            pass
        self._collect(out)
        self.buf, self.i = self.buf[self.i :], 0
        return out

    def finish(self) -> ParsedDelta:
        """The text has ended: a held-back partial marker is content after all."""
        out = ParsedDelta()
        if self.mode in ("text", "start") and self.i < len(self.buf):
            self._say(out, self.buf[self.i :])
        self.buf, self.i = "", 0
        return out

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def num_complete(self) -> int:
        return sum(1 for c in self.calls if c.scanner.done)

    def tool_calls(self) -> list[ToolCall]:
        """The calls begun so far, in order, as streamed: one cut short (max_tokens) has partial arguments,
        as OpenAI returns it."""
        return [c.tool_call() for c in self.calls if c.name_sent]

    # --- helpers for the state machines -----------------------------------------------------------

    def _advance(self, out: ParsedDelta) -> bool:
        """One move; False when more text is needed."""
        raise NotImplementedError

    def _say(self, out: ParsedDelta, text: str) -> None:
        if text:
            out.content += text
            self._content.append(text)

    def _skip_ws(self) -> bool:
        """Skip whitespace; False when the buffer ran out."""
        while self.i < len(self.buf) and self.buf[self.i] in _WS:
            self.i += 1
        return self.i < len(self.buf)

    def _next_non_ws(self) -> int:
        """Where the next non-whitespace character is, without consuming anything (-1: not yet seen)."""
        j = self.i
        while j < len(self.buf) and self.buf[j] in _WS:
            j += 1
        return j if j < len(self.buf) else -1

    def _at(self, marker: str) -> str:
        """At the cursor: "yes" (the marker is there, consumed), "maybe" (a prefix of it ends the
        buffer) or "no"."""
        rest = self.buf[self.i : self.i + len(marker)]
        if rest == marker:
            self.i += len(marker)
            return "yes"
        return "maybe" if marker.startswith(rest) else "no"

    def _text_until(self, out: ParsedDelta, marker: str) -> bool:
        """Content up to `marker` (consumed; True), or up to a possible partial marker (False)."""
        j = self.buf.find(marker, self.i)
        if j >= 0:
            self._say(out, self.buf[self.i : j])
            self.i = j + len(marker)
            return True
        keep = next(
            (k for k in range(min(len(marker) - 1, len(self.buf) - self.i), 0, -1) if self.buf.endswith(marker[:k])), 0
        )
        self._say(out, self.buf[self.i : len(self.buf) - keep])
        self.i = len(self.buf) - keep
        return False

    def _open_call(self) -> None:
        index = len(self.calls)
        self.calls.append(_Call(index, call_id(self.request_id, self.sample, index), self.args_keys))

    def _scan_call(self) -> str:
        """Feed the current call; "done", "failed" or "more"."""
        call = self.calls[-1].scanner
        while self.i < len(self.buf) and not (call.done or call.failed):
            call.feed(self.buf[self.i])
            self.i += 1
        return "done" if call.done else "failed" if call.failed else "more"

    def _collect(self, out: ParsedDelta) -> None:
        for call in self.calls:
            if call.closed_out:
                continue
            d = call.delta()
            if d is not None:
                out.tool_calls.append(d)
            call.closed_out = call.scanner.done or call.scanner.failed

    # --- the grammar of a forced call -------------------------------------------------------------

    @classmethod
    def forced_tag(cls, tools: list[dict[str, Any]], *, single: bool, token_markers: frozenset[str]) -> dict:
        """The structural tag (xgrammar's JSON format) of one (`single`) or more calls of `tools`.
        `token_markers`: markers that are single tokens of the tokenizer (matched as tokens)."""
        raise NotImplementedError


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a tool's arguments (any object when the tool names none)."""
    params = tool["function"].get("parameters")
    return fix_bounded_strings(params) if params else {"type": "object"}


def call_tags(tools: list[dict[str, Any]], begin: str, args_key: str, end: str) -> list[dict]:
    """One tag per tool: `begin` + {"name": NAME, "<args_key>": <arguments> + `end`."""
    tags = []
    for tool in tools:
        name = tool["function"]["name"]
        tags.append(
            {
                "type": "tag",
                "begin": f'{begin}{{"name": "{name}", "{args_key}": ',
                # At most one whitespace character between JSON tokens: a model cannot pad a call forever.
                "content": {"type": "json_schema", "json_schema": parameters_schema(tool), "max_whitespace_cnt": 1},
                "end": f"}}{end}",
            }
        )
    return tags
