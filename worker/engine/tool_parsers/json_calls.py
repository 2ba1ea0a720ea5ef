"""Tool calls for a model without a tool-call format of its own (no `--tool-call-parser`, and a chat
template whose markup names none): a forced call is written as plain JSON under a grammar, as vLLM does.

* A named function (`tool_choice: {"type": "function", ...}`): the answer is the function's arguments,
  one JSON object valid against its `parameters` (`NamedArgumentsParser`).
* `tool_choice: "required"`: the answer is a JSON list of calls of the request's functions,
  ``[{"name": "f", "parameters": {...}}, {"name": "g", "parameters": {...}}]`` (vLLM's shape for
  "required"), exactly one call when `parallel_tool_calls` is off (`JsonCallListParser`).

These are not `--tool-call-parser` choices: the engine picks one per request, and only for a forced call
(tool_choice "auto" needs the model's own format). The calls come out as the format parsers' do: the same
ids, streamed deltas (id and name first, then argument fragments that join to the arguments) and
finish_reason "tool_calls".
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, ClassVar

from worker.engine.tool_parsers.base import ParsedDelta, ToolParser, call_tags, parameters_schema

LIST_OPEN, LIST_SEPARATOR, LIST_CLOSE = "[", ", ", "]"


class NamedArgumentsParser(ToolParser):
    """The whole answer is the arguments of `function`: one call, open from the first token."""

    name = "json_arguments"
    function: ClassVar[str] = ""  # set by `for_function`

    def __init__(self, request_id: str = "", sample: int = 0) -> None:
        super().__init__(request_id, sample)
        self.mode = "call"

    @staticmethod
    @lru_cache(maxsize=256)
    def for_function(function: str) -> type[NamedArgumentsParser]:
        """The parser class of the arguments of `function` (one class per name, kept)."""
        return type("NamedArgumentsParser", (NamedArgumentsParser,), {"function": function})

    def _advance(self, out: ParsedDelta) -> bool:
        if self.mode == "call":
            if not self.calls:
                self._open_call()
                # The scanner reads the answer as the arguments of a call object around it.
                for ch in f'{{"name": {json.dumps(self.function)}, "arguments": ':
                    self.calls[0].scanner.feed(ch)
            scanner = self.calls[0].scanner
            while self.i < len(self.buf) and scanner.args_end < 0 and not scanner.failed:
                scanner.feed(self.buf[self.i])
                self.i += 1
            if scanner.args_end < 0 and not scanner.failed:
                return False
            if not scanner.failed:
                scanner.feed("}")  # the arguments ended: so does the call
            self.mode = "content"
        self._say(out, self.buf[self.i :])  # nothing, under the grammar
        self.i = len(self.buf)
        return False

    @classmethod
    def forced_tag(cls, tools: list[dict[str, Any]], *, single: bool, token_markers: frozenset[str]) -> dict:
        (tool,) = tools
        return {
            "type": "structural_tag",
            "format": {"type": "json_schema", "json_schema": parameters_schema(tool), "max_whitespace_cnt": 1},
        }


class JsonCallListParser(ToolParser):
    """``[{"name": ..., "parameters": {...}}, ...]``: one call per object of the list."""

    name = "json_list"
    args_keys = ("parameters", "arguments")

    def __init__(self, request_id: str = "", sample: int = 0) -> None:
        super().__init__(request_id, sample)
        self.mode = "start"

    def _advance(self, out: ParsedDelta) -> bool:
        if self.mode == "start":
            if not self._skip_ws():
                return False
            if self.buf[self.i] != LIST_OPEN:
                self.mode = "content"
            else:
                self.i += 1
                self.mode = "open"
        if self.mode == "open":
            if not self._skip_ws():
                return False
            if self.buf[self.i] != "{":
                self.mode = "content"
                return True
            self._open_call()
            self.mode = "call"
        if self.mode == "call":
            state = self._scan_call()
            if state == "more":
                return False
            self.mode = "sep" if state == "done" else "content"
        if self.mode == "sep":
            if not self._skip_ws():
                return False
            ch = self.buf[self.i]
            if ch in ",]":
                self.i += 1
            self.mode = "open" if ch == "," else "end" if ch == "]" else "content"
        if self.mode in ("content", "end"):  # after the list (nothing, under the grammar)
            self._say(out, self.buf[self.i :])
            self.i = len(self.buf)
            return False
        return True

    @classmethod
    def forced_tag(cls, tools: list[dict[str, Any]], *, single: bool, token_markers: frozenset[str]) -> dict:
        return {
            "type": "structural_tag",
            "format": {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": LIST_OPEN},
                    {
                        "type": "tags_with_separator",
                        "tags": call_tags(tools, "", "parameters", ""),
                        "separator": LIST_SEPARATOR,
                        "at_least_one": True,
                        "stop_after_first": single,
                    },
                    {"type": "const_string", "value": LIST_CLOSE},
                ],
            },
        }
