"""Paged-attention kernels: correctness on the GPU, then decode timings against SDPA.

    python -m ops.bench.kernels                     # needs CUDA; writes ops/bench/results/kernels-<device>.json
    python -m ops.bench.kernels --batches 1,64 --contexts 512,8192 --models llama8b
    python -m ops.bench.kernels --cpu               # times the torch reference (the engine's CPU path)
    python -m ops.bench.kernels --dry-run           # the GPU flow on CPU under TRITON_INTERPRET=1, tiny sizes

GPU run: (1) Triton vs the torch reference on CUDA tensors, bf16 and fp16, mixed decode/prefill batches,
sliding window, forced and automatic decode splits, write_kv; (2) the device-to-device copy bandwidth
(one large `copy_`); (3) decode attention, batch x context x head layout, timed with
`triton.testing.do_bench` (median), next to `scaled_dot_product_attention` over the same K/V laid out
contiguously (`[B, Hkv, L, D]`, `enable_gqa`). Achieved bandwidth counts the bytes of K/V read plus
queries plus outputs, and is reported as a fraction of the copy bandwidth. Sizes that do not fit in
memory are skipped.

The CPU run times the reference with SmolLM2-135M shapes (batch-64 decode with ragged contexts, one
512-token prefill chunk) against SDPA on contiguous K/V, with `--threads` torch threads (default 2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ops.bench.attention_problems import (
    BLOCK_SIZE,
    MODELS,
    SMALL_HEADS,
    TOLERANCE,
    build_problem,
    contiguous_kv,
    copy_bandwidth,
    free_bytes,
    rel_err,
    timer,
)

RESULTS = Path(__file__).resolve().parent / "results"


# --- GPU sections -------------------------------------------------------------------------------


def check_correctness(device: str, small: bool) -> list[dict]:
    """Triton vs the torch reference on the same device; every output poisoned with NaN first.
    `split` cases force (num_partitions, min_partition) on the decode grid."""
    from pagedq_kernels import paged_attention, use_backend, write_kv
    from pagedq_kernels.paged_attention import paged_attention_triton

    long = 300 if small else 5000
    heads = SMALL_HEADS if small else MODELS
    mixed = ([1, 16, 130, long, 1 + long // 3, 37, 100 + 37, 60], [1, 1, 1, 1, 1, 1, 37, 60])
    cases = [
        ("mixed llama8b heads", mixed, heads["llama8b"], None, None, 16),
        ("mixed llama8b heads, window 64", mixed, heads["llama8b"], 64, None, 16),
        ("mixed llama1b heads", mixed, heads["llama1b"], None, None, 16),
        ("mixed smollm2 heads, block 32", mixed, heads["smollm2"], None, None, 32),
        ("D=80, MHA", ([5, 77, 200], [1, 1, 50]), (4, 4, 80) if not small else (2, 2, 80), None, None, 16),
        ("decode forced split 8 x >=64", ([long, 65, 3], [1, 1, 1]), heads["llama8b"], None, (8, 64), 16),
        ("decode forced split, window 100", ([long, 65, 3], [1, 1, 1]), heads["llama1b"], 100, (8, 64), 16),
        ("decode auto split", ([4 * long], [1]), heads["llama8b"], None, None, 16),
    ]
    dtypes = [torch.float16] if device == "cpu" else [torch.bfloat16, torch.float16]  # no bf16 in the interpreter
    # The first dtype gets every case; the others a mixed batch and a split (each case compiles kernels).
    second = {"mixed llama1b heads", "decode forced split 8 x >=64", "mixed llama8b heads, window 64"}
    rows = []
    for dtype in dtypes:
        for name, (seq, qlen), shape, window, split, bs in cases:
            if dtype != dtypes[0] and name not in second:
                continue
            q, kc, vc, meta = build_problem(seq, qlen, shape, dtype, device, block_size=bs)
            scale = shape[2] ** -0.5
            with use_backend("torch"):
                ref = paged_attention(q, kc, vc, meta, scale=scale, sliding_window=window)
            out = torch.full_like(q, float("nan"))
            if split is None:
                with use_backend("triton"):
                    got = paged_attention(q, kc, vc, meta, scale=scale, sliding_window=window, out=out)
            else:
                got = paged_attention_triton(
                    q, kc, vc, meta, scale=scale, sliding_window=window, out=out,
                    num_partitions=split[0], min_partition=split[1],
                )  # fmt: skip
            err = rel_err(got, ref)
            ok = bool(torch.isfinite(got).all()) and err < TOLERANCE[dtype]
            rows.append({"check": name, "dtype": str(dtype).removeprefix("torch."), "rel_err": err, "ok": ok})
        # write_kv: both backends must store bit-identical caches, and skip negative slots.
        _, hkv, d = heads["llama8b"]
        key = torch.randn(40, 3 * hkv, d, device=device, dtype=dtype)[:, hkv : 2 * hkv]  # strided view
        slots = torch.randperm(8 * BLOCK_SIZE, device=device)[:40]
        slots[::5] = -1
        caches = {}
        for backend in ("torch", "triton"):
            kc = torch.zeros(8, BLOCK_SIZE, hkv, d, device=device, dtype=dtype)
            vc = torch.zeros_like(kc)
            with use_backend(backend):
                write_kv(key, key * 2, kc, vc, slots)
            caches[backend] = (kc, vc)
        same = all(torch.equal(a, b) for a, b in zip(caches["torch"], caches["triton"]))
        written = int((caches["triton"][0].abs().sum(-1) > 0).sum())
        rows.append(
            {
                "check": "write_kv",
                "dtype": str(dtype).removeprefix("torch."),
                "rel_err": 0.0 if same else float("inf"),
                "ok": same and written == 32 * hkv,
            }
        )
    return rows


def time_decode(
    device: str, models: list[str], batches: list[int], contexts: list[int], copy_bw: float, bench: Callable
) -> list[dict]:
    from pagedq_kernels import paged_attention, use_backend

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    rows = []
    for model in models:
        hq, hkv, d = MODELS[model] if model in MODELS else SMALL_HEADS[model]
        es = torch.tensor([], dtype=dtype).element_size()
        for ctx in contexts:
            for batch in batches:
                kv_bytes = 2 * batch * ctx * hkv * d * es
                row = {"model": model, "batch": batch, "context": ctx, "kv_bytes": kv_bytes}
                # Peak: the paged cache plus its contiguous copy for SDPA, plus slack.
                if 2.1 * kv_bytes + (1 << 30) > free_bytes(device):
                    row["skipped"] = "does not fit in memory"
                    rows.append(row)
                    print(_decode_line(row), flush=True)
                    continue
                q, kc, vc, meta = build_problem([ctx] * batch, [1] * batch, (hq, hkv, d), dtype, device)
                out = torch.empty_like(q)
                scale = d**-0.5
                moved = kv_bytes + 2 * q.numel() * es  # K/V read, queries read, outputs written

                def paged(q=q, kc=kc, vc=vc, meta=meta, out=out, scale=scale):
                    with use_backend("triton"):
                        paged_attention(q, kc, vc, meta, scale=scale, out=out)

                t = bench(paged)
                row.update(triton_us=t * 1e6, triton_gbps=moved / t / 1e9, triton_frac=moved / t / copy_bw)
                # Peak memory stays at two copies of K/V: each paged cache goes once its copy exists.
                tables = meta.block_tables
                del paged, meta
                k4 = contiguous_kv(kc, tables, ctx)
                del kc
                v4 = contiguous_kv(vc, tables, ctx)
                del vc, tables
                q4 = q.view(batch, hq, 1, d)
                try:
                    t = bench(lambda q4=q4, k4=k4, v4=v4, s=scale: F.scaled_dot_product_attention(
                        q4, k4, v4, scale=s, enable_gqa=True
                    ))  # fmt: skip
                    row.update(sdpa_us=t * 1e6, sdpa_gbps=moved / t / 1e9, sdpa_frac=moved / t / copy_bw)
                except RuntimeError as exc:  # torch.cuda.OutOfMemoryError included
                    row["sdpa_error"] = str(exc).splitlines()[0][:200]
                del q, q4, k4, v4, out
                rows.append(row)
                print(_decode_line(row), flush=True)
    return rows


def _decode_line(r: dict) -> str:
    if "skipped" in r:
        return f"| {r['model']} | {r['batch']} | {r['context']} | skipped: {r['skipped']} | | | | | |"
    sdpa = (
        f"{r['sdpa_us']:.1f} | {r['sdpa_gbps']:.0f} | {100 * r['sdpa_frac']:.0f}%"
        if "sdpa_us" in r
        else f"error: {r.get('sdpa_error', '?')} | | "
    )
    speedup = f"{r['sdpa_us'] / r['triton_us']:.2f}x" if "sdpa_us" in r else ""
    return (
        f"| {r['model']} | {r['batch']} | {r['context']} | {r['triton_us']:.1f} | {r['triton_gbps']:.0f} | "
        f"{100 * r['triton_frac']:.0f}% | {sdpa} | {speedup} |"
    )


DECODE_HEADER = (
    "| heads | batch | context | Triton µs | Triton GB/s | % copy bw | SDPA µs | SDPA GB/s | % copy bw | "
    "speedup (SDPA time / Triton time) |\n|---|---|---|---|---|---|---|---|---|---|"
)


def device_slug(device: str) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu-{platform.machine()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run_gpu(args: argparse.Namespace) -> int:
    device = "cpu" if args.dry_run else "cuda"
    bench = timer(device)
    print(f"# paged attention on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU (dry run)'}\n")
    checks = check_correctness(device, small=args.dry_run)
    print("| check | dtype | rel err | ok |\n|---|---|---|---|")
    for c in checks:
        print(f"| {c['check']} | {c['dtype']} | {c['rel_err']:.2e} | {'yes' if c['ok'] else 'NO'} |")
    copy_bw = copy_bandwidth(device, (4 << 30) if device == "cuda" else (64 << 20), bench)
    print(f"\ndevice-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)\n")
    print(DECODE_HEADER, flush=True)
    decode = time_decode(device, args.models, args.batches, args.contexts, copy_bw, bench)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "block_size": BLOCK_SIZE,
        "dtype": "bfloat16" if device == "cuda" else "float16",
        "copy_bandwidth_Bps": copy_bw,
        "correctness": checks,
        "decode": decode,
    }
    out = args.out or (None if args.dry_run else RESULTS / f"kernels-{device_slug(device)}.json")
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {out}")
    failed = [c for c in checks if not c["ok"]]
    if failed:
        print(f"\n{len(failed)} correctness check(s) FAILED", file=sys.stderr)
        return 1
    return 0


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "absent"


# --- CPU reference timings ----------------------------------------------------------------------


def run_cpu(args: argparse.Namespace) -> int:
    """The reference (the engine's CPU path) vs SDPA on contiguous K/V, SmolLM2-135M shapes."""
    from pagedq_kernels import paged_attention

    torch.set_num_threads(args.threads)
    bench = timer("cpu")
    heads = MODELS["smollm2"]
    hq, hkv, d = heads
    scale = d**-0.5
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(100, 601, (64,), generator=gen).tolist()
    rows = []
    print(f"# torch reference on CPU, {args.threads} threads, SmolLM2-135M heads (Hq={hq}, Hkv={hkv}, D={d})\n")
    print("| case | dtype | reference ms | first layer of a step ms | SDPA contiguous ms |\n|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        q, kc, vc, meta = build_problem(lens, [1] * 64, heads, dtype, "cpu")
        out = torch.empty_like(q)
        paged_attention(q, kc, vc, meta, scale=scale, out=out)  # builds the step's memo
        per_layer = bench(lambda q=q, kc=kc, vc=vc, m=meta, o=out: paged_attention(q, kc, vc, m, scale=scale, out=o))
        first = bench(
            lambda q=q, kc=kc, vc=vc, m=meta, o=out: paged_attention(q, kc, vc, _fresh(m), scale=scale, out=o)
        )
        # SDPA over the same K/V, contiguous [B, Hkv, Lmax, D], masked past each length; G query heads
        # per KV head as G query rows (the fastest SDPA form on CPU; enable_gqa is slower in bf16).
        lmax = max(lens)
        k4 = contiguous_kv(kc, meta.block_tables, lmax)
        v4 = contiguous_kv(vc, meta.block_tables, lmax)
        mask = (torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
        qg = q.view(64, hkv, hq // hkv, d)
        sdpa = bench(
            lambda qg=qg, k4=k4, v4=v4, mask=mask: F.scaled_dot_product_attention(
                qg, k4, v4, attn_mask=mask, scale=scale
            )
        )
        rows.append(
            {"case": "decode b=64 ctx 100..600", "dtype": name, "ref_ms": per_layer * 1e3,
             "ref_first_layer_ms": first * 1e3, "sdpa_ms": sdpa * 1e3}
        )  # fmt: skip
        for ctx in (0, 512):
            q, kc, vc, meta = build_problem([ctx + 512], [512], heads, dtype, "cpu")
            out = torch.empty_like(q)
            paged_attention(q, kc, vc, meta, scale=scale, out=out)
            t = bench(lambda q=q, kc=kc, vc=vc, m=meta, o=out: paged_attention(q, kc, vc, m, scale=scale, out=o))
            k4 = contiguous_kv(kc, meta.block_tables, ctx + 512)
            v4 = contiguous_kv(vc, meta.block_tables, ctx + 512)
            q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
            causal = torch.arange(ctx + 512)[None, :] <= (ctx + torch.arange(512))[:, None]
            sdpa = bench(
                lambda q4=q4, k4=k4, v4=v4, c=causal: F.scaled_dot_product_attention(
                    q4, k4, v4, attn_mask=c, scale=scale, enable_gqa=True
                )
            )
            rows.append(
                {"case": f"prefill chunk 512 after {ctx}", "dtype": name, "ref_ms": t * 1e3, "sdpa_ms": sdpa * 1e3}
            )
    for r in rows:
        first = f"{r['ref_first_layer_ms']:.2f}" if "ref_first_layer_ms" in r else ""
        print(f"| {r['case']} | {r['dtype']} | {r['ref_ms']:.2f} | {first} | {r['sdpa_ms']:.2f} |")
    out = Path(args.out) if args.out else RESULTS / f"kernels-{device_slug('cpu')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


def _fresh(meta):
    """The same step's metadata with an empty memo: what the first layer of a step pays."""
    from dataclasses import replace

    return replace(meta, derived={})


# --- main ---------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=_ints, default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--contexts", type=_ints, default=[512, 2048, 8192, 32768])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--out", help="JSON path (default: ops/bench/results/kernels-<device>.json)")
    parser.add_argument("--cpu", action="store_true", help="time the torch reference on CPU instead")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for --cpu")
    parser.add_argument("--dry-run", action="store_true", help="run the GPU flow on CPU (interpreter, tiny)")
    args = parser.parse_args(argv)
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
    if args.cpu:
        return run_cpu(args)
    if args.dry_run:
        # Before any kernel module is imported: @triton.jit reads it when the kernels are defined.
        os.environ["TRITON_INTERPRET"] = "1"
        if args.batches == parser.get_default("batches"):
            args.batches = [1, 2]
        if args.contexts == parser.get_default("contexts"):
            args.contexts = [64, 200]
        return run_gpu(args)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
