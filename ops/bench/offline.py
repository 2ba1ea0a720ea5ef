"""Offline throughput: the same requests through pagedq's `LLM` and three transformers baselines.

Systems (each run in a fresh subprocess, model load and a warm-up excluded from the timing, peak RSS
from `getrusage` in that subprocess, `torch.set_num_threads(threads)`):

    pagedq      worker.LLM, greedy, ignore_eos, KV pool sized to hold the whole workload
    hf-single   transformers `generate`, one request at a time (on a deterministic subset when
                `--single-requests` is below `--requests`: it is the slow one)
    hf-static   transformers `generate`, batches of 16 in arrival order, left padding
    hf-cb       transformers continuous batching (the `generate_batch` engine), tuned sizes
    matmul      a 2048^3 product in the same dtype and threads, the fastest GEMM path here: the ceiling;
                and the memory's streaming rate, for the roofline bound (ops/bench/roofline.py)

Systems run round-robin inside each repeat (the order rotated from one repeat to the next), so slow
drifts of a shared machine hit all of them; each
ratio is pagedq's throughput over the other's in the same repeat, and the median over repeats is
quoted. Greedy agreement: the fraction of requests with identical token ids, and the mean length of
the common prefix.

    python -m ops.bench offline ...                  (or `pagedq bench offline ...`)
    python -m ops.bench.offline --child SPEC.json    (internal: one measurement, run by the harness)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ops.bench.common import BLOCK_SIZE, child_entry, kv_blocks_for, model_info, run_child
from ops.bench.progress import Progress
from ops.bench.roofline import flops_per_token, measure_bandwidth, measure_matmul, model_flops, roofline
from ops.bench.stats import median
from ops.bench.workloads import Workload, make_workload, mean_context, warmup_requests

SYSTEMS = ("pagedq", "hf-single", "hf-static", "hf-cb")


# --- the child side --------------------------------------------------------------------------------


def _cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _pagedq_runner(spec: dict):
    from worker import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], device=spec["device"], **spec.get("engine", {}))

    def gen(reqs):
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
        outs = llm.generate([list(r.prompt) for r in reqs], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def extra() -> dict:
        eng = llm.engine
        snap = eng.snapshot()
        return {
            "kv_blocks": eng.limits.num_kv_blocks,
            "steps": snap.steps,
            "preemptions": snap.num_preemptions,
            "max_num_batched_tokens": eng.limits.max_num_batched_tokens,
            "chunked_prefill": eng.config.enable_chunked_prefill,
        }

    return gen, extra, None


def _hf_runner(spec: dict):
    from ops.bench import hf_baselines as hf

    model = hf.load_hf_model(spec["model"], spec["dtype"], spec["device"])
    system = spec["system"]
    if system == "hf-single":
        return (lambda reqs: hf.run_single(model, reqs)), dict, None
    if system == "hf-static":
        bs = spec.get("batch_size", 16)
        return (lambda reqs: hf.run_static(model, reqs, bs)), (lambda: {"batch_size": bs}), None
    cb = hf.HFContinuousBatching(model, spec.get("preset", hf.DEFAULT_CB_PRESET), spec.get("kv_tokens"))
    return cb.generate, (lambda: {"preset": spec.get("preset"), "config": cb.resolved_config()}), cb


def child_main(spec_path: str) -> int:
    import contextlib

    import torch

    from ops.bench.hf_baselines import sync

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    result: dict[str, Any] = {"system": spec["system"], "threads": torch.get_num_threads()}
    if spec["system"] == "matmul":
        result.update(measure_matmul(spec["dtype"], spec["device"]))
        result["bandwidth"] = measure_bandwidth(spec["device"])["bytes_per_s"]
    else:
        wl = Workload.load(spec["workload"])
        if spec.get("indices") is not None:
            wl = wl.subset(spec["indices"])
        t0 = time.perf_counter()
        gen, extra, ctx = (_pagedq_runner if spec["system"] == "pagedq" else _hf_runner)(spec)
        with ctx if ctx is not None else contextlib.nullcontext():
            gen(warmup_requests(spec["vocab_size"]))
            sync(spec["device"])
            result["load_and_warmup_s"] = time.perf_counter() - t0
            load0, cpu0, t0 = os.getloadavg()[0], _cpu_seconds(), time.perf_counter()
            tokens = gen(wl.requests)
            sync(spec["device"])
            elapsed = time.perf_counter() - t0
            # How much of `threads` cores this process got while timed (below ~1 on a busy machine,
            # and below 1 anyway where the work is single-threaded): a noise indicator.
            result["cpu_share"] = (_cpu_seconds() - cpu0) / (elapsed * spec["threads"])
            result["loadavg_1m"] = [load0, os.getloadavg()[0]]
            result.update(extra())
        produced = sum(len(t) for t in tokens)
        result.update(
            tokens=tokens,
            elapsed_s=elapsed,
            requests=len(wl),
            prompt_tokens=wl.prompt_tokens,
            output_tokens=produced,
            expected_output_tokens=wl.output_tokens,
            out_tok_s=produced / elapsed,
            total_tok_s=(produced + wl.prompt_tokens) / elapsed,
        )
    result["peak_rss_mb"] = _peak_rss_mb()
    if spec["device"].startswith("cuda"):
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


# --- the parent side -------------------------------------------------------------------------------


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    """Identical-output fraction and mean common-prefix length (tokens, and as a fraction of length)."""
    same, prefix, frac = 0, [], []
    for a, b in zip(ref, other, strict=True):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        same += a == b
        prefix.append(k)
        frac.append(k / max(len(a), 1))
    n = len(ref)
    return {
        "n": n,
        "identical": same / n if n else math.nan,
        "mean_common_prefix": sum(prefix) / n if n else math.nan,
        "mean_common_prefix_frac": sum(frac) / n if n else math.nan,
    }


def single_indices(n: int, k: int | None) -> list[int] | None:
    """k requests spread evenly over the workload (None: all of them)."""
    if not k or k >= n:
        return None
    return sorted({round(i * n / k) for i in range(k)})


def plan_units(args: argparse.Namespace) -> int:
    sweep = len(args.hf_cb_sweep) - 1 if "hf-cb" in args.systems and args.hf_cb_sweep else 0
    return args.repeats * (1 + len(args.systems)) + sweep


def child_base(args: argparse.Namespace, info: dict) -> dict:
    """What every measured child process gets: model, dtype, device, threads, prompt vocabulary."""
    return {
        "model": str(args.model_dir),
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "vocab_size": info["prompt_vocab"],
    }


def pagedq_engine(args: argparse.Namespace, kv_blocks: int) -> dict:
    """The offline pagedq's engine options: a KV cache of `kv_blocks`, then --engine-arg."""
    return {"num_kv_blocks": kv_blocks, **args.engine}


