"""Serving through Redis: a real redis-server, a real worker process, requests sent with the SDK.

Systems (each its own worker process and key namespace, same model, dtype, threads and requests):

    pagedq          `pagedq worker`, chunked prefill on, the engine's chunking defaults (--chunk-cap sets
                    --long-prefill-token-threshold; --engine-arg any other option)
    pagedq-nochunk  `pagedq worker --no-enable-chunked-prefill`: prefill-only and decode-only steps
    hf-static       ops/bench/baseline_worker.py: the same protocol, transformers static batches of 16
    llama-server    opt-in (--systems names it, or --llama-cpp-dir without --systems): llama.cpp's HTTP
                    server on a GGUF of the same weights and dtype, the same requests streamed over HTTP,
                    not through Redis (ops/bench/llama_server.py); unavailable without its binary

Per system: (1) saturation: the whole `random` workload submitted at once (pagedq: repeated, median);
its requests/s is the saturation rate of the first system, and the Poisson rates are fractions of
it, the same absolute rates for every system; each pagedq saturation run comes right after an offline
run of the same workload, the pair giving the serving goal's ratio (ops/bench/serve_ratio.py);
(2) one run per rate with Poisson arrivals;
(3) pagedq systems only: the `long-prompt` workload's short chats running together, alone and then with
its long prompts arriving while they decode: the inter-token latency of the running short requests
(`long_prompt_run`). `--long-prompt-only` runs (3) alone.

The client (asyncio, `producer_sdk.AsyncClient`; llama-server's: an HTTP SSE one) records when each
streamed chunk arrives. TTFT:
submit to first token. Inter-token latency (ITL): the gaps between chunks of a request (vLLM's
convention; a chunk may carry several tokens when the worker merged steps). TPOT: (e2e - TTFT) /
(tokens - 1). Goodput: requests/s that meet the SLO (TTFT <= --slo-ttft and TPOT <= --slo-tpot).
The pagedq workers' /metrics are scraped during the saturation run (KV usage and waste, for the memory
benchmark).

Threads: every worker (and llama-server) gets `--threads`, and OMP_NUM_THREADS / MKL_NUM_THREADS in
its environment.
"""

from __future__ import annotations

import argparse
import math
import uuid
from collections.abc import Callable

from ops.bench import gateway_load, llama_server
from ops.bench.common import kv_blocks_for, model_info
from ops.bench.progress import Progress
from ops.bench.serve_ratio import OfflinePairs, offline_ref
from ops.bench.serving import ReqResult, Worker, run_load, summarize, worker_engine
from ops.bench.stats import dist, median
from ops.bench.workloads import Workload, make_workload, poisson_arrivals, warmup_requests

SYSTEMS = ("pagedq", "pagedq-nochunk", "hf-static")  # the default list
OPTIONAL = (llama_server.SYSTEM,)  # run only when asked for (cli.serve_systems)


# --- the long-prompt experiment ------------------------------------------------------------------


def long_prompt_run(redis_url: str, namespace: str, wl: Workload, args: argparse.Namespace) -> dict:
    """Running short chats, then the same with long prompts arriving while they decode.

    Run 1: the short chats of `wl` all submitted at once. Their steady state starts when the last
    one has its first token and lasts at least until the first one finishes. Run 2: the same, plus
    the long prompts, submitted at evenly spaced times inside that steady window. Compared: p99 of
    the short requests' inter-token gaps in run 1's steady state, and p99 of their gaps in run 2
    that overlap a long prompt's prefill (its submit to its first token)."""
    shorts = [r for r in wl.requests if r.kind != "long"]
    longs = [r for r in wl.requests if r.kind == "long"]
    timeout = args.child_timeout
    alone, t_alone, _ = run_load(redis_url, namespace, shorts, [0.0] * len(shorts), timeout=timeout)
    ok = [r for r in alone if r.ok]
    steady_from = max((r.t_first for r in ok), default=t_alone) - t_alone
    steady_to = min((r.t_end for r in ok), default=t_alone) - t_alone
    span = max(steady_to - steady_from, 0.0)
    at = [steady_from + (k + 1) * span / (len(longs) + 1) for k in range(len(longs))]
    mixed, t_mixed, _ = run_load(redis_url, namespace, shorts + longs, [0.0] * len(shorts) + at, timeout=timeout)
    long_res = [r for r in mixed if r.kind == "long"]
    windows = [(r.t_submit, r.t_first) for r in long_res if not math.isnan(r.t_first)]
    mixed_shorts = [r for r in mixed if r.kind != "long" and r.ok]

    def during(t: float, gap: float) -> bool:
        return any(t - gap < b and t > a for a, b in windows)

    gaps_alone = [(t - t_alone, g) for r in ok for t, g in r.gaps()]
    steady_alone = [g for t, g in gaps_alone if t > steady_from]
    gaps_mixed = [(t - t_mixed, g) for r in mixed_shorts for t, g in r.gaps()]
    gaps_during = [g for t, g in gaps_mixed if during(t + t_mixed, g)]
    p99_alone = dist(steady_alone)["p99"]
    p99_during = dist(gaps_during)["p99"]
    return {
        "short_requests": len(shorts),
        "long_prompts": [len(r.prompt) for r in longs],
        "long_arrivals_s": at,
        "steady_window_s": [steady_from, steady_to],
        "errors": sorted({r.error for r in alone + mixed if r.error})[:5],
        "itl_alone_s": dist(steady_alone),
        "itl_with_long_s": dist(g for _, g in gaps_mixed),
        "itl_during_long_s": dist(gaps_during),
        "p99_ratio_during": p99_during / p99_alone if p99_alone else math.nan,
        "long_ttft_s": dist(r.ttft for r in long_res),
        "timeline": {
            "alone": [(round(t, 4), round(g, 4)) for t, g in gaps_alone],
            "with_long": [(round(t, 4), round(g, 4)) for t, g in gaps_mixed],
            "long_windows": [(round(a - t_mixed, 4), round(b - t_mixed, 4)) for a, b in windows],
        },
    }


