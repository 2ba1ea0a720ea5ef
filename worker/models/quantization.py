"""Weight-only int8 at load (`--quantization int8`, vLLM's flag name): each projection's weight W [N, K] becomes
symmetric int8 per output channel, Q = round(W / s) with s = max|W[n, :]| / 127 (fp32), so W ~ Q * s.

A decode step on a CPU is bound by reading the weights, and int8 halves the bytes of bf16. Only the
weights are quantized: the activations stay in the model's dtype (quantizing them too cost SmolLM2 1.2-4%
perplexity in a simulation; the weights alone cost 0.7%: 16.56 -> 16.67 on ops/bench/texts/ppl.txt,
`python -m ops.bench.quant_quality`). Where the C++ extension has its int8 GEMM
(pagedq_kernels/csrc/cpu_gemm_int8.cpp, AVX-512, bf16 or fp32 activations), the weight is packed into its
panels, scales included, and goes wherever a packed bf16 weight goes (`cpu_linear.linear`, the one-call
layer). Elsewhere (an AVX2 build, PAGEDQ_CPU_GEMM=0, fp16 activations) the int8 weight and its scales are
kept and each call computes (x @ Q^T) * s in fp32 through torch (`cpu_linear.linear`): correct, not fast.

The embedding table stays in the model's dtype. A tied LM head (SmolLM2) keeps the table and gets an int8
copy, a fifth of SmolLM2's weight bytes read per token; quantizing it cost nothing measurable (perplexity
+0.68% with it, +0.85% without). `PAGEDQ_INT8_LM_HEAD=0` keeps the LM head in the model's dtype (an A/B
switch).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from worker.models.cpu_linear import gemm_bias

METHODS = ("int8",)
LM_HEAD_ENV = "PAGEDQ_INT8_LM_HEAD"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class QuantizationError(ValueError):
    """An unknown `--quantization` method, or one this device does not run."""


def check_method(method: str | None, device: torch.device | None = None) -> None:
    """Raise QuantizationError unless `method` is None or one pagedq runs on `device`."""
    if method is None:
        return
    if method not in METHODS:
        raise QuantizationError(f"--quantization={method!r}: choose {', '.join(METHODS)} (or leave it unset)")
    if device is not None and device.type != "cpu":
        raise QuantizationError(f"--quantization={method}: not supported on {device.type} yet (CPU only)")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q int8 [N, K], s fp32 [N]) with Q = round(W / s) in [-127, 127]; a zero row gets s = 1."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def int8_gemm_for(dtype: torch.dtype):
    """The C++ extension when its int8 GEMM takes activations of `dtype` here (AVX-512; float32 or
    bfloat16) and PAGEDQ_CPU_GEMM is not 0; else None (the torch path)."""
    if dtype not in _KERNEL_DTYPES or os.environ.get("PAGEDQ_CPU_GEMM", "1") == "0":
        return None
    from pagedq_kernels.cpu import extension

    ext = extension()
    return ext if ext is not None and hasattr(ext, "gemm_int8_available") and ext.gemm_int8_available() else None


def quantize_linear(module: nn.Module, *, keep_weight: bool = False) -> None:
    """Replace `module`'s 2-D `.weight` by its int8 form for `cpu_linear.linear` (the plain weight's storage
    is freed unless `keep_weight`, for a tied embedding table)."""
    weight = module.weight
    module.out_features = weight.shape[0]
    q, scale = quantize_int8(weight)
    ext = int8_gemm_for(weight.dtype)
    if ext is not None:
        module.gemm_weight = ext.pack_gemm_weight_int8(q, scale)
        module.gemm = ext.gemm_linear
        bias = getattr(module, "bias", None)
        module.gemm_bias = None if bias is None else gemm_bias(bias.detach(), module.gemm_weight)
    else:
        module.int8_weight, module.int8_scale = q, scale
    if not keep_weight:
        module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False)


def quantize_lm_head() -> bool:
    return os.environ.get(LM_HEAD_ENV, "1") != "0"
