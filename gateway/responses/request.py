"""A `POST /v1/responses` body: decoded strictly, then mapped onto the chat request the queue runs.

A Responses request is a chat request in other clothes: `instructions` is the system message,
`input` items are messages (`function_call` items are an assistant turn's tool calls,
`function_call_output` items are tool turns), flat function tools become chat tools, `text.format`
becomes `response_format`, `max_output_tokens` is `max_tokens`. The conversation before this turn
(`previous_response_id`) is given as chat messages (`history`), read from the stored previous
response. Nothing is dropped silently: what pagedq cannot honour is a 400 naming the parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from gateway import errors, json_body
from gateway.mapping import RESERVED_METADATA
from gateway.mapping_chat import failure_param as chat_failure_param

ID_PREFIX = "resp_"
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
INCLUDABLE: tuple[str, ...] = ()  # `include` values pagedq can add (none yet: no logprobs, no reasoning)
UNSUPPORTED = (
    "reasoning",
    "prompt",
    "conversation",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "max_tool_calls",
    "top_logprobs",
    "context_management",
)


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's `ResponseCreateParams` (the fields pagedq reads), then vLLM's extra sampling fields."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    # vLLM's extra body fields
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    priority: int | None = None
    # not supported yet
    reasoning: Any = None
    prompt: Any = None
    conversation: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    context_management: Any = None


_decoder = msgspec.json.Decoder(ResponsesRequest)
_SAMPLING_COPY = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos")


class MappedResponse(msgspec.Struct, kw_only=True):
    """A decoded request: what to submit, and what the stored response keeps."""

    model: str
    stream: bool
    background: bool
    store: bool
    previous: str | None  # the previous response's request id
    submit: dict[str, Any]  # keyword arguments of AsyncClient.submit (messages added by `messages_for`)
    instructions: str | None
    turn: list[dict[str, Any]]  # this turn's input as chat messages
    items: list[dict[str, Any]]  # this turn's input items (normalized, without ids yet)
    echo: dict[str, Any]  # request fields as the Response object shows them
    constraint: str | None  # the parameter that constrains the output, for a grammar error


def decode(body: bytes) -> ResponsesRequest:
    return json_body.decode(_decoder, body)


def request_id_of(response_id: str) -> str:
    return response_id[len(ID_PREFIX) :] if response_id.startswith(ID_PREFIX) else response_id


def map_request(body: ResponsesRequest) -> MappedResponse:
    for name in UNSUPPORTED:
        if getattr(body, name) is not None:
            raise errors.unsupported(name)
    if body.truncation not in (None, "disabled"):
        raise errors.unsupported("truncation", 'only "disabled" (a prompt over the context is a 400)')
    for i, value in enumerate(body.include or []):
        if value not in INCLUDABLE:
            raise errors.unsupported(f"include[{i}]", f"{value!r}")
    store = body.store is not False
    background = bool(body.background)
    if background and not store:
        raise errors.invalid("background responses need store=true (they are fetched later)", "store")
    if body.stream_options is not None and not body.stream:
        raise errors.invalid("stream_options is only allowed with stream=true", "stream_options")
    items = input_items(body.input)
    turn = items_to_messages(items)
    submit: dict[str, Any] = {}
    for name in _SAMPLING_COPY:
        if getattr(body, name) is not None:
            submit[name] = getattr(body, name)
    submit["max_tokens"] = body.max_output_tokens  # None: up to the model's length, as OpenAI does
    if body.priority is not None:
        submit["priority"] = -body.priority  # vLLM: lower is earlier; pagedq: higher is earlier
    tools = [chat_tool(i, t) for i, t in enumerate(body.tools or [])]
    if tools:
        submit["tools"] = tools
        if body.parallel_tool_calls is False:
            submit["parallel_tool_calls"] = False
    choice = chat_tool_choice(body.tool_choice)
    if choice is not None and (tools or choice != "none"):
        submit["tool_choice"] = choice
    fmt = (body.text or {}).get("format")
    response_format = chat_response_format(fmt)
    if response_format is not None:
        submit["response_format"] = response_format
    metadata = dict(body.metadata or {})
    for key in RESERVED_METADATA:
        if key in metadata:
            raise errors.invalid(f"metadata key {key!r} is reserved", f"metadata.{key}")
    wire_metadata = dict(metadata)
    if body.user is not None:
        wire_metadata["user"] = body.user
    if body.safety_identifier is not None:
        wire_metadata["safety_identifier"] = body.safety_identifier
    if wire_metadata:
        submit["metadata"] = wire_metadata
    constraint = "text.format" if response_format else "tools" if tools and choice != "none" else None
    echo = {
        "instructions": body.instructions,
        "tools": list(body.tools or []),
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {"format": fmt or {"type": "text"}},
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "metadata": metadata,
        "user": body.user,
        "store": store,
        "background": background,
        "previous_response_id": body.previous_response_id,
        "truncation": body.truncation or "disabled",
    }
    echo = {k: v for k, v in echo.items() if v is not None}  # the rest: OpenAI's defaults
    previous = request_id_of(body.previous_response_id) if body.previous_response_id else None
    return MappedResponse(
        model=body.model,
        stream=bool(body.stream),
        background=background,
        store=store,
        previous=previous,
        submit=submit,
        instructions=body.instructions,
        turn=turn,
        items=items,
        echo=echo,
        constraint=constraint,
    )


def messages_for(m: MappedResponse, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat the model sees: this turn's instructions, the conversation so far, this turn's input.
    A `function_call_output` must answer a call made before it (in the history or this input)."""
    calls = {c["id"] for msg in history for c in msg.get("tool_calls", ())}
    for i, item in enumerate(m.items):
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            raise errors.invalid(
                f"No tool call found for function call output with call_id {item['call_id']!r}.",
                f"input[{i}].call_id",
            )
    head = [{"role": "system", "content": m.instructions}] if m.instructions is not None else []
    out = head + history + m.turn
    if not out:
        raise errors.invalid("input is required (or previous_response_id)", "input", "missing_required_parameter")
    return out


