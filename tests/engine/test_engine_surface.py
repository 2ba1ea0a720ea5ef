"""The engine's surface for other threads: `limits` (fixed) and `snapshot()` (rebuilt after each step)."""

from __future__ import annotations

import dataclasses
import itertools
import threading

import pytest

from tests.engine.test_engine_behaviour import drain
from tests.engine.test_engine_equality import assert_clean
from worker import LLMEngine, SamplingParams
from worker.engine.engine import RequestError

BLOCKS = 64


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=BLOCKS, max_num_seqs=8)


def test_limits_are_the_resolved_configuration(engine, llama_dir):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(llama_dir)
    lim = engine.limits
    head_dim = hf.hidden_size // hf.num_attention_heads
    block_bytes = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4 * 16  # K and V, fp32
    assert lim.model == str(llama_dir)
    assert (lim.max_num_seqs, lim.block_size, lim.num_kv_blocks) == (8, 16, BLOCKS)
    assert lim.max_num_batched_tokens == 2048  # chunked prefill's default budget
    assert lim.max_model_len == engine.max_model_len == hf.max_position_embeddings
    assert lim.kv_cache_bytes == BLOCKS * block_bytes
    assert (lim.dtype, lim.device) == ("float32", "cpu")
    assert lim.max_logprobs == 20 and lim.vocab_size == hf.vocab_size
    with pytest.raises(dataclasses.FrozenInstanceError):
        lim.max_num_seqs = 1  # type: ignore[misc]


def test_an_idle_engine_has_an_empty_snapshot(llama_dir):
    eng = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=BLOCKS)
    snap = eng.snapshot()
    assert (snap.steps, snap.running, snap.waiting, snap.unfinished) == (0, 0, 0, 0)
    assert (snap.num_kv_blocks, snap.num_free_kv_blocks, snap.kv_usage, snap.kv_waste) == (BLOCKS, BLOCKS, 0.0, 0.0)
    assert snap.last_progress is None and dict(snap.finished) == {}
    assert eng.snapshot() is snap  # nothing ran: the same value, no work to read it


def test_snapshot_follows_each_step(engine):
    before = engine.snapshot()
    prompt = list(range(3, 3 + 17))  # two blocks of 16: the second holds one token
    engine.add_request("s", prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=3))
    assert engine.snapshot() is before  # commands reach the snapshot with the next step
    engine.step()
    snap = engine.snapshot()
    assert snap is not before and snap.ts >= before.ts
    assert snap.steps == before.steps + 1
    assert (snap.running, snap.waiting, snap.unfinished) == (1, 0, 1)
    assert snap.prompt_tokens - before.prompt_tokens == 17
    assert snap.generation_tokens - before.generation_tokens == 1
    assert (snap.last_step_tokens, snap.last_step_seqs) == (17, 1) and snap.last_step_seconds > 0
    assert snap.last_progress is not None and before.ts <= snap.last_progress <= snap.ts
    assert snap.num_free_kv_blocks == BLOCKS - 2 and snap.kv_usage == pytest.approx(2 / BLOCKS)
    assert snap.kv_waste == pytest.approx(1 - 17 / 32)  # 17 slots written of the 32 allocated
    assert snap.prefix_queries_tokens - before.prefix_queries_tokens == 17
    drain(engine)
    done = engine.snapshot()
    assert (done.running, done.waiting, done.unfinished, done.num_free_kv_blocks) == (0, 0, 0, BLOCKS)
    assert (done.kv_usage, done.kv_waste) == (0.0, 0.0)
    assert done.finished["length"] - before.finished.get("length", 0) == 1
    assert done.generation_tokens - before.generation_tokens == 3
    assert snap.steps == before.steps + 1 and snap.running == 1  # an old snapshot never changes
    with pytest.raises(TypeError):
        done.finished["stop"] = 1  # type: ignore[index]
    assert_clean(engine)


def test_waiting_and_preemptions_show_in_the_snapshot(llama_dir):
    eng = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=4, watermark=0.0, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):  # 3 x (10 + 40) tokens do not fit 4 blocks of 16 at once
        eng.add_request(f"p{i}", prompt_token_ids=[5 + i] * 10, params=params)
    seen_waiting = False
    while eng.has_unfinished_requests():
        eng.step()
        seen_waiting |= eng.snapshot().waiting > 0
    snap = eng.snapshot()
    assert seen_waiting and snap.num_preemptions > 0
    assert snap.num_preemptions == eng.stats.num_preemptions
    assert sum(snap.finished.values()) == 3
    assert_clean(eng)


def test_discard_updates_the_snapshot(engine):
    engine.add_request("x", prompt="discard me", params=SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.snapshot().unfinished == 1
    engine.discard(["x"])
    snap = engine.snapshot()
    assert (snap.unfinished, snap.running, snap.num_free_kv_blocks) == (0, 0, BLOCKS)
    assert_clean(engine)


def test_another_thread_reads_snapshots_while_the_engine_steps(engine):
    """Readers never see a half-built or going-backwards value (each one is replaced whole)."""
    for i in range(4):
        engine.add_request(f"t{i}", prompt=f"thread {i}", params=SamplingParams(temperature=0, max_tokens=12))
    seen = []
    stop, reading = threading.Event(), threading.Event()

    def read() -> None:
        # A read every millisecond: a reader spinning on the GIL made each of the engine's torch ops wait
        # for a switch interval (the test took 36 s). The first read comes before the engine steps
        # (`reading`): a tiny model can drain before a reader's first millisecond is up.
        while True:
            seen.append(engine.snapshot())
            reading.set()
            if stop.wait(0.001):
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert reading.wait(30)
        drain(engine)
    finally:
        stop.set()
        reader.join()
    seen.append(engine.snapshot())
    assert seen[-1].steps > seen[0].steps  # the first read came before the steps, the last after them
    for a, b in itertools.pairwise(seen):
        assert b.ts >= a.ts and b.steps >= a.steps and b.generation_tokens >= a.generation_tokens
    assert engine.snapshot().unfinished == 0
    assert_clean(engine)


def test_add_generation_prompt_reaches_the_chat_template(engine):
    chat = [{"role": "user", "content": "Hi"}]
    tok = engine.tokenizer
    for flag in (True, False):
        rendered = tok.apply_chat_template(chat, add_generation_prompt=flag, tokenize=False)
        want = tok(rendered, add_special_tokens=False).input_ids
        assert engine.encode_prompt(messages=chat, add_generation_prompt=flag) == want
        engine.add_request(
            f"chat-{flag}", messages=chat, add_generation_prompt=flag, params=SamplingParams(max_tokens=1)
        )
        assert drain(engine)[f"chat-{flag}"].prompt_token_ids == want
    with_prompt = engine.encode_prompt(messages=chat)
    assert len(with_prompt) > len(engine.encode_prompt(messages=chat, add_generation_prompt=False))
    assert_clean(engine)


def test_logprobs_above_the_engine_limit_are_refused(engine):
    with pytest.raises(RequestError, match="max_logprobs"):
        engine.add_request("lp", prompt="x", params=SamplingParams(logprobs=engine.limits.max_logprobs + 1))
    with pytest.raises(RequestError, match="no prompt"):
        engine.add_request("none")
    assert engine.snapshot().unfinished == 0
