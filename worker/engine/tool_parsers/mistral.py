"""Mistral format: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the JSON-array form of
Mistral's v3 tokenizers); text before the marker is content."""

from __future__ import annotations

from typing import Any

from worker.engine.tool_parsers.base import ParsedDelta, ToolParser, call_tags

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (MARKER,)

    def _advance(self, out: ParsedDelta) -> bool:
        if self.mode == "text":
            if not self._text_until(out, MARKER):
                return False
            self.mode = "array"
        if self.mode == "array":
            if not self._skip_ws():
                return False
            if self.buf[self.i] == "[":
                self.i += 1
            self.mode = "element"
        if self.mode == "element":
            if not self._skip_ws():
                return False
            if self.buf[self.i] != "{":
                self.i += self.buf[self.i] == "]"
                self.mode = "text"
                return True
            self._open_call()
            self.mode = "call"
        if self.mode == "call":
            state = self._scan_call()
            if state == "more":
                return False
            self.mode = "after" if state == "done" else "text"
        if self.mode == "after":
            if not self._skip_ws():
                return False
            sep = self.buf[self.i]
            self.i += sep in ",]"
            self.mode = "element" if sep == "," else "text"
        return True

    @classmethod
    def forced_tag(cls, tools: list[dict[str, Any]], *, single: bool, token_markers: frozenset[str]) -> dict:
        marker = (
            {"type": "token", "token": MARKER} if MARKER in token_markers else {"type": "const_string", "value": MARKER}
        )
        return {
            "type": "structural_tag",
            "format": {
                "type": "sequence",
                "elements": [
                    marker,
                    {"type": "const_string", "value": "["},
                    {
                        "type": "tags_with_separator",
                        "tags": call_tags(tools, "", "arguments", ""),
                        "separator": ", ",
                        "at_least_one": True,
                        "stop_after_first": single,
                    },
                    {"type": "const_string", "value": "]"},
                ],
            },
        }
