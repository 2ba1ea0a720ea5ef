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

from producer_sdk._stream import Backoff, Follower, outcome, translate_redis_error
from producer_sdk.contract import keys, scripts
from producer_sdk.contract.connection import client_options
from producer_sdk.errors import (
    ProtocolError,
    QueueFull,
    RequestFailed,
    RequestLost,
    ValidationError,
)
from producer_sdk.protocol import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    SAMPLING_FIELDS,
    ControlMessage,
    GenerateRequest,
    Limits,
    Message,
    Timings,
    Usage,
    WorkerState,
    encode_control,
    encode_request,
    now_ms,
    schema_error,
)
from producer_sdk.results import Completion, QueueStats

# --- building a request ---------------------------------------------------------------------------


class Prepared(msgspec.Struct):
    """A checked, encoded request, ready for the enqueue script."""

    request: GenerateRequest
    payload: bytes

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def lane(self) -> str:
        return self.request.lane


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


def _plain_message(m: Any) -> Any:
    if isinstance(m, Message):
        return {"role": m.role, "content": m.content}
    if isinstance(m, Mapping):
        return dict(m)
    return m  # wrong type: msgspec.convert names it


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, str] | Message] | None = None,
    request_id: str | None = None,
    priority: int = 0,
    deadline: float | _dt.datetime | _dt.timedelta | None = None,
    metadata: Mapping[str, str] | None = None,
    add_generation_prompt: bool = True,
    limits: Limits = DEFAULT_LIMITS,
    **sampling: Any,
) -> Prepared:
    """Build, type-check, validate and encode a request (the same checks the worker runs)."""
    _check_sampling_names(sampling)
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
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
        raw["messages"] = [_plain_message(m) for m in messages]
    ms = deadline_to_ms(deadline)
    if ms is not None:
        raw["deadline_ms"] = max(ms, 0)
    try:
        request = msgspec.convert(raw, GenerateRequest, strict=True)
    except msgspec.ValidationError as e:
        raise schema_error(e, "request", ValidationError) from None
    return Prepared(request, encode_request(request, limits))


