"""The CPU's one-call decoder layer (pagedq_kernels/csrc/cpu_layer.cpp via worker/models/cpu_layer.py) gives the
Python fused path's logits and cache bit for bit, in every family it takes, in fp32 and bf16, over decode
steps and prompt chunks mixed; and it is not taken where some part of a layer would not run in the
extension (then the Python layers run, as before)."""

from __future__ import annotations

import pytest
import torch

from ops.bench.gpu_check_common import run_steps
from pagedq_kernels import cpu, use_backend
from worker.models import cpu_layer
from worker.models.cpu_linear import gemm_for
from worker.models.loader import load_model
from worker.models.tiny import build_tiny_model


def _gemm_built(dtype: torch.dtype) -> bool:
    return gemm_for(dtype) is not None


def _run(model, monkeypatch, layer: str):
    """Logits of three sequences: a decode from the second step, a prompt in three chunks, a ragged one."""
    monkeypatch.setenv(cpu_layer.ENV, layer)
    calls = []
    run_layers = cpu_layer.run_layers
    monkeypatch.setattr("worker.models.llama.run_layers", lambda *a: calls.append(r := run_layers(*a)) or r)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 30, 21)]
    logits = run_steps(model, seqs, [1, 24, 17], "cpu", chunk=8)
    return logits, [c is not None for c in calls]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_the_c_layer_equals_the_python_layers_bit_for_bit(tiny_model_dirs, family, dtype, monkeypatch):
    if not _gemm_built(dtype):
        pytest.skip(f"the extension's GEMM is not built for {dtype} on this CPU (the Python layers run)")
    model = load_model(tiny_model_dirs[family], dtype=str(dtype).removeprefix("torch."), device="cpu").model
    assert model.cpu_layer_plan is not None
    python, taken = _run(model, monkeypatch, "0")
    assert not any(taken)
    c, taken = _run(model, monkeypatch, "1")
    assert taken and all(taken)  # every step, the mixed ones included
    for i, (got, want) in enumerate(zip(c, python, strict=True)):
        assert torch.equal(got, want), f"{family} {dtype} sequence {i}"


def test_a_sliding_window_matches(tmp_path, monkeypatch):
    if not _gemm_built(torch.float32):
        pytest.skip("the extension's GEMM is not built for float32 on this CPU")
    folder = build_tiny_model("mistral", tmp_path / "m", seed=4, sliding_window=5)
    model = load_model(folder, dtype="float32", device="cpu").model
    assert model.cpu_layer_plan[0].window == 5
    python, _ = _run(model, monkeypatch, "0")
    c, taken = _run(model, monkeypatch, "1")
    assert all(taken)
    assert all(torch.equal(a, b) for a, b in zip(c, python, strict=True))


def test_not_taken_where_a_part_would_not_run_in_the_extension(tiny_model_dirs, monkeypatch):
    qwen3 = load_model(tiny_model_dirs["qwen3"], dtype="float32", device="cpu").model
    assert qwen3.cpu_layer_plan is None  # q/k norm: the Python layers
    if not _gemm_built(torch.float32):
        pytest.skip("the extension's GEMM is not built for float32 on this CPU")
    model = load_model(tiny_model_dirs["llama"], dtype="float32", device="cpu").model
    monkeypatch.setenv(cpu.PREFILL_ENV, "0")  # prompt chunks through the torch reference: those steps in Python
    _, taken = _run(model, monkeypatch, "1")
    assert any(taken) and not all(taken)
    monkeypatch.delenv(cpu.PREFILL_ENV)
    with use_backend("torch"):  # the backend forced away from the extension
        _, taken = _run(model, monkeypatch, "1")
    assert not any(taken)
