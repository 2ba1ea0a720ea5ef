"""What a gateway needs to answer for a request it did not take: a small record in Redis, written
next to the submit, that lives as long as the result (the worker's publish step gives it the
response stream's TTL). With it any gateway can serve ``GET /v1/chat/completions/{id}`` (resume a
stream or fetch the finished object), even after the gateway that took the POST died.

Also: request ids from `Idempotency-Key` / `X-Request-Id` headers.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import msgspec

from producer_sdk.constants import REQUEST_ID_PATTERN


class StoredResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a stored Responses API response keeps besides its generation (which is its response
    stream): the request fields it echoes, its input items, and the conversation before its output,
    so that the next turn (`previous_response_id`) reads one record and one stream, not the chain."""

    echo: dict[str, Any]  # the request's fields as the Response object shows them
    input: list[dict[str, Any]]  # this turn's input items, each with an id (GET .../input_items)
    history: list[dict[str, Any]]  # chat messages up to this turn's input (instructions excluded)
    previous: str | None = None  # the previous response's request id
    background: bool = False
    constraint: str | None = None  # the parameter that constrains the output (a grammar error names it)


class Record(msgspec.Struct, kw_only=True, omit_defaults=True):
    kind: str  # chat | completion | response
    model: str
    created: int  # unix seconds, the `created` of every object of the response
    n: int = 1
    include_usage: bool = False
    tenant: str | None = None
    token_ids: bool = False  # logprobs name tokens "token_id:N" (return_tokens_as_token_ids)
    response: StoredResponse | None = None  # kind "response" only


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def encode(record: Record) -> bytes:
    return _encoder.encode(record)


def decode(raw: bytes | None) -> Record | None:
    if raw is None:
        return None
    try:
        return _decoder.decode(raw)
    except (msgspec.MsgspecError, ValueError):
        return None


def request_id_for(key: str | None, tenant: str | None) -> str:
    """The pagedq request id of a POST: derived from its idempotency key when it has one, so a retry
    attaches to the same generation; else a fresh one.

    A key that is already a valid request id is used as is, unless tenants are configured: then
    every key is hashed with the tenant, so two tenants' keys never name the same request.
    """
    if not key:
        return uuid.uuid4().hex
    if tenant is None and REQUEST_ID_PATTERN.fullmatch(key):
        return key
    digest = hashlib.sha256(f"{tenant or ''}\x00{key}".encode()).hexdigest()
    return "idem-" + digest[:40]
