"""Request bodies: read up to a limit (`read_capped`), and decoded into the gateway's Structs, strictly and
safely: a body is valid JSON of the
right shape nested at most MAX_JSON_DEPTH levels (JSON schemas, tool parameters and metadata included),
or a 400 naming what is wrong. A deeper body would exhaust the decoder's recursion (and every later
walk of it: the grammar compiler's, the worker's), so it is refused before anything else reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request

from gateway import errors
from producer_sdk.protocol import schema_error

T = TypeVar("T")
MAX_JSON_DEPTH = 64  # objects and arrays within one another, the body itself counted as 1


async def read_capped(
    request: Request,
    limit: int,
    over: Callable[[int | None], errors.ApiError],
    timeout_s: float | None = None,
) -> bytes:
    """The whole body, refused with `over(declared length)` when its Content-Length says it is larger than
    `limit`, or `over(None)` as soon as more than `limit` bytes have arrived (nothing more is read), or
    with a 408 (`errors.BodyTimeout`) when it has not all arrived within `timeout_s` (a client sending a byte a
    second; its answer closes the connection)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise over(int(declared))

    async def whole() -> bytes:
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise over(None)
                parts.append(part)
        except ClientDisconnect:  # gone mid-body: nothing to log, nobody to answer
            raise errors.client_closed() from None
        return b"".join(parts)

    if not timeout_s:
        return await whole()
    try:
        return await asyncio.wait_for(whole(), timeout_s)
    except asyncio.TimeoutError:
        raise errors.body_timeout(timeout_s) from None


def too_deep(where: str | None = None) -> errors.ApiError:
    return errors.invalid(
        f"The body is nested more than {MAX_JSON_DEPTH} levels deep (objects and arrays within one another).",
        where,
        "json_too_deep",
    )


def decode(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """The body as the decoder's type; a 400 naming the field on malformed JSON, a wrong type, an unknown
    field, or too deep a nesting."""
    try:
        value = decoder.decode(body)
    except RecursionError:
        raise too_deep() from None
    except msgspec.ValidationError as e:
        field = schema_error(e, "request").field
        if field and "unknown field" in str(e):
            message = f"Unrecognized request argument supplied: {field}"
            raise errors.invalid(message, field, "unknown_parameter") from None
        raise errors.invalid(f"Invalid request body: {clean(str(e))}", field) from None
    except msgspec.DecodeError as e:
        raise errors.invalid(f"The body is not valid JSON: {e}", None, "invalid_json") from None
    check_depth(value)
    return value


def check_depth(value: Any) -> None:
    """A 400 naming the first value nested deeper than MAX_JSON_DEPTH."""
    where = deeper_than(value, MAX_JSON_DEPTH)
    if where is not None:
        raise too_deep(where or None)


def clean(text: str) -> str:
    """msgspec's message with the JSON path as OpenAI names parameters."""
    return text.replace("`$.", "`").replace("`$`", "the body")


def deeper_than(value: Any, limit: int) -> str | None:
    """The path ("" for the root) of the first value nested deeper than `limit` (Structs, dicts and
    lists), else None.
    Iterative, so a deep value cannot exhaust the stack."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, msgspec.Struct):
            children = ((name, getattr(node, name)) for name in node.__struct_fields__)
        elif isinstance(node, dict):
            children = iter(node.items())
        elif isinstance(node, (list, tuple)):
            children = ((f"[{i}]", v) for i, v in enumerate(node))
        else:
            continue
        if depth > limit:
            return path.lstrip(".")
        for key, child in children:
            if isinstance(child, (msgspec.Struct, dict, list, tuple)):
                sub = f"{path}{key}" if str(key).startswith("[") else f"{path}.{key}"
                stack.append((child, depth + 1, sub))
    return None
