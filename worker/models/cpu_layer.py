"""The CPU's one-call decoder layer (pagedq_kernels/csrc/cpu_layer.cpp): a layer's ten or so kernels called from
C++ rather than Python, the same kernels in the same order as `DecoderLayer.forward_fused`, so the output is
the same bit for bit. It saves the Python glue between them, about 85 us per layer, 4-5% of a SmolLM2
decode step on 2 cores.

It is taken only where every part of the layer runs in the extension: projections packed for its GEMM
(AVX-512), no q/k norm (Qwen3 takes the Python path), fp32 rotary tables, a cache layout the attention
kernels take, and prompt chunks that its prefill kernel takes. `PAGEDQ_CPU_LAYER=0` keeps the Python path
(an A/B switch).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from pagedq_kernels import AttentionMetadata
from pagedq_kernels.cpu import PREFILL_ENV, extension, supported
from pagedq_kernels.dispatch import backend_for

ENV = "PAGEDQ_CPU_LAYER"


class LayerConstants(NamedTuple):
    """A layer's arguments of `decoder_layer` that never change, in its order (passed as `*constants`)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    qkv: torch.Tensor  # packed weights and fp32 biases (or None), as worker.models.cpu_linear packs them
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    scale: float
    window: int


def layer_plan(model: Any) -> list[LayerConstants] | None:
    """Per layer, the arguments of `decoder_layer` that never change (norm weights, packed projections,
    head counts), or None when some layer cannot run there. Built once, after the weights are packed."""
    ext = extension()
    if ext is None or not hasattr(ext, "decoder_layer"):
        return None
    plan = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if attn.qk_norm or any(getattr(p, "gemm_weight", None) is None for p in projections):
            return None
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        if ln1.eps != ln2.eps:
            return None
        plan.append(
            LayerConstants(
                ln1.weight,
                ln2.weight,
                float(ln1.eps),
                attn.qkv_proj.gemm_weight,
                attn.qkv_proj.gemm_bias,
                attn.o_proj.gemm_weight,
                attn.o_proj.gemm_bias,
                mlp.gate_up_proj.gemm_weight,
                mlp.down_proj.gemm_weight,
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                attn.o_proj.out_features,
                mlp.intermediate,
                float(attn.scale),
                int(attn.sliding_window or 0),
            )
        )
    return plan


def run_layers(
    model: Any,
    plan: list[LayerConstants],
    x: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the last layer's MLP output, the residual stream before it), or None when this step cannot run
    in C++ (the caller then takes the Python path)."""
    if os.environ.get(ENV, "1") == "0" or x.dim() != 2 or backend_for(x) != "cpu":
        return None
    k0, v0 = kv_caches[0]
    rope = model.rotary
    tables = (meta.block_tables, meta.query_start_loc, meta.seq_lens)
    if (
        k0.dtype != x.dtype
        or v0.stride() != k0.stride()
        or rope.cos.dtype != torch.float32
        or rope.cos.stride() != rope.sin.stride()
        or any(t.dtype != torch.int32 for t in tables)
    ):
        return None
    ext = extension()
    q_like = x.new_empty(0, plan[0].num_heads, plan[0].head_dim)
    if not supported(q_like, k0):
        return None
    prompts = meta.num_decodes < meta.num_seqs
    if prompts and (os.environ.get(PREFILL_ENV, "1") == "0" or not ext.prefill_supported(q_like)):
        return None
    step = (positions, rope.cos, rope.sin, meta.slot_mapping, *tables, meta.num_decodes)
    residual = None
    for constants, (k_cache, v_cache) in zip(plan, kv_caches, strict=True):
        x, residual = ext.decoder_layer(x, residual, k_cache, v_cache, *step, *constants)
    return x, residual
