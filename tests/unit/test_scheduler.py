"""The scheduler alone: a real `KVCacheManager`, no model. Each test drives `schedule()` and plays the
engine's part after each step (tokens computed, full blocks named, a token sampled where the chunk
reached the end), then checks what was scheduled, in which order, with which blocks."""

from __future__ import annotations

import itertools

import pytest

from worker.engine.config import ConfigError, EngineConfig, SchedulerConfig
from worker.engine.kv_cache import KVCacheManager
from worker.engine.prefill_cost import affordable_tokens, attention_cost_context, chunk_cost
from worker.engine.request import Request, SeqStatus, Sequence
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler, SchedulerOutput

BS = 4  # tokens per block: small, so a few tokens cross block boundaries


def make_scheduler(
    *,
    num_blocks: int = 256,
    max_num_seqs: int = 16,
    budget: int = 64,
    max_model_len: int = 512,
    chunked: bool = True,
    policy: str = "fcfs",
    threshold: int = 0,
    partials: int = 1,
    longs: int | None = None,
    long_budget: int = 0,
    context: int = 1024,
    prefix_caching: bool = True,
    fair_tokens: int = 0,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix_caching, watermark=0.0)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        policy=policy,
        long_prefill_token_threshold=threshold,
        max_num_partial_prefills=partials,
        max_long_partial_prefills=longs or partials,  # as EngineConfig resolves it
        long_prefill_budget=long_budget,
        attention_cost_context=context,
        fair_share_prefill_tokens=fair_tokens,
    )
    return Scheduler(config, kv)


_arrival = iter(range(1, 1_000_000))  # also makes every request's tokens its own (no accidental prefix hits)


def add(
    sched: Scheduler,
    rid: str,
    prompt: int | list[int],
    *,
    priority: int = 0,
    n: int = 1,
    isolated: bool = False,
    tenant: str | None = None,
    weight: float = 1.0,
) -> Sequence:
    """Queue a request (arrivals strictly increase in call order); returns its first sequence."""
    arrival = next(_arrival)
    ids = prompt if isinstance(prompt, list) else [arrival * 1000 + i for i in range(prompt)]
    req = Request(
        rid,
        ids,
        SamplingParams(n=n),
        priority=priority,
        arrival_time=float(arrival),
        isolated=isolated,
        tenant=tenant,
        tenant_weight=weight,
    )
    sched.add(req.seqs[0])
    return req.seqs[0]


