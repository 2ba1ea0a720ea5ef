"""CUDA graphs for decode-only steps and the step's host-device traffic, on a real GPU (issue 19).

Graphs on and off give transformers' greedy tokens in fp32 and the same logits within a tolerance in
bf16; after the engine is constructed, serving compiles no kernel; a decode step after the first
allocates no device memory; every step waits for the device once (the sampled ids), nowhere else.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from worker import LLMEngine, SamplingParams
from worker.engine import transfer

pytestmark = pytest.mark.gpu

PROMPT_LENS = (3, 9, 17, 33, 40, 70, 130)
MAX_NEW = (4, 12, 6, 9, 12, 3, 8)  # requests finish at different steps: the batch shrinks through buckets


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lens]


def _engine(model_dir, dtype: str, eager: bool, **kw) -> LLMEngine:
    options = dict(max_num_seqs=16, max_num_batched_tokens=64, kv_cache_memory=64 << 20, max_model_len=1024)
    return LLMEngine(model=str(model_dir), dtype=dtype, device="cuda", enforce_eager=eager, **{**options, **kw})


def _run(engine: LLMEngine, prompts, params) -> list[list[list[int]]]:
    ids = [engine.add_request(None, prompt_token_ids=p, params=q) for p, q in zip(prompts, params, strict=True)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(o.token_ids) for o in out.outputs]
    return [done[i] for i in ids]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _decode_only(sched) -> bool:
    return sched.num_batched_tokens == len(sched.scheduled)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_graphs_on_and_off_give_transformers_greedy_tokens_in_fp32(tiny_model_dirs, family):
    from transformers import AutoModelForCausalLM

    from ops.bench.gpu_check_common import hf_greedy

    model_dir = tiny_model_dirs[family]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    forked = [[17], [301]]  # one-token prompts: their first step is decode-only, and forks them (n=2)
    want_forked = [hf_greedy(hf, p, 5, "cuda") for p in forked]
    prompts = _prompts(500)
    want = [hf_greedy(hf, p, n, "cuda") for p, n in zip(prompts, MAX_NEW, strict=True)]
    for eager in (True, False):
        engine = _engine(model_dir, "float32", eager)
        assert engine.runner.cuda_graphs is (not eager)
        pair = SamplingParams(temperature=0.0, max_tokens=5, n=2, ignore_eos=True)
        assert _run(engine, forked, [pair, pair]) == [[w, w] for w in want_forked], f"eager={eager}"
        got = _run(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_NEW])
        assert [g[0] for g in got] == want, f"eager={eager}"
        if not eager:
            assert engine.runner.decode_graphs.replays >= 4 + 4


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_graph_replay_logits_match_eager_logits(tiny_model_dirs, monkeypatch, dtype, tolerance):
    """Each decode-only step is run eagerly and by its graph, on the same inputs, before the engine's own
    execution of it: the logits agree (bf16: within a tolerance; kernel choices differ with the padded
    batch size), also when the bucket is larger than the batch."""
    engine = _engine(tiny_model_dirs["llama"], dtype, eager=False)
    runner = engine.runner
    execute = runner.execute
    compared = []

    def spy(sched, rows):
        if rows and _decode_only(sched):
            graph = runner.logits(sched, rows).float()
            eager = runner.logits(sched, rows, eager=True).float()
            bucket = runner.decode_graphs.bucket(len(sched.scheduled))
            compared.append((len(sched.scheduled), bucket, _rel(graph, eager)))
            if dtype == "float32":
                assert torch.equal(graph.argmax(-1), eager.argmax(-1))
        return execute(sched, rows)

    monkeypatch.setattr(runner, "execute", spy)
    _run(engine, _prompts(500), [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_NEW])
    assert len(compared) >= 4
    assert any(n < bucket for n, bucket, _ in compared), "no step ran a padded bucket"
    worst = max(err for _, _, err in compared)
    assert worst < tolerance, compared


@pytest.mark.parametrize("eager", [False, True])
def test_serving_compiles_nothing_allocates_nothing_and_waits_once_per_step(tiny_model_dirs, monkeypatch, eager):
    from ops.bench.gpu_check_correctness import compiled_counts

    engine = _engine(tiny_model_dirs["llama"], "bfloat16", eager, max_num_batched_tokens=256)
    runner = engine.runner
    compiled = compiled_counts()  # right after construction: everything serving needs is built
    waits = []
    real_wait = transfer.wait
    monkeypatch.setattr(transfer, "wait", lambda event: waits.append(1) or real_wait(event))
    execute = runner.execute
    steps = []

    def spy(sched, rows):
        before = len(waits)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = execute(sched, rows)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)
        stats = torch.cuda.memory_stats()
        steps.append(
            dict(
                decode_only=_decode_only(sched),
                rows=len(rows),
                waits=len(waits) - before,
                syncs=syncs,
                segments=stats.get("segment.all.allocated", 0),
                reserved=torch.cuda.memory_reserved(),
            )
        )
        return out

    monkeypatch.setattr(runner, "execute", spy)
    prompts = _prompts(500, lens=(1, 5, 17, 40, 64, 100, 150, 260), seed=3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, seed=1),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, max_tokens=8, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=4, max_tokens=10, stop_token_ids=[3, 600]),
        SamplingParams(temperature=0.9, n=2, max_tokens=7, ignore_eos=True, seed=5),
        SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.5, max_tokens=14, ignore_eos=True),
    ]
    _run(engine, prompts, params)
    assert steps and all(s["waits"] == (1 if s["rows"] else 0) for s in steps), steps
    assert all(s["syncs"] <= s["waits"] for s in steps), steps  # nothing but the one wait synchronises
    if any(compiled.values()):  # this Triton exposes its caches: serving must not have compiled anything
        assert compiled_counts() == compiled
    decodes = [s for s in steps if s["decode_only"]]
    assert len(decodes) >= 4
    if not eager:
        assert runner.decode_graphs.replays >= len(decodes)
        first = decodes[1]  # from the second decode step on, every buffer is cached: no new device memory
        assert all((s["segments"], s["reserved"]) == (first["segments"], first["reserved"]) for s in decodes[1:])


def test_uploads_are_pinned_aligned_and_correct_and_results_come_back_in_one_copy():
    import numpy as np

    up = transfer.Uploader(torch.device("cuda"))
    assert up.copy and up.pinned
    rng = np.random.default_rng(0)
    for step in range(3):
        arrays = [
            rng.integers(0, 100, size=5 + step, dtype=np.int64),
            rng.integers(0, 100, size=(3, 4 + step), dtype=np.int32),
            rng.integers(0, 100, size=3, dtype=np.int64),
        ]
        got = up.upload(*arrays)
        for a, t in zip(arrays, got, strict=True):
            assert t.is_cuda and t.data_ptr() % 64 == 0 and np.array_equal(t.cpu().numpy(), a)
    assert all(h.is_pinned() for h in up._host.values())
    ids = torch.tensor([3, 1, 4], device="cuda")
    top_ids = torch.randint(0, 100, (3, 5), device="cuda")
    lp, top_lp = torch.randn(3, device="cuda"), torch.randn(3, 5, device="cuda")
    out = transfer.to_host([ids, top_ids, lp, None, top_lp])
    assert out[3] is None
    for got, want in zip([out[0], out[1], out[2], out[4]], [ids, top_ids, lp, top_lp], strict=True):
        assert got.device.type == "cpu" and got.dtype == want.dtype and torch.equal(got, want.cpu())
