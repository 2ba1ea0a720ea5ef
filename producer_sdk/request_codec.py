"""Request payloads on the wire: encode a `GenerateRequest` for the queue and decode one from it, with
the limits checked on both sides by the same `validate` (the SDK before sending, the worker on intake).
Kept apart from `protocol` (the message types) because validation reads those types, and this reads both."""

from __future__ import annotations

from typing import Any

import msgspec

from producer_sdk.constants import PROTOCOL_VERSION, SUPPORTED_VERSIONS
from producer_sdk.errors import MalformedPayload, PayloadTooLarge, UnsupportedVersion
from producer_sdk.protocol import GenerateRequest, malformed, schema_error
from producer_sdk.validation import DEFAULT_LIMITS, Limits, validate

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(GenerateRequest, strict=True)


class _Envelope(msgspec.Struct):
    v: Any = None


def encode_request(request: GenerateRequest, limits: Limits | None = DEFAULT_LIMITS) -> bytes:
    """Validate (unless `limits` is None) and encode a request."""
    if limits is not None:
        validate(request, limits)
    data = _encoder.encode(request)
    if limits is not None and len(data) > limits.max_payload_bytes:
        raise PayloadTooLarge(
            f"request payload is {len(data)} bytes, more than the limit {limits.max_payload_bytes}",
            field=None,
        )
    return data


def decode_request(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> GenerateRequest:
    """Decode and validate a request payload; every failure is a `ProtocolError` subclass."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedPayload(f"request payload must be bytes, got {type(data).__name__}")
    if len(data) > limits.max_payload_bytes:
        raise PayloadTooLarge(f"request payload is {len(data)} bytes, more than the limit {limits.max_payload_bytes}")
    try:
        request = _request_decoder.decode(data)
    except msgspec.ValidationError as e:
        _raise_if_other_version(data)
        raise schema_error(e, "request") from None
    except (msgspec.MsgspecError, ValueError, RecursionError, OverflowError) as e:
        raise malformed(e, "request payload") from None
    return validate(request, limits)


def _raise_if_other_version(data: bytes | bytearray | memoryview) -> None:
    """A payload of another version fails the schema for that reason first: say so."""
    try:
        v = msgspec.msgpack.decode(data, type=_Envelope).v
    except (msgspec.MsgspecError, ValueError, RecursionError, OverflowError):
        return
    if type(v) is int and v not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(v, PROTOCOL_VERSION)
