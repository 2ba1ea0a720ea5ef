"""Tools in a request: chat messages as chat templates read them, the model's tool-call format, and the
grammar that forces a call.

The format is chosen once per engine: `--tool-call-parser`, else detected from the chat template
(`--chat-template FILE` replaces the tokenizer's). A request with `tool_choice` "required" or a named
function gets the format's structural tag as its grammar, so even a small model writes calls whose
arguments validate against the tool's parameter schema; "auto" leaves the model free and parses what it
writes; "none" parses nothing.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from worker.engine.errors import RequestError, ToolsUnsupported
from worker.engine.structured.spec import GrammarSpec, spec_from_tag
from worker.engine.tool_parsers import TOOL_PARSERS, ToolParser, detect_tool_parser


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file's contents (or the template itself, when it is one)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"--chat-template {value!r}: no such file")


def choose_tool_parser(name: str | None, chat_template: str | None) -> type[ToolParser] | None:
    """The configured parser, else the one the chat template's markup names, else None."""
    name = name or detect_tool_parser(chat_template)
    return TOOL_PARSERS[name] if name else None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages as chat templates expect them: content parts joined into a string, and
    tool-call arguments (JSON text on the wire) as objects (transformers' convention)."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if m.get("tool_calls"):
            m["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        with contextlib.suppress(ValueError):  # else left as text: the template renders what it was given
            fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}


def forced_function(tool_choice: str | dict[str, Any] | None) -> tuple[bool, str | None]:
    """(a call is forced, the one function named): "required" -> (True, None), a named function ->
    (True, name), anything else -> (False, None)."""
    if isinstance(tool_choice, dict):
        return True, (tool_choice.get("function") or {}).get("name")
    return tool_choice == "required", None


def tool_grammar(
    parser: type[ToolParser],
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any] | None,
    token_markers: frozenset[str],
    *,
    parallel: bool = True,
) -> GrammarSpec | None:
    """The grammar of a forced call (one or more of the tools, or exactly one when a function is named or
    `parallel` is off), or None when the model chooses (auto) or may not call (none)."""
    forced, name = forced_function(tool_choice)
    if not forced:
        return None
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools")
    single = name is not None or not parallel
    return spec_from_tag(parser.forced_tag(chosen, single=single, token_markers=token_markers))


def require_parser(parser: type[ToolParser] | None) -> type[ToolParser]:
    if parser is None:
        raise ToolsUnsupported(
            "this worker knows no tool-call format for its model: start it with --tool-call-parser "
            "(hermes, llama3_json, mistral) and a --chat-template that renders tools"
        )
    return parser