def run(args: argparse.Namespace, progress: Progress) -> dict:
    model_dir = str(args.model_dir)
    info = model_info(model_dir)
    wl = make_workload(args.workload, args.requests, args.seed, info["prompt_vocab"], info["max_model_len"])
    kv_blocks = kv_blocks_for(wl, info["max_model_len"])
    base = child_base(args, info)
    engine = pagedq_engine(args, kv_blocks)
    single_idx = single_indices(len(wl), args.single_requests)
    runs: dict[str, list[dict]] = {s: [] for s in ("matmul", *args.systems)}
    errors: dict[str, str] = {}
    sweep: list[dict] = []
    cb_preset = args.hf_cb
    timeout = args.child_timeout
    with tempfile.TemporaryDirectory(prefix="pagedq-bench-") as tmp_name:
        tmp = Path(tmp_name)
        wl_path = str(wl.save(tmp / "workload.json"))
        for rep in range(args.repeats):
            # Rotated each repeat, so a burst of load from a neighbour does not always hit the same system.
            order = args.systems[rep % len(args.systems) :] + args.systems[: rep % len(args.systems)]
            for system in ("matmul", *order):
                spec = {**base, "system": system, "workload": wl_path}
                if system == "pagedq":
                    spec["engine"] = engine
                elif system == "hf-single":
                    spec["indices"] = single_idx
                elif system == "hf-static":
                    spec["batch_size"] = args.static_batch
                elif system == "hf-cb":
                    if rep > 0 and cb_preset is None:  # every preset failed in repeat 1
                        progress.done()
                        continue
                    spec["kv_tokens"] = kv_blocks * BLOCK_SIZE
                    if rep == 0 and args.hf_cb_sweep:
                        cb_preset = _sweep_cb(spec, args.hf_cb_sweep, tmp, timeout, progress, sweep, runs, errors)
                        continue
                    spec["preset"] = cb_preset
                progress.start(f"offline {rep + 1}/{args.repeats} {system}")
                res = run_child(spec, tmp, timeout, "ops.bench.offline")
                if "error" in res:
                    errors[system] = res["error"]
                    progress.write(f"[offline] {system} failed: {res['error'].splitlines()[0]}")
                else:
                    runs[system].append({**res, "repeat": rep})
                progress.done(note=_note(system, res))
    return _assemble(args, info, wl, kv_blocks, runs, errors, sweep, cb_preset, single_idx)


