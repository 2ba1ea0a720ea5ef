"""Wire structs of protocol v2's chat features: rich messages, tools, response formats, vLLM's
structured-output parameters, and the tool-call deltas workers stream back.

Names follow OpenAI's Chat Completions API (messages, `tools`, `tool_choice`, `response_format`) and
vLLM's `StructuredOutputsParams` (`json`, `regex`, `choice`, `grammar`, `json_object`,
`disable_any_whitespace`), so a gateway maps them one to one.
"""

from __future__ import annotations

from typing import Any

import msgspec

# --- messages ---------------------------------------------------------------------------------------


class TextPart(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    """A text content part (the only kind of part a worker renders)."""

    text: str


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    """The function a tool call invokes; `arguments` is JSON text (as OpenAI sends it)."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class Message(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One chat message, rendered by the worker with the model's chat template.

    `content` is a string or a list of text parts (joined); an assistant turn may carry `tool_calls`
    instead of content; a `tool` turn answers the call named by `tool_call_id`."""

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        """The content as one string ("" when there is none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


# --- tools ------------------------------------------------------------------------------------------


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """A function the model may call; `parameters` is the JSON schema of its arguments. `strict` is
    OpenAI's flag: a forced call (`tool_choice` "required" or named) always follows the schema
    strictly (no property the schema does not list), whatever its value."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    function: FunctionDefinition
    type: str = "function"

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's JSON lays it out (`type` first; unset fields left out): chat templates
        print tools with `tojson`, so the key order is part of the prompt."""
        fn = {"name": self.function.name}
        for key in ("description", "parameters", "strict"):
            value = getattr(self.function, key)
            if value is not None:
                fn[key] = value
        return {"type": self.type, "function": fn}


class ToolChoiceFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """`tool_choice` naming the one function the model must call."""

    function: ToolChoiceFunction
    type: str = "function"


ToolChoice = str | NamedToolChoice  # "none" | "auto" | "required" | a named function
TOOL_CHOICES = ("none", "auto", "required")


# --- structured outputs -----------------------------------------------------------------------------


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """OpenAI's `response_format.json_schema`. The output always follows `schema` strictly (no
    property the schema does not list), whatever `strict` says."""

    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """OpenAI's `response_format`: type "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" (the output validates against `json_schema.schema`)."""

    type: str
    json_schema: JsonSchemaFormat | None = None


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class StructuredOutputsParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """vLLM's structured-output parameters: exactly one of `json` (a JSON schema, as an object or as
    JSON text), `regex`, `choice` (the output is one of these strings), `grammar` (EBNF, GBNF-style,
    with a `root` rule) or `json_object` (any JSON object). `disable_any_whitespace`: JSON without
    optional whitespace."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    @property
    def kinds(self) -> list[str]:
        """The constraint kinds that are set (valid when exactly one is)."""
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_for(response_format: ResponseFormat | None) -> StructuredOutputsParams | None:
    """The constraint a `response_format` asks for (None for "text" or no format). The JSON is written
    the way `json.dumps` writes it (", " and ": " between items, no other whitespace), as OpenAI's
    models answer: a grammar that allows any whitespace lets a model pad its answer without end."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    spec = response_format.json_schema
    schema = dict(spec.schema or {}) if spec is not None else {}
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


# --- streamed back ----------------------------------------------------------------------------------


class ToolCallDelta(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A piece of the `index`-th tool call of a sample: its `id` and `name` come once, first; the
    `arguments` fragments, joined in order, are the call's arguments (JSON text)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCalls(msgspec.Struct, tag="tool_calls", tag_field="type", kw_only=True, omit_defaults=True):
    """The event (`producer_sdk.protocol.Event`) of tool-call deltas of sample `index`, parsed from the
    text of the Tokens events before it. Readers older than v2 skip it (an unknown event type)."""

    seq: int
    attempt: int = 1
    index: int = 0
    tool_calls: list[ToolCallDelta]


__all__ = [
    "RESPONSE_FORMAT_TYPES",
    "STRUCTURED_KINDS",
    "TOOL_CHOICES",
    "FunctionCall",
    "FunctionDefinition",
    "JsonSchemaFormat",
    "Message",
    "NamedToolChoice",
    "ResponseFormat",
    "StructuredOutputsParams",
    "TextPart",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCalls",
    "ToolChoice",
    "ToolChoiceFunction",
    "structured_outputs_for",
]
