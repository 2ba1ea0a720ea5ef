"""The persistent `InputBatch` equals a from-scratch `build_step_batch` after every step of random schedules.

A real `Scheduler` and `KVCacheManager` (small pool, 4-token blocks, prefix caching on) run random
operations between steps: new requests (some sharing a prompt prefix, so they adopt cached blocks),
forks of running sequences (shared blocks, then copy-on-write when either writes its last block),
finishes, aborts of waiting sequences, and a pool small enough that decodes preempt others. Each step
plays the engine's part (tokens computed, full blocks named, a token sampled), as in test_scheduler.py.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, given, settings

from worker.engine.config import SchedulerConfig
from worker.engine.input_batch import InputBatch
from worker.engine.kv_cache import KVCacheManager
from worker.engine.request import Request, SeqStatus, Sequence
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.step_inputs import StepBatch, build_step_batch

BS = 4
MAX_SEQS = 6
FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables")


def _scheduler(num_blocks: int, budget: int) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=budget,
        max_model_len=96,
        enable_chunked_prefill=True,
        policy="fcfs",
        long_prefill_token_threshold=8,
        max_num_partial_prefills=2,
        max_long_partial_prefills=2,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BS, enable_prefix_caching=True, watermark=0.0))


def assert_same(a: StepBatch, b: StepBatch) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert np.array_equal(x, y), f"{name}:\n{x}\n!=\n{y}"
    assert a.query_lens == b.query_lens and a.num_decodes == b.num_decodes
    assert (a.logits_rows is None) == (b.logits_rows is None)
    if a.logits_rows is not None:
        assert np.array_equal(a.logits_rows, b.logits_rows)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "add_shared", "fork", "finish", "abort", "none", "none"]),
        st.integers(0, 10_000),
    ),
    min_size=5,
    max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(ops=OPS, num_blocks=st.integers(7, 16), budget=st.sampled_from([6, 16, 64]))
def test_persistent_batch_equals_a_rebuild_after_every_step(ops, num_blocks, budget):
    sched = _scheduler(num_blocks, budget)
    batch = InputBatch(MAX_SEQS, 96 // BS, BS)
    shared_prefix = [900 + i for i in range(9)]
    steps_checked = 0
    for k, (op, x) in enumerate(ops):
        running = [s for s in sched.running if s.num_computed_tokens == s.num_tokens - 1]
        if op.startswith("add") and len(sched.running) + len(sched.waiting) < MAX_SEQS:
            prompt = [k * 100 + i for i in range(1 + x % 13)]
            if op == "add_shared":
                prompt = shared_prefix + prompt
            req = Request(f"r{k}", prompt, SamplingParams(max_tokens=50), arrival_time=float(k))
            sched.add(req.seqs[0])
        elif op == "fork" and running and len(sched.running) + len(sched.waiting) < MAX_SEQS:
            parent = running[x % len(running)]
            child = Sequence(f"{parent.seq_id}/f{k}", parent.request, list(parent.token_ids), index=k)
            child.num_computed_tokens = parent.num_computed_tokens
            sched.kv.fork(parent.seq_id, child.seq_id)
            sched.add_running(child)
        elif op == "finish" and sched.running:
            sched.finish(sched.running[x % len(sched.running)], SeqStatus.FINISHED_STOPPED)
        elif op == "abort" and len(sched.waiting):
            sched.finish(sched.waiting.peek(), SeqStatus.FINISHED_ABORTED)
        out = sched.schedule()
        if out.is_empty:
            continue
        sample_from = [i for i, s in enumerate(out.scheduled) if s.samples]
        assert_same(
            batch.prepare(out.scheduled, out.num_decodes, sample_from),
            build_step_batch(out.scheduled, out.num_decodes, sample_from, BS),
        )
        steps_checked += 1
        for s in out.scheduled:  # the engine's part
            seq = s.seq
            samples = s.samples
            seq.num_computed_tokens += s.num_new_tokens
            sched.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if samples:
                seq.token_ids.append(7000 + k)
                if seq.num_tokens >= 90:
                    sched.finish(seq, SeqStatus.FINISHED_LENGTH)
    assert len(batch.row_of) <= MAX_SEQS


def test_a_steady_decode_rewrites_only_the_new_blocks():
    """Four sequences decoding 40 steps: each row is written once, then only one entry per new block."""
    sched = _scheduler(num_blocks=200, budget=64)
    batch = InputBatch(MAX_SEQS, 96 // BS, BS)
    for k in range(4):
        sched.add(Request(f"r{k}", [k * 100 + i for i in range(6)], SamplingParams(), arrival_time=k).seqs[0])
    new_blocks = 0
    prev: dict[str, int] = {}
    for _ in range(40):
        out = sched.schedule()
        before = {s.seq.seq_id: len(s.block_table) for s in out.scheduled}
        sample_from = [i for i, s in enumerate(out.scheduled) if s.samples]
        assert_same(
            batch.prepare(out.scheduled, out.num_decodes, sample_from),
            build_step_batch(out.scheduled, out.num_decodes, sample_from, BS),
        )
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            s.seq.token_ids.append(5)
        new_blocks += sum(n - prev[i] for i, n in before.items() if i in prev)
        prev = before
    assert batch.rows_written == 4
    assert batch.entries_written == 4 * 2 + new_blocks  # 2 blocks for 6 prompt tokens + 1, then the growth
