"""Limits and rules of a generation request: one rule set, run by the SDK before sending, by the
worker on intake, and by the engine on its own sampling parameters (`sampling_problems`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import msgspec

from producer_sdk.constants import (
    DEFAULT_TENANT,
    MODEL_NAME_PATTERN,
    PROTOCOL_VERSION,
    REQUEST_ID_PATTERN,
    ROLES,
    SUPPORTED_VERSIONS,
    TENANT_PATTERN,
    TRACEPARENT_MAX_CHARS,
    TRACEPARENT_PATTERN,
    TRACESTATE_MAX_CHARS,
)
from producer_sdk.errors import UnsupportedVersion, ValidationError
from producer_sdk.validation_chat import (
    message_problems,
    min_version,
    response_format_problems,
    structured_problems,
    tool_problems,
)

if TYPE_CHECKING:
    from producer_sdk.protocol import GenerateRequest


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Size and range limits of a request (the SDK checks before sending, the worker on intake)."""

    max_payload_bytes: int = 1 << 20
    max_prompt_chars: int = 1_000_000  # also the total content of `messages`
    max_prompt_tokens: int = 131072
    token_id_bound: int = 1 << 31  # token ids in [0, bound)
    max_messages: int = 512
    max_tokens: int = 131072
    max_n: int = 16
    max_stop: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 64
    max_logprobs: int = 20
    max_metadata: int = 32
    max_metadata_key_chars: int = 64
    max_metadata_value_chars: int = 1024
    max_priority: int = 100  # priority in [-max_priority, max_priority]
    # v2: tools and structured outputs (a grammar is compiled from each schema: these bound its cost)
    max_tools: int = 128
    max_schema_bytes: int = 64 * 1024  # a JSON schema (tool parameters, response format), as JSON
    max_schema_depth: int = 32  # nesting of objects and arrays in a schema
    max_regex_chars: int = 4096
    max_grammar_chars: int = 64 * 1024
    max_choices: int = 256


DEFAULT_LIMITS = Limits()


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def sampling_problems(s: Any, lim: Limits):
    """Yield (field, problem) for each broken rule of `s`: the one rule set of sampling parameters,
    applied to the wire struct and to the engine's `SamplingParams` alike (any object with these fields).
    None in temperature, top_p, top_k, min_p, repetition_penalty is "unset": the model's default."""
    if not 1 <= s.n <= lim.max_n:
        yield "n", f"must be in [1, {lim.max_n}]"
    if s.max_tokens is not None and not 1 <= s.max_tokens <= lim.max_tokens:
        yield "max_tokens", f"must be in [1, {lim.max_tokens}] or None"
    if not 0 <= s.min_tokens <= (s.max_tokens if s.max_tokens is not None else lim.max_tokens):
        yield "min_tokens", "must be in [0, max_tokens]"
    if s.temperature is not None and not (_finite(s.temperature) and s.temperature >= 0):
        yield "temperature", "must be a finite number >= 0"
    if s.top_p is not None and not (_finite(s.top_p) and 0 < s.top_p <= 1):
        yield "top_p", "must be in (0, 1]"
    if s.top_k is not None and not (s.top_k >= 0 or s.top_k == -1):
        yield "top_k", "must be >= 0 (or -1: off)"
    if s.min_p is not None and not (_finite(s.min_p) and 0 <= s.min_p <= 1):
        yield "min_p", "must be in [0, 1]"
    if s.seed is not None and not -(1 << 63) <= s.seed < (1 << 64):
        yield "seed", "must fit in 64 bits"
    if len(s.stop) > lim.max_stop:
        yield "stop", f"at most {lim.max_stop} stop strings"
    elif not all(1 <= len(x) <= lim.max_stop_chars for x in s.stop):
        yield "stop", f"each stop string must be 1..{lim.max_stop_chars} characters"
    if len(s.stop_token_ids) > lim.max_stop_token_ids:
        yield "stop_token_ids", f"at most {lim.max_stop_token_ids} ids"
    elif not all(0 <= t < lim.token_id_bound for t in s.stop_token_ids):
        yield "stop_token_ids", f"token ids must be in [0, {lim.token_id_bound})"
    if s.repetition_penalty is not None and not (_finite(s.repetition_penalty) and s.repetition_penalty > 0):
        yield "repetition_penalty", "must be > 0"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not (_finite(value) and -2 <= value <= 2):
            yield name, "must be in [-2, 2]"
    if s.logprobs is not None and not 0 <= s.logprobs <= lim.max_logprobs:
        yield "logprobs", f"must be in [0, {lim.max_logprobs}] or None"
    if s.structured_outputs is not None:
        yield from structured_problems(s.structured_outputs, lim)


