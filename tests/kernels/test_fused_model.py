"""The model's fused path (fused norms, SiLU-mul, rotary folded into the KV write) computes the plain
path's logits: with the Triton kernels (on CPU tensors under the interpreter, and on CUDA, marked gpu)
and with the C++ CPU extension."""

from __future__ import annotations

import pytest
import torch

import pagedq_kernels
from ops.bench.gpu_check import run_steps
from pagedq_kernels import use_backend
from worker.models.loader import load_model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_path_matches_plain_path(tiny_model_dirs, family, device):
    model = load_model(tiny_model_dirs[family], dtype="float32", device=device).model
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 30, 21)]
    prompts = [1, 24, 17]  # chunks of 8: a decode from step 2, a 3-chunk prompt, a ragged one
    model.use_fused_ops = False
    with use_backend("torch"):
        plain = run_steps(model, seqs, prompts, device, chunk=8)
    model.use_fused_ops = True
    with use_backend("triton"):
        fused = run_steps(model, seqs, prompts, device, chunk=8)
    for i, (got, want) in enumerate(zip(fused, plain, strict=True)):
        assert _rel(got, want) < 1e-5, f"{family} seq {i}"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_cpu_fused_path_matches_plain_path(tiny_model_dirs, family):
    """The same, with the C++ CPU extension's fused ops (pagedq_kernels/csrc/cpu_fused.cpp)."""
    model = load_model(tiny_model_dirs[family], dtype="float32", device="cpu").model
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 30, 21)]
    prompts = [1, 24, 17]
    model.use_fused_ops = False
    with use_backend("torch"):
        plain = run_steps(model, seqs, prompts, "cpu", chunk=8)
    model.use_fused_ops = True
    with use_backend("cpu"):
        fused = run_steps(model, seqs, prompts, "cpu", chunk=8)
    for i, (got, want) in enumerate(zip(fused, plain, strict=True)):
        assert _rel(got, want) < 1e-5, f"{family} seq {i}"


def test_the_fused_path_is_the_default_on_cpu_with_the_extension(llama_dir, monkeypatch):
    model = load_model(llama_dir, dtype="float32", device="cpu").model
    assert model.use_fused_ops is None  # auto: fused on CUDA, and on the CPU where the extension is built
    calls = []
    add_rms_norm = pagedq_kernels.add_rms_norm
    monkeypatch.setattr(pagedq_kernels, "add_rms_norm", lambda *a: calls.append(1) or add_rms_norm(*a))
    run_steps(model, [[5, 6, 7]], [3], "cpu", chunk=8)
    assert calls
    calls.clear()
    with use_backend("torch"):  # no extension for these tensors: the plain path
        run_steps(model, [[5, 6, 7]], [3], "cpu", chunk=8)
    assert not calls
