"""Reading a model's queue: lane lengths, dead letters, live workers (sans-IO, for both clients)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from producer_sdk.contract import keys
from producer_sdk.contract.replies import as_text
from producer_sdk.protocol import (
    WorkerState,
    now_ms,
)
from producer_sdk.results import QueueStats

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
        self._members = [(as_text(m), float(score)) for m, score in members]
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