# --- the benchmark ---------------------------------------------------------------------------------


def sat_repeats(system: str, args: argparse.Namespace) -> int:
    return args.repeats if system == "pagedq" else 1


def systems_run(args: argparse.Namespace) -> list[str]:
    return [s for s in args.systems if s.startswith("pagedq")] if args.long_prompt_only else list(args.systems)


def plan_units(args: argparse.Namespace) -> int:
    if getattr(args, "via", "sdk") == "gateway":
        return gateway_load.plan_units(args)
    n = 0
    for s in systems_run(args):
        n += 1 + (0 if args.long_prompt_only else sat_repeats(s, args) + len(args.rates))  # start, saturation, rates
        n += 2 if s.startswith("pagedq") and args.long_requests else 0
        n += sat_repeats(s, args) if _pairs_wanted(s, args) else 0
    return n


def _pairs_wanted(system: str, args: argparse.Namespace) -> bool:
    return system == "pagedq" and not args.long_prompt_only and not args.no_offline_pairs


def run(args: argparse.Namespace, progress: Progress, context: dict | None = None) -> dict:
    if getattr(args, "via", "sdk") == "gateway":
        return gateway_load.run(args, progress)
    from worker.service.redis_proc import RedisProcess

    info = model_info(args.model_dir)
    vocab, max_len = info["prompt_vocab"], info["max_model_len"]
    wl = make_workload(args.workload, args.requests, args.seed, vocab, max_len)
    poisson_wl = Workload(wl.name, wl.seed, wl.requests[: args.serve_requests])
    if len(poisson_wl) < args.serve_requests:
        poisson_wl = make_workload(args.workload, args.serve_requests, args.seed, vocab, max_len)
    long_wl = make_workload("long-prompt", args.long_requests, args.seed, vocab, max_len)
    kv_blocks = max(kv_blocks_for(wl, max_len), kv_blocks_for(poisson_wl, max_len), kv_blocks_for(long_wl, max_len))
    out: dict = {
        "kind": "serve",
        "model": info,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "repeats": args.repeats,
        "workload": wl.describe(),
        "poisson_workload": poisson_wl.describe(),
        "long_prompt_workload": long_wl.describe(),
        "kv_blocks": kv_blocks,
        "chunk_cap": args.chunk_cap,
        "long_prompt_only": args.long_prompt_only,
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "rate_fractions": args.rates,
        "systems": {},
    }
    with RedisProcess() as server:
        for system in systems_run(args):
            entry: dict = {}
            out["systems"][system] = entry
            if system == llama_server.SYSTEM:
                _llama_system(entry, out, args, progress, wl, poisson_wl)
                continue
            ns = f"bench-{system}-{uuid.uuid4().hex[:6]}"
            engine = worker_engine(system, args)
            progress.start(f"serve {system}: starting worker")
            worker = Worker(system, args, server.url, ns, kv_blocks=kv_blocks, engine=engine)
            entry.update(worker_cmd=worker.cmd[2:], engine=engine)
            try:
                worker.start()
                warm = warmup_requests(vocab)
                run_load(server.url, ns, warm, [0.0] * len(warm), timeout=args.child_timeout)
                progress.done()
                if args.long_prompt_only:
                    progress.start(f"serve {system}: long prompts")
                    entry["long_prompt"] = long_prompt_run(server.url, ns, long_wl, args)
                    progress.done(2, note=f"ITL p99 x{entry['long_prompt']['p99_ratio_during']:.1f}")
                    continue

                def load(reqs, arrivals, sample=None, ns=ns):
                    return run_load(server.url, ns, reqs, arrivals, timeout=args.child_timeout, sample=sample)

                pairs = OfflinePairs(args, wl, info) if _pairs_wanted(system, args) else None
                try:
                    _measure(system, entry, out, load, worker, args, progress, wl, poisson_wl, pairs)
                finally:
                    if pairs is not None:
                        pairs.close()
                if system.startswith("pagedq") and args.long_requests:
                    progress.start(f"serve {system}: long prompts")
                    entry["long_prompt"] = long_prompt_run(server.url, ns, long_wl, args)
                    progress.done(2, note=f"ITL p99 x{entry['long_prompt']['p99_ratio_during']:.1f}")
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"
                progress.write(f"[serve] {system} failed: {entry['error'].splitlines()[0]}")
            finally:
                worker.stop()
    out["offline_ref"] = offline_ref(out, args, context or {})
    return out


