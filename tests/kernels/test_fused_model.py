"""The model's fused path (the one CUDA takes: fused norms, SiLU-mul, rotary folded into the KV write,
Triton attention) computes the plain path's logits: on CPU tensors with the Triton interpreter, and on
CUDA (marked gpu) with real kernels."""

from __future__ import annotations

import pytest
import torch

from kernels import use_backend
from ops.bench.gpu_check import run_steps
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


def test_plain_path_is_the_default_on_cpu(llama_dir):
    model = load_model(llama_dir, dtype="float32", device="cpu").model
    assert model.use_fused_ops is None  # auto: fused only for CUDA tensors
