"""Which models are served, and by which live workers: read from the workers' heartbeats.

`keys.models()` names every model a worker served (recently); per model, `keys.heartbeats(model)`
lists its workers and `keys.worker_state(model, worker)` (a JSON that expires a few heartbeats after
the worker stops) says it is alive, its `max_model_len` and whether it is draining. The view is
refreshed every `refresh_s` in the background; a request for a model the view does not know (or
knows without a live worker) forces one fresh read first, so a worker that just started is found.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec

from gateway import errors
from producer_sdk.contract import keys
from producer_sdk.contract.replies import as_text


class LiveWorker(msgspec.Struct):
    """The fields of a worker's state JSON the gateway reads (unknown keys are ignored)."""

    worker: str = ""
    started_ms: int = 0
    max_model_len: int | None = None
    draining: bool = False


_state = msgspec.json.Decoder(LiveWorker)


class ModelView(msgspec.Struct):
    name: str
    last_seen_ms: int
    workers: list[LiveWorker] = []

    @property
    def live(self) -> list[LiveWorker]:
        return [w for w in self.workers if not w.draining]

    @property
    def max_model_len(self) -> int | None:
        """The smallest of the live workers' (any of them may take a request)."""
        lens = [w.max_model_len for w in self.workers if w.max_model_len]
        return min(lens) if lens else None

    @property
    def created(self) -> int:
        starts = [w.started_ms for w in self.workers if w.started_ms]
        return (min(starts) if starts else self.last_seen_ms) // 1000


class Registry:
    def __init__(self, redis: Any, *, refresh_s: float = 1.0, min_forced_s: float = 0.1) -> None:
        self.redis = redis
        self.refresh_s = refresh_s
        self.min_forced_s = min_forced_s
        self.models: dict[str, ModelView] = {}
        self._read_at = float("-inf")
        self._pending: asyncio.Future | None = None

    async def refresh(self) -> dict[str, ModelView]:
        """One read of the registry; concurrent callers share it."""
        if self._pending is not None:
            return await asyncio.shield(self._pending)
        self._pending = asyncio.ensure_future(self._read())
        try:
            return await asyncio.shield(self._pending)
        finally:
            self._pending = None

    async def _read(self) -> dict[str, ModelView]:
        names = await self.redis.zrange(keys.models(), 0, -1, withscores=True)
        views = {as_text(n): ModelView(as_text(n), int(score)) for n, score in names}
        pipe = self.redis.pipeline(transaction=False)
        for name in views:
            pipe.zrange(keys.heartbeats(name), 0, -1)
        members = await pipe.execute() if views else []
        state_keys = [(name, as_text(w)) for name, ws in zip(views, members) for w in ws]
        # One MGET per model, concurrently: each model's keys share a hash slot (a cluster pipeline takes
        # no MGET).
        batches = await asyncio.gather(
            *(
                self.redis.mget([keys.worker_state(name, as_text(w)) for w in ws])
                for name, ws in zip(views, members)
                if ws
            )
        )
        states = [raw for batch in batches for raw in batch]
        for (model, name), raw in zip(state_keys, states):
            if raw is None:
                continue  # expired: the worker stopped heartbeating
            try:
                state = _state.decode(raw)
            except (msgspec.MsgspecError, ValueError):
                state = LiveWorker(worker=name)
            views[model].workers.append(state)
        self.models = views
        self._read_at = time.monotonic()
        return views

    async def run(self) -> None:
        """Refresh in the background (errors are retried at the next tick)."""
        while True:
            with contextlib.suppress(Exception):  # Redis away: keep the last view; /ready says so
                await self.refresh()
            await asyncio.sleep(self.refresh_s)

    async def _fresh_if_stale(self) -> None:
        if time.monotonic() - self._read_at >= self.min_forced_s:
            await self.refresh()

    async def check(self, model: str, *, allowed: Any = None, queue_without_workers: bool = False) -> ModelView:
        """The model's view, or the answer to give: 404 unknown (or not allowed for this key), 503
        without a live worker (unless `queue_without_workers`)."""
        view = self.models.get(model)
        if view is None or (not view.live and not queue_without_workers):
            await self._fresh_if_stale()
            view = self.models.get(model)
        if view is None or (allowed is not None and not allowed(model)):
            served = [m for m in self.models if allowed is None or allowed(m)]
            raise errors.model_not_found(model, sorted(served))
        if not view.live and not queue_without_workers:
            raise errors.no_worker(model, draining=bool(view.workers))
        return view

    def listed(self, allowed: Any = None) -> list[ModelView]:
        """Models with a live worker now (what /v1/models shows)."""
        return [v for _, v in sorted(self.models.items()) if v.workers and (allowed is None or allowed(v.name))]
