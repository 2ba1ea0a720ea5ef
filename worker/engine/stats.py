"""The engine's read-only surface for other threads: fixed `EngineLimits` and per-step `EngineSnapshot`s.

The engine thread builds a new snapshot after every step (and after `discard`) and swaps it in with one
assignment, so any thread reads a consistent, immutable value in O(1) without touching the scheduler,
the KV manager or the model runner. vLLM's `Scheduler.make_stats` has the same role.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine.kv_cache import KVCacheManager
    from worker.engine.scheduler import Scheduler

WASTE_INTERVAL_S = 0.5  # kv_waste walks every block table: at most twice a second


@dataclass(frozen=True)
class EngineLimits:
    """What the engine was built with, resolved (defaults filled in from the model and the memory)."""

    model: str
    max_num_seqs: int
    max_num_batched_tokens: int  # the token budget of one step
    max_model_len: int  # prompt + output
    block_size: int  # tokens per KV block
    num_kv_blocks: int
    kv_cache_bytes: int  # num_kv_blocks * bytes of one block (K and V, every layer)
    dtype: str  # "float32", "bfloat16", ...
    device: str  # "cpu", "cuda:0", ...
    max_logprobs: int
    vocab_size: int


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after its latest step. Counters count since the engine started.

    `last_step_*` and `last_progress` describe the latest step that scheduled work (the one `steps`
    counted last); a step that found nothing to run leaves them as they were.
    """

    ts: float  # time.monotonic() when built
    steps: int  # steps that ran a forward pass
    running: int  # sequences in the running set
    waiting: int  # sequences waiting for admission (new or preempted)
    unfinished: int  # requests accepted and not finished
    kv_usage: float  # 0..1: blocks in use / all blocks
    kv_waste: float  # 0..1: allocated slots holding no live token (refreshed at most twice a second)
    num_kv_blocks: int
    num_free_kv_blocks: int
    prompt_tokens: int  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int
    num_preemptions: int
    finished: Mapping[str, int]  # read-only: finished sequences by finish reason
    prefix_queries_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hits_tokens: int  # of which found there
    last_step_tokens: int
    last_step_seqs: int
    last_step_seconds: float
    last_progress: float | None  # time.monotonic() of the latest step that scheduled work


@dataclass
class EngineStats:
    """The engine thread's own counters, the source of each snapshot's."""

    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    last_step_tokens: int = 0
    last_step_seqs: int = 0
    last_step_seconds: float = 0.0
    last_progress: float | None = None


class SnapshotMaker:
    """Builds the engine's snapshots, on the engine thread (the only one that may walk the KV tables)."""

    def __init__(self, stats: EngineStats, scheduler: Scheduler, kv: KVCacheManager) -> None:
        self.stats, self.scheduler, self.kv = stats, scheduler, kv
        self._waste, self._waste_at = 0.0, float("-inf")

    def __call__(self, unfinished: int) -> EngineSnapshot:
        now = time.monotonic()
        kv, st = self.kv, self.stats
        if not kv.num_seqs():
            self._waste = 0.0
        elif now - self._waste_at >= WASTE_INTERVAL_S:
            self._waste, self._waste_at = kv.waste(), now
        return EngineSnapshot(
            ts=now,
            steps=st.steps,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            unfinished=unfinished,
            kv_usage=kv.usage,
            kv_waste=self._waste,
            num_kv_blocks=kv.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            prompt_tokens=st.prompt_tokens,
            generation_tokens=st.generation_tokens,
            num_preemptions=st.num_preemptions,
            finished=MappingProxyType(dict(st.finished)),
            prefix_queries_tokens=kv.prefix_queries_tokens,
            prefix_hits_tokens=kv.prefix_hits_tokens,
            last_step_tokens=st.last_step_tokens,
            last_step_seqs=st.last_step_seqs,
            last_step_seconds=st.last_step_seconds,
            last_progress=st.last_progress,
        )
