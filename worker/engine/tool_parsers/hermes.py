"""Hermes / Qwen format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block
per call; text before the first block is content."""

from __future__ import annotations

from typing import Any

from worker.engine.tool_parsers.base import ParsedDelta, ToolParser, call_tags

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (START, END)

    def _advance(self, out: ParsedDelta) -> bool:
        if self.mode == "text":
            if not self._text_until(out, START):
                return False
            self.mode = "open"
        if self.mode == "open":
            j = self._next_non_ws()
            if j < 0:
                return False
            if self.buf[j] != "{":
                self._say(out, START + self.buf[self.i : j])  # not a call after all: the marker was content
                self.i = j
                self.mode = "text"
                return True
            self.i = j
            self._open_call()
            self.mode = "call"
        if self.mode == "call":
            state = self._scan_call()
            if state == "more":
                return False
            self.mode = "close" if state == "done" else "text"
        if self.mode == "close":
            if not self._skip_ws():
                return False
            seen = self._at(END)
            if seen == "maybe":
                return False
            self.mode = "gap"
        if self.mode == "gap":  # between calls: whitespace, then another call or more content
            if not self._skip_ws():
                return False
            seen = self._at(START)
            if seen == "maybe":
                return False
            self.mode = "open" if seen == "yes" else "text"
        return True

    @classmethod
    def forced_tag(cls, tools: list[dict[str, Any]], *, single: bool, token_markers: frozenset[str]) -> dict:
        return {
            "type": "structural_tag",
            "format": {
                "type": "tags_with_separator",
                "tags": call_tags(tools, START + "\n", "arguments", "\n" + END),
                "separator": "\n",
                "at_least_one": True,
                "stop_after_first": single,
            },
        }
