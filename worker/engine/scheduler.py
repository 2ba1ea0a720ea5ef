"""Iteration-level scheduler: which sequences run in the next forward, and how many tokens each.

Called once per engine step. One token budget (`max_num_batched_tokens`) and at most
`max_num_seqs` running sequences. With chunked prefill, running sequences go first (a decode costs
one token, a partially computed prompt gets its next chunk), then new sequences in policy order, so
decodes never wait behind a long prompt. Without it, a step is either prefill-only (whole prompts)
or decode-only, the classic alternative. When the KV pool runs dry, the lowest-priority, latest
sequence is preempted by recompute: its blocks are freed (their prefix-cache names survive) and it
rejoins the front of the waiting queue.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from worker.engine.config import SchedulerConfig
from worker.engine.kv_cache import KVCacheManager
from worker.engine.request import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    """`num_new_tokens` of `seq` go through this step's forward, from `seq.num_computed_tokens` on;
    `block_table` is the sequence's KV block table for the step (vLLM: `NewRequestData.block_ids`)."""

    seq: Sequence
    num_new_tokens: int
    block_table: list[int]

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so the step samples its next one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first
    num_decodes: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitQueue:
    """Waiting sequences: FIFO for `fcfs`, a heap on (priority, arrival) for `priority`.

    `push_front` (preempted sequences) puts a sequence first among its equals: ahead of everything
    under fcfs, ahead of later arrivals of its priority under `priority`.
    """

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Sequence] = deque()
        self._heap: list[tuple[tuple, int, Sequence]] = []
        self._tie = itertools.count()

    def _key(self, seq: Sequence) -> tuple:
        return (*seq.request.sort_key(self.policy), seq.index)

    def push(self, seq: Sequence) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (self._key(seq), next(self._tie), seq))
        else:
            self._fifo.append(seq)

    def push_front(self, seq: Sequence) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (self._key(seq), -next(self._tie), seq))
        else:
            self._fifo.appendleft(seq)

    def peek(self) -> Sequence:
        return self._heap[0][2] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[2] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, seq: Sequence) -> bool:
        if self.policy == "priority":
            for i, item in enumerate(self._heap):
                if item[2] is seq:
                    self._heap[i] = self._heap[-1]
                    self._heap.pop()
                    heapq.heapify(self._heap)
                    return True
            return False
        try:
            self._fifo.remove(seq)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitQueue(config.policy)
        self.running: list[Sequence] = []

    # --- membership --------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.push(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins the running set directly (its blocks are shared with its parent)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, status: SeqStatus) -> None:
        """Take a sequence out wherever it is and return its blocks to the pool."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif not seq.status.finished:
            self.waiting.remove(seq)
        seq.status = status
        self.kv.free(seq.seq_id)

    # --- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # Victims of preemption are taken from the end: lowest priority, latest arrival.
        self.running.sort(key=lambda s: (*s.request.sort_key(self.config.policy), s.index))
        # An isolated (suspect) request shares its steps with nobody.
        isolated = any(s.request.isolated for s in self.running)
        if self.config.enable_chunked_prefill:
            budget = self._schedule_running(out, self.config.max_num_batched_tokens)
            if not out.preempted and not isolated:
                self._schedule_waiting(out, budget)
        else:
            # Prefill-only step when a new prompt can be admitted, decode-only step otherwise.
            if not isolated:
                self._schedule_waiting(out, self.config.max_num_batched_tokens)
            if out.is_empty:
                self._schedule_running(out, self.config.max_num_batched_tokens)
        # One-token queries first: the attention kernels' decode fast path takes a prefix of the batch.
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        out.num_decodes = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
        out.block_copies = self.kv.take_copies()
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap and self.config.enable_chunked_prefill else n

    def _partial(self, seq: Sequence, n: int) -> bool:
        """This chunk leaves the sequence's prompt unfinished: it is a partial (chunked) prefill."""
        return seq.num_computed_tokens + n < seq.num_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        partials = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if self._partial(seq, n):
                # Long prompts take turns: each one's chunk attends to its whole context, so several
                # at once would multiply the stall every running decode sees.
                if partials >= self.config.max_num_partial_prefills:
                    i += 1
                    continue
                partials += 1
            while not self.kv.allocate(seq.seq_id, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self._schedule(out, seq, n)
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        cfg = self.config
        deferred: list[Sequence] = []  # long prompts waiting for their turn; shorter ones may pass
        partials = sum(self._partial(s.seq, s.num_new_tokens) for s in out.scheduled)
        # A request with n samples holds n seats from admission on, though it forks only once its prompt is in.
        seats_taken = len(self.running) + sum(
            s.request.sampling_params.n - 1 for s in self.running if not s.request.forked
        )
        while len(self.waiting) and budget > 0:
            seq = self.waiting.peek()
            if seq.request.isolated and (self.running or out.scheduled):
                break
            seats = seq.request.sampling_params.n if not seq.request.forked else 1
            if seats_taken + seats > cfg.max_num_seqs:
                break
            salt = seq.request.cache_salt
            hits = self.kv.match_prefix(seq.token_ids, salt)
            num_cached = len(hits) * self.kv.block_size
            remaining = seq.num_tokens - num_cached
            if not cfg.enable_chunked_prefill and remaining > budget:
                break
            seq.num_computed_tokens = num_cached
            n = self._chunk(seq, budget)
            partial = self._partial(seq, n)  # never without chunked prefill: the whole rest fits
            if partial and partials >= cfg.max_num_partial_prefills:
                seq.num_computed_tokens = 0
                deferred.append(self.waiting.pop())
                continue
            if not self.kv.allocate(seq.seq_id, num_cached + n, hits, keep_watermark=True):
                seq.num_computed_tokens = 0
                break
            self.waiting.pop()
            metrics = seq.request.metrics
            if metrics.first_scheduled is None:
                metrics.first_scheduled = time.time()
                metrics.num_cached_tokens = num_cached
            self.kv.record_prefix_query(seq.num_tokens, num_cached)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._schedule(out, seq, n)
            seats_taken += seats
            budget -= n
            partials += partial
            if seq.request.isolated:
                break
        for seq in reversed(deferred):  # back at the front, in their order
            self.waiting.push_front(seq)

    def _schedule(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.scheduled.append(ScheduledSeq(seq, n, list(self.kv.block_table(seq.seq_id))))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.request.metrics.num_preemptions += 1
        self.waiting.push_front(seq)
        out.preempted.append(seq)
