"""Tool-call parsers, one per output format, chosen per model (`--tool-call-parser`, or detected from
the chat template): `hermes`, `llama3_json`, `mistral` (vLLM's names)."""

from __future__ import annotations

from worker.engine.tool_parsers.base import ParsedDelta, ToolParser, call_id
from worker.engine.tool_parsers.hermes import HermesToolParser
from worker.engine.tool_parsers.llama3 import Llama3JsonToolParser
from worker.engine.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

# What in a chat template gives its tool-call format away (checked in this order).
_TEMPLATE_SIGNS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
)


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool markup names, or None when it names none."""
    if not chat_template:
        return None
    return next((name for sign, name in _TEMPLATE_SIGNS if sign in chat_template), None)


__all__ = ["TOOL_PARSERS", "ParsedDelta", "ToolParser", "call_id", "detect_tool_parser"]