def split_submit_item(item: str | Mapping[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """An item of `submit_many`: a prompt string, or a dict of `submit` keyword arguments."""
    if isinstance(item, str):
        return (item,), {}
    if isinstance(item, Mapping):
        kwargs = dict(item)
        return (kwargs.pop("prompt", None),), kwargs
    raise TypeError(f"submit_many takes prompt strings or dicts of submit() arguments, not {item!r}")


# --- enqueue --------------------------------------------------------------------------------------


def enqueue_keys_args(p: Prepared, model: str, max_queue_len: int | None, ttl_s: float) -> tuple[list[str], list[Any]]:
    return scripts.enqueue_call(model, p.lane, p.request_id, p.payload, max_queue_len, int(ttl_s * 1000))


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class EnqueueResult(msgspec.Struct):
    duplicate: bool
    entry_id: str | None


def parse_enqueue_reply(reply: Any, p: Prepared) -> EnqueueResult:
    """Interpret the script's reply; raise QueueFull for a full queue."""
    try:
        r = scripts.read_enqueue(reply)
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    if r.status == "full":
        raise QueueFull(p.lane, r.queued, r.limit)
    return EnqueueResult(r.status == "duplicate", r.entry_id)


# --- queue stats ---------------------------------------------------------------------------------

_state_decoder = msgspec.json.Decoder(WorkerState)


class StatsReader:
    """The three steps of `queue_stats` (sans-IO):

    1. `queue_reads(pipe)`: XLEN of each lane and of the dead letters, the heartbeat zset, the
       configured queue limit; `after_reads(replies)` returns the worker state keys to MGET.
    2. `after_states(values)` returns the zset members to prune (their state key expired; the
       heartbeat is older than `prune_after_ms`, which spares a worker between its ZADD and SET).
    3. `stats()`.
    """

    def __init__(self, model: str, prune_after_ms: int = 1000) -> None:
        self.model = model
        self.heartbeats = keys.heartbeats(model)
        self.prune_after_ms = prune_after_ms
        self._lanes: list[int] = []
        self._dead = 0
        self._limit: Any = None
        self._members: list[tuple[str, float]] = []
        self._live: list[WorkerState] = []

    def queue_reads(self, pipe: Any) -> None:
        for lane in keys.LANES:
            pipe.xlen(keys.lane_stream(self.model, lane))
        pipe.xlen(keys.dead_letters(self.model))
        pipe.zrange(self.heartbeats, 0, -1, withscores=True)
        pipe.hget(keys.config(self.model), "max_queue_len")

    def after_reads(self, replies: Sequence[Any]) -> list[str]:
        *lanes, dead, members, limit = replies
        self._lanes = [int(x) for x in lanes]
        self._dead = int(dead)
        self._limit = limit
        self._members = [(_s(m), float(score)) for m, score in members]
        return [keys.worker_state(self.model, name) for name, _ in self._members]

    def after_states(self, values: Sequence[Any]) -> list[str]:
        now = now_ms()
        dead = []
        for (name, score), raw in zip(self._members, values):
            if raw is None:
                if now - score > self.prune_after_ms:
                    dead.append(name)
                continue
            try:
                self._live.append(_state_decoder.decode(raw))
            except (msgspec.MsgspecError, ValueError):
                self._live.append(WorkerState(worker=name, model=self.model))
        return dead

    def stats(self) -> QueueStats:
        try:
            limit = int(self._limit) if self._limit is not None else None
        except ValueError:
            limit = None
        return QueueStats(
            model=self.model,
            lanes=dict(zip(keys.LANES, self._lanes)),
            dead_letters=self._dead,
            workers=self._live,
            max_queue_len=limit if limit and limit > 0 else None,
        )


def queue_cancel(pipe: Any, model: str, request_id: str, ttl_s: float) -> None:
    """Queue a cancel on a pipeline: the flag (read at intake and between steps), then the
    notification (for the worker that owns the request now)."""
    msg = encode_control(ControlMessage(type="cancel", request_id=request_id))
    pipe.set(keys.cancel_flag(request_id), 1, ex=max(1, int(ttl_s)))
    pipe.publish(keys.control_channel(model), msg)


def queue_liveness(pipe: Any, f: Follower) -> None:
    pipe.exists(f.marker)
    pipe.exists(f.key)


# --- client options -------------------------------------------------------------------------------


class ClientOptions(msgspec.Struct, kw_only=True):
    model: str = "default"
    max_queue_len: int | None = None
    result_ttl_s: float = 86400.0
    block_ms: int = 2000
    reconnect_attempts: int = 10
    reconnect_backoff_max_s: float = 2.0
    resubmit_lost: bool = True
    limits: Limits = DEFAULT_LIMITS

    def backoff(self) -> Backoff:
        return Backoff(self.reconnect_attempts, max_s=self.reconnect_backoff_max_s)


SOCKET_TIMEOUT_S = 30.0  # a read longer than this is a dead connection (XREAD BLOCK stays at half of it)


def redis_kwargs(connect_timeout: float | None, extra: dict[str, Any], *, asyncio: bool) -> dict[str, Any]:
    """Keyword arguments for Redis.from_url: the contract's explicit connection settings (no silent
    retries, timeouts, keepalive), then the caller's (ssl_ca_certs, username, socket_timeout, ...)."""
    kwargs = client_options(asyncio=asyncio, socket_timeout=SOCKET_TIMEOUT_S, connect_timeout=connect_timeout)
    kwargs.update(extra)
    if kwargs.get("decode_responses"):
        raise ValueError("producer_sdk needs decode_responses=False (payloads are binary msgpack)")
    return kwargs


def fit_block_ms(block_ms: int, client: Any) -> int:
    """XREAD BLOCK must end before redis-py's `socket_timeout`, or every idle wait would look
    like a broken connection: keep it to half the timeout."""
    timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
    if timeout:
        return max(1, min(int(block_ms), int(timeout * 500)))
    return max(1, int(block_ms))


def check_redis_instance(client: Any) -> None:
    pool = getattr(client, "connection_pool", None)
    if pool is not None and pool.connection_kwargs.get("decode_responses"):
        raise ValueError("producer_sdk needs a Redis client with decode_responses=False")


class HandleState:
    """What both handle flavours know and expose about one request."""

    def __init__(
        self,
        request_id: str,
        *,
        model: str,
        prepared: Prepared | None = None,
        duplicate: bool = False,
        entry_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.prepared = prepared
        self.duplicate = duplicate  # an earlier submit of this id was found: following its stream
        self.entry_id = entry_id
        self.reconnects = 0  # Redis connection failures its readers recovered from
        self.resubmits = 0  # times a reader resubmitted it after Redis lost it
        self._completion: Completion | None = None
        self._failure: RequestFailed | None = None

    # Filled once a reader has seen the final event.
    @property
    def finish_reason(self) -> str | None:
        return self._completion.finish_reason if self._completion else None

    @property
    def usage(self) -> Usage | None:
        return self._completion.usage if self._completion else None

    @property
    def timings(self) -> Timings | None:
        return self._completion.timings if self._completion else None

    @property
    def stop_reason(self) -> str | int | None:
        return self._completion.stop_reason if self._completion else None

    @property
    def done(self) -> bool:
        return self._completion is not None or self._failure is not None

    def _follower(self, opts: ClientOptions, timeout: float | None) -> Follower:
        return Follower(
            self.request_id,
            prepared=self.prepared,
            timeout=timeout,
            block_ms=opts.block_ms,
            backoff=opts.backoff(),
            resubmit_lost=opts.resubmit_lost,
            owner=self,
        )

    def _record(self, f: Follower) -> None:
        if f.finished is not None:
            self._completion = f.completion()

    def _record_failure(self, exc: RequestFailed) -> None:
        self._failure = exc

    def _cached(self, partial_ok: bool) -> Completion | None:
        if self._failure is not None:
            raise self._failure
        if self._completion is not None:
            return outcome(self._completion, partial_ok=partial_ok)
        return None

    def __repr__(self) -> str:
        state = self.finish_reason or ("failed" if self._failure else "pending")
        return f"<{type(self).__name__} {self.request_id} model={self.model!r} {state}>"


# --- submit_many ----------------------------------------------------------------------------------


def prepare_many(items: Iterable[str | Mapping[str, Any]], common: Mapping[str, Any], limits: Limits) -> list[Prepared]:
    """Build every request of `submit_many` first: nothing is sent if one of them is invalid."""
    prepared = []
    for i, item in enumerate(items):
        args, kwargs = split_submit_item(item)
        try:
            prepared.append(build_request(*args, **{**common, **kwargs}, limits=limits))
        except ValidationError as e:
            raise type(e)(f"submit_many item {i}: {e.message}", field=e.field) from None
    return prepared


def parse_many_replies(
    prepared: Sequence[Prepared], replies: Sequence[Any]
) -> tuple[list[EnqueueResult | None], QueueFull | None]:
    """Per item: its EnqueueResult, or None where its lane was full (and the first QueueFull)."""
    results: list[EnqueueResult | None] = []
    first_full: QueueFull | None = None
    for p, reply in zip(prepared, replies):
        if isinstance(reply, Exception):
            translated = translate_redis_error(reply)
            raise translated if translated is not None else reply
        try:
            results.append(parse_enqueue_reply(reply, p))
        except QueueFull as full:
            results.append(None)
            first_full = first_full or full
    return results, first_full


def lost_on_resubmit(request_id: str, exc: BaseException) -> RequestLost:
    return RequestLost(
        f"request {request_id} was lost by redis and could not be resubmitted: {exc}", request_id=request_id
    )


# --- the shared client skeleton -------------------------------------------------------------------


class ClientBase:
    """Constructor and I/O-free helpers of AsyncClient and Client (see AsyncClient's docstring)."""

    _redis_class: Any = None  # redis.asyncio.Redis or redis.Redis
    _asyncio = False
    _handle_class: Any = None

    def __init__(
        self,
        redis_url: Any = "redis://localhost:6379/0",
        model: str = "default",
        *,
        max_queue_len: int | None = None,
        result_ttl_s: float = 86400.0,
        connect_timeout: float | None = 5.0,
        block_ms: int = 2000,
        reconnect_attempts: int = 10,
        reconnect_backoff_max_s: float = 2.0,
        resubmit_lost: bool = True,
        limits: Limits = DEFAULT_LIMITS,
        **redis_options: Any,
    ) -> None:
        if isinstance(redis_url, str):
            options = redis_kwargs(connect_timeout, redis_options, asyncio=self._asyncio)
            self._redis = self._redis_class.from_url(redis_url, **options)
            self._owns_redis = True
        else:
            if redis_options:
                raise TypeError(f"redis options {sorted(redis_options)} need a URL, not a Redis instance")
            check_redis_instance(redis_url)
            self._redis = redis_url
            self._owns_redis = False
        self._opts = ClientOptions(
            model=model,
            max_queue_len=max_queue_len,
            result_ttl_s=result_ttl_s,
            block_ms=fit_block_ms(block_ms, self._redis),
            reconnect_attempts=reconnect_attempts,
            reconnect_backoff_max_s=reconnect_backoff_max_s,
            resubmit_lost=resubmit_lost,
            limits=limits,
        )
        self._script = self._redis.register_script(scripts.ENQUEUE)

    @property
    def model(self) -> str:
        return self._opts.model

    @property
    def redis(self) -> Any:
        """The underlying redis-py client."""
        return self._redis

    def handle(self, request_id: str) -> Any:
        """Re-attach to a request submitted earlier (by any client, in any process) from its id."""
        return self._handle_class(self, request_id)

    def _prepare(self, prompt: str | None, kwargs: dict[str, Any]) -> Prepared:
        return build_request(prompt, limits=self._opts.limits, **kwargs)

    def _enqueue_args(self, p: Prepared) -> tuple[list[str], list[Any]]:
        return enqueue_keys_args(p, self.model, self._opts.max_queue_len, self._opts.result_ttl_s)

    def _new_handle(self, p: Prepared, res: EnqueueResult) -> Any:
        return self._handle_class(self, p.request_id, prepared=p, duplicate=res.duplicate, entry_id=res.entry_id)

    def _many_handles(self, prepared: list[Prepared], replies: Sequence[Any]) -> list[Any]:
        results, full = parse_many_replies(prepared, replies)
        handles = [self._new_handle(p, r) if r is not None else None for p, r in zip(prepared, results)]
        if full is not None:
            full.handles = handles
            raise full
        return handles

    def __repr__(self) -> str:
        return f"<{type(self).__name__} model={self.model!r} redis={self._redis!r}>"
