"""Tools in a request: chat messages as chat templates read them, the model's tool-call format, and the
grammar that forces a call.

The format is chosen once per engine: `--tool-call-parser`, else detected from the chat template
(`--chat-template FILE` replaces the tokenizer's). A request with `tool_choice` "required" or a named
function gets the format's structural tag as its grammar, so even a small model writes calls whose
arguments validate against the tool's parameter schema; "auto" leaves the model free and parses what it
writes; "none" parses nothing.

A model with no format (no parser, and a template whose markup names none) still takes a forced call,
as vLLM does: the answer is plain JSON under a grammar (`tool_parsers/json_calls.py`), the arguments
object of a named function, or for "required" a list of calls `[{"name": ..., "parameters": {...}}]`.
Only "auto" needs the model's own format (`ToolsUnsupported`). When the chat template renders no tools,
the prompt gets `TOOLS_PREAMBLE` (the tools and the answer's shape) in its system turn, and an
assistant turn's calls are written into its text in that same list shape.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from worker.engine.errors import RequestError, ToolsUnsupported
from worker.engine.structured.spec import GrammarSpec, spec_from_tag
from worker.engine.tool_parsers import TOOL_PARSERS, ToolParser, detect_tool_parser
from worker.engine.tool_parsers.json_calls import JsonCallListParser, NamedArgumentsParser


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


def json_call_parser(tool_choice: str | dict[str, Any] | None) -> type[ToolParser]:
    """The parser (and grammar) of a forced call for a model without a tool-call format: the arguments of
    a named function, or a JSON list of calls for "required". Any other tool_choice (auto) needs the
    model's own format: `ToolsUnsupported`."""
    forced, name = forced_function(tool_choice)
    if not forced:
        raise ToolsUnsupported(
            'tool_choice "auto" needs the model\'s own tool-call format, which this worker does not know: '
            "start it with --tool-call-parser (hermes, llama3_json, mistral) and a --chat-template that "
            'renders tools, or force a call (tool_choice "required" or a named function)'
        )
    return JsonCallListParser if name is None else NamedArgumentsParser


def request_parser(parser: type[ToolParser], tool_choice: str | dict[str, Any] | None) -> type[ToolParser]:
    """The parser class of a request's samples (a named function's own, for NamedArgumentsParser)."""
    if parser is NamedArgumentsParser:
        return NamedArgumentsParser.for_function(forced_function(tool_choice)[1] or "")
    return parser


# The system-turn text of a forced call for a model without a tool-call format, when its chat template
# renders no tools: {tools} is one line per tool (the request's tool object as JSON), {answer} one of
# ANSWER_NAMED / ANSWER_LIST / ANSWER_ONE.
TOOLS_PREAMBLE = "You can call these functions (their parameters are JSON schemas):\n{tools}\n{answer}"
ANSWER_NAMED = "Call {name}: answer with its arguments, one JSON object."
ANSWER_LIST = 'Answer with a JSON list of one or more calls: [{"name": <function name>, "parameters": <arguments>}]'
ANSWER_ONE = 'Answer with a JSON list of exactly one call: [{"name": <function name>, "parameters": <arguments>}]'


def tools_preamble(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None, parallel: bool) -> str:
    _, name = forced_function(tool_choice)
    if name is not None:
        answer = ANSWER_NAMED.format(name=name)
    else:
        answer = ANSWER_LIST if parallel else ANSWER_ONE
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_PREAMBLE.format(tools=listed, answer=answer)


def with_preamble(messages: list[dict[str, Any]], preamble: str) -> list[dict[str, Any]]:
    """The preamble first in the system turn: before the text of a first system (or developer) message,
    separated by a blank line, else as a system message of its own at the start."""
    if messages and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0])
        text = first.get("content") or ""
        first["content"] = f"{preamble}\n\n{text}" if text else preamble
        return [first, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def calls_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a chat template that renders no tools: each assistant turn's tool calls written into its text
    as the JSON list a forced call answers with, `[{"name": ..., "parameters": {...}}]` (after its own
    text, on a new line, when it has some), so the template, which knows only text, shows them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            listed = json.dumps(
                [{"name": c["function"].get("name"), "parameters": c["function"].get("arguments")} for c in calls],
                ensure_ascii=False,
            )
            text = m.get("content") or ""
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{text}\n{listed}" if text else listed
        out.append(m)
    return out
