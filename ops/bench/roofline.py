"""The memory side of the hardware ceiling, beside the matmul rate (offline.py's `measure_matmul`).

A decode step multiplies a few rows by every weight of the model, and reads each running request's KV
cache once. On a CPU whose matmuls are fast (AMX tiles, say), such steps are bound by memory, not by the
matmul rate, and "share of the matmul ceiling" says little about how close the engine is to what the
machine allows. So the offline benchmark also measures how fast this machine streams memory and reports
a roofline bound: the least time the workload's unavoidable traffic and arithmetic take,

    bound = max(useful FLOPs / matmul rate, (steps x weight bytes + KV bytes read) / bandwidth)

where every step reads every matmul weight once (the run's own step count) and each decoded token reads
its request's context from the KV cache once (each prompt position once, while it is prefilled). Both
are lower bounds of what an engine moves from memory, so `bound / elapsed` is at most 1, as long as the
weights and the cache do not fit in the CPU's caches (a tiny test model's do: its share means nothing).
"""

from __future__ import annotations

import time
from typing import Any

from ops.bench.stats import median
from ops.bench.workloads import Workload

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_flops(info: dict, workload: Workload) -> float:
    """Useful FLOPs to run the workload: every position through the layers (2 per matmul parameter,
    plus causal attention QK^T and PV over its context), and the LM head once per sampled token."""
    attn = 4 * info["layers"] * info["heads"] * info["head_dim"]
    total = 0.0
    for r in workload.requests:
        n = len(r.prompt) + r.max_tokens - 1  # positions run; the last sampled token is never fed back
        total += 2 * info["matmul_params_layers"] * n + attn * n * (n + 1) / 2
        total += 2 * info["matmul_params_lm_head"] * r.max_tokens
    return total


def flops_per_token(info: dict, ctx: float) -> float:
    """2 x (matmul parameters incl. the LM head) + attention at context `ctx`."""
    p = info["matmul_params_layers"] + info["matmul_params_lm_head"]
    return 2 * p + 4 * info["layers"] * info["heads"] * info["head_dim"] * ctx


def measure_bandwidth(device: str, gib: float = 1.0, reps: int = 5) -> dict[str, Any]:
    """Streaming read rate: the `sum()` of an fp32 tensor of `gib` GiB (larger than the caches), in
    torch's threads. Bytes per second, median and best of `reps`."""
    import torch

    from ops.bench.hf_baselines import sync

    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    x.sum()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        sync(device)
        times.append(time.perf_counter() - t0)
    size = x.numel() * 4
    return {"bytes_per_s": size / median(times), "bytes_per_s_best": size / min(times), "bytes": size}


def weight_bytes(info: dict, dtype: str) -> int:
    """Bytes of the matmul weights (the layers' projections and the LM head) that every step reads."""
    return (info["matmul_params_layers"] + info["matmul_params_lm_head"]) * _DTYPE_BYTES[dtype]


def kv_bytes_read(info: dict, workload: Workload, dtype: str) -> float:
    """KV cache bytes the workload must read: each prompt position once, then each decoded token its
    request's context (prompt and the outputs before it)."""
    per_position = info["kv_bytes_per_token_bf16"] // 2 * _DTYPE_BYTES[dtype]
    positions = 0
    for r in workload.requests:
        p, fed = len(r.prompt), r.max_tokens - 1  # the last sampled token is never fed back
        positions += p + fed * p + fed * (fed + 1) // 2
    return positions * per_position


def roofline(
    info: dict,
    workload: Workload,
    dtype: str,
    *,
    steps: int,
    useful_flops: float,
    matmul_flops: float,
    bandwidth: float,
    elapsed_s: float,
) -> dict[str, Any]:
    """The bound above, its two sides and `share` = bound / elapsed."""
    traffic = steps * weight_bytes(info, dtype) + kv_bytes_read(info, workload, dtype)
    compute_s, memory_s = useful_flops / matmul_flops, traffic / bandwidth
    bound = max(compute_s, memory_s)
    return {
        "bytes": traffic,
        "compute_s": compute_s,
        "memory_s": memory_s,
        "bound_s": bound,
        "bound_by": "memory" if memory_s >= compute_s else "compute",
        "share": bound / elapsed_s,
    }
