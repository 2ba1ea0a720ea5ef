"""Prefix caching: the `shared-prefix` workload (one 512-token system prompt, short user turns) served by a
pagedq worker with prefix caching off, then on (otherwise the chunked `pagedq` serving configuration).

Per setting: the whole workload submitted at once (throughput), then Poisson arrivals at
`--prefix-load` x the saturation rate measured without caching, the same absolute rate for both
(TTFT), repeated `--repeats` times. The quoted TTFT ratio is the median over repeats of p50 TTFT with
caching over p50 TTFT without, paired by repeat. The cache stays warm between runs on a worker, as in
a long-lived server whose system prompt is always in use; the warm-up prompts share nothing with it.
"""

from __future__ import annotations

import argparse
import uuid

from ops.bench.common import kv_blocks_for, model_info
from ops.bench.progress import Progress
from ops.bench.serving import Worker, run_load, summarize, worker_engine
from ops.bench.stats import median
from ops.bench.workloads import make_workload, poisson_arrivals, warmup_requests

SETTINGS = (("cache-off", False), ("cache-on", True))


def plan_units(args: argparse.Namespace) -> int:
    return len(SETTINGS) * (2 + args.repeats)


def run(args: argparse.Namespace, progress: Progress, context: dict | None = None) -> dict:
    from worker.service.redis_proc import RedisProcess

    info = model_info(args.model_dir)
    wl = make_workload("shared-prefix", args.prefix_requests, args.seed, info["prompt_vocab"], info["max_model_len"])
    kv_blocks = kv_blocks_for(wl, info["max_model_len"])
    out: dict = {
        "kind": "prefix",
        "model": info,
        "dtype": args.dtype,
        "threads": args.threads,
        "repeats": args.repeats,
        "workload": wl.describe(),
        "load_fraction": args.prefix_load,
        "settings": {},
    }
    rate = None
    with RedisProcess() as server:
        for name, caching in SETTINGS:
            ns = f"bench-prefix-{name}-{uuid.uuid4().hex[:6]}"
            engine = {**worker_engine("pagedq", args), "enable_prefix_caching": caching}
            worker = Worker("pagedq", args, server.url, ns, kv_blocks=kv_blocks, engine=engine)
            entry: dict = {"engine": engine}
            out["settings"][name] = entry
            try:
                progress.start(f"prefix {name}: starting worker")
                worker.start()
                warm = warmup_requests(info["prompt_vocab"])
                run_load(server.url, ns, warm, [0.0] * len(warm), timeout=args.child_timeout)
                progress.done()
                progress.start(f"prefix {name}: all at once")
                res, _, _ = run_load(server.url, ns, wl.requests, [0.0] * len(wl), timeout=args.child_timeout)
                entry["saturation"] = summarize(res, args.slo_ttft, args.slo_tpot)
                progress.done(note=f"{entry['saturation']['out_tok_s']:.1f} tok/s")
                if rate is None:
                    rate = args.prefix_load * entry["saturation"]["req_s"]
                    out["rate_req_s"] = rate
                entry["poisson"] = []
                for rep in range(args.repeats):
                    progress.start(f"prefix {name}: Poisson {rep + 1}/{args.repeats}")
                    arrivals = poisson_arrivals(len(wl), rate, args.seed + rep)
                    res, _, _ = run_load(server.url, ns, wl.requests, arrivals, timeout=args.child_timeout)
                    entry["poisson"].append(summarize(res, args.slo_ttft, args.slo_tpot, keep_samples=True))
                    progress.done(note=f"TTFT p50 {entry['poisson'][-1]['ttft_s']['p50']:.3f}s")
                m = worker.metrics()
                q, h = m.get("pagedq_prefix_cache_queries_total", 0.0), m.get("pagedq_prefix_cache_hits_total", 0.0)
                entry["prefix_cache"] = {"queries_tokens": q, "hits_tokens": h, "hit_rate": h / q if q else 0.0}
                entry["ttft_p50_s"] = median(p["ttft_s"]["p50"] for p in entry["poisson"])
                entry["out_tok_s"] = entry["saturation"]["out_tok_s"]
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"
                progress.write(f"[prefix] {name} failed: {entry['error'].splitlines()[0]}")
            finally:
                worker.stop()
    on, off = out["settings"].get("cache-on", {}), out["settings"].get("cache-off", {})
    if on.get("poisson") and off.get("poisson"):
        pairs = zip(on["poisson"], off["poisson"])
        out["ttft_p50_ratio"] = median(a["ttft_s"]["p50"] / b["ttft_s"]["p50"] for a, b in pairs)
        out["throughput_ratio"] = on["out_tok_s"] / off["out_tok_s"]
    return out
