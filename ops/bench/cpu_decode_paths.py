"""The CPU decode attention's two builds on this CPU: AVX2 against AVX-512 (pagedq_kernels/csrc/).

    python -m ops.bench.cpu_decode_paths                      # SmolLM2's heads (9 query, 3 KV, 64), bf16 + fp32
    python -m ops.bench.cpu_decode_paths --cases 64x165,1x2000 --dtypes bfloat16

Both builds of the extension are loaded into one process (`PAGEDQ_CPU_AVX512=0` names the AVX2 one)
and called in turn on the same inputs. Each case is B requests of C positions with one KV cache per
layer (30, as in SmolLM2), the blocks of each request spread at random over the cache, so a sweep over
the layers reads the cache from memory, not from the last level of cache, as a decode step does. Prints
microseconds per layer, the KV bytes read per second, the speed-up and the largest difference between
the two outputs.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from ops.bench.common import BLOCK_SIZE
from pagedq_kernels import cpu


def builds() -> dict:
    """The extension as built for this CPU, and its AVX2 build (None where AVX-512 is not available)."""
    wide = cpu._build()
    before = os.environ.get("PAGEDQ_CPU_AVX512")
    os.environ["PAGEDQ_CPU_AVX512"] = "0"
    try:
        narrow = cpu._build()
    finally:
        if before is None:
            os.environ.pop("PAGEDQ_CPU_AVX512")
        else:
            os.environ["PAGEDQ_CPU_AVX512"] = before
    if not wide or not narrow:
        raise SystemExit("the C++ CPU kernels did not build here")
    return {"avx2": narrow, "avx512": wide if wide is not narrow else None}


def measure(exts: dict, dtype: torch.dtype, b: int, ctx: int, heads: tuple[int, int, int], layers: int, reps: int):
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(0)
    blocks = b * -(-ctx // BLOCK_SIZE)
    shape = (blocks + 1, BLOCK_SIZE, hkv, d)
    caches = [tuple(torch.randn(shape, generator=g).to(dtype) for _ in "kv") for _ in range(layers)]
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g).view(b, -1).to(torch.int32)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    outs, per_layer = {}, {}
    for name, ext in exts.items():
        out = torch.empty_like(q)
        for k, v in caches:
            ext.paged_decode(q, k, v, tables, lens, out, d**-0.5, 0)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for k, v in caches:
                ext.paged_decode(q, k, v, tables, lens, out, d**-0.5, 0)
            times.append((time.perf_counter() - t0) / layers)
        outs[name], per_layer[name] = out, sorted(times)[len(times) // 2]
    return per_layer, outs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.bench.cpu_decode_paths", description=__doc__)
    p.add_argument("--cases", default="1x165,16x165,64x165,1x2000,8x1000", help="BxCONTEXT, comma list")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    exts = {k: v for k, v in builds().items() if v is not None}
    heads = tuple(int(x) for x in args.heads.split(","))
    print(f"threads {args.threads}, heads {heads}, {args.layers} layers; builds: {', '.join(exts)}")
    print("| dtype | B | context | AVX2 us/layer | GB/s | AVX-512 us/layer | GB/s | speed-up | max diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dt_name in args.dtypes.split(","):
        dtype = getattr(torch, dt_name)
        for case in args.cases.split(","):
            b, ctx = (int(x) for x in case.split("x"))
            t, outs = measure(exts, dtype, b, ctx, heads, args.layers, args.reps)
            gb = 2 * b * ctx * heads[1] * heads[2] * dtype.itemsize / 1e9
            row = [dt_name, str(b), str(ctx), f"{t['avx2'] * 1e6:,.0f}", f"{gb / t['avx2']:.1f}"]
            if "avx512" in t:
                diff = (outs["avx2"].float() - outs["avx512"].float()).abs().max().item()
                row += [
                    f"{t['avx512'] * 1e6:,.0f}",
                    f"{gb / t['avx512']:.1f}",
                    f"{t['avx2'] / t['avx512']:.2f}x",
                    f"{diff:.1e}",
                ]
            else:
                row += ["-"] * 4
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
