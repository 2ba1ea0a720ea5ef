"""The logic the async and the blocking client share, with no I/O in it (sans-IO).

`client.py` and `sync.py` only execute what this module (and `_stream.py`, which follows a
response stream) decides: build and check a request, the enqueue script and its replies, cancel,
queue stats, and the constructor and state the two clients and their handles have in common.
"""

from __future__ import annotations

import datetime as _dt
import operator
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from producer_sdk import trace_context
from producer_sdk._stream import Follower, translate_redis_error
from producer_sdk.chat import Message, NamedToolChoice, ResponseFormat, Tool
from producer_sdk.constants import UNFINISHED_TTL_S
from producer_sdk.contract import keys, scripts
from producer_sdk.errors import (
    ProtocolError,
    QueueFull,
    RateLimited,
    RequestLost,
    ValidationError,
)
from producer_sdk.prepared import EnqueueResult, Prepared
from producer_sdk.protocol import (
    PROTOCOL_VERSION,
    SAMPLING_FIELDS,
    ControlMessage,
    GenerateRequest,
    encode_control,
    now_ms,
    schema_error,
)
from producer_sdk.request_codec import encode_request
from producer_sdk.validation import DEFAULT_LIMITS, Limits, validate_tenant
from producer_sdk.validation_chat import min_version

# --- building a request ---------------------------------------------------------------------------


def new_request_id() -> str:
    return uuid.uuid4().hex


def deadline_to_ms(deadline: float | _dt.datetime | _dt.timedelta | None) -> int | None:
    """Seconds from now, a timedelta, or a datetime (naive = local time) -> absolute unix ms."""
    if deadline is None:
        return None
    if isinstance(deadline, _dt.datetime):
        return int(deadline.timestamp() * 1000)
    if isinstance(deadline, _dt.timedelta):
        deadline = deadline.total_seconds()
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        raise TypeError(f"deadline must be seconds from now, a timedelta or a datetime, not {deadline!r}")
    return now_ms() + int(deadline * 1000)


def _check_sampling_names(sampling: Mapping[str, Any]) -> None:
    unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"unknown sampling parameter(s) {', '.join(unknown)}; valid: {', '.join(SAMPLING_FIELDS)}")


def _token_ids(ids: Iterable[Any]) -> list[Any]:
    """Plain ints (numpy integers welcome); anything else is left for msgspec to name."""
    out = []
    for t in ids:
        try:
            out.append(operator.index(t))
        except TypeError:
            out.append(t)
    return out


def _plain(value: Any) -> Any:
    """Structs (Message, Tool, ResponseFormat, ...) as plain data; anything else as it is (a wrong type
    is left for msgspec.convert to name)."""
    if isinstance(value, msgspec.Struct):
        return msgspec.to_builtins(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, Any] | Message] | None = None,
    tools: Sequence[Mapping[str, Any] | Tool] | None = None,
    tool_choice: str | Mapping[str, Any] | NamedToolChoice | None = None,
    response_format: Mapping[str, Any] | ResponseFormat | None = None,
    parallel_tool_calls: bool = True,
    request_id: str | None = None,
    priority: int = 0,
    deadline: float | _dt.datetime | _dt.timedelta | None = None,
    metadata: Mapping[str, str] | None = None,
    add_generation_prompt: bool = True,
    traceparent: str | None = None,
    tracestate: str | None = None,
    tenant: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    propagate_trace: bool = True,
    **sampling: Any,
) -> Prepared:
    """Build, type-check, validate and encode a request (the same checks the worker runs). It is
    written in the lowest protocol version that carries it, so older workers serve what they can.
    Without an explicit `traceparent` (nor `tracestate`), the current OpenTelemetry span's context is
    carried when `propagate_trace` (see `trace_context`)."""
    _check_sampling_names(sampling)
    tenant = validate_tenant(tenant)
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    if sampling.get("structured_outputs") is not None:
        sampling["structured_outputs"] = _plain(sampling["structured_outputs"])
    raw: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "request_id": request_id if request_id is not None else new_request_id(),
        "sampling": sampling,
        "priority": priority,
        "created_ms": now_ms(),
        "metadata": dict(metadata) if metadata is not None else {},
        "add_generation_prompt": add_generation_prompt,
    }
    if prompt is not None:
        raw["prompt"] = prompt
    if prompt_token_ids is not None:
        raw["prompt_token_ids"] = _token_ids(prompt_token_ids)
    if messages is not None:
        raw["messages"] = [_plain(m) for m in messages]
    if tools is not None:
        raw["tools"] = [_plain(t) for t in tools]
    if tool_choice is not None:
        raw["tool_choice"] = _plain(tool_choice)
    if response_format is not None:
        raw["response_format"] = _plain(response_format)
    if not parallel_tool_calls:
        raw["parallel_tool_calls"] = False
    ms = deadline_to_ms(deadline)
    if ms is not None:
        raw["deadline_ms"] = max(ms, 0)
    if traceparent is None and tracestate is None and propagate_trace:
        traceparent, tracestate = trace_context.current()
    if traceparent is not None:
        raw["traceparent"] = traceparent
    if tracestate is not None:
        raw["tracestate"] = tracestate
    try:
        request = msgspec.convert(raw, GenerateRequest, strict=True)
    except msgspec.ValidationError as e:
        raise schema_error(e, "request", ValidationError) from None
    request.v = min_version(request)
    return Prepared(request, encode_request(request, limits), tenant)


