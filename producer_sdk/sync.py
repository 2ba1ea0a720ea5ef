"""Client: the blocking twin of AsyncClient, on redis-py's synchronous client (no event loop).

Same arguments, same errors, same protocol code (`producer_sdk._core`); only the I/O differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import redis

from producer_sdk import _core, _plans
from producer_sdk._client_base import ClientBase, HandleState, ServedModel
from producer_sdk._stream import Follower, outcome
from producer_sdk.batch import DEFAULT_WINDOW, BatchItem, Outcome, run_batch_sync
from producer_sdk.contract import scripts, steps
from producer_sdk.contract.redis_errors import RETRY_CANDIDATES
from producer_sdk.errors import QueueFull, RateLimited, RequestFailed, RequestTimeout
from producer_sdk.prepared import EnqueueResult, Prepared
from producer_sdk.results import Chunk, Completion, QueueStats
from producer_sdk.submit_options import GenerateOptions, SubmitOptions, split_wait

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

T = TypeVar("T")


class SyncHandle(HandleState):
    """One submitted request (blocking). See `producer_sdk.client.Handle`."""

    def __init__(self, client: Client, request_id: str, **kwargs: Any) -> None:
        super().__init__(request_id, model=client.model, **kwargs)
        self._client = client

    def stream(
        self, timeout: float | None = None, *, partial_ok: bool = False, cancel_on_timeout: bool = False
    ) -> Iterator[Chunk]:
        """Yield the chunks as they arrive (same semantics and errors as `Handle.stream`)."""
        f = self._follower(self._client._opts, timeout)
        try:
            yield from self._events(f)
        except RequestTimeout as e:
            raise self._timed_out(e, cancel_on_timeout) from None
        except RequestFailed as e:
            self._record_failure(e)
            raise
        self._record(f)
        outcome(f.completion(), partial_ok=partial_ok)

    def result(
        self, timeout: float | None = None, *, partial_ok: bool = False, cancel_on_timeout: bool = False
    ) -> Completion:
        cached = self._cached(partial_ok)
        if cached is not None:
            return cached
        for _ in self.stream(timeout, partial_ok=partial_ok, cancel_on_timeout=cancel_on_timeout):
            pass
        assert self._completion is not None
        return self._completion

    def cancel(self) -> None:
        self._client.cancel(self.request_id)

    def _timed_out(self, e: RequestTimeout, cancel: bool) -> RequestTimeout:
        if not cancel:
            return e
        self._client.cancel(self.request_id)
        return RequestTimeout(self.request_id, e.timeout, cancelled=True)

    def _events(self, f: Follower) -> Iterator[Chunk]:
        r = self._client._redis
        while not f.done:
            try:
                if f.needs_check:
                    if f.on_liveness(*_plans.run_sync(_plans.liveness(f), r)) == Follower.RESUBMIT:
                        f.on_resubmitted(self._resubmit())
                    continue
                streams, count, block = f.xread_args()
                reply = r.xread(streams, count=count, block=block)
            except RETRY_CANDIDATES as e:
                time.sleep(f.on_error(e))
                continue
            yield from f.on_reply(reply)

    def _resubmit(self) -> EnqueueResult:
        assert self.prepared is not None
        try:
            return self._client._enqueue(self.prepared)
        except (QueueFull, RateLimited) as e:
            raise _core.lost_on_resubmit(self.request_id, e) from e


class Client(ClientBase):
    """Blocking producer client: the arguments, methods and errors of `producer_sdk.AsyncClient`
    (`redis_url` may be a ``redis.Redis``)."""

    _redis_class = redis.Redis
    _handle_class = SyncHandle

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_redis:
            self._redis.close()

    def ping(self) -> bool:
        return bool(self._retry(self._redis.ping))

    def submit(self, prompt: str | None = None, **options: Unpack[SubmitOptions]) -> SyncHandle:
        """Enqueue a request; see `AsyncClient.submit`."""
        p = self._prepare(prompt, dict(options))
        return self._new_handle(p, self._enqueue(p))

    def submit_many(self, items: Iterable[str | Mapping[str, Any]], **common: Any) -> list[SyncHandle]:
        """Submit many requests in one pipeline; see `AsyncClient.submit_many`."""
        prepared = self._prepare_many(items, common)
        if prepared:
            self._check_model()

        def run() -> list[Any]:
            quotas = self._quotas({p.tenant for p in prepared})
            return steps.run_many_sync(self._redis, [self._enqueue_call(p, quotas) for p in prepared])

        return self._many_handles(prepared, self._retry(run) if prepared else [])

    def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> Completion:
        wait = split_wait(options)
        return self.submit(prompt, **options).result(**wait)

    def stream(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> Iterator[Chunk]:
        """Submit and yield chunks; leaving the loop early cancels the request (see
        `AsyncClient.stream`)."""
        wait = split_wait(options)
        handle = self.submit(prompt, **options)
        try:
            yield from handle.stream(**wait)
        except GeneratorExit:
            if not handle.done:
                self.cancel(handle.request_id)
            raise

    def run_batch(
        self, items: Iterable[BatchItem | tuple], *, batch_id: str, window: int = DEFAULT_WINDOW
    ) -> Iterator[tuple[str, Outcome]]:
        """Run a batch on the low lane; see `AsyncClient.run_batch`. Outcomes come in submission
        order (the oldest of the `window` requests in flight is waited for first)."""
        return run_batch_sync(self, items, batch_id, window)

    def cancel(self, request_id: str) -> None:
        self._run(lambda: _plans.cancel(self.model, request_id, self._opts.result_ttl_s), request_id)

    def queue_stats(self) -> QueueStats:
        return self._run(lambda: _plans.queue_stats(self.model))

    def served_models(self) -> list[ServedModel]:
        """The model names workers serve here (from their heartbeats), with when each was last seen."""
        return self._models.update(self._run(_plans.served_models))

    def _check_model(self) -> None:
        if self._opts.check_model and not self._models.fresh(self.model):
            self.served_models()
            self._models.check(self.model)

    def _enqueue(self, p: Prepared) -> EnqueueResult:
        self._check_model()

        def run() -> Any:
            step, ks, args = self._enqueue_call(p, self._quotas({p.tenant}))
            return step.run_sync(self._redis, ks, args)

        return _core.parse_enqueue_reply(self._retry(run, p.request_id), p)

    def _quotas(self, tenants: set[str]) -> dict[str, scripts.Quota]:
        return _plans.run_sync(_plans.quotas(tenants), self._redis)

    def _run(self, plan: Callable[[], _plans.Plan[T]], request_id: str | None = None) -> T:
        """Run a plan (`producer_sdk._plans`), afresh after each connection error."""
        return self._retry(lambda: _plans.run_sync(plan(), self._redis), request_id)

    def _retry(self, op: Callable[[], T], request_id: str | None = None) -> T:
        backoff = self._opts.backoff()
        while True:
            try:
                return op()
            except RETRY_CANDIDATES as e:
                time.sleep(backoff.delay(e, request_id))


__all__ = ["Chunk", "Client", "Completion", "QueueStats", "SyncHandle"]
