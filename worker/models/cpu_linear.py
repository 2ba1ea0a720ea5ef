"""CPU linear layers through weights packed once at load: pagedq's own GEMM, else oneDNN's.

`F.linear` on CPU calls MKL's GEMM. On a 2-core AMD EPYC with AVX-512 a [32 x 576] x [576 x 3072] fp32
product ran 2.6x faster through oneDNN with the weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the same pair of ops inductor's CPU freezing pass emits),
and bf16 products up to 1.9x faster (`python -m ops.bench.gemm_paths`). Both are exact GEMMs in their
dtype; only the summation order differs.

Where the C++ extension has its own GEMM (`pagedq_kernels/csrc/cpu_gemm.cpp`: fp32 on a CPU with AVX-512,
bf16 with avx512_bf16), it takes oneDNN's place. With SmolLM2's 30 layers of weights read from memory,
as in a decode step, it ran 1.1x to 4.8x faster than oneDNN's packed path per shape at 1 to 64 rows in
bf16 (1.1x to 2.3x in fp32). From 256 rows up it ran at 0.93x to 1.19x of it in bf16
(`python -m ops.bench.gemm_paths --cold`, ops/bench/RESULTS.md). On a CPU with AMX, bf16 products of 4 rows
or more run on its tiles (pagedq_kernels/csrc/cpu_gemm_amx.cpp, same packed weight): on a 2-core Xeon they
ran 1.0x to 1.65x as fast as oneDNN's AMX path at 8 to 64 rows (0.6x to 1.3x at 256) and 1.3x to 7.2x as
fast as the vector kernel.

Packing replaces a projection's weight with its packed copy (the plain weight's storage is freed, so
weights are not held twice); the embedding table stays plain, and a tied LM head is packed as a copy.
`PAGEDQ_ONEDNN_LINEAR=0` keeps `F.linear` (for comparisons); `PAGEDQ_CPU_GEMM=0` sends both dtypes
through oneDNN instead of pagedq's GEMM. Weights quantized to int8 at load (worker/models/quantization.py)
are packed for the extension's int8 GEMM, or kept as int8 and scales for `int8_linear` where it is not built.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

ENV = "PAGEDQ_ONEDNN_LINEAR"
GEMM_ENV = "PAGEDQ_CPU_GEMM"
# oneDNN and its torch wrapper (ideep) cache one compiled GEMM per input shape, and a step's row count
# changes from step to step: with their default capacity of 1,024 each, a worker's memory grew by about
# 2.5 MB per new row count (220 MiB over a 400-request soak). 32 entries hold the shapes of the last 8
# row counts; a miss costs about 0.6 ms once per projection shape in a step. Set before the first GEMM;
# the environment's own values win.
CACHE_CAPACITY = "32"
os.environ.setdefault("LRU_CACHE_CAPACITY", CACHE_CAPACITY)
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", CACHE_CAPACITY)
_DTYPES = (torch.float32, torch.bfloat16)
PANEL = 16  # output columns per panel of a packed weight (bf16, fp32 and int8 alike)


def onednn_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Pack on CPU for fp32 and bf16 unless PAGEDQ_ONEDNN_LINEAR=0. bf16 only with native bf16 (the
    oneDNN reorder has no bf16 kernel to reorder for elsewhere). Needs torch's oneDNN even where the
    extension's GEMM takes the projections: it packs the shapes that GEMM does not (odd K in bf16)."""
    if device.type != "cpu" or dtype not in _DTYPES or os.environ.get(ENV, "1") == "0":
        return False
    if not onednn_available():
        return False
    if dtype == torch.bfloat16:
        from pagedq_kernels.cpu import native_bf16

        return native_bf16()
    return True


def gemm_for(dtype: torch.dtype):
    """The C++ extension when its GEMM was built for `dtype` (float32 where the CPU has AVX-512,
    bfloat16 where it has avx512_bf16) and PAGEDQ_CPU_GEMM is not 0; else None."""
    if os.environ.get(GEMM_ENV, "1") == "0":
        return None
    from pagedq_kernels.cpu import extension

    ext = extension()
    return ext if ext is not None and str(dtype).removeprefix("torch.") in ext.gemm_dtypes() else None


def gemm_bias(bias: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`bias` as the extension's GEMM takes it: fp32, zero-padded to the packed weight's width (it adds
    the bias to its sums, 16 columns at a time)."""
    out = torch.zeros(packed.shape[0] * PANEL, dtype=torch.float32)
    out[: bias.numel()] = bias.float()
    return out


def pack(module: nn.Module, *, keep_weight: bool = False) -> None:
    """Give `module` (an object with a 2-D `.weight`, optional `.bias`) a packed weight for `linear`."""
    weight = module.weight
    module.out_features = weight.shape[0]
    ext = gemm_for(weight.dtype)
    if ext is not None and weight.dtype == torch.bfloat16 and weight.shape[1] % 2:
        ext = None  # bf16 K is packed in pairs
    if ext is not None:
        module.gemm_weight = ext.pack_gemm_weight(weight.detach())
        module.gemm = ext.gemm_linear
        bias = getattr(module, "bias", None)
        module.gemm_bias = None if bias is None else gemm_bias(bias.detach(), module.gemm_weight)
    else:
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    if not keep_weight:  # the packed copy is the weight from now on
        module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False)


def linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """`F.linear(x, module.weight, module.bias)`, through the packed weight when there is one."""
    gemm = getattr(module, "gemm_weight", None)
    packed = getattr(module, "packed_weight", None)
    if getattr(module, "int8_weight", None) is not None:
        return int8_linear(x, module)
    if packed is None and gemm is None:
        return F.linear(x, module.weight, getattr(module, "bias", None))
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), module).view(*x.shape[:-1], module.out_features)
    if gemm is not None:
        out = torch.empty(x.shape[0], module.out_features, dtype=x.dtype, device=x.device)
        module.gemm(x if x.stride(-1) == 1 else x.contiguous(), gemm, module.gemm_bias, out)
        return out
    return torch.ops.mkldnn._linear_pointwise(x, packed, getattr(module, "bias", None), "none", [], "")


def int8_linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """An int8 weight without the C++ kernel (worker/models/quantization.py): (x @ Q^T) * s (+ bias) in fp32,
    rounded to x's dtype once, as the kernel rounds its fp32 sums."""
    out = F.linear(x.float(), module.int8_weight.float()) * module.int8_scale
    bias = getattr(module, "bias", None)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
