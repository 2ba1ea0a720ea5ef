"""Tenant isolation: a tenant far over its quota gets `RateLimited` while another tenant's time to first
token stays close to what it is alone.

    python -m ops.bench.tenants                          # tiny model, about 2.5 minutes on 2 cores
    python -m ops.bench.tenants --model smollm2 --calm-rate 0.5    # SmolLM2 needs a lower rate (at 2/s on
                                                                   # 2 cores calm's requests took a median 6-9 s)
    python -m ops.bench.tenants --duration 3 --out /tmp/results    # seconds: a smoke run

Setup: a real redis-server and one real `pagedq worker` process (prefix caching off: every phase sends
the same prompts). Tenant "calm" has no quota; tenant "noisy" has `--noisy-max-queued` (4) outstanding
requests (and `--noisy-rpm` requests per minute, if given), set with `producer_sdk.tenants.set_quota`.

Phases, with the same calm requests (64 prompt + 32 output tokens) at the same Poisson arrival times
(`--calm-rate` 4/s for `--duration` 40 s): (1) calm alone; (2) calm while noisy, a client in its own
process (ops/bench/tenant_noisy.py), submits a burst of `--overload` (10) x its max_queued requests every
`--burst-interval` (0.25 s), each submit once (nothing retried), and reads every accepted answer to its
end (its requests are 64 + 128 tokens, so they hold their slots); (3) calm alone again, so that a shared
machine's drift shows. Calm's reference p99 is the mean of the two solo phases' p99; the goal is p99
with noisy <= 1.2x of it.

TTFT: from the SDK's `submit` call to the first streamed token (`ops.bench.serving.drive`). Recorded
with each phase, to tell where the time went: the parts of calm's TTFT by the worker's own timings
(submit to first schedule, the step that computes the first token, delivery to the client), noisy's
outstanding count and the engine's waiting and running requests (sampled every 0.5 s), and the CPU
cores each process used. The result goes to ops/bench/results/tenants-<timestamp>.json (and
latest/tenants.json).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
import uuid
from pathlib import Path

from ops.bench.common import model_info, resolve_model
from ops.bench.stats import dist
from ops.bench.tenant_noisy import NOISY, NoisyProcess, make_requests
from ops.bench.workloads import poisson_arrivals

GOAL_RATIO = 1.2
CALM = "calm"
PHASES = ("solo", "with_noisy", "solo_again")


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system, all threads) a process has used so far; NaN where /proc cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, TypeError):
        return math.nan


class Sampler:
    """Every `period` s on a thread: noisy's outstanding requests (the count its max_queued quota reads)
    and the worker's waiting and running requests (its /metrics)."""

    def __init__(self, redis_url: str, namespace: str, worker, period: float = 0.5) -> None:
        self.redis_url, self.namespace, self.worker, self.period = redis_url, namespace, worker, period
        self.outstanding: list[int] = []
        self.waiting: list[float] = []
        self.running: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import redis

        from producer_sdk.contract import keys

        r = redis.Redis.from_url(self.redis_url)
        try:
            while not self._stop.wait(self.period):
                self.outstanding.append(int(r.hget(keys.tenant_queued(self.namespace), NOISY) or 0))
                try:
                    m = self.worker.metrics()
                except OSError:
                    continue
                self.waiting.append(m.get("pagedq_num_requests_waiting", math.nan))
                self.running.append(m.get("pagedq_num_requests_running", math.nan))
        finally:
            r.close()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        return {
            "noisy_outstanding": dist(self.outstanding),
            "engine_waiting": dist(self.waiting),
            "engine_running": dist(self.running),
        }


# --- the benchmark ---------------------------------------------------------------------------------


def calm_summary(results) -> dict:
    ok = [r for r in results if r.ok]
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": sorted({r.error or f"{r.tokens}/{r.max_tokens} tokens" for r in results if not r.ok})[:5],
        "ttft_s": dist(r.ttft for r in ok),
        # The worker's timings of the same requests (its clock is this machine's): submit to first
        # schedule (Redis, intake, admission, waiting for a step), first schedule to first token (the
        # step that computes it), and first token to the client seeing it (publish, XREAD).
        "worker_queue_s": dist(r.worker_queue_s for r in ok),
        "worker_compute_s": dist(r.worker_ttft_s - r.worker_queue_s for r in ok),
        "delivery_s": dist(r.ttft - r.worker_ttft_s for r in ok),
        "e2e_s": dist(r.e2e for r in ok),
        "itl_s": dist(g for r in ok for _, g in r.gaps()),
        "ttft_samples_s": [round(r.ttft, 5) for r in ok],
    }


