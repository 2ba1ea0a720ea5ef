"""GEMM paths on this CPU at a model's shapes: `F.linear` (MKL), oneDNN with a packed weight, and
pagedq's own GEMM from the C++ extension (fp32 where the CPU has AVX-512, bf16 where it has
avx512_bf16).

    python -m ops.bench.gemm_paths                       # SmolLM2-135M's projections, M = 1, 32, 64, 512
    python -m ops.bench.gemm_paths --rows 64 --dtypes float32
    python -m ops.bench.gemm_paths --cold --dtypes bfloat16 --rows 1,4,16,64,256

Why the engine packs its CPU weights (`worker/models/cpu_linear.py`): prints, per shape, microseconds
per call and GFLOP/s of each path, and the largest relative error against a float64 product (every
path is an exact GEMM in its dtype; only the summation order differs). With `--cold` each call takes
the next of `--layers` copies of the weight, as a decode step does with the layers of a model, so
the weights come from memory rather than from cache.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

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
PATHS = ("F.linear", "onednn", "pagedq")


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _path_fns(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """One callable per path this machine has, each computing x @ w^T through its own packed copy."""
    from worker.models.cpu_linear import gemm_for

    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    fns = {
        "F.linear": lambda: F.linear(x, w),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    }
    ext = gemm_for(w.dtype)
    if ext is not None:
        ours = ext.pack_gemm_weight(w)

        def pagedq() -> torch.Tensor:
            out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
            ext.gemm_linear(x, ours, None, out)
            return out

        fns["pagedq"] = pagedq
    return fns


def measure(dtype: torch.dtype, m: int, n: int, k: int, reps: int, layers: int = 1) -> dict:
    """Per path: us per call, GFLOP/s and relative error. With layers > 1, the calls cycle through that
    many weight copies (each path its own), so each call reads its weight from memory."""
    x = torch.randn(m, k, dtype=dtype)
    copies = [_path_fns(x, torch.randn(n, k, dtype=dtype)) for _ in range(layers)]
    ref_w = torch.randn(n, k, dtype=dtype)
    ref = F.linear(x.double(), ref_w.double())
    scale = ref.abs().max().item()
    check = _path_fns(x, ref_w)
    out = {}
    for name in check:
        fns = [c[name] for c in copies]

        def one_round(fns=fns) -> None:
            for fn in fns:
                fn()

        seconds = _time(one_round, reps) / layers
        err = (check[name]().double() - ref).abs().max().item() / scale
        out[name] = {"us": seconds * 1e6, "gflops": 2 * m * n * k / seconds / 1e9, "rel_err": err}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.bench.gemm_paths", description=__doc__)
    p.add_argument("--rows", default="1,32,64,512", help="M values (tokens in a step), comma list")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--cold", action="store_true", help="weights from memory: cycle through --layers copies")
    p.add_argument("--layers", type=int, default=30, help="weight copies per shape with --cold")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = args.layers if args.cold else 1
    print("| dtype | shape | M | " + " | ".join(f"{name} us | GFLOP/s" for name in PATHS) + " | rel. error |")
    print("|---|---|---|" + "---|---|" * len(PATHS) + "---|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name.strip())
        for m in (int(r) for r in args.rows.split(",")):
            for name, n, k in SMOLLM2_SHAPES:
                big = n > 10000
                reps = max(2, args.reps // (20 if big else 1) // max(1, layers // 5))
                r = measure(dtype, m, n, k, reps, layers=min(layers, 4) if big else layers)
                cells = [f"{r[path]['us']:,.0f} | {r[path]['gflops']:,.0f}" if path in r else "- | -" for path in PATHS]
                errs = " / ".join(f"{r[path]['rel_err']:.0e}" for path in PATHS if path in r)
                print(f"| {dtype_name} | {name} {n}x{k} | {m} | " + " | ".join(cells) + f" | {errs} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
