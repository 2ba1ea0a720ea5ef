"""What a prompt chunk costs, in tokens: the scheduler sizes long prompts' chunks by it."""

from __future__ import annotations

import math
from typing import Any

# Paged prefill attention ran about this many times slower per FLOP than the matmuls (CPU, fp32).
ATTENTION_SLOWDOWN = 3


def chunk_cost(position: int, n: int, context: int) -> float:
    """Cost, in tokens, of computing prompt tokens `position .. position + n - 1`: each costs its linear
    layers (1) plus its attention over the keys before it (`q / context` for the token at position q)."""
    return n + (n * position + n * (n - 1) / 2) / context


def affordable_tokens(position: int, budget: float, context: int) -> int:
    """The most prompt tokens from `position` on whose `chunk_cost` fits `budget`."""
    if budget < 1:
        return 0
    b = 1 + (position - 0.5) / context  # cost(n) = n^2 / (2 context) + b n
    n = int(context * (math.sqrt(b * b + 2 * budget / context) - b))
    while chunk_cost(position, n + 1, context) <= budget:
        n += 1
    while n > 0 and chunk_cost(position, n, context) > budget:
        n -= 1
    return n


def attention_cost_context(hf_config: Any) -> int:
    """`SchedulerConfig.attention_cost_context` of a Llama-shaped model: the context at which one token's
    attention costs as much as its linear layers. By FLOPs that is the matmul parameters of a layer over
    2 x heads x head_dim (QK^T and PV, 2 FLOPs a multiply-add); measured on the CPU (SmolLM2, fp32,
    chunks of 16-64 tokens at positions up to 3,072), paged prefill attention runs at about a third of
    the matmul rate, hence the division by ATTENTION_SLOWDOWN."""
    if not all(hasattr(hf_config, k) for k in ("hidden_size", "num_attention_heads", "intermediate_size")):
        return 1024  # not Llama-shaped: SmolLM2's figure
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    inter = int(hf_config.intermediate_size)
    layer_params = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    return max(64, round(layer_params / (2 * heads * head_dim) / ATTENTION_SLOWDOWN))