def _sweep_cb(spec, presets, tmp, timeout, progress, sweep, runs, errors) -> str | None:
    """Repeat 1 of hf-cb: every preset once; the fastest is kept for the other repeats."""
    best, best_rate = None, -1.0
    for preset in presets:
        progress.start(f"offline 1 hf-cb sweep {preset}")
        res = run_child({**spec, "preset": preset}, tmp, timeout, "ops.bench.offline")
        entry = {"preset": preset, "out_tok_s": res.get("out_tok_s"), "peak_rss_mb": res.get("peak_rss_mb")}
        if "error" in res:
            entry["error"] = res["error"][-1500:]
            progress.write(f"[offline] hf-cb preset {preset} failed: {res['error'].splitlines()[0]}")
        elif res["out_tok_s"] > best_rate:
            best, best_rate = preset, res["out_tok_s"]
            runs["hf-cb"][:] = [{**res, "repeat": 0}]
        sweep.append(entry)
        progress.done(note=_note("hf-cb", res))
    if best is None:
        errors["hf-cb"] = "every preset failed: " + "; ".join(str(e.get("error", ""))[:300] for e in sweep)
    return best


def _note(system: str, res: dict) -> str:
    if "error" in res:
        return f"{system} failed"
    if system == "matmul":
        return f"matmul {res['flops'] / 1e9:.0f} GFLOP/s"
    return f"{system} {res['out_tok_s']:.1f} tok/s"


def _paired(a: list[dict], b: list[dict]) -> list[tuple[dict, dict]]:
    """Runs of two systems from the same repeat."""
    by_repeat = {r["repeat"]: r for r in b}
    return [(x, by_repeat[x["repeat"]]) for x in a if x["repeat"] in by_repeat]


def _assemble(args, info, wl, kv_blocks, runs, errors, sweep, cb_preset, single_idx) -> dict:
    systems: dict[str, dict] = {}
    for s in args.systems:
        rs = runs[s]
        systems[s] = {
            "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rs],
            "out_tok_s": median(r["out_tok_s"] for r in rs),
            "total_tok_s": median(r["total_tok_s"] for r in rs),
            "peak_rss_mb": median(r["peak_rss_mb"] for r in rs),
            "cpu_share": median(r["cpu_share"] for r in rs),
            "elapsed_s": median(r["elapsed_s"] for r in rs),
            "requests": rs[0]["requests"] if rs else None,
            "subset": s == "hf-single" and single_idx is not None,
            "error": errors.get(s),
        }
        if rs and "peak_gpu_mb" in rs[0]:
            systems[s]["peak_gpu_mb"] = median(r["peak_gpu_mb"] for r in rs)
    pq = runs.get("pagedq", [])
    ratios, agree = {}, {}
    for s in args.systems:
        if s == "pagedq" or not pq or not runs[s]:
            continue
        # Paired by repeat: both measured in the same round, under the same machine conditions.
        # (hf-cb's sweep winner was measured in repeat 1, so it pairs with pagedq's repeat 1.)
        pairs = _paired(pq, runs[s])
        ratios[s] = median(a["out_tok_s"] / b["out_tok_s"] for a, b in pairs)
        ref = pq[0]["tokens"]
        if s == "hf-single" and single_idx is not None:
            ref = [ref[i] for i in single_idx]
        agree[s] = agreement(ref, runs[s][0]["tokens"])
    mm = runs.get("matmul", [])
    ceiling: dict[str, Any] = {"matmul_flops": median(r["flops"] for r in mm)}
    useful = model_flops(info, wl)
    ctx = mean_context(wl)
    ceiling.update(
        model_flops_total=useful,
        flops_per_token=flops_per_token(info, ctx),
        mean_context=ctx,
        matmul_size=mm[0]["n"] if mm else None,
        matmul_path=mm[0].get("path") if mm else None,
    )
    if pq and mm:
        pairs = _paired(pq, mm)
        ceiling["achieved_flops"] = median(useful / a["elapsed_s"] for a in pq)
        ceiling["fraction"] = median(useful / a["elapsed_s"] / b["flops"] for a, b in pairs)
        ceiling["fraction_brief_formula"] = median(
            ceiling["flops_per_token"] * a["total_tok_s"] / b["flops"] for a, b in pairs
        )
        if all("bandwidth" in b and "steps" in a for a, b in pairs):
            ceiling["bandwidth"] = median(b["bandwidth"] for b in mm)
            ceiling["roofline"] = roofline(
                info,
                wl,
                args.dtype,
                steps=median(a["steps"] for a in pq),
                useful_flops=useful,
                matmul_flops=ceiling["matmul_flops"],
                bandwidth=ceiling["bandwidth"],
                elapsed_s=median(a["elapsed_s"] for a in pq),
            )
    return {
        "kind": "offline",
        "model": info,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "repeats": args.repeats,
        "workload": wl.describe(),
        "kv_blocks": kv_blocks,
        "engine": {"num_kv_blocks": kv_blocks, **args.engine},
        "single_subset": single_idx,
        "static_batch": args.static_batch,
        "hf_cb": {"preset": cb_preset, "sweep": sweep},
        "systems": systems,
        "ratios": ratios,
        "agreement": agree,
        "ceiling": ceiling,
        "errors": errors,
    }


if __name__ == "__main__":
    sys.exit(child_entry(child_main))
