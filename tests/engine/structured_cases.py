"""Schemas and tools the structured-output tests share (engine, service, benchmark)."""

from __future__ import annotations

import json

import jsonschema

# Objects inside arrays, enums, required fields, integer ranges, bounded strings.
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "status": {"enum": ["open", "closed", "pending"]},
        "title": {"type": "string", "minLength": 1, "maxLength": 16},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 8},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 10},
                    "kind": {"enum": ["a", "b"]},
                },
                "required": ["sku", "qty", "kind"],
            },
        },
        "urgent": {"type": "boolean"},
    },
    "required": ["id", "status", "title", "items"],
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 100},
                    "b": {"type": "integer", "minimum": 0, "maximum": 100},
                },
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "minLength": 1, "maxLength": 10},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["query"],
            },
        },
    },
]

TOOL_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris, in celsius?"},
]


def assert_valid_calls(calls, finish_reason: str | None = None, tools=TOOLS) -> None:
    """Every call names one of `tools` and its arguments validate against that tool's parameters (all
    but the last when max_tokens cut the answer: that one may be partial)."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls, "no tool call"
    for call in calls[:-1] if finish_reason == "length" else calls:
        assert call.function.name in params, call.function.name
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def joined_deltas(deltas) -> dict[int, dict]:
    """Streamed tool-call deltas assembled per call index: id, name and the joined arguments."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        c["id"] = d.id or c["id"]
        c["name"] = d.name or c["name"]
        c["arguments"] += d.arguments
    return calls
