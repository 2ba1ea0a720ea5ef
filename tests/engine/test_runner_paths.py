"""The model runner's paths on CPU: the decode-graph path (static buffers, buckets, padded rows, the
fixed split-K grid) run eagerly under the Triton interpreter, the staging of uploads, and "ready
means ready": after `LLMEngine(...)` returns, serving builds nothing (issue 18)."""

from __future__ import annotations

import pytest
import torch

import pagedq_kernels
import pagedq_kernels.cpu as kernels_cpu
from tests.engine.oracle import hf_greedy
from worker import LLMEngine, SamplingParams
from worker.engine.transfer import Uploader


def _run(engine: LLMEngine, prompts, params) -> dict[str, list[list[int]]]:
    ids = [engine.add_request(None, prompt_token_ids=p, params=q) for p, q in zip(prompts, params, strict=True)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(o.token_ids) for o in out.outputs]
    return [done[i] for i in ids]


class StepSpy:
    """Wraps `runner.execute`: per step, whether it was decode-only, its block copies, its row count."""

    def __init__(self, runner) -> None:
        self.runner, self.steps, self._execute = runner, [], runner.execute
        runner.execute = self

    def __call__(self, sched, rows):
        before = self.runner.decode_graphs.replays if self.runner.decode_graphs else 0
        out = self._execute(sched, rows)
        after = self.runner.decode_graphs.replays if self.runner.decode_graphs else 0
        self.steps.append(
            dict(
                decode_only=sched.num_batched_tokens == len(sched.scheduled),
                seqs=len(sched.scheduled),
                rows=len(rows),
                copies=len(sched.block_copies),
                replayed=after - before,
            )
        )
        return out


def test_decode_graph_path_gives_transformers_greedy_tokens(llama_dir):
    """Decode-only steps through the static buffers of the graph buckets (1, 2, 4, 6), run eagerly:
    padded rows, a shrinking batch, forked samples sharing logits, copy-on-write block copies."""
    forked = [[17], [301]]  # one-token prompts: their first step is a decode-only step that forks them
    varied = [[5 + i for i in range(n)] for n in (3, 9, 17, 33, 40)]
    max_new = [2, 4, 6, 9, 12]
    want_forked = hf_greedy(llama_dir, forked, 5)
    want_varied = hf_greedy(llama_dir, varied, max_new)
    with pagedq_kernels.use_backend("triton"):
        engine = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", max_num_seqs=6, block_size=4)
        runner = engine.runner
        runner.uploader = Uploader(runner.device, copy=True)  # the staging a GPU uses, in host memory
        runner.capture_decode_graphs(capture=False)
        assert runner.decode_graphs.sizes == [1, 2, 4, 6] and not runner.cuda_graphs
        spy = StepSpy(runner)
        greedy_pair = SamplingParams(temperature=0.0, n=2, max_tokens=5)
        got_forked = _run(engine, forked, [greedy_pair] * 2)
        got_varied = _run(engine, varied, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_new])
    assert got_forked == [[w, w] for w in want_forked]
    assert got_varied == [[w] for w in want_varied]
    decodes = [s for s in spy.steps if s["decode_only"]]
    assert all(s["replayed"] == 1 for s in decodes) and not any(
        s["replayed"] for s in spy.steps if not s["decode_only"]
    )
    assert any(s["rows"] > s["seqs"] for s in decodes), "no decode-only step forked samples"
    assert any(s["copies"] for s in decodes), "no decode-only step copied blocks"
    assert {s["seqs"] for s in decodes} >= {5, 4, 3, 2, 1}  # padded into buckets 6, 4, 4, 2, 1


def test_engine_is_ready_when_constructed(llama_dir, monkeypatch):
    """The C++ decode extension is built (or found unbuildable) by the constructor, and nothing is built
    afterwards; the warm-up step wrote nothing to the KV cache."""
    if pagedq_kernels.dispatch.backend_for(torch.zeros(1)) != "cpu":
        pytest.skip("the CPU attention backend is not the active one here")
    monkeypatch.setattr(kernels_cpu, "_ext", None)  # as in a fresh worker process
    engine = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", enforce_eager=False)
    assert kernels_cpu._ext is not None, "the CPU decode extension was left for the first request"
    assert not engine.runner.kv_cache.any(), "the warm-up wrote to the KV cache"

    def no_build():
        raise AssertionError("something was built after the engine was ready")

    monkeypatch.setattr(kernels_cpu, "_build", no_build)
    calls = []
    if kernels_cpu._ext:  # the extension exists: count that decodes really go through it (from Python, or
        # inside its one-call layer, worker/models/cpu_layer.py)
        for name in ("paged_decode", "decoder_layer"):
            real = getattr(kernels_cpu._ext, name)
            monkeypatch.setattr(kernels_cpu._ext, name, lambda *a, real=real: calls.append(1) or real(*a))
    out = _run(engine, [[3, 4, 5, 6]], [SamplingParams(temperature=0.0, max_tokens=4)])
    assert len(out[0][0]) == 4
    assert calls or not kernels_cpu._ext


def test_cpu_never_captures_graphs(llama_dir):
    engine = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", enforce_eager=False)
    assert engine.runner.cuda_graphs is False and engine.runner.decode_graphs is None
    with pytest.raises(RuntimeError, match="CUDA graphs need"):
        engine.runner.capture_decode_graphs()
