"""Iteration-level scheduler: which sequences run in the next forward, and how many tokens each.

Called once per engine step. One token budget (`max_num_batched_tokens`) and at most `max_num_seqs`
running sequences. With chunked prefill a step is built in three passes: running decodes (one token
each, so a decode never waits behind a prompt), then the next chunks of prompts part-way through, then
new sequences in policy order. Without it, a step is either prefill-only (whole prompts) or
decode-only, the classic alternative. When the KV pool runs dry, the lowest-priority, latest sequence
is preempted by recompute: its blocks are freed (their prefix-cache names survive) and it rejoins the
front of the waiting queue.

Batches beside interactive traffic (`low_priority_max_seqs`): while a sequence of priority >= 0 is in
the engine (or left less than `contention_hold_s` ago), sequences of negative priority (the low lane,
where batch lines go) run at most `low_priority_max_seqs` at once: the others wait, and running ones
over the cap are preempted (latest first; their prefix-cache names survive). Every step carries all
running decodes, so a batch filling the engine would slow every interactive token; with the cap it
takes what interactive traffic leaves, and all of an idle engine.

A step also carries at most `low_priority_max_batched_tokens` tokens of negative-priority sequences
(their decodes and prompt chunks together), contended or not. A step cannot be interrupted, so an
interactive request that arrives during a step of batch work waits for all of it: this bounds that
wait (a 2,048-token chunk of a batch's prompts took 1.3 s on a 2-core CPU). The decodes over the bound
wait for a later step (those first in running order go first), and no batch sequence is admitted while
the bound is spent, so the batch's running set settles near the bound.

Prompt chunks, with chunked prefill (vLLM's option names):
- A prompt with more than `long_prefill_token_threshold` tokens to compute when it is admitted is
  long. No chunk is longer than the threshold.
- After a step at most `max_num_partial_prefills` prompts are part-way through, at most
  `max_long_partial_prefills` of them long. A prompt computed whole in one step takes no slot, so short
  prompts never queue behind chunked long ones; a prompt waiting for a slot keeps its place at the
  head of the queue while the ones behind it that fit pass.
- In a step that carries decodes, the chunks of long prompts cost at most `long_prefill_budget`
  tokens, a prompt token at position p costing 1 + p / `attention_cost_context` (its linear layers
  plus its attention over the p keys before it). A chunk shrinks as its context grows, so the stall it
  adds to every decode stays about the same from a long prompt's first chunk to its last. The first
  long chunk of a step always gets at least one token: a long prompt is never starved.

Fair share between tenants (`fair_share_prefill_tokens`), while sequences of more than one tenant are
in the engine (or were, a moment ago), a tenant that has had more than its weighted share of the
tokens computed lately (decaying, tenant_share.py) is over its share. Prompts of tenants within
their share are scheduled first; over-share tenants' prompt chunks come after them and take at most
`fair_share_prefill_tokens` tokens a step between them, none in a step that carries a prompt of a
tenant within its share. Their decodes are never held back. So a tenant that floods the engine cannot
make another tenant's first token wait behind its prompts, and its own prompts still move on in every
step that has no such prompt.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from worker.engine.config import SchedulerConfig
from worker.engine.kv_cache import KVCacheManager
from worker.engine.prefill_cost import affordable_tokens, chunk_cost
from worker.engine.request import SeqStatus, Sequence
from worker.engine.tenant_share import TenantShare
from worker.engine.wait_queue import WaitQueue


@dataclass
class ScheduledSeq:
    """`num_new_tokens` of `seq` go through this step's forward, from `seq.num_computed_tokens` on;
    `block_table` is the sequence's KV block table (vLLM: `NewRequestData.block_ids`): the KV manager's own
    list, not a copy, so it is only valid until the next step is scheduled."""

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


@dataclass
class _Step:
    """What is left of one step's budgets while the step is built."""

    tokens: int
    long_cost: float = math.inf  # cost left for long-prompt chunks (finite once decodes are in the step)
    long_chunks: int = 0
    scheduled: set[str] = field(default_factory=set)  # seq ids in the step
    over_share: frozenset[str] = frozenset()  # tenants whose prompt chunks are capped this step
    over_share_tokens: int = 0  # prompt tokens left for them
    fair_prompt: bool = False  # a prompt of a tenant within its share is in the step
    low_seats: float = math.inf  # seats sequences of negative priority may still take (the cap, when contended)
    low_tokens: float = math.inf  # tokens sequences of negative priority may still take in this step


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitQueue(config.policy)
        self.tenants = TenantShare()
        self.running: list[Sequence] = []
        self._long: set[str] = set()  # running sequences admitted as long prompts, prompt not yet computed
        self._unsorted = False  # a sequence joined `running` since it was last put in policy order
        self._contended_until = 0.0  # monotonic time until which the low-priority cap holds

    # --- membership --------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.push(seq)
        self.tenants.join(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins the running set directly (its blocks are shared with its parent)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._unsorted = True
        self.tenants.join(seq)

    def finish(self, seq: Sequence, status: SeqStatus) -> None:
        """Take a sequence out wherever it is and return its blocks to the pool."""
        if not seq.status.finished:
            self.tenants.leave(seq)
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif not seq.status.finished:
            self.waiting.remove(seq)
        seq.status = status
        self._long.discard(seq.seq_id)
        self.kv.free(seq.seq_id)

    def is_long(self, seq: Sequence) -> bool:
        """`seq` was admitted as a long prompt and is still being prefilled."""
        return seq.seq_id in self._long and _left(seq) > 1

    # --- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        # Victims of preemption are taken from the end: lowest priority, latest arrival. Only sequences
        # joining break the order (removals keep it), so a steady decode step sorts nothing.
        if self._unsorted:
            self.running.sort(key=lambda s: (*s.request.sort_key(cfg.policy), s.index))
            self._unsorted = False
        if self._long:
            self._long &= {s.seq_id for s in self.running if _left(s) > 1}
        step = _Step(cfg.max_num_batched_tokens, low_tokens=cfg.low_priority_max_batched_tokens or math.inf)
        shed = self._shed_low_priority(step)
        if self._schedule_suspect(out, step):
            out.preempted += shed
            return self._finish(out)
        if cfg.fair_share_prefill_tokens and cfg.enable_chunked_prefill:
            step.over_share = self.tenants.over_share()
            step.over_share_tokens = cfg.fair_share_prefill_tokens
        # A suspect (isolated: after a failed step) shares its steps with nobody; one waiting for blocks
        # keeps the others from being admitted meanwhile.
        isolated = any(s.request.isolated for s in self.running)
        if cfg.enable_chunked_prefill:
            self._schedule_running(out, step, decodes=True)
            if out.scheduled and cfg.long_prefill_budget:
                step.long_cost = cfg.long_prefill_budget  # decodes are in: long chunks must not stall them
            # Prompts of tenants within their share first, new ones included; then the others'.
            self._schedule_running(out, step, decodes=False, over_share=False)
            admit = not out.preempted and not isolated
            if not step.over_share:
                if admit:
                    self._schedule_waiting(out, step)
            else:
                admit = admit and self._schedule_waiting(out, step, over_share=False)
                if not out.preempted:
                    self._schedule_running(out, step, decodes=False, over_share=True)
                if admit and not out.preempted:
                    self._schedule_waiting(out, step, over_share=True)
        else:
            # Prefill-only step when a new prompt can be admitted, decode-only step otherwise.
            if not isolated:
                self._schedule_waiting(out, step)
            if out.is_empty:
                self._schedule_running(out, step, decodes=True)
        out.preempted += shed  # after admission: shedding the batch must not hold back the others
        return self._finish(out)

    def _shed_low_priority(self, step: _Step) -> list[Sequence]:
        """Under contention, the seats left to negative-priority sequences (in `step`), after preempting
        the running ones over the cap; returns those preempted."""
        cap = self.config.low_priority_max_seqs
        if not cap:
            return []
        now = time.monotonic()
        if any(s.request.priority >= 0 for s in self.running) or any(s.request.priority >= 0 for s in self.waiting):
            self._contended_until = now + self.config.contention_hold_s
        if now >= self._contended_until:
            return []
        low = [s for s in self.running if s.request.priority < 0]
        shed = low[cap:]  # running is in policy order: the latest last
        for seq in reversed(shed):
            self._back_to_waiting(seq)
        step.low_seats = cap - (len(low) - len(shed))
        return shed

    def _finish(self, out: SchedulerOutput) -> SchedulerOutput:
        # One-token queries first (a stable partition): the attention kernels' decode fast path takes a
        # prefix of the batch.
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        if len(decodes) < len(out.scheduled):
            out.scheduled = decodes + [s for s in out.scheduled if s.num_new_tokens != 1]
        out.num_decodes = len(decodes)
        out.block_copies = self.kv.take_copies()
        if self.config.fair_share_prefill_tokens:
            self.tenants.charge((s.seq, s.num_new_tokens) for s in out.scheduled)
        return out

    def _schedule_suspect(self, out: SchedulerOutput, step: _Step) -> bool:
        """A step of a suspect's own, until it has sampled a token alone (the engine then clears it): the
        one admitted already, else the next one waiting, while the others sit this step out. False when
        there is none, or it cannot run now (no blocks yet): the others' step goes on."""
        suspect = next((s for s in self.running if s.request.isolated), None)
        if suspect is not None:
            self._schedule_running(out, step, decodes=_left(suspect) == 1, only=suspect)
        elif len(self.waiting) and self.waiting.peek().request.isolated:
            self._schedule_waiting(out, step)  # admits the suspect alone
        return bool(out.scheduled)

    def _chunk(self, seq: Sequence, left: int, step: _Step, long: bool) -> int:
        """Tokens of `seq`'s prompt (`left` still to compute) that go into this step."""
        cfg = self.config
        n = min(left, step.tokens)
        if not cfg.enable_chunked_prefill:
            return n
        if cfg.long_prefill_token_threshold:
            n = min(n, cfg.long_prefill_token_threshold)
        if long and step.long_cost < math.inf:
            fit = affordable_tokens(seq.num_computed_tokens, step.long_cost, cfg.attention_cost_context)
            n = min(n, fit if fit or step.long_chunks else 1)  # the first long chunk always moves on
        if seq.request.tenant in step.over_share:
            n = 0 if step.fair_prompt else min(n, step.over_share_tokens)
        if seq.request.priority < 0:
            n = min(n, step.low_tokens)
        return int(n)

    def _schedule_running(
        self,
        out: SchedulerOutput,
        step: _Step,
        *,
        decodes: bool,
        only: Sequence | None = None,
        over_share: bool | None = None,
    ) -> None:
        """Decodes (`decodes`), or the next chunks of prompts part-way through, in running order (`only`:
        of that sequence alone; `over_share`: of tenants over their share, or within it)."""
        if decodes and only is None and over_share is None:
            self._schedule_decodes(out, step)
            return
        if len(step.scheduled) == len(self.running):
            return  # every running sequence is in the step already (a decode-only step)
        i = 0
        while i < len(self.running) and step.tokens > 0:
            seq = self.running[i]
            left = _left(seq)
            if (
                (left == 1) != decodes
                or seq.seq_id in step.scheduled
                or (only is not None and seq is not only)
                or (over_share is not None and (seq.request.tenant in step.over_share) != over_share)
            ):
                i += 1
                continue
            n = (1 if seq.request.priority >= 0 or step.low_tokens >= 1 else 0) if decodes else None
            if n is None:
                n = self._chunk(seq, left, step, self.is_long(seq))
            if n == 0:
                i += 1
                continue
            if self._grow(seq, n, i, step, out, decode=decodes):
                self._schedule(out, step, seq, n)
                i += 1
            elif seq.status == SeqStatus.RUNNING:  # not preempted: its chunk waits for blocks
                i += 1

    def _schedule_decodes(self, out: SchedulerOutput, step: _Step) -> None:
        """Every running decode, in running order: the steady state's pass, kept lean (one token each, no
        chunk rules apply); blocks come from `_grow` only when a decode needs a new or private block."""
        running, scheduled, kv = self.running, step.scheduled, self.kv
        i = 0
        while i < len(running) and step.tokens > 0:
            seq = running[i]
            seq_id = seq.seq_id
            if len(seq.token_ids) - seq.num_computed_tokens != 1 or seq_id in scheduled:
                i += 1
                continue
            if step.low_tokens < 1 and seq.request.priority < 0:  # the batch's tokens for this step are spent
                i += 1
                continue
            if kv.fits(seq_id, seq.num_computed_tokens + 1) or self._grow(seq, 1, i, step, out, decode=True):
                out.scheduled.append(ScheduledSeq(seq, 1, kv.block_table(seq_id)))
                step.tokens -= 1
                if seq.request.priority < 0:
                    step.low_tokens -= 1
                scheduled.add(seq_id)
                i += 1
            elif seq.status == SeqStatus.RUNNING:
                i += 1

    def _grow(self, seq: Sequence, n: int, i: int, step: _Step, out: SchedulerOutput, *, decode: bool) -> bool:
        """Blocks for `n` more tokens of `seq` (`self.running[i]`), preempting the lowest-ranked sequences
        not yet in this step. When only `seq` is left: a decode is preempted itself, a prompt chunk waits
        for a later step if the step already holds others (it never takes a scheduled decode's blocks)."""
        while not self.kv.allocate(seq.seq_id, seq.num_computed_tokens + n):
            victim = next(s for s in reversed(self.running[i:]) if s.seq_id not in step.scheduled)
            if victim is seq and not decode and step.scheduled:
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _prefill_slots(self, out: SchedulerOutput, step: _Step) -> tuple[int, int]:
        """Running prompts part-way through after this step's chunks, and how many of them are long
        (over-share tenants' prompts take no slot: their chunks have a cap of their own)."""
        new = {s.seq.seq_id: s.num_new_tokens for s in out.scheduled}
        partial = [
            s
            for s in self.running
            if _left(s) > new.get(s.seq_id, 0) and _left(s) > 1 and s.request.tenant not in step.over_share
        ]
        return len(partial), sum(self.is_long(s) for s in partial)

    def _schedule_waiting(self, out: SchedulerOutput, step: _Step, over_share: bool | None = None) -> bool:
        """Admit waiting sequences in policy order (`over_share`: only those of tenants over their share,
        or within it; the others keep their place). False when admission stopped for want of seats or
        blocks, or behind a suspect: then nobody behind may pass."""
        cfg = self.config
        if not len(self.waiting):
            return True
        # Prompts waiting for a prefill slot, or not in this pass: the ones behind them may pass.
        deferred: list[Sequence] = []
        partials, longs = self._prefill_slots(out, step)
        open_ = True
        # A request with n samples holds n seats from admission on, though it forks only once its prompt is in.
        seats_taken = len(self.running) + sum(
            s.request.sampling_params.n - 1 for s in self.running if not s.request.forked
        )
        threshold = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else 0
        while len(self.waiting) and step.tokens > 0:
            seq = self.waiting.peek()
            if over_share is not None and (seq.request.tenant in step.over_share) != over_share:
                deferred.append(self.waiting.pop())
                continue
            if seq.request.isolated and out.scheduled:
                open_ = False
                break
            seats = seq.request.sampling_params.n if not seq.request.forked else 1
            low = seq.request.priority < 0
            if low and seats > step.low_seats:  # the batch's cap, while others are here: they pass
                deferred.append(self.waiting.pop())
                continue
            if seats_taken + seats > cfg.max_num_seqs:
                open_ = False
                break
            salt = seq.request.cache_salt
            hits = self.kv.match_prefix(seq.token_ids, salt)
            num_cached = len(hits) * self.kv.block_size
            left = seq.num_tokens - num_cached
            if not cfg.enable_chunked_prefill and left > step.tokens:
                break
            long = 0 < threshold < left
            seq.num_computed_tokens = num_cached
            n = self._chunk(seq, left, step, long)
            partial = n < left  # never without chunked prefill: the whole rest fits
            if (
                not n
                or (long and longs >= cfg.max_long_partial_prefills)
                or (partial and partials >= cfg.max_num_partial_prefills)
            ):
                seq.num_computed_tokens = 0
                deferred.append(self.waiting.pop())
                continue
            if not self.kv.allocate(seq.seq_id, num_cached + n, hits, keep_watermark=True):
                seq.num_computed_tokens = 0
                open_ = False
                break
            self.waiting.pop()
            metrics = seq.request.metrics
            if metrics.first_scheduled is None:
                metrics.first_scheduled = time.time()
                metrics.num_cached_tokens = num_cached
            self.kv.record_prefix_query(seq.num_tokens, num_cached)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._unsorted = True
            if long:
                self._long.add(seq.seq_id)
            self._schedule(out, step, seq, n)
            seats_taken += seats
            if low:
                step.low_seats -= seats
            partials += partial
            longs += long
            if seq.request.isolated:
                open_ = False
                break
        for seq in reversed(deferred):  # back at the front, in their order
            self.waiting.push_front(seq)
        return open_

    def _schedule(self, out: SchedulerOutput, step: _Step, seq: Sequence, n: int) -> None:
        out.scheduled.append(ScheduledSeq(seq, n, self.kv.block_table(seq.seq_id)))
        step.tokens -= n
        if seq.request.priority < 0:
            step.low_tokens -= n
        step.scheduled.add(seq.seq_id)
        if n > 1 or _left(seq) > 1:  # a prompt chunk
            if seq.request.tenant in step.over_share:
                step.over_share_tokens -= n
            elif step.over_share:
                step.fair_prompt = True
        if self.is_long(seq):
            step.long_cost -= chunk_cost(seq.num_computed_tokens, n, self.config.attention_cost_context)
            step.long_chunks += 1

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._back_to_waiting(seq)
        out.preempted.append(seq)

    def _back_to_waiting(self, seq: Sequence) -> None:
        """Preemption by recompute: the blocks go back to the pool, the sequence to the queue's front."""
        self.running.remove(seq)
        self._long.discard(seq.seq_id)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.request.metrics.num_preemptions += 1
        self.waiting.push_front(seq)


def _left(seq: Sequence) -> int:
    """Tokens of `seq` not in the KV cache yet: 1 for a decode, more for a prompt part-way through."""
    return seq.num_tokens - seq.num_computed_tokens