def _measure(
    system: str,
    entry: dict,
    out: dict,
    load: Callable[..., tuple[list[ReqResult], float, list[dict]]],
    sampled: Worker | None,
    args: argparse.Namespace,
    progress: Progress,
    wl: Workload,
    poisson_wl: Workload,
    pairs: OfflinePairs | None = None,
) -> None:
    """Saturation (repeated for pagedq, median) and the Poisson sweep of one system, into `entry`. The
    first system measured sets the saturation rate the sweep's fractions are of. With `pairs`, an
    offline run of the same workload right before each saturation run."""
    sat_runs, offline_pairs = [], []
    for rep in range(sat_repeats(system, args)):
        if pairs is not None:
            progress.start(f"serve {system}: offline pair {rep + 1}")
            pair = pairs.run(sampled.proc.pid if sampled and sampled.proc else None)
            offline_pairs.append(pair)
            note = f"offline {pair['out_tok_s']:.1f} tok/s" if "out_tok_s" in pair else "offline failed"
            progress.done(note=note)
        progress.start(f"serve {system}: saturation {rep + 1}")
        sample = sampled if system.startswith("pagedq") and rep == 0 else None
        res, _, samples = load(wl.requests, [0.0] * len(wl), sample)
        summary = summarize(res, args.slo_ttft, args.slo_tpot)
        if samples:
            entry["metrics_samples"] = samples
        sat_runs.append(summary)
        progress.done(note=f"{system} {summary['out_tok_s']:.1f} tok/s")
    entry["saturation"] = {
        "runs": sat_runs,
        "out_tok_s": median(s["out_tok_s"] for s in sat_runs),
        "total_tok_s": median(s["total_tok_s"] for s in sat_runs),
        "req_s": median(s["req_s"] for s in sat_runs),
    }
    if pairs is not None:
        entry["saturation"]["offline_pairs"] = offline_pairs
    if out.get("saturation_rate_req_s") is None:
        out["saturation_rate_req_s"] = entry["saturation"]["req_s"]
    sat_rate = out["saturation_rate_req_s"]
    entry["sweep"] = []
    for frac in args.rates:
        rate = frac * sat_rate
        progress.start(f"serve {system}: {frac:g}x ({rate:.2f} req/s)")
        arrivals = poisson_arrivals(len(poisson_wl), rate, args.seed)
        res, _, _ = load(poisson_wl.requests, arrivals)
        summary = summarize(res, args.slo_ttft, args.slo_tpot, keep_samples=True)
        entry["sweep"].append({"fraction": frac, "rate_req_s": rate, **summary})
        progress.done(note=f"p50 TTFT {summary['ttft_s']['p50']:.2f}s")


def _llama_system(
    entry: dict, out: dict, args: argparse.Namespace, progress: Progress, wl: Workload, poisson_wl: Workload
) -> None:
    """llama-server: the same saturation and sweep over HTTP; 'unavailable' (no numbers) without it."""
    units = 1 + sat_repeats(llama_server.SYSTEM, args) + len(args.rates)
    progress.start("serve llama-server: starting")
    found = llama_server.locate(args, args.model_dir)
    if isinstance(found, str):
        entry["unavailable"] = found
        progress.write(f"[serve] llama-server unavailable: {found}")
        progress.done(units)
        return
    binary, gguf = found
    slots, ctx = llama_server.slots_and_ctx([wl, poisson_wl], args.engine.get("max_num_seqs", 256))
    srv = llama_server.LlamaServer(binary, gguf, slots=slots, ctx=ctx, threads=args.threads)
    entry.update(server_cmd=srv.cmd, gguf=str(gguf), slots=slots, ctx_per_slot=ctx)
    try:
        srv.start()
        warm = warmup_requests(out["model"]["prompt_vocab"])
        llama_server.run_load(srv.port, warm, [0.0] * len(warm), timeout=args.child_timeout)
        progress.done()

        def load(reqs, arrivals, sample=None):
            return llama_server.run_load(srv.port, reqs, arrivals, timeout=args.child_timeout)

        _measure(llama_server.SYSTEM, entry, out, load, None, args, progress, wl, poisson_wl)
    except Exception as e:
        entry["error"] = f"{type(e).__name__}: {e}"
        progress.write(f"[serve] llama-server failed: {entry['error'].splitlines()[0]}")
    finally:
        srv.stop()