def _prompt_problems(r: GenerateRequest, lim: Limits):
    given = [k for k in ("prompt", "prompt_token_ids", "messages") if getattr(r, k) is not None]
    if not given:
        yield "prompt", "no prompt: set exactly one of prompt, prompt_token_ids, messages"
        return
    if len(given) > 1:
        yield given[1], f"{' and '.join(given)} are both set: set exactly one prompt kind"
        return
    if r.prompt is not None:
        if not r.prompt:
            yield "prompt", "must not be empty"
        elif len(r.prompt) > lim.max_prompt_chars:
            yield "prompt", f"{len(r.prompt)} characters, more than the limit {lim.max_prompt_chars}"
    elif r.prompt_token_ids is not None:
        ids = r.prompt_token_ids
        if not 1 <= len(ids) <= lim.max_prompt_tokens:
            yield "prompt_token_ids", f"must hold 1..{lim.max_prompt_tokens} ids (got {len(ids)})"
        elif not all(0 <= t < lim.token_id_bound for t in ids):
            yield "prompt_token_ids", f"token ids must be in [0, {lim.token_id_bound})"
    else:
        msgs = r.messages or []
        if not 1 <= len(msgs) <= lim.max_messages:
            yield "messages", f"must hold 1..{lim.max_messages} messages (got {len(msgs)})"
            return
        problems = list(message_problems(msgs, ROLES))
        yield from problems[:1]
        if problems:
            return
        total = sum(len(m.text) + sum(len(c.function.arguments) for c in m.tool_calls or []) for m in msgs)
        if total > lim.max_prompt_chars:
            yield "messages", f"{total} characters of content, more than the limit {lim.max_prompt_chars}"


def _request_problems(r: GenerateRequest, lim: Limits):
    if not isinstance(r.request_id, str) or not REQUEST_ID_PATTERN.fullmatch(r.request_id):
        yield "request_id", "must match ^[A-Za-z0-9_-]{8,64}$"
    yield from _prompt_problems(r, lim)
    for name, why in sampling_problems(r.sampling, lim):
        yield f"sampling.{name}", why
    if not -lim.max_priority <= r.priority <= lim.max_priority:
        yield "priority", f"must be in [-{lim.max_priority}, {lim.max_priority}]"
    if r.deadline_ms is not None and not 0 <= r.deadline_ms < (1 << 63):
        yield "deadline_ms", "must be an absolute unix time in ms"
    if not 0 <= r.created_ms < (1 << 63):
        yield "created_ms", "must be a unix time in ms"
    if len(r.metadata) > lim.max_metadata:
        yield "metadata", f"at most {lim.max_metadata} entries"
    for k, val in r.metadata.items():
        if len(k) > lim.max_metadata_key_chars:
            yield "metadata", f"key {k[:20]!r}... longer than {lim.max_metadata_key_chars} characters"
        elif len(val) > lim.max_metadata_value_chars:
            yield f"metadata.{k}", f"value longer than {lim.max_metadata_value_chars} characters"
    yield from tool_problems(r, lim)
    yield from response_format_problems(r, lim)
    yield from trace_context_problems(r.traceparent, r.tracestate)


def trace_context_problems(traceparent: str | None, tracestate: str | None):
    """W3C Trace Context headers: a `traceparent` of the spec's form (version 00: exactly
    ``00-<32 hex>-<16 hex>-<2 hex>``, ids not all zero), and a `tracestate` only beside one."""
    if traceparent is not None:
        m = TRACEPARENT_PATTERN.fullmatch(traceparent) if len(traceparent) <= TRACEPARENT_MAX_CHARS else None
        if m is None or (m.group(1) == "00" and m.group(5)):
            yield "traceparent", "must be a W3C traceparent: 00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>"
        elif m.group(2) == "0" * 32 or m.group(3) == "0" * 16:
            yield "traceparent", "trace id and parent id must not be all zeros"
    if tracestate is not None:
        if traceparent is None:
            yield "tracestate", "is only carried with a traceparent"
        elif len(tracestate) > TRACESTATE_MAX_CHARS or not all(" " <= c <= "~" for c in tracestate):
            yield "tracestate", f"must be printable ASCII of at most {TRACESTATE_MAX_CHARS} characters"


def validate(request: GenerateRequest, limits: Limits = DEFAULT_LIMITS) -> GenerateRequest:
    """Check version, request id, prompt kind and every limit; raise on the first problem.

    Assumes the field types are right (as after `decode_request` or `build_request`).
    """
    if request.v not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(request.v, PROTOCOL_VERSION)
    needed = min_version(request)
    if request.v < needed:
        raise ValidationError(
            f"invalid request: v={request.v}: it uses protocol version {needed} features (tools, tool_choice, "
            "response_format, structured_outputs, rich messages); send v=2",
            field="v",
        )
    for field, why in _request_problems(request, limits):
        value = _field_value(request, field)
        shown = f"={_short(value)}" if isinstance(value, (int, float, str)) else ""
        raise ValidationError(f"invalid request: {field}{shown}: {why}", field=field)
    return request


_MISSING = object()


def _field_value(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if "[" in part or not hasattr(obj, part):
            return _MISSING
        obj = getattr(obj, part)
    return obj


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate_tenant(tenant: str | None) -> str:
    """The tenant a request is counted under (`DEFAULT_TENANT` for None); ValidationError if malformed."""
    if tenant is None:
        return DEFAULT_TENANT
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
        raise ValidationError(f"tenant must match {TENANT_PATTERN.pattern} (got {_short(tenant)})", field="tenant")
    return tenant


def validate_model_name(model: str) -> str:
    """A model name (the key namespace pagedq:{model}:*); ValueError if it cannot be one."""
    if not isinstance(model, str) or not MODEL_NAME_PATTERN.fullmatch(model):
        raise ValueError(
            f"model name must match {MODEL_NAME_PATTERN.pattern} (it names Redis keys), not {_short(model)}"
        )
    return model