# --- input items ------------------------------------------------------------------------------------


def input_items(given: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`input` as a list of checked items in one shape: messages with text content, function calls
    and their outputs."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    return [_item(i, item) for i, item in enumerate(given)]


def _item(i: int, item: dict[str, Any]) -> dict[str, Any]:
    where = f"input[{i}]"
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise errors.invalid(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", f"{where}.role")
        return {"type": "message", "role": role, "content": _parts(where, role, item.get("content"))}
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise errors.invalid(f"{where}.{name} must be a string", f"{where}.{name}")
        return {k: item[k] for k in ("type", "call_id", "name", "arguments")} | {"type": "function_call"}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise errors.invalid(f"{where}.call_id must be a string", f"{where}.call_id")
        output = item.get("output")
        if isinstance(output, list):
            output = _text_of(f"{where}.output", output)
        if not isinstance(output, str):
            raise errors.invalid(f"{where}.output must be a string or a list of text parts", f"{where}.output")
        return {"type": "function_call_output", "call_id": item["call_id"], "output": output}
    if kind is None:
        raise errors.invalid(f"{where} has no type", f"{where}.type", "missing_required_parameter")
    raise errors.unsupported(
        f"{where}.type", f"input items of type {kind!r} (only message, function_call, function_call_output)"
    )


def _parts(where: str, role: str, content: Any) -> list[dict[str, Any]]:
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [{"type": part_type, "text": content}]
    if not isinstance(content, list):
        raise errors.invalid(f"{where}.content must be a string or a list of parts", f"{where}.content")
    return [{"type": part_type, "text": _text_of(f"{where}.content", [p])} for p in content]


def _text_of(where: str, parts: list[Any]) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise errors.unsupported(f"{where}[{j}]", f"content parts of type {kind!r} (only text)")
        texts.append(part["text"])
    return "\n".join(texts)


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as chat messages; consecutive function calls join the assistant turn before them."""
    out: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            text = "\n".join(p["text"] for p in item["content"])
            out.append({"role": ROLES[item["role"]], "content": text})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def output_message(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A finished response's output as the assistant turn of the chat that continues it."""
    message: dict[str, Any] = {"role": "assistant"}
    if content or not calls:
        message["content"] = content
    if calls:
        message["tool_calls"] = calls
    return message


# --- tools and formats ------------------------------------------------------------------------------


def chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise errors.unsupported(f"tools[{i}].type", f"tools of type {kind!r} (only function tools)")
    if not isinstance(tool.get("name"), str):
        raise errors.invalid(f"tools[{i}].name must be a string", f"tools[{i}].name")
    known = {"type", "name", "description", "parameters", "strict"}
    extra = sorted(set(tool) - known)
    if extra:
        raise errors.invalid(
            f"Unrecognized argument supplied: tools[{i}].{extra[0]}", f"tools[{i}].{extra[0]}", "unknown_parameter"
        )
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise errors.invalid(
                f"tool_choice must be auto, none, required or a function, got {choice!r}", "tool_choice"
            )
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise errors.unsupported("tool_choice", f"tool choices of type {choice.get('type')!r}")


def chat_response_format(fmt: Any) -> dict[str, Any] | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise errors.invalid("text.format.schema must be a JSON schema object", "text.format.schema")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise errors.invalid(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format.type")


# --- errors ------------------------------------------------------------------------------------------

PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def api_error_mappers(constraint: str | None) -> tuple[Callable[[str], str], Callable[[str], str | None]]:
    """The Responses parameter behind a protocol field path, and behind a worker's error code."""

    def param_of(field: str) -> str:
        head, _, rest = field.partition(".")
        if head == "sampling" and rest:
            name = rest.split(".", 1)[0]
            return PARAM_NAMES.get(name, name)
        base = head.split("[", 1)[0]
        return PARAM_NAMES.get(base, base)

    def failure_param(code: str) -> str | None:
        param = chat_failure_param(True, constraint, code)
        return PARAM_NAMES.get(param, param) if param else None

    return param_of, failure_param