def complete(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does once the forward ran: count the tokens in, name full blocks, sample."""
    for s in out.scheduled:
        seq = s.seq
        samples = s.samples
        seq.num_computed_tokens += s.num_new_tokens
        sched.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if samples:
            seq.token_ids.append(token)


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    complete(sched, out, token)
    return out


def shape(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled]


# --- the token budget --------------------------------------------------------------------------


def test_one_step_never_exceeds_the_token_budget():
    sched = make_scheduler(budget=64)
    for rid in "abc":
        add(sched, rid, 30)
    out = sched.schedule()
    # a and b fit whole; c gets the 4 tokens left (a partial prefill, the one allowed)
    assert shape(out) == [("a", 30), ("b", 30), ("c", 4)]
    assert out.num_batched_tokens == 64
    assert len(sched.waiting) == 0 and len(sched.running) == 3


def test_decodes_go_first_and_prompts_get_what_the_budget_leaves():
    sched = make_scheduler(budget=16)
    add(sched, "a", 5)
    add(sched, "b", 6)
    step(sched)  # both prompts computed, one token sampled each
    add(sched, "c", 30)
    out = sched.schedule()
    assert shape(out) == [("a", 1), ("b", 1), ("c", 14)]
    assert out.num_decodes == 2
    assert [s.samples for s in out.scheduled] == [True, True, False]  # c's chunk stops short of its end


def test_decodes_are_first_in_the_batch():
    sched = make_scheduler(budget=64)
    add(sched, "a", 5)
    step(sched)
    add(sched, "b", 9)
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [1, 9] and out.num_decodes == 1


# --- chunked prefill ---------------------------------------------------------------------------


def test_long_prefill_token_threshold_caps_each_chunk():
    sched = make_scheduler(budget=64, threshold=16)
    seq = add(sched, "long", 50)
    chunks = []
    while not seq.num_output_tokens:
        chunks.append(step(sched).scheduled[0].num_new_tokens)
    assert chunks == [16, 16, 16, 2]
    assert seq.num_computed_tokens == 50 and seq.num_tokens == 51


def test_chunks_of_a_long_prompt_leave_room_for_decodes():
    sched = make_scheduler(budget=8)
    add(sched, "a", 3)
    step(sched)
    add(sched, "long", 40)
    for _ in range(3):
        out = step(sched)
        assert shape(out) == [("a", 1), ("long", 7)]


@pytest.mark.parametrize("partials", [1, 2])
def test_max_num_partial_prefills_limits_prompts_part_way_through(partials):
    sched = make_scheduler(budget=64, threshold=16, partials=partials)
    long1 = add(sched, "long1", 100)
    add(sched, "long2", 100)
    add(sched, "short", 8)
    out = step(sched)
    if partials == 1:
        # long2 waits its turn (still first in the queue); the short prompt is not a partial and passes
        assert shape(out) == [("long1", 16), ("short", 8)]
        assert sched.waiting.peek().request.request_id == "long2"
    else:
        assert shape(out) == [("long1", 16), ("long2", 16), ("short", 8)]
    if partials == 1:
        while long1.num_computed_tokens + 16 < long1.num_tokens:
            out = step(sched)
            assert "long2" not in dict(shape(out))
        out = step(sched)  # long1's last chunk is not partial: long2 may start in the same step
        assert shape(out) == [("short", 1), ("long1", 4), ("long2", 16)]


def test_without_chunked_prefill_steps_are_prefill_only_or_decode_only():
    sched = make_scheduler(chunked=False, budget=512, max_model_len=512, num_blocks=1024)
    add(sched, "a", 5)
    assert shape(step(sched)) == [("a", 5)]
    add(sched, "b", 300)
    assert shape(step(sched)) == [("b", 300)]  # a prompt waits for no decode and takes the whole step
    assert shape(step(sched)) == [("a", 1), ("b", 1)]
    add(sched, "c", 200)
    add(sched, "d", 400)  # c fits, d does not fit the budget c left: it is never chunked, it waits a step
    assert shape(step(sched)) == [("c", 200)]
    assert shape(step(sched)) == [("d", 400)]
    assert shape(step(sched)) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def test_without_chunked_prefill_the_budget_must_hold_a_whole_prompt():
    with pytest.raises(ConfigError, match="max-num-batched-tokens"):
        make_scheduler(chunked=False, budget=64, max_model_len=512)


def test_decodes_are_scheduled_before_a_higher_ranked_prompt_chunk():
    sched = make_scheduler(policy="priority", budget=8)
    add(sched, "a", 3)
    add(sched, "b", 3)
    step(sched)
    add(sched, "long", 40, priority=5)
    assert shape(step(sched)) == [("a", 1), ("b", 1), ("long", 6)]
    # long now ranks first among the running, yet the decodes still get their tokens before its chunk
    assert shape(step(sched)) == [("a", 1), ("b", 1), ("long", 6)]
    assert [s.request.request_id for s in sched.running] == ["long", "a", "b"]


def test_a_prompt_chunk_never_takes_the_blocks_of_a_scheduled_decode():
    sched = make_scheduler(num_blocks=3, prefix_caching=False, policy="priority", threshold=4)
    add(sched, "a", 4)
    step(sched)  # a: 1 block, full
    long = add(sched, "long", 8, priority=5)
    assert shape(step(sched)) == [("a", 1), ("long", 4)]  # a's 5th token and long's chunk: all 3 blocks
    out = step(sched)  # long ranks first now, but a is in the step first; long's next chunk finds no block
    assert shape(out) == [("a", 1)] and not out.preempted
    assert long.status == SeqStatus.RUNNING and long.num_computed_tokens == 4  # it waits, blocks kept


# --- long and short prompts: max_num_partial_prefills / max_long_partial_prefills ----------------------


def test_short_prompts_pass_a_long_one_waiting_for_its_slot():
    sched = make_scheduler(budget=40, threshold=16, partials=2, longs=1)
    add(sched, "long1", 100)
    add(sched, "long2", 100)
    add(sched, "s1", 12)
    add(sched, "s2", 14)
    # long2 waits for the one long slot though a partial slot is free; s1 fits whole (no slot), and s2,
    # cut by the token budget, takes the second partial slot
    assert shape(step(sched)) == [("long1", 16), ("s1", 12), ("s2", 12)]
    assert sched.waiting.peek().request.request_id == "long2" and len(sched.waiting) == 1
    assert shape(step(sched)) == [("s1", 1), ("long1", 16), ("s2", 2)]
    assert len(sched.waiting) == 1  # long1 is still part-way: long2 keeps waiting


def test_with_one_partial_slot_a_cut_short_prompt_waits_for_it():
    sched = make_scheduler(budget=40, threshold=16, partials=1)
    add(sched, "long1", 100)
    add(sched, "s1", 12)
    add(sched, "s2", 14)
    assert shape(step(sched)) == [("long1", 16), ("s1", 12)]  # s2 would be cut: no slot for it
    assert sched.waiting.peek().request.request_id == "s2"


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_prompt_is_long_by_the_tokens_it_has_left_to_compute(prefix_caching):
    sched = make_scheduler(budget=64, threshold=16, partials=1, prefix_caching=prefix_caching)
    a = add(sched, "a", 40)
    while not a.num_output_tokens:
        step(sched)
    sched.finish(a, SeqStatus.FINISHED_STOPPED)
    add(sched, "holder", 100)  # a long prompt holds the only slot
    b = add(sched, "b", [*a.token_ids[:36], 901, 902, 903, 904])
    out = step(sched)
    if prefix_caching:  # 36 tokens hit: 4 left, a short prompt computed whole beside the long one
        assert shape(out) == [("holder", 16), ("b", 4)] and not sched.is_long(b)
    else:  # all 40 to compute: long, and the long slot is taken
        assert shape(out) == [("holder", 16)] and sched.waiting.peek() is b


def test_long_prompts_start_in_arrival_order_as_the_long_slot_frees():
    sched = make_scheduler(budget=64, threshold=16, partials=2, longs=1)
    for rid in ("long1", "long2", "long3"):
        add(sched, rid, 40)
    started = []
    for _ in range(12):
        for s in step(sched).scheduled:
            rid = s.seq.request.request_id
            if rid not in started:
                started.append(rid)
            assert sum(sched.is_long(r) for r in sched.running) <= 1
    assert started == ["long1", "long2", "long3"]


def test_max_long_partial_prefills_cannot_exceed_max_num_partial_prefills():
    with pytest.raises(ConfigError, match="max-long-partial-prefills"):
        make_scheduler(partials=1, longs=2)
    with pytest.raises(ConfigError, match="max-long-partial-prefills"):
        EngineConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ConfigError, match="long-prefill-budget"):
        EngineConfig(long_prefill_budget=-1)


# --- the attention-cost budget of long chunks ---------------------------------------------------------


def test_chunk_cost_counts_each_token_attention_over_its_context():
    assert chunk_cost(0, 1, 64) == 1  # the first token attends to nothing before it
    assert chunk_cost(128, 1, 64) == 3  # 1 + 128/64
    assert chunk_cost(10, 4, 2) == 4 + (10 + 11 + 12 + 13) / 2
    for position in (0, 1, 7, 100, 3000):
        for budget in (0.5, 1, 2.5, 16, 100):
            n = affordable_tokens(position, budget, 64)
            assert chunk_cost(position, n, 64) <= budget < chunk_cost(position, n + 1, 64)


def test_attention_cost_context_of_a_smollm2_shaped_model():
    from types import SimpleNamespace

    smollm2 = SimpleNamespace(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, head_dim=64
    )
    # per layer 3,538,944 matmul weights over 2 x 9 x 64: 3,072 by FLOPs, a third of it as measured
    assert attention_cost_context(smollm2) == 1024


def test_while_decoding_long_chunks_shrink_as_their_context_grows():
    sched = make_scheduler(budget=512, threshold=64, long_budget=16, context=64)
    add(sched, "a", 3)
    step(sched)
    long = add(sched, "long", 300)
    chunks: list[tuple[int, int]] = []
    while not long.num_output_tokens:
        position = long.num_computed_tokens
        out = step(sched)
        assert ("a", 1) in shape(out)  # the decode is in every step
        chunks.append((position, dict(shape(out))["long"]))
    sizes = [n for _, n in chunks]
    assert sizes[0] == 14  # cost(14 tokens at 0) = 14 + 91/64 <= 16 < cost(15)
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < 5
    for position, n in chunks[:-1]:  # each the most the budget affords (the last one is what was left)
        assert chunk_cost(position, n, 64) <= 16 < chunk_cost(position, n + 1, 64)
    assert sum(sizes) == 300


def test_without_decodes_a_long_prompt_gets_full_chunks():
    sched = make_scheduler(budget=512, threshold=64, long_budget=16, context=64)
    long = add(sched, "long", 300)
    sizes = []
    while not long.num_output_tokens:
        sizes.append(step(sched).scheduled[0].num_new_tokens)
    assert sizes == [64, 64, 64, 64, 44]


def test_long_chunks_of_one_step_share_the_budget():
    sched = make_scheduler(budget=512, threshold=16, partials=2, long_budget=40, context=64)
    add(sched, "a", 3)
    step(sched)
    long1 = add(sched, "long1", 200)
    long2 = add(sched, "long2", 200)
    for _ in range(6):
        positions = {s.seq_id: s.num_computed_tokens for s in (long1, long2)}
        out = step(sched)
        longs = [s for s in out.scheduled if s.seq in (long1, long2)]
        costs = [chunk_cost(positions[s.seq.seq_id], s.num_new_tokens, 64) for s in longs]
        assert len(costs) == 2 and sum(costs) <= 40
    assert long1.num_computed_tokens > long2.num_computed_tokens > 0  # the first in line gets served first


def test_short_prompts_are_not_sized_by_the_cost_budget():
    sched = make_scheduler(budget=512, threshold=64, long_budget=4, context=64)
    add(sched, "a", 3)
    step(sched)
    add(sched, "short", 60)  # costs 60 + 27.7 tokens, over the budget of 4, but it is not long
    assert shape(step(sched)) == [("a", 1), ("short", 60)]


def test_the_first_long_chunk_of_a_step_always_moves():
    sched = make_scheduler(budget=512, threshold=16, long_budget=2, context=1)  # past position 1 a token costs > 2
    add(sched, "a", 3)
    step(sched)
    long = add(sched, "long", 30)
    for k in range(30):
        assert shape(step(sched)) == [("a", 1), ("long", 1)]
        assert long.num_computed_tokens == k + 1
    assert long.num_output_tokens == 1


def test_a_stream_of_short_prompts_never_starves_a_long_one():
    sched = make_scheduler(budget=32, threshold=8, partials=2, longs=1, long_budget=8, context=16)
    add(sched, "a", 3)
    step(sched)
    long = add(sched, "long", 200)
    for k in range(400):
        if long.num_output_tokens:
            break
        before = long.num_computed_tokens
        short = add(sched, f"s{k}", 6)
        step(sched)
        assert short.num_computed_tokens == 6  # each short prompt starts the step it arrives
        assert long.num_computed_tokens > before  # and the long one moves on every step
        for seq in list(sched.running):
            if seq is not long and seq.request.request_id != "a" and seq.num_output_tokens >= 3:
                sched.finish(seq, SeqStatus.FINISHED_LENGTH)
    assert long.num_output_tokens == 1


# --- order ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "order"), [("fcfs", ["low", "mid", "high"]), ("priority", ["high", "mid", "low"])])
def test_policy_orders_the_waiting_queue(policy, order):
    sched = make_scheduler(policy=policy, max_num_seqs=1)
    seqs = {rid: add(sched, rid, 5, priority=p) for rid, p in [("low", -5), ("mid", 0), ("high", 7)]}
    started = []
    while len(started) < 3:
        out = step(sched)
        for s in out.scheduled:
            if s.seq.num_output_tokens == 1:  # its prompt just completed
                started.append(s.seq.request.request_id)
                sched.finish(s.seq, SeqStatus.FINISHED_LENGTH)
    assert started == order
    assert all(s.finished for s in seqs.values())


def test_priority_ties_go_by_arrival():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    for rid in ("first", "second"):
        add(sched, rid, 5, priority=3)
    assert shape(sched.schedule()) == [("first", 5)]


# --- admission limits ---------------------------------------------------------------------------


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        add(sched, f"r{i}", 5)
    assert shape(step(sched)) == [("r0", 5), ("r1", 5)]
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    assert shape(step(sched)) == [("r0", 1), ("r1", 1)]
    sched.finish(sched.running[0], SeqStatus.FINISHED_STOPPED)
    assert shape(sched.schedule()) == [("r1", 1), ("r2", 5)]


def test_a_request_with_n_samples_needs_n_seats():
    sched = make_scheduler(max_num_seqs=4)
    add(sched, "one", 5)
    step(sched)
    add(sched, "three", 5, n=3)  # 1 + 3 = 4 seats: fits
    add(sched, "next", 5)  # a fifth would not
    assert shape(sched.schedule()) == [("one", 1), ("three", 5)]
    assert sched.waiting.peek().request.request_id == "next"


def test_an_isolated_request_runs_in_steps_of_its_own():
    sched = make_scheduler()
    add(sched, "a", 5)
    step(sched)
    suspect = add(sched, "suspect", 5, isolated=True)
    add(sched, "b", 5)
    assert shape(step(sched)) == [("suspect", 5)]  # a step of its own: a sits it out, b waits behind it
    assert shape(step(sched)) == [("suspect", 1)]  # still suspect: alone again
    suspect.request.isolated = False  # (the engine clears it once it has sampled a token alone)
    assert shape(step(sched)) == [("a", 1), ("suspect", 1), ("b", 5)]


# --- preemption ---------------------------------------------------------------------------------


def test_preemption_by_recompute_when_blocks_run_out():
    sched = make_scheduler(num_blocks=4, prefix_caching=False)
    a = add(sched, "a", 7)
    b = add(sched, "b", 7)
    step(sched)  # 2 blocks each: the pool is full
    step(sched)  # the 8th token of each still fits its second block
    assert sched.kv.num_free_blocks == 0
    out = step(sched)  # a's 9th token needs a third block: b (the latest) gives its blocks back
    assert shape(out) == [("a", 1)]
    assert out.preempted == [b]
    assert b.status == SeqStatus.WAITING and b.num_computed_tokens == 0
    assert not sched.kv.has_seq(b.seq_id) and b.request.metrics.num_preemptions == 1
    assert sched.waiting.peek() is b
    sched.finish(a, SeqStatus.FINISHED_LENGTH)
    out = sched.schedule()
    assert shape(out) == [("b", 9)]  # prompt and generated tokens computed again, all at once
    assert not out.preempted


def test_preemption_takes_the_lowest_priority_first():
    sched = make_scheduler(num_blocks=4, prefix_caching=False, policy="priority")
    low = add(sched, "low", 7, priority=-1)  # arrives first, but matters least
    add(sched, "high", 7, priority=1)
    step(sched)
    step(sched)
    out = step(sched)
    assert out.preempted == [low] and shape(out) == [("high", 1)]


def test_a_sequence_that_cannot_grow_preempts_itself_last():
    sched = make_scheduler(num_blocks=2, prefix_caching=False)
    a = add(sched, "a", 8)  # exactly two blocks
    step(sched)
    out = sched.schedule()  # its 9th token has no block anywhere: it is preempted, nothing runs
    assert out.is_empty and out.preempted == [a]
    assert sched.kv.num_free_blocks == 2


# --- the prefix cache ------------------------------------------------------------------------------


def test_a_cached_prefix_is_not_computed_again():
    sched = make_scheduler()
    a = add(sched, "a", 18)
    step(sched)
    a_table = list(sched.kv.block_table(a.seq_id))
    sched.finish(a, SeqStatus.FINISHED_STOPPED)
    b = add(sched, "b", [*a.token_ids[:16], 901, 902])
    out = sched.schedule()
    assert shape(out) == [("b", 2)]  # 4 full blocks (16 tokens) hit
    assert b.num_computed_tokens == 16 and b.request.metrics.num_cached_tokens == 16
    assert out.scheduled[0].block_table[:4] == a_table[:4]
    assert sched.kv.prefix_queries_tokens == 18 + 18 and sched.kv.prefix_hits_tokens == 16


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = make_scheduler()
    a = add(sched, "a", 16)
    step(sched)
    sched.finish(a, SeqStatus.FINISHED_STOPPED)
    add(sched, "b", a.token_ids[:16])
    # the last block holds the token whose logits are sampled: it cannot be a hit
    assert shape(sched.schedule()) == [("b", 4)]


def test_no_hits_with_prefix_caching_off():
    sched = make_scheduler(prefix_caching=False)
    a = add(sched, "a", 18)
    step(sched)
    sched.finish(a, SeqStatus.FINISHED_STOPPED)
    add(sched, "b", a.token_ids[:18])
    assert shape(sched.schedule()) == [("b", 18)]
    assert sched.kv.prefix_hits_tokens == 0


# --- what the model runner gets ------------------------------------------------------------------


def test_the_output_carries_each_sequence_block_table():
    sched = make_scheduler(budget=64, threshold=8)
    add(sched, "a", 5)
    add(sched, "b", 13)
    tables: dict[str, list[list[int]]] = {"a": [], "b": []}
    for _ in range(4):
        out = sched.schedule()
        for s in out.scheduled:
            assert s.block_table is sched.kv.block_table(s.seq.seq_id)  # the manager's list, valid for the step
            table = list(s.block_table)  # kept across steps: a copy
            assert len(table) == -(-(s.seq.num_computed_tokens + s.num_new_tokens) // BS)
            tables[s.seq.request.request_id].append(table)
        complete(sched, out)
    for seen in tables.values():  # a table only grows at its end
        assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(seen))
    assert [len(t) for t in tables["b"]] == [2, 4, 4, 4]  # a chunk of 8, then the rest and two decodes
    assert not set(tables["a"][-1]) & set(tables["b"][-1])


def test_a_shared_partial_block_is_copied_before_a_write():
    sched = make_scheduler(prefix_caching=False)
    parent = add(sched, "p", 6, n=2)
    step(sched)  # prefill: 6 tokens, block 2 half full
    child = Sequence("p#1", parent.request, [*parent.token_ids[:-1], 8], index=1)  # as the engine forks
    child.num_computed_tokens = parent.num_computed_tokens
    parent.request.forked = True
    parent.request.seqs.append(child)
    sched.kv.fork(parent.seq_id, child.seq_id)
    sched.add_running(child)
    out = sched.schedule()
    assert shape(out) == [("p", 1), ("p", 1)]
    (src, dst), *more = out.block_copies
    assert not more  # the first writer copies; the other then owns the original alone
    tables = [s.block_table for s in out.scheduled]
    assert tables[0][0] == tables[1][0]  # the full block stays shared
    assert {tables[0][1], tables[1][1]} == {src, dst}


# --- fair share between tenants ------------------------------------------------------------------


def test_tenants_over_their_weighted_share_of_recent_work():
    from worker.engine.tenant_share import TenantShare

    now = [0.0]
    share = TenantShare(half_life_s=10.0, memory_s=2.0, clock=lambda: now[0])
    sched = make_scheduler()
    noisy = [add(sched, f"n{i}", 4, tenant="noisy") for i in range(4)]
    calm = add(sched, "c", 4, tenant="calm")
    for seq in [*noisy, calm]:
        share.join(seq)
    assert share.over_share() == frozenset()  # no work yet
    share.charge([(s, 100) for s in noisy] + [(calm, 100)])
    assert share.over_share() == {"noisy"}
    now[0] = 1.5
    share.leave(calm)
    assert share.over_share() == {"noisy"}  # calm, between two requests, is still there
    bunch = [add(sched, f"c{i}", 4, tenant="calm") for i in range(6)]
    for seq in bunch:
        share.join(seq)
    # calm now holds more sequences than noisy, but has had less of the work
    assert share.over_share() == {"noisy"}
    share.charge([(s, 100) for s in bunch])
    assert share.over_share() == {"calm"}  # 700 tokens against 400
    for seq in noisy:
        share.leave(seq)
    now[0] = 4.0
    assert share.over_share() == frozenset()  # noisy gone for longer than the memory: calm alone
    anon = add(sched, "anon", 4)
    share.join(anon)
    share.charge([(anon, 10_000)])
    assert share.over_share() == frozenset()  # no tenant: not counted


def test_weights_scale_the_share():
    from worker.engine.tenant_share import TenantShare

    share = TenantShare(clock=lambda: 0.0)
    sched = make_scheduler()
    heavy = add(sched, "h", 4, tenant="heavy", weight=4.0)
    light = add(sched, "l", 4, tenant="light")
    share.join(heavy)
    share.join(light)
    share.charge([(heavy, 400), (light, 100)])
    assert share.over_share() == frozenset()  # 4:1 work for 4:1 weights
    share.charge([(heavy, 10)])
    assert share.over_share() == {"heavy"}


def test_service_decays_with_its_half_life():
    from worker.engine.tenant_share import TenantShare

    now = [0.0]
    share = TenantShare(half_life_s=10.0, memory_s=100.0, clock=lambda: now[0])
    sched = make_scheduler()
    a, b = add(sched, "a", 4, tenant="a"), add(sched, "b", 4, tenant="b")
    share.join(a)
    share.join(b)
    share.charge([(a, 1000)])
    now[0] = 10.0
    share.charge([(b, 600)])  # a's 1000 are worth 500 now
    assert share.over_share() == {"b"}


def _noisy_decoding(sched: Scheduler, count: int = 3, prompt: int = 16) -> None:
    """Noisy's sequences decode from now on: it has had more of the work than anyone."""
    for i in range(count):
        add(sched, f"n{i}", prompt, tenant="noisy")
    step(sched)  # their prompts computed: they decode from now on


def test_another_tenants_prompt_goes_first_and_alone_among_prompts():
    sched = make_scheduler(budget=64, fair_tokens=8)
    _noisy_decoding(sched)
    add(sched, "n-new", 20, tenant="noisy")  # queued first
    add(sched, "calm", 20, tenant="calm")
    out = step(sched)
    # noisy's decodes still run; its new prompt waits while calm's is in the step
    assert shape(out) == [("n0", 1), ("n1", 1), ("n2", 1), ("calm", 20)]
    assert sched.waiting.peek().request.request_id == "n-new"
    out = step(sched)  # calm decodes now: noisy's prompt moves on, capped
    assert shape(out) == [("n0", 1), ("n1", 1), ("n2", 1), ("calm", 1), ("n-new", 8)]


def test_over_share_prompt_chunks_are_capped_between_them():
    sched = make_scheduler(budget=64, fair_tokens=8, partials=2)
    _noisy_decoding(sched)
    add(sched, "calm", 3, tenant="calm")
    step(sched)
    add(sched, "n-a", 20, tenant="noisy")
    add(sched, "n-b", 20, tenant="noisy")
    chunks = [dict(shape(step(sched))) for _ in range(3)]
    assert [(c.get("n-a", 0), c.get("n-b", 0)) for c in chunks] == [(8, 0), (8, 0), (4, 4)]
    assert all(c["calm"] == 1 and c["n0"] == 1 for c in chunks)  # decodes never wait


def test_an_over_share_prompt_takes_no_prefill_slot_from_another_tenant():
    sched = make_scheduler(budget=64, threshold=16, fair_tokens=8)
    _noisy_decoding(sched)
    add(sched, "calm", 2, tenant="calm")
    step(sched)
    add(sched, "n-long", 100, tenant="noisy")
    assert dict(shape(step(sched)))["n-long"] == 8  # part-way through, beside calm's decode
    add(sched, "calm-long", 100, tenant="calm")  # long too: it needs the one partial-prefill slot
    out = step(sched)
    assert dict(shape(out))["calm-long"] == 16 and "n-long" not in dict(shape(out))


def test_an_over_share_prompt_moves_on_while_the_other_tenants_prompt_waits_for_blocks():
    sched = make_scheduler(num_blocks=16, budget=64, fair_tokens=8, prefix_caching=False)
    _noisy_decoding(sched, prompt=4)
    add(sched, "calm", 2, tenant="calm")
    step(sched)
    add(sched, "n-new", 16, tenant="noisy")
    assert dict(shape(step(sched)))["n-new"] == 8
    free = sched.kv.num_free_blocks
    assert free < 64 // BS
    add(sched, "calm-big", 100, tenant="calm")  # its first chunk needs more blocks than are free
    out = step(sched)
    assert dict(shape(out)).get("n-new") == 8 and "calm-big" not in dict(shape(out))
    assert sched.waiting.peek().request.request_id == "calm-big"


def test_without_fair_share_tenants_change_nothing():
    sched = make_scheduler(budget=64, fair_tokens=0)
    _noisy_decoding(sched)
    add(sched, "n-new", 20, tenant="noisy")
    add(sched, "calm", 20, tenant="calm")
    assert shape(step(sched)) == [("n0", 1), ("n1", 1), ("n2", 1), ("n-new", 20), ("calm", 20)]
