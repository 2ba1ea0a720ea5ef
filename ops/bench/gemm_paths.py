"""GEMM paths on this CPU: `F.linear` (MKL) against oneDNN with a packed weight, at a model's shapes.

    python -m ops.bench.gemm_paths                       # SmolLM2-135M's projections, M = 1, 32, 64, 512
    python -m ops.bench.gemm_paths --rows 64 --dtypes float32

Why the engine packs its CPU weights for oneDNN (`worker/models/cpu_linear.py`): prints, per shape,
microseconds per call and GFLOP/s of each path, and the largest relative error against a float64
product (both paths are exact GEMMs in their dtype; only the summation order differs).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# (name, N, K) of SmolLM2-135M's projections (hidden 576, 9 + 2x3 heads of 64, MLP 1536, vocab 49152)
SMOLLM2_SHAPES = (
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
)


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def measure(dtype: torch.dtype, m: int, n: int, k: int, reps: int) -> dict:
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    ref = F.linear(x.double(), w.double())
    scale = ref.abs().max().item()
    out = {}
    for name, fn in (
        ("F.linear", lambda: F.linear(x, w)),
        ("onednn", lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")),
    ):
        seconds = _time(fn, reps)
        err = (fn().double() - ref).abs().max().item() / scale
        out[name] = {"us": seconds * 1e6, "gflops": 2 * m * n * k / seconds / 1e9, "rel_err": err}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.bench.gemm_paths", description=__doc__)
    p.add_argument("--rows", default="1,32,64,512", help="M values (tokens in a step), comma list")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        "| dtype | shape | M | F.linear us | GFLOP/s | oneDNN packed us | GFLOP/s | speed-up "
        "| rel. error F.linear / oneDNN |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name.strip())
        for m in (int(r) for r in args.rows.split(",")):
            for name, n, k in SMOLLM2_SHAPES:
                r = measure(dtype, m, n, k, max(3, args.reps // (20 if n > 10000 else 1)))
                a, b = r["F.linear"], r["onednn"]
                print(
                    f"| {dtype_name} | {name} {n}x{k} | {m} | {a['us']:,.0f} | {a['gflops']:,.0f} | {b['us']:,.0f} | "
                    f"{b['gflops']:,.0f} | {a['us'] / b['us']:.2f}x | {a['rel_err']:.0e} / {b['rel_err']:.0e} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
