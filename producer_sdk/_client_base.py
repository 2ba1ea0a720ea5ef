"""What the async and the blocking client share: options, connection settings, handle state, and
the constructor (sans-IO)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from producer_sdk._core import (
    EnqueueResult,
    Prepared,
    build_request,
    enqueue_keys_args,
    parse_many_replies,
    prepare_many,
)
from producer_sdk._stream import Backoff, Follower, outcome
from producer_sdk.constants import DEFAULT_RESULT_TTL_S, DEFAULT_TENANT
from producer_sdk.contract import scripts, steps
from producer_sdk.contract.cluster import decodes_responses, socket_timeout
from producer_sdk.contract.connection import client_options, redis_from_url
from producer_sdk.contract.replies import as_text
from producer_sdk.errors import (
    ModelNotFound,
    RequestFailed,
)
from producer_sdk.protocol import (
    Timings,
    Usage,
)
from producer_sdk.results import Completion
from producer_sdk.validation import DEFAULT_LIMITS, Limits, validate_model_name, validate_tenant

# --- served models --------------------------------------------------------------------------------

MODEL_CHECK_TTL_S = 5.0  # a known model stays known this long without asking Redis again


class ServedModel(msgspec.Struct, frozen=True):
    """A model name workers serve, and when a worker last heartbeated for it."""

    name: str
    last_seen_ms: int


class ModelRegistryView:
    """The client's cached view of `keys.models()` (sans-IO): is a model name served at all?"""

    def __init__(self) -> None:
        self.models: list[ServedModel] = []
        self._read_at = float("-inf")

    def fresh(self, model: str) -> bool:
        return time.monotonic() - self._read_at < MODEL_CHECK_TTL_S and any(m.name == model for m in self.models)

    def update(self, members: Any) -> list[ServedModel]:
        self.models = sorted((ServedModel(as_text(name), int(score)) for name, score in members), key=lambda m: m.name)
        self._read_at = time.monotonic()
        return self.models

    def check(self, model: str) -> None:
        if not any(m.name == model for m in self.models):
            raise ModelNotFound(model, [m.name for m in self.models])


# --- client options -------------------------------------------------------------------------------


class ClientOptions(msgspec.Struct, kw_only=True):
    model: str = "default"
    tenant: str = DEFAULT_TENANT  # of every request that names none
    max_queue_len: int | None = None
    result_ttl_s: float = DEFAULT_RESULT_TTL_S  # docs/sdk.md, "How long an answer can be fetched"
    block_ms: int = 2000
    reconnect_attempts: int = 10
    reconnect_backoff_max_s: float = 2.0
    resubmit_lost: bool = True
    check_model: bool = True
    limits: Limits = DEFAULT_LIMITS
    propagate_trace: bool = True

    def backoff(self) -> Backoff:
        return Backoff(self.reconnect_attempts, max_s=self.reconnect_backoff_max_s)


SOCKET_TIMEOUT_S = 30.0  # a read longer than this is a dead connection (XREAD BLOCK stays at half of it)


def redis_kwargs(connect_timeout: float | None, extra: dict[str, Any], *, asyncio: bool) -> dict[str, Any]:
    """Keyword arguments for `redis_from_url`: the contract's explicit connection settings (no silent
    retries, timeouts, keepalive), then the caller's (ssl_ca_certs, username, socket_timeout, ...)."""
    kwargs = client_options(asyncio=asyncio, socket_timeout=SOCKET_TIMEOUT_S, connect_timeout=connect_timeout)
    kwargs.update(extra)
    if kwargs.get("decode_responses"):
        raise ValueError("producer_sdk needs decode_responses=False (payloads are binary msgpack)")
    return kwargs


def fit_block_ms(block_ms: int, client: Any) -> int:
    """XREAD BLOCK must end before redis-py's `socket_timeout`, or every idle wait would look
    like a broken connection: keep it to half the timeout."""
    timeout = socket_timeout(client)
    if timeout:
        return max(1, min(int(block_ms), int(timeout * 500)))
    return max(1, int(block_ms))


def check_redis_instance(client: Any) -> None:
    if decodes_responses(client):
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
            model=self.model,
            prepared=self.prepared,
            timeout=timeout,
            block_ms=opts.block_ms,
            backoff=opts.backoff(),
            resubmit_lost=opts.resubmit_lost,
            owner=self,
            entry_id=self.entry_id,
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
        tenant: str | None = None,
        max_queue_len: int | None = None,
        result_ttl_s: float = DEFAULT_RESULT_TTL_S,
        connect_timeout: float | None = 5.0,
        block_ms: int = 2000,
        reconnect_attempts: int = 10,
        reconnect_backoff_max_s: float = 2.0,
        resubmit_lost: bool = True,
        check_model: bool = True,
        limits: Limits = DEFAULT_LIMITS,
        propagate_trace: bool = True,
        **redis_options: Any,
    ) -> None:
        tenant, model = validate_tenant(tenant), validate_model_name(model)
        if not result_ttl_s >= 0.001:
            raise ValueError(f"result_ttl_s must be at least 1 ms, got {result_ttl_s!r}")
        if isinstance(redis_url, str):
            options = redis_kwargs(connect_timeout, redis_options, asyncio=self._asyncio)
            self._redis = redis_from_url(redis_url, asyncio=self._asyncio, **options)
            self._owns_redis = True
        else:
            if redis_options:
                raise TypeError(f"redis options {sorted(redis_options)} need a URL, not a Redis instance")
            check_redis_instance(redis_url)
            self._redis = redis_url
            self._owns_redis = False
        self._opts = ClientOptions(
            model=model,
            tenant=tenant,
            max_queue_len=max_queue_len,
            result_ttl_s=result_ttl_s,
            block_ms=fit_block_ms(block_ms, self._redis),
            reconnect_attempts=reconnect_attempts,
            reconnect_backoff_max_s=reconnect_backoff_max_s,
            resubmit_lost=resubmit_lost,
            check_model=check_model,
            limits=limits,
            propagate_trace=propagate_trace,
        )
        self._models = ModelRegistryView()

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

    @property
    def tenant(self) -> str:
        """The tenant of the requests that name none."""
        return self._opts.tenant

    def _prepare(self, prompt: str | None, kwargs: dict[str, Any]) -> Prepared:
        if kwargs.get("tenant") is None:
            kwargs["tenant"] = self._opts.tenant
        return build_request(prompt, limits=self._opts.limits, propagate_trace=self._opts.propagate_trace, **kwargs)

    def _prepare_many(self, items: Any, common: dict[str, Any]) -> list[Prepared]:
        return prepare_many(items, common, self._opts.limits, self._opts.propagate_trace, self._opts.tenant)

    def _enqueue_call(self, p: Prepared, quotas: dict[str, scripts.Quota]) -> steps.Call:
        ks, args = enqueue_keys_args(p, self.model, self._opts.max_queue_len, self._opts.result_ttl_s, quotas[p.tenant])
        return steps.ENQUEUE, ks, args

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
