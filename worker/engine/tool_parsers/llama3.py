"""Llama 3.x JSON format (vLLM's `llama3_json`): the answer is ``{"name": ..., "parameters": {...}}``,
several separated by ``; ``, optionally after ``<|python_tag|>``. An answer that starts otherwise is
content."""

from __future__ import annotations

from typing import Any

from worker.engine.tool_parsers.base import ParsedDelta, ToolParser, call_tags

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    args_keys = ("parameters", "arguments")

    def __init__(self, request_id: str = "", sample: int = 0) -> None:
        super().__init__(request_id, sample)
        self.mode = "start"

    def _advance(self, out: ParsedDelta) -> bool:
        if self.mode == "start":
            rest = self.buf[self.i :].lstrip()
            if not rest:
                return False
            if rest.startswith(PYTHON_TAG) or rest[0] == "{":
                self._skip_ws()
                self._at(PYTHON_TAG)
                self.mode = "open"
            elif PYTHON_TAG.startswith(rest):
                return False
            else:
                self.mode = "content"
        if self.mode == "content":
            self._say(out, self.buf[self.i :])
            self.i = len(self.buf)
            return False
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
            if self.buf[self.i] == ";":
                self.i += 1
                self.mode = "open"
            else:
                self.mode = "content"
        return True

    @classmethod
    def forced_tag(cls, tools: list[dict[str, Any]], *, single: bool, token_markers: frozenset[str]) -> dict:
        return {
            "type": "structural_tag",
            "format": {
                "type": "tags_with_separator",
                "tags": call_tags(tools, "", "parameters", ""),
                "separator": SEPARATOR,
                "at_least_one": True,
                "stop_after_first": single,
            },
        }
