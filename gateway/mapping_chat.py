"""The chat features of protocol v2 in an OpenAI request: messages (tool calls and tool results
included), `tools`, `tool_choice`, `parallel_tool_calls`, `response_format` and vLLM's
`structured_outputs`, mapped one to one onto `AsyncClient.submit` arguments (the wire's names).

The shapes were already checked when the body was decoded (into the wire's own structs); the rules
(names, schemas, a tool_choice naming a tool, one constraint per request) are the SDK's, which refuses
a broken request with the field that is wrong before anything is enqueued.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway import errors
from gateway.schemas import ChatMessage

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name of the system role
# Errors a worker reports about a request's output constraint: the client's to fix (a 400).
GRAMMAR_CODES = ("invalid_grammar", "grammar_timeout", "grammar_unsatisfiable")


def message(i: int, m: ChatMessage) -> dict[str, Any]:
    """One message in the wire's shape: text parts joined with newlines, the rest as given."""
    where = f"messages[{i}]"
    for name in ("function_call", "audio"):
        if getattr(m, name) is not None:
            raise errors.unsupported(f"{where}.{name}")
    if m.refusal is not None:
        raise errors.unsupported(f"{where}.refusal")
    role = ROLE_ALIASES.get(m.role, m.role)
    calls = m.tool_calls or None  # `tool_calls: []` (an answer without calls, sent back) says nothing
    content = m.content
    if content is None and not (role == "assistant" and calls):
        raise errors.invalid(
            f"{where}.content must be set (only an assistant turn with tool_calls may leave it out)", f"{where}.content"
        )
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise errors.unsupported(f"{where}.content[{j}]", "only text parts ({type: text, text})")
            parts.append(part["text"])
        content = "\n".join(parts)
    out: dict[str, Any] = {"role": role}
    if content is not None:
        out["content"] = content
    if m.name is not None:
        out["name"] = m.name
    if calls:
        out["tool_calls"] = [msgspec.to_builtins(c) for c in calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def tools(body: Any, submit: dict[str, Any]) -> None:
    """`tools`, `tool_choice` and `parallel_tool_calls` into `submit`. Values that ask for nothing
    (`tools: []`, `tool_choice: "none"` without tools, `parallel_tool_calls` without tools) are left
    out, so the request stays in the lowest protocol version that carries it."""
    given = body.tools or None
    if given:
        submit["tools"] = [msgspec.to_builtins(t) for t in given]
    choice = body.tool_choice
    if choice is not None and (given or choice != "none"):
        submit["tool_choice"] = msgspec.to_builtins(choice)
    if given and body.parallel_tool_calls is False:
        submit["parallel_tool_calls"] = False


def output_format(body: Any, submit: dict[str, Any]) -> None:
    """`response_format` (type "text" asks for nothing) and vLLM's `structured_outputs` into `submit`."""
    rf = body.response_format
    if rf is not None and not (rf.type == "text" and rf.json_schema is None):
        submit["response_format"] = msgspec.to_builtins(rf)
    if body.structured_outputs is not None:
        submit["structured_outputs"] = msgspec.to_builtins(body.structured_outputs)


def constraint_param(submit: dict[str, Any]) -> str | None:
    """The parameter that constrains the output (the one a grammar error is about), if any."""
    if "response_format" in submit:
        return "response_format"
    if "structured_outputs" in submit:
        return "structured_outputs"
    if submit.get("tools") and submit.get("tool_choice") != "none":
        return "tools"
    return None


def failure_param(kind_is_chat: bool, constraint: str | None, code: str) -> str | None:
    """The parameter a worker's error event is about (None when it is about none)."""
    if code in GRAMMAR_CODES:
        return constraint
    if code == "tools_unsupported":
        return "tools"
    if code == "prompt_too_long":
        return "messages" if kind_is_chat else "prompt"
    return None
