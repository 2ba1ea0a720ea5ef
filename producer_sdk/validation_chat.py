"""Rules of protocol v2's chat features (messages, tools, response formats, structured outputs),
part of the one rule set in `producer_sdk.validation`.

A JSON schema is checked for its shape only (sizes, nesting, the keywords a grammar compiler reads),
so a broken or oversized schema is refused with a field name before anything is enqueued; the worker's
grammar compiler remains the final judge (an `invalid_grammar` error event).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from producer_sdk.chat import RESPONSE_FORMAT_TYPES, TOOL_CHOICES, NamedToolChoice, StructuredOutputsParams
from producer_sdk.constants import ROLES, V1_ROLES

if TYPE_CHECKING:
    from producer_sdk.protocol import GenerateRequest

Problems = Iterator[tuple[str, str]]

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JSON_TYPES = frozenset(("object", "array", "string", "number", "integer", "boolean", "null"))
_ROOT_RULE = re.compile(r"(?m)^\s*root\s*::=")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def min_version(r: GenerateRequest) -> int:
    """The lowest protocol version that carries this request (2 once it uses a v2 feature)."""
    if r.tools is not None or r.tool_choice is not None or r.response_format is not None:
        return 2
    if not r.parallel_tool_calls:
        return 2
    if r.sampling.structured_outputs is not None:
        return 2
    for m in r.messages or []:
        if isinstance(m.content, list) or (m.role in ROLES and m.role not in V1_ROLES):
            return 2
        if m.name is not None or m.tool_calls is not None or m.tool_call_id is not None:
            return 2
    return 1


# --- JSON schemas -----------------------------------------------------------------------------------


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of dicts and lists, counting no further than limit + 1."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _subschemas(s: dict) -> Iterator[tuple[str, Any]]:
    for key in _SUBSCHEMA_MAPS:
        if isinstance(s.get(key), dict):
            for name, sub in s[key].items():
                yield f"{key}.{name}", sub
    for key in _SUBSCHEMA_LISTS:
        if isinstance(s.get(key), list):
            for i, sub in enumerate(s[key]):
                yield f"{key}[{i}]", sub
    for key in _SUBSCHEMA_ONE:
        if key in s and not isinstance(s[key], bool):
            yield key, s[key]


def _keyword_problems(s: dict) -> Iterator[str]:
    t = s.get("type")
    types = t if isinstance(t, list) else [t] if t is not None else []
    if not all(isinstance(x, str) and x in JSON_TYPES for x in types):
        yield f"type {t!r} is not a JSON type ({', '.join(sorted(JSON_TYPES))})"
    for key in _SUBSCHEMA_MAPS:
        if key in s and not isinstance(s[key], dict):
            yield f"{key} must be an object"
    for key in _SUBSCHEMA_LISTS:
        if key in s and not (isinstance(s[key], list) and s[key]):
            yield f"{key} must be a non-empty array"
    if "required" in s and not (isinstance(s["required"], list) and all(isinstance(x, str) for x in s["required"])):
        yield "required must be an array of property names"
    if "enum" in s and not (isinstance(s["enum"], list) and s["enum"]):
        yield "enum must be a non-empty array"
    ref = s.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        yield f"$ref {ref!r} must point inside the schema (start with #)"
    if "pattern" in s:
        try:
            re.compile(s["pattern"])
        except (re.error, TypeError) as e:
            yield f"pattern {s['pattern']!r} is not a regular expression: {e}"
    for key in _COUNTS:
        if key in s and not (type(s[key]) is int and s[key] >= 0):
            yield f"{key} must be an integer >= 0"
    for key in _BOUNDS:
        value = s.get(key)
        if key in s and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            yield f"{key} must be a finite number"
    for low, high in (("minLength", "maxLength"), ("minItems", "maxItems"), ("minimum", "maximum")):
        a, b = s.get(low), s.get(high)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > b:
            yield f"{low} {a} is above {high} {b}"


def json_schema_problems(schema: Any, lim: Any, where: str) -> Problems:
    """Shape checks of a JSON schema: an object, within the size and nesting limits, with well-formed
    keywords (types, properties, required, enum, local $refs, patterns, bounds)."""
    if not isinstance(schema, dict):
        yield where, "a JSON schema must be an object"
        return
    try:
        size = len(msgspec.json.encode(schema))
    except (TypeError, ValueError, OverflowError) as e:
        yield where, f"not JSON: {e}"
        return
    if size > lim.max_schema_bytes:
        yield where, f"{size} bytes of JSON, more than the limit {lim.max_schema_bytes}"
        return
    if _depth(schema, lim.max_schema_depth) > lim.max_schema_depth:
        yield where, f"nested deeper than the limit of {lim.max_schema_depth} levels"
        return
    stack: list[tuple[str, Any]] = [(where, schema)]
    while stack:
        path, s = stack.pop()
        if isinstance(s, bool):
            continue
        if not isinstance(s, dict):
            yield path, "a (sub)schema must be an object or a boolean"
            return
        for why in _keyword_problems(s):
            yield path, why
            return
        stack.extend((f"{path}.{k}", sub) for k, sub in _subschemas(s))


# --- structured outputs -----------------------------------------------------------------------------


def structured_problems(so: StructuredOutputsParams, lim: Any) -> Problems:
    """`sampling.structured_outputs` (the engine checks its own copy with the same function)."""
    kinds = so.kinds
    if len(kinds) != 1:
        yield "structured_outputs", f"set exactly one of json, regex, choice, grammar, json_object (got {kinds})"
        return
    if so.json is not None:
        schema = so.json
        if isinstance(schema, str):
            if len(schema) > lim.max_schema_bytes:
                yield "structured_outputs.json", f"{len(schema)} characters, more than {lim.max_schema_bytes}"
                return
            try:
                schema = msgspec.json.decode(schema)
            except msgspec.DecodeError as e:
                yield "structured_outputs.json", f"not JSON: {e}"
                return
        yield from json_schema_problems(schema, lim, "structured_outputs.json")
    elif so.regex is not None:
        if not 1 <= len(so.regex) <= lim.max_regex_chars:
            yield "structured_outputs.regex", f"must be 1..{lim.max_regex_chars} characters"
            return
        try:
            re.compile(so.regex)
        except re.error as e:
            yield "structured_outputs.regex", f"not a regular expression: {e}"
    elif so.choice is not None:
        if not 1 <= len(so.choice) <= lim.max_choices:
            yield "structured_outputs.choice", f"must hold 1..{lim.max_choices} strings"
        elif not all(1 <= len(c) <= lim.max_stop_chars for c in so.choice):
            yield "structured_outputs.choice", f"each choice must be 1..{lim.max_stop_chars} characters"
    elif so.grammar is not None:
        if not 1 <= len(so.grammar) <= lim.max_grammar_chars:
            yield "structured_outputs.grammar", f"must be 1..{lim.max_grammar_chars} characters"
        elif not _ROOT_RULE.search(so.grammar):
            yield "structured_outputs.grammar", "an EBNF grammar needs a `root ::= ...` rule"


# --- messages, tools, response format --------------------------------------------------------------


def _message_problem(m: Any, roles: tuple[str, ...]) -> tuple[str, str] | None:
    if m.role not in roles:
        return "role", f"{m.role!r} is not one of {', '.join(roles)}"
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        return "content", "missing: only an assistant message with tool_calls may leave it out"
    if m.tool_calls is not None and m.role != "assistant":
        return "tool_calls", "only assistant messages carry tool calls"
    if m.tool_call_id is not None and m.role != "tool":
        return "tool_call_id", "only tool messages answer a tool call"
    for call in m.tool_calls or []:
        if call.type != "function" or not call.id or not FUNCTION_NAME.fullmatch(call.function.name):
            return "tool_calls", "each needs an id, type 'function' and a function name [A-Za-z0-9_-]"
    return None


def message_problems(messages: list, roles: tuple[str, ...]) -> Problems:
    for i, m in enumerate(messages):
        problem = _message_problem(m, roles)
        if problem is not None:
            yield f"messages[{i}].{problem[0]}", problem[1]
            return


def tool_problems(r: GenerateRequest, lim: Any) -> Problems:
    tools = r.tools or []
    if len(tools) > lim.max_tools:
        yield "tools", f"at most {lim.max_tools} tools"
        return
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if tool.type != "function":
            yield f"tools[{i}].type", f"{tool.type!r}: only 'function' tools exist"
        elif not FUNCTION_NAME.fullmatch(fn.name):
            yield f"tools[{i}].function.name", "must match ^[A-Za-z0-9_-]{1,64}$"
        elif fn.name in names:
            yield f"tools[{i}].function.name", f"{fn.name!r} is defined twice"
        elif fn.parameters is not None:
            yield from json_schema_problems(fn.parameters, lim, f"tools[{i}].function.parameters")
        names.add(fn.name)
    if tools and r.messages is None:
        yield "tools", "tools are rendered by the chat template: send messages, not a prompt"
    choice = r.tool_choice
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function" or choice.function.name not in names:
            yield "tool_choice", f"names no tool of this request ({choice.function.name!r})"
    elif choice is not None and choice not in TOOL_CHOICES:
        yield "tool_choice", f"{choice!r} is not one of {', '.join(TOOL_CHOICES)} or a named function"
    elif choice in ("auto", "required") and not tools:
        yield "tool_choice", f"{choice!r} needs tools"


def response_format_problems(r: GenerateRequest, lim: Any) -> Problems:
    rf = r.response_format
    if rf is not None:
        if rf.type not in RESPONSE_FORMAT_TYPES:
            yield "response_format.type", f"{rf.type!r} is not one of {', '.join(RESPONSE_FORMAT_TYPES)}"
            return
        if (rf.json_schema is not None) != (rf.type == "json_schema"):
            yield "response_format.json_schema", "set it exactly when type is 'json_schema'"
            return
        if rf.json_schema is not None:
            if not FUNCTION_NAME.fullmatch(rf.json_schema.name):
                yield "response_format.json_schema.name", "must match ^[A-Za-z0-9_-]{1,64}$"
            if rf.json_schema.schema is not None:
                yield from json_schema_problems(rf.json_schema.schema, lim, "response_format.json_schema.schema")
    constraints = [
        name
        for name, on in (
            ("response_format", rf is not None and rf.type != "text"),
            ("sampling.structured_outputs", r.sampling.structured_outputs is not None),
            ("tools", bool(r.tools) and r.tool_choice != "none"),
        )
        if on
    ]
    if len(constraints) > 1:
        yield constraints[1], f"{' and '.join(constraints)} both constrain the output: use one (or tool_choice 'none')"
