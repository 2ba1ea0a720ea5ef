"""A batch beside interactive traffic in the engine (`low_priority_max_seqs`): negative-priority
sequences fill an idle engine, shrink to the cap while a priority >= 0 sequence is in (the running ones
over it preempted by recompute), grow back once it has gone for `contention_hold_s`, and every output
is still the greedy one (preemption by recompute changes no token)."""

from __future__ import annotations

import random

from tests.engine.test_engine_behaviour import drain
from worker import LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
CAP, SEATS = 3, 16


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(5, 400) for _ in range(rng.randint(4, 12))] for _ in range(n)]


def _running(eng: LLMEngine, low: bool) -> int:
    return sum((s.request.priority < 0) == low for s in eng.scheduler.running)


def test_the_batch_shrinks_to_the_cap_while_others_run_and_outputs_stay_greedy(llama_dir):
    prompts = _prompts(12)
    reference = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", max_num_seqs=SEATS)
    for i, p in enumerate(prompts):
        reference.add_request(f"b{i}", p, GREEDY, priority=-1)
    expected = {rid: out.outputs[0].token_ids for rid, out in drain(reference).items()}

    eng = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", max_num_seqs=SEATS, low_priority_max_seqs=CAP)
    for i, p in enumerate(prompts):
        eng.add_request(f"b{i}", p, GREEDY, priority=-1)
    finals: dict = {}

    def step() -> None:
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out

    step()
    step()
    assert _running(eng, low=True) == 12  # an idle engine: the batch takes every seat it needs
    eng.add_request("chat", prompts[0], SamplingParams(temperature=0, max_tokens=4), priority=0)
    step()
    assert _running(eng, low=True) == CAP and _running(eng, low=False) == 1  # shed at once
    assert eng.stats.num_preemptions == 12 - CAP
    while "chat" not in finals:
        step()
        assert _running(eng, low=True) <= CAP
    eng.scheduler._contended_until = 0.0  # the hold's end, without waiting contention_hold_s
    step()
    assert _running(eng, low=True) > CAP  # the chat has gone: the batch takes the seats back
    finals.update(drain(eng))
    assert {rid: finals[rid].outputs[0].token_ids for rid in expected} == expected


def test_no_cap_without_others_and_zero_turns_it_off(llama_dir):
    for cap, with_chat in ((CAP, False), (0, True)):
        eng = LLMEngine(
            model=str(llama_dir), dtype="float32", device="cpu", max_num_seqs=SEATS, low_priority_max_seqs=cap
        )
        for i, p in enumerate(_prompts(8)):
            eng.add_request(f"b{i}", p, GREEDY, priority=-1)
        if with_chat:
            eng.add_request("chat", [7, 8, 9], GREEDY, priority=0)
        eng.step()
        eng.step()
        assert _running(eng, low=True) == 8 and eng.stats.num_preemptions == 0


def test_a_step_carries_at_most_the_batch_token_budget_and_outputs_stay_greedy(llama_dir):
    """`low_priority_max_batched_tokens`: however much batch work there is, a step carries at most that
    many negative-priority tokens (chunks and decodes), so an arriving request never waits behind a long
    step of batch work; a priority >= 0 request is not bounded by it."""
    budget = 8
    prompts = _prompts(10)
    reference = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", max_num_seqs=SEATS)
    for i, p in enumerate(prompts):
        reference.add_request(f"b{i}", p, GREEDY, priority=-1)
    expected = {rid: out.outputs[0].token_ids for rid, out in drain(reference).items()}

    eng = LLMEngine(
        model=str(llama_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=SEATS,
        low_priority_max_seqs=0,
        low_priority_max_batched_tokens=budget,
    )
    for i, p in enumerate(prompts):
        eng.add_request(f"b{i}", p, GREEDY, priority=-1)
    finals: dict = {}
    chat = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    chat_done = None
    for k in range(400):
        if k == 6:
            eng.add_request("chat", chat, SamplingParams(temperature=0, max_tokens=3), priority=0)
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
        snap = eng.snapshot()
        if k == 6:
            assert snap.last_step_tokens >= len(chat)  # the whole chat prompt, beside the batch's budget
        if k < 6 or (chat_done is not None and k > chat_done):  # steps of batch work alone
            assert snap.last_step_tokens <= budget, (k, snap.last_step_tokens)
        if chat_done is None and "chat" in finals:
            chat_done = k
        if not eng.has_unfinished_requests():
            break
    assert _running(eng, low=True) == 0 and "chat" in finals
    assert {rid: finals[rid].outputs[0].token_ids for rid in expected} == expected
