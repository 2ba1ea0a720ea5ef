"""Greedy outputs of the engine equal transformers' `generate`, token for token (fp32), under every
scheduling configuration; and the engine leaks nothing afterwards."""

from __future__ import annotations

import pytest

from tests.engine.oracle import hf_greedy, mixed_prompts
from worker import LLMEngine, SamplingParams

MAX_NEW = [8 + (i * 7) % 25 for i in range(24)]  # 8..32 tokens, varied so requests finish at different steps

CONFIGS = {
    "defaults": {},
    "chunked-16": {"max_num_batched_tokens": 16, "enable_chunked_prefill": True},
    "no-chunking": {"enable_chunked_prefill": False},
    "tiny-pool": {"num_kv_blocks": 40, "block_size": 16, "watermark": 0.0},  # 640 slots for ~24 x 190
    "prefix-cache": {"enable_prefix_caching": True},
    "block-1": {"block_size": 1},
    "block-32": {"block_size": 32},
    "one-seq": {"max_num_seqs": 1},
}


@pytest.fixture(scope="module")
def oracle(tiny_model_dirs):
    """family -> (prompts, HF greedy outputs); prompt set + shared-prefix variants."""
    from transformers import AutoTokenizer

    cases = {}
    for fam, path in tiny_model_dirs.items():
        tok = AutoTokenizer.from_pretrained(path)
        prompts = mixed_prompts(tok, 24, seed=len(fam))
        shared = prompts[18][:80]  # a long common prefix, then distinct tails
        prefixed = [shared + p[:20] for p in prompts[:6]]
        cases[fam] = (prompts, hf_greedy(path, prompts, MAX_NEW), prefixed, hf_greedy(path, prefixed, 12))
    return cases


def assert_clean(engine: LLMEngine) -> None:
    """Nothing leaked: every block free, no request or sequence left anywhere (and the snapshot says so)."""
    assert not engine.has_unfinished_requests()
    snap = engine.snapshot()
    assert (snap.unfinished, snap.running, snap.waiting) == (0, 0, 0)
    assert snap.num_free_kv_blocks == snap.num_kv_blocks and snap.kv_usage == 0.0
    assert engine.requests == {}
    assert engine.scheduler.running == [] and len(engine.scheduler.waiting) == 0
    assert engine.kv.num_seqs() == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(b.ref_count == 0 for b in engine.kv.blocks)


def run(engine: LLMEngine, prompts, max_new, *, stagger: bool = True) -> list[list[int]]:
    """Half the requests arrive first; the rest join while those are generating."""
    results: dict[str, list[int]] = {}
    ids = [f"r{i}" for i in range(len(prompts))]
    first = len(prompts) // 2 if stagger else len(prompts)

    def add(i: int) -> None:
        n = max_new[i] if isinstance(max_new, list) else max_new
        engine.add_request(ids[i], prompt_token_ids=prompts[i], params=SamplingParams(temperature=0, max_tokens=n))

    for i in range(first):
        add(i)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 3:
            for i in range(first, len(prompts)):
                add(i)
    return [results[i] for i in ids]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_transformers(tiny_model_dirs, oracle, config):
    for fam, path in tiny_model_dirs.items():
        prompts, want, prefixed, want_prefixed = oracle[fam]
        engine = LLMEngine(model=str(path), dtype="float32", device="cpu", **CONFIGS[config])
        got = run(engine, prompts, MAX_NEW)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"{fam}/{config}: prompt {i} ({len(prompts[i])} tokens) diverged"
        if config == "tiny-pool":
            assert engine.snapshot().num_preemptions > 0, "the pool was meant to be too small"
        if config == "prefix-cache":
            hits_before = engine.snapshot().prefix_hits_tokens
            got = run(engine, prefixed, 12, stagger=False)
            assert got == want_prefixed
            assert engine.snapshot().prefix_hits_tokens - hits_before >= 5 * 80 // 16 * 16
        assert_clean(engine)
