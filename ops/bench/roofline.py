"""The hardware ceiling: the matmul rate (`measure_matmul`) and, beside it, the memory side.

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


def measure_matmul(dtype: str, device: str, n: int = 2048, reps: int = 10) -> dict:
    """The hardware ceiling: the fastest GEMM path here on an n^3 product: `F.linear`, and on CPU
    oneDNN with a packed weight and pagedq's own GEMM (where it is built for the dtype)."""
    import torch
    import torch.nn.functional as F

    from ops.bench.hf_baselines import DTYPES, sync
    from worker.models.cpu_linear import gemm_for, onednn_available

    dt = DTYPES[dtype]
    x = torch.randn(n, n, dtype=dt, device=device)
    w = torch.randn(n, n, dtype=dt, device=device)
    paths = {"F.linear": lambda: F.linear(x, w)}
    if device == "cpu" and onednn_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        paths["onednn-packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    ext = gemm_for(dt) if device == "cpu" else None
    if ext is not None:
        ours, out = ext.pack_gemm_weight(w), torch.empty(n, n, dtype=dt)
        paths["pagedq-gemm"] = lambda: ext.gemm_linear(x, ours, None, out)
    per_path = {}
    for name, fn in paths.items():
        for _ in range(3):
            fn()
        sync(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        per_path[name] = times
    path = min(per_path, key=lambda k: median(per_path[k]))
    times = per_path[path]
    return {
        "n": n,
        "path": path,
        "flops": 2 * n**3 / median(times),
        "flops_best": 2 * n**3 / min(times),
        "flops_by_path": {k: 2 * n**3 / median(v) for k, v in per_path.items()},
        "times_s": times,
    }


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