def run(args: argparse.Namespace, tmp: Path) -> dict:
    import redis

    from ops.bench.serving import Worker, run_load
    from ops.bench.workloads import warmup_requests
    from producer_sdk import tenants
    from worker.service.redis_proc import RedisProcess

    info = model_info(args.model_dir)
    vocab = info["prompt_vocab"]
    n_calm = max(1, round(args.calm_rate * args.duration))
    calm = make_requests(n_calm, args.prompt_len, args.max_tokens, vocab, f"calm:{args.seed}")
    arrivals = poisson_arrivals(n_calm, args.calm_rate, args.seed)
    burst = args.overload * args.noisy_max_queued
    longest = max(args.prompt_len + args.max_tokens, args.noisy_prompt_len + args.noisy_max_tokens)
    kv_blocks = (math.ceil(longest / 16) + 1) * (min(n_calm, 64) + args.noisy_max_queued + 8)
    ns = f"bench-tenants-{uuid.uuid4().hex[:6]}"
    out: dict = {
        "model": info,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "kv_blocks": kv_blocks,
        "goal_ratio": GOAL_RATIO,
        "calm": {
            "tenant": CALM,
            "quota": None,
            "rate_req_s": args.calm_rate,
            "duration_s": args.duration,
            "requests": n_calm,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
        },
        "noisy_setup": {
            "tenant": NOISY,
            "quota": {"max_queued": args.noisy_max_queued, "requests_per_minute": args.noisy_rpm},
            "overload": args.overload,
            "burst": burst,
            "burst_interval_s": args.burst_interval,
            "prompt_len": args.noisy_prompt_len,
            "max_tokens": args.noisy_max_tokens,
        },
        "phases": {},
    }
    with RedisProcess() as server:
        r = redis.Redis.from_url(server.url)
        tenants.set_quota(r, NOISY, max_queued=args.noisy_max_queued, requests_per_minute=args.noisy_rpm)
        wargs = argparse.Namespace(
            model_dir=args.model_dir, dtype=args.dtype, device=args.device, threads=args.threads, engine={}
        )
        engine: dict = {"enable_prefix_caching": False}
        if args.fair_share_prefill_tokens is not None:
            engine["fair_share_prefill_tokens"] = args.fair_share_prefill_tokens
        worker = Worker("pagedq", wargs, server.url, ns, kv_blocks=kv_blocks, engine=engine)
        out["worker_cmd"] = worker.cmd[2:]
        noisy = None
        try:
            _say(args, "starting the worker")
            worker.start()
            warm = warmup_requests(vocab, n=4)
            run_load(server.url, ns, warm, [0.0] * len(warm), timeout=args.timeout, tenant=CALM)
            for phase in PHASES:
                if phase == "with_noisy":
                    spec = {
                        "redis_url": server.url,
                        "namespace": ns,
                        "burst": burst,
                        "interval_s": args.burst_interval,
                        "prompt_len": args.noisy_prompt_len,
                        "max_tokens": args.noisy_max_tokens,
                        "vocab": vocab,
                        "timeout": args.timeout,
                        "drain_s": args.timeout,
                    }
                    noisy = NoisyProcess(spec, tmp, args.threads)
                    noisy.start(r)
                    time.sleep(args.lead)  # noisy's slots are full before calm's first request
                _say(args, f"phase {phase}: {n_calm} calm requests over {arrivals[-1]:.0f} s")
                pids = {"worker": worker.proc.pid, "redis": server.proc.pid, "calm_client": os.getpid()}
                if noisy is not None:
                    pids["noisy_client"] = noisy.proc.pid
                cpu0, wall0 = {k: cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
                with Sampler(server.url, ns, worker) as sampler:
                    res, _, _ = run_load(server.url, ns, calm, arrivals, timeout=args.timeout, tenant=CALM)
                wall = time.monotonic() - wall0
                cpu = {k: (cpu_seconds(p) - cpu0[k]) / wall for k, p in pids.items()}
                out["phases"][phase] = {**calm_summary(res), **sampler.summary(), "wall_s": wall, "cpu_cores": cpu}
                if noisy is not None:
                    out["noisy"] = noisy.stop(r)
                    noisy = None
            use = tenants.usage(r, models=[ns], tenants=[NOISY])[0]
            out["noisy_outstanding_after"] = use.queued.get(ns, 0)  # back to 0 once its requests ended
        finally:
            if noisy is not None:
                noisy.kill()
            worker.stop()
            r.close()
    p99 = {p: out["phases"][p]["ttft_s"]["p99"] for p in PHASES}
    solo = (p99["solo"] + p99["solo_again"]) / 2
    out["calm_ttft_p99_solo_ref_s"] = solo
    out["ratio_p99"] = p99["with_noisy"] / solo if solo else math.nan
    out["ratio_p99_vs_first_solo"] = p99["with_noisy"] / p99["solo"] if p99["solo"] else math.nan
    out["goal_met"] = out["ratio_p99"] <= GOAL_RATIO and out.get("noisy", {}).get("rate_limited", 0) > 0
    return out


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        print(f"[tenants] {text}", file=sys.stderr, flush=True)


def print_summary(result: dict) -> None:
    calm, noisy, setup = result["calm"], result.get("noisy", {}), result["noisy_setup"]
    print(
        f"model {result['model']['folder']}, {result['dtype']} on {result['device']}, {result['threads']} threads; "
        f"calm: {calm['requests']} requests at {calm['rate_req_s']:g}/s (Poisson), "
        f"{calm['prompt_len']} prompt + {calm['max_tokens']} output tokens"
    )
    q = setup["quota"]
    print(
        f"noisy: quota max_queued={q['max_queued']}, requests_per_minute={q['requests_per_minute'] or 'unlimited'}; "
        f"bursts of {setup['burst']} ({setup['overload']}x max_queued) every {setup['burst_interval_s']:g} s"
    )
    if "error" in noisy:
        print(f"noisy client failed: {noisy['error'].splitlines()[0]}")
    else:
        print(
            f"noisy: sent {noisy['sent']} in {noisy['bursts']} bursts, accepted {noisy['accepted']}, "
            f"RateLimited {noisy['rate_limited']} {noisy['rate_limited_by_quota']}, finished {noisy['finished']}"
        )
    for phase in PHASES:
        p = result["phases"][phase]
        t = p["ttft_s"]
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in p["cpu_cores"].items())
        print(
            f"calm TTFT {phase:<10}: p50 {1000 * t['p50']:7.1f} ms  p99 {1000 * t['p99']:7.1f} ms  "
            f"max {1000 * t['max']:7.1f} ms  ({p['ok']}/{p['requests']} ok); noisy outstanding mean "
            f"{p['noisy_outstanding']['mean']:.1f}, engine waiting max {p['engine_waiting']['max']:.0f}; "
            f"CPU cores used: {cpu}"
        )
        parts = ", ".join(
            f"{name} {1000 * p[key]['p50']:.1f} / {1000 * p[key]['p99']:.1f}"
            for name, key in (("to first schedule", "worker_queue_s"), ("step", "worker_compute_s"))
        )
        print(
            f"    parts of it, p50 / p99 ms: {parts}, delivery {1000 * p['delivery_s']['p50']:.1f} / "
            f"{1000 * p['delivery_s']['p99']:.1f}"
        )
    print(
        f"calm TTFT p99 with noisy / solo (mean of both solo runs): {result['ratio_p99']:.2f}x "
        f"(goal <= {GOAL_RATIO}x; vs the first solo run {result['ratio_p99_vs_first_solo']:.2f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m ops.bench.tenants", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="model folder, 'tiny' (default) or 'smollm2'")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the worker")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of calm arrivals per phase")
    p.add_argument("--calm-rate", type=float, default=4.0, help="calm's requests per second (Poisson)")
    p.add_argument("--prompt-len", type=int, default=64, help="calm's prompt tokens")
    p.add_argument("--max-tokens", type=int, default=32, help="calm's output tokens (EOS ignored)")
    p.add_argument("--noisy-max-queued", type=int, default=4, help="noisy's quota: outstanding requests")
    p.add_argument("--noisy-rpm", type=int, default=0, help="noisy's quota: requests per minute (0: none)")
    p.add_argument("--overload", type=int, default=10, help="noisy's burst, in multiples of its max_queued")
    p.add_argument("--burst-interval", type=float, default=0.25, help="seconds between noisy's bursts")
    p.add_argument("--noisy-prompt-len", type=int, default=None, help="noisy's prompt tokens (default: calm's)")
    p.add_argument("--noisy-max-tokens", type=int, default=128, help="noisy's output tokens: it holds its slots")
    p.add_argument("--lead", type=float, default=1.0, help="seconds noisy runs before calm's phase starts")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take")
    p.add_argument(
        "--fair-share-prefill-tokens", type=int, default=None, help="the worker's option (default: the engine's)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results folder (default ops/bench/results)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.noisy_max_queued < 1 or args.overload < 1:
        p.error("--noisy-max-queued and --overload must be at least 1")
    args.noisy_prompt_len = args.noisy_prompt_len or args.prompt_len

    import tempfile

    from ops.bench.machine import machine_info
    from ops.bench.results import save_result

    args.model_dir = resolve_model(args.model)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pagedq-bench-tenants-") as tmp:
        result = {
            "benchmark": "tenants",
            "command": " ".join(["python -m ops.bench.tenants", *argv]),
            "machine": machine_info(args.threads, args.device),
            **run(args, Path(tmp)),
        }
    result["wall_s"] = time.monotonic() - started
    path = save_result("tenants", result, args.out)
    print_summary(result)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