def split_submit_item(item: str | Mapping[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """An item of `submit_many`: a prompt string, or a dict of `submit` keyword arguments."""
    if isinstance(item, str):
        return (item,), {}
    if isinstance(item, Mapping):
        kwargs = dict(item)
        return (kwargs.pop("prompt", None),), kwargs
    raise TypeError(f"submit_many takes prompt strings or dicts of submit() arguments, not {item!r}")


# --- enqueue --------------------------------------------------------------------------------------


def enqueue_keys_args(
    p: Prepared, model: str, max_queue_len: int | None, ttl_s: float, quota: scripts.Quota
) -> tuple[list[str], list[Any]]:
    """`ttl_s`: the retention (`result_ttl_s`), which travels in the entry for the worker to apply from
    the final event on; the submitted marker lives at least UNFINISHED_TTL_S until then."""
    marker_ms, retention_ms = int(max(ttl_s, UNFINISHED_TTL_S) * 1000), int(ttl_s * 1000)
    return scripts.enqueue_call(
        model, p.lane, p.request_id, p.payload, max_queue_len, marker_ms, p.tenant, quota, retention_ms=retention_ms
    )


def queue_quota_reads(pipe: Any, tenants: Sequence[str]) -> None:
    """Read each tenant's quota (one HMGET each): the enqueue step applies what was read."""
    for tenant in tenants:
        pipe.hmget(keys.tenant_quota(tenant), list(scripts.QUOTA_FIELDS))


def read_quotas(tenants: Sequence[str], replies: Sequence[Any]) -> dict[str, scripts.Quota]:
    return {t: scripts.read_quota(r) for t, r in zip(tenants, replies, strict=True)}


def parse_enqueue_reply(reply: Any, p: Prepared) -> EnqueueResult:
    """Interpret the script's reply; raise QueueFull for a full queue, RateLimited for a tenant over
    its quota."""
    try:
        r = scripts.read_enqueue(reply)
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    if r.status == "full":
        raise QueueFull(p.lane, r.queued, r.limit)
    if r.status == "limited":
        raise RateLimited(p.tenant, r.quota or "", r.queued, r.limit, max(r.retry_after_ms, 1) / 1000)
    return EnqueueResult(r.status == "duplicate", r.entry_id)


def read_enqueue_reply(reply: Any, p: Prepared) -> EnqueueResult:
    """`parse_enqueue_reply` of one pipelined reply, which may be the error Redis answered (raised,
    typed where retrying cannot fix it)."""
    if isinstance(reply, Exception):
        translated = translate_redis_error(reply)
        raise translated if translated is not None else reply
    return parse_enqueue_reply(reply, p)


def cancel_commands(model: str, request_id: str, ttl_s: float) -> list[tuple[Any, ...]]:
    """The two commands of a cancel, in order: the flag (read at intake and between steps), then the
    notification (for the worker that owns the request now). Sent one after the other, not in one
    pipeline: a cluster pipeline takes no PUBLISH."""
    msg = encode_control(ControlMessage(type="cancel", request_id=request_id))
    return [
        ("SET", keys.cancel_flag(request_id), 1, "EX", max(1, int(ttl_s))),
        ("PUBLISH", keys.control_channel(model), msg),
    ]


def queue_liveness(pipe: Any, f: Follower) -> None:
    """The reads `Follower.on_liveness` takes, in its argument order."""
    pipe.exists(f.marker)
    pipe.exists(f.key)
    if f.lane_stream is not None and f.entry_id is not None:
        pipe.xrange(f.lane_stream, f.entry_id, f.entry_id, count=1)


# --- submit_many ----------------------------------------------------------------------------------


def prepare_many(
    items: Iterable[str | Mapping[str, Any]],
    common: Mapping[str, Any],
    limits: Limits,
    propagate_trace: bool = True,
    tenant: str | None = None,
) -> list[Prepared]:
    """Build every request of `submit_many` first: nothing is sent if one of them is invalid.
    `tenant`: the client's, for the items that name none."""
    prepared = []
    for i, item in enumerate(items):
        args, kwargs = split_submit_item(item)
        kwargs = {**common, **kwargs}
        if kwargs.get("tenant") is None:
            kwargs["tenant"] = tenant
        try:
            prepared.append(build_request(*args, **kwargs, limits=limits, propagate_trace=propagate_trace))
        except ValidationError as e:
            raise type(e)(f"submit_many item {i}: {e.message}", field=e.field) from None
    return prepared


def parse_many_replies(
    prepared: Sequence[Prepared], replies: Sequence[Any]
) -> tuple[list[EnqueueResult | None], QueueFull | RateLimited | None]:
    """Per item: its EnqueueResult, or None where it was refused (a full queue, a tenant over its
    quota), and the first refusal."""
    results: list[EnqueueResult | None] = []
    first_full: QueueFull | RateLimited | None = None
    for p, reply in zip(prepared, replies):
        try:
            results.append(read_enqueue_reply(reply, p))
        except (QueueFull, RateLimited) as full:
            results.append(None)
            first_full = first_full or full
    return results, first_full


def lost_on_resubmit(request_id: str, exc: BaseException) -> RequestLost:
    return RequestLost(
        f"request {request_id} was lost by redis and could not be resubmitted: {exc}", request_id=request_id
    )
