"""KV memory: how much of the allocated KV cache holds live tokens, and how many requests fit a budget.

1. Serving run: the pagedq worker's /metrics (`pagedq_kv_cache_waste_perc`, `..._usage_perc`,
   `pagedq_num_requests_running`) scraped during the `random` saturation run of the serve benchmark
   (or a run of its own when `memory` runs alone). Live fraction = 1 - waste.
2. Fixed budget, the real engine (in a subprocess): a KV pool of `--fit-contiguous` x `--max-model-len`
   tokens, the `random` workload submitted at once. A contiguous allocator that reserves
   max-model-len slots per request holds exactly `--fit-contiguous` requests in it; paged allocation
   holds as many as the pool has blocks for: the mean number of running requests while requests were
   waiting for memory (and the peak), with every step's waste.
3. `ops/bench/kv_waste.py`'s simulation (the KV block manager alone, lengths up to max-model-len).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from ops.bench.common import BLOCK_SIZE, child_entry, kv_blocks_for, model_info, run_child
from ops.bench.progress import Progress
from ops.bench.stats import dist
from ops.bench.workloads import Workload, make_workload


def plan_units(args: argparse.Namespace) -> int:
    return 3


def _serving_waste(samples: list[dict]) -> dict:
    live = [s for s in samples if s.get("pagedq_kv_cache_usage_perc", 0) > 0]
    waste = [s.get("pagedq_kv_cache_waste_perc", 0.0) for s in live]
    # The worker refreshes the waste gauge less often than the others: count its distinct values.
    distinct = len({round(w, 9) for w in waste if w > 0})
    return {
        "samples": len(live),
        "waste_updates": distinct,
        "waste": dist(waste),
        "live_fraction_mean": 1 - (sum(waste) / len(waste)) if waste else math.nan,
        "kv_usage": dist(s["pagedq_kv_cache_usage_perc"] for s in live),
        "running": dist(s.get("pagedq_num_requests_running", 0) for s in live),
        "series": [
            [
                round(s["t"], 2),
                s.get("pagedq_kv_cache_usage_perc"),
                s.get("pagedq_kv_cache_waste_perc"),
                s.get("pagedq_num_requests_running"),
            ]
            for s in samples
        ],
    }


def _own_serving_samples(args: argparse.Namespace) -> list[dict]:
    """A saturation run of the `random` workload through a pagedq worker, /metrics scraped."""
    import uuid

    from ops.bench.serving import Worker, run_load, worker_engine
    from worker.service.redis_proc import RedisProcess

    info = model_info(args.model_dir)
    wl = make_workload(args.workload, args.requests, args.seed, info["prompt_vocab"], info["max_model_len"])
    with RedisProcess() as server:
        ns = f"bench-memory-{uuid.uuid4().hex[:6]}"
        worker = Worker(
            "pagedq",
            args,
            server.url,
            ns,
            kv_blocks=kv_blocks_for(wl, info["max_model_len"]),
            engine=worker_engine("pagedq", args),
        )
        try:
            worker.start()
            _, _, samples = run_load(
                server.url, ns, wl.requests, [0.0] * len(wl), timeout=args.child_timeout, sample=worker
            )
        finally:
            worker.stop()
    return samples


def run(args: argparse.Namespace, progress: Progress, context: dict | None = None) -> dict:
    from ops.bench.kv_waste import simulate

    info = model_info(args.model_dir)
    max_len = min(args.max_model_len, info["max_model_len"])
    budget_tokens = args.fit_contiguous * max_len
    out: dict = {
        "kind": "memory",
        "model": info,
        "dtype": args.dtype,
        "threads": args.threads,
        "max_model_len": max_len,
        "budget_tokens": budget_tokens,
        "budget_bytes": budget_tokens * info["kv_bytes_per_token_bf16"] * (2 if args.dtype == "float32" else 1),
    }
    # 1. serving
    progress.start("memory: serving run KV waste")
    serve = (context or {}).get("serve", {}).get("systems", {}).get("pagedq", {})
    samples = serve.get("metrics_samples")
    out["serving_source"] = "serve benchmark (pagedq saturation run)" if samples else "own serving run"
    if not samples:
        try:
            samples = _own_serving_samples(args)
        except Exception as e:
            out["serving_error"] = f"{type(e).__name__}: {e}"
            samples = []
    out["serving"] = _serving_waste(samples)
    progress.done()
    # 2. fixed budget, real engine
    progress.start("memory: fixed KV budget (engine)")
    # Enough requests to keep the pool full: twice what the budget holds at the workload's mean length.
    probe = make_workload(args.workload, 64, args.seed, info["prompt_vocab"], max_len)
    n = max(args.requests, math.ceil(2 * budget_tokens * len(probe) / sum(r.total_tokens for r in probe.requests)))
    wl = make_workload(args.workload, n, args.seed, info["prompt_vocab"], max_len)
    out["engine_workload"] = wl.describe()
    with tempfile.TemporaryDirectory(prefix="pagedq-bench-") as tmp:
        spec = {
            "system": "memory",
            "model": str(args.model_dir),
            "dtype": args.dtype,
            "device": args.device,
            "threads": args.threads,
            "workload": str(wl.save(Path(tmp) / "workload.json")),
            "engine": {"num_kv_blocks": budget_tokens // BLOCK_SIZE, "max_model_len": max_len, **args.engine},
            "max_seconds": 30 if args.quick else 60,
        }
        res = run_child(spec, Path(tmp), args.child_timeout, module="ops.bench.memory")
    out["engine_run"] = res
    fit_contiguous = budget_tokens // max_len
    if "error" not in res:
        out["fit"] = {
            "contiguous": fit_contiguous,
            "paged_mean": res["running_when_full"]["mean"],
            "paged_peak": res["running_peak"],
            "ratio": res["running_when_full"]["mean"] / fit_contiguous,
            "contiguous_workload_max": budget_tokens // max(r.total_tokens for r in wl.requests),
        }
    progress.done()
    # 3. simulation
    progress.start("memory: block manager simulation")
    out["simulation"] = simulate(512, max_len, BLOCK_SIZE, 32, args.seed)
    progress.done()
    # The goal's number: the serving run's waste when the gauge was refreshed there, else the engine's.
    if out["serving"]["waste_updates"] >= 2:
        out["waste_mean"], out["waste_source"] = out["serving"]["waste"]["mean"], "serving /metrics"
    elif "error" not in res:
        out["waste_mean"], out["waste_source"] = res["waste"]["mean"], "engine steps (fixed budget)"
    return out


# --- child: the engine under a fixed KV budget ---------------------------------------------------------


def child_main(spec_path: str) -> int:
    import torch

    from worker import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    wl = Workload.load(spec["workload"])
    llm = LLM(model=spec["model"], dtype=spec["dtype"], device=spec["device"], **spec["engine"])
    eng = llm.engine
    for r in wl.requests:
        eng.add_request(None, list(r.prompt), SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    running_full, running_all, waste, usage = [], [], [], []
    steps = 0
    while eng.has_unfinished_requests() and time.perf_counter() - t0 < spec["max_seconds"]:
        eng.step()
        steps += 1
        snap = eng.snapshot()
        running_all.append(snap.running)
        if snap.waiting:
            running_full.append(snap.running)
        if snap.num_free_kv_blocks < snap.num_kv_blocks:
            waste.append(snap.kv_waste)  # the engine refreshes waste at most twice a second
            usage.append(snap.kv_usage)
    result = {
        "steps": steps,
        "seconds": time.perf_counter() - t0,
        "finished_all": not eng.has_unfinished_requests(),
        "kv_blocks": eng.limits.num_kv_blocks,
        "running_when_full": dist(running_full or running_all),
        "running_peak": max(running_all, default=0),
        "preemptions": eng.snapshot().num_preemptions,
        "waste": dist(waste),
        "usage": dist(usage),
        "generation_tokens": eng.snapshot().generation_tokens,
    }
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(child_entry(child_main))
