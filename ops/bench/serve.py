"""Serving through Redis: a real redis-server, a real worker process, requests sent with the SDK.

Systems (each its own worker process and key namespace, same model, dtype, threads and requests):

    pagedq          `pagedq worker`, chunked prefill on (a prompt gets at most --chunk-cap tokens a step)
    pagedq-nochunk  `pagedq worker --no-enable-chunked-prefill`: prefill-only and decode-only steps
    hf-static       ops/bench/baseline_worker.py: the same protocol, transformers static batches of 16

Per system: (1) saturation: the whole `random` workload submitted at once (pagedq: repeated, median);
its requests/s is the saturation rate of the first system, and the Poisson rates are fractions of
it, the same absolute rates for every system; (2) one run per rate with Poisson arrivals;
(3) pagedq systems: the `long-prompt` workload's short chats running together, alone and then with
its long prompts arriving while they decode: the inter-token latency of the running short requests
(`long_prompt_run`).

The client (asyncio, `producer_sdk.AsyncClient`) records when each streamed chunk arrives. TTFT:
submit to first token. Inter-token latency (ITL): the gaps between chunks of a request (vLLM's
convention; a chunk may carry several tokens when the worker merged steps). TPOT: (e2e - TTFT) /
(tokens - 1). Goodput: requests/s that meet the SLO (TTFT <= --slo-ttft and TPOT <= --slo-tpot).
The worker's /metrics are scraped during the saturation run (KV usage and waste, for the memory
benchmark).

Threads: both workers get `--threads`, and OMP_NUM_THREADS / MKL_NUM_THREADS in their environment.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ops.bench.offline import REPO, child_env, kv_blocks_for, model_info
from ops.bench.report import Progress, dist, load_latest, median
from ops.bench.workloads import BenchRequest, Workload, make_workload, poisson_arrivals, warmup_requests

SYSTEMS = ("pagedq", "pagedq-nochunk", "hf-static")
MAX_SAMPLES = 4000  # raw latency samples kept in the JSON (for the CDF plots)
SAMPLED = (  # worker metrics kept from the /metrics scrapes
    "pagedq_num_requests_running",
    "pagedq_num_requests_waiting",
    "pagedq_kv_cache_usage_perc",
    "pagedq_kv_cache_waste_perc",
    "pagedq_generation_tokens_total",
    "pagedq_prompt_tokens_total",
    "pagedq_num_preemptions_total",
)


# --- workers -------------------------------------------------------------------------------------


def _engine_flags(engine: dict) -> list[str]:
    flags = []
    for k, v in engine.items():
        name = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            flags.append(name if v else "--no-" + name[2:])
        else:
            flags += [name, str(v)]
    return flags


class Worker:
    """A worker process serving namespace `pagedq:{namespace}:*`, ready once it heartbeats."""

    def __init__(
        self,
        kind: str,
        args: argparse.Namespace,
        redis_url: str,
        namespace: str,
        *,
        kv_blocks: int,
        engine: dict | None = None,
    ) -> None:
        from worker.service.redis_proc import free_port

        self.kind, self.redis_url, self.namespace = kind, redis_url, namespace
        self.consumer = f"{namespace}-w1"
        self.metrics_port = free_port() if kind != "hf-static" else None
        model = str(args.model_dir)
        if kind == "hf-static":
            self.cmd = [
                sys.executable,
                "-m",
                "ops.bench.baseline_worker",
                "--model",
                model,
                "--redis-url",
                redis_url,
                "--model-name",
                namespace,
                "--consumer",
                self.consumer,
                "--dtype",
                args.dtype,
                "--device",
                args.device,
                "--threads",
                str(args.threads),
                "--batch-size",
                str(args.static_batch),
            ]
        else:
            self.cmd = [
                sys.executable,
                "-m",
                "worker.cli",
                "worker",
                "--model",
                model,
                "--redis-url",
                redis_url,
                "--model-name",
                namespace,
                "--consumer",
                self.consumer,
                "--dtype",
                args.dtype,
                "--device",
                args.device,
                "--metrics-port",
                str(self.metrics_port),
                "--log-level",
                "WARNING",
                "--log-json",
                "--num-kv-blocks",
                str(kv_blocks),
                "--threads",
                str(args.threads),
            ]
            self.cmd += _engine_flags({**args.engine, **(engine or {})})
        self.env = child_env(args.threads)
        self.log_path = Path(tempfile.mkstemp(prefix=f"pagedq-bench-{namespace}-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> Worker:
        import redis

        from producer_sdk.contract import keys

        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        r = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.kind} worker exited with {self.proc.returncode}:\n{self.log()}")
                if r.exists(keys.worker_state(self.namespace, self.consumer)):
                    return self
                time.sleep(0.1)
        finally:
            r.close()
        self.stop()
        raise RuntimeError(f"{self.kind} worker not ready within {timeout:.0f}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "_log"):
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[str, float]:
        """The worker's unlabelled-by-us gauges and counters (samples summed over label sets)."""
        if self.metrics_port is None:
            return {}
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            head, value = line.rsplit(" ", 1)
            name = head.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
        return out


# --- the client ------------------------------------------------------------------------------------


@dataclass
class ReqResult:
    index: int
    kind: str
    prompt_len: int
    max_tokens: int
    t_submit: float = math.nan
    t_first: float = math.nan
    t_end: float = math.nan
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens == self.max_tokens

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_submit

    @property
    def e2e(self) -> float:
        return self.t_end - self.t_submit

    @property
    def tpot(self) -> float:
        return (self.t_end - self.t_first) / (self.tokens - 1) if self.tokens > 1 else math.nan

    def gaps(self) -> list[tuple[float, float]]:
        """(arrival, gap since the previous chunk) for every chunk after the first."""
        return [(t, t - p) for (p, _), (t, _) in zip(self.chunks, self.chunks[1:])]


async def drive(
    redis_url: str,
    namespace: str,
    reqs: list[BenchRequest],
    arrivals: list[float],
    *,
    timeout: float,
    sample: Worker | None = None,
) -> tuple[list[ReqResult], float, list[dict]]:
    """Send `reqs` at `arrivals` (seconds from start) and stream them all back. Returns the results,
    the start time (perf_counter) and, with `sample`, the worker's metrics every 0.5 s."""
    from producer_sdk import AsyncClient

    results = [ReqResult(i, r.kind, len(r.prompt), r.max_tokens) for i, r in enumerate(reqs)]
    samples: list[dict] = []
    async with AsyncClient(redis_url, model=namespace) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            res, r = results[i], reqs[i]
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            res.t_submit = time.perf_counter()
            try:
                handle = await client.submit(
                    prompt_token_ids=list(r.prompt), max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True
                )
                async for chunk in handle.stream(timeout=timeout):
                    if chunk.token_ids:
                        now = time.perf_counter()
                        if not res.chunks:
                            res.t_first = now
                        res.chunks.append((now, len(chunk.token_ids)))
                res.t_end = time.perf_counter()
            except Exception as e:  # recorded, the run goes on
                res.error = f"{type(e).__name__}: {e}"
                res.t_end = time.perf_counter()

        async def scrape() -> None:
            while True:
                with contextlib.suppress(Exception):
                    m = await asyncio.to_thread(sample.metrics)
                    samples.append({"t": time.perf_counter() - t0, **{k: m[k] for k in SAMPLED if k in m}})
                await asyncio.sleep(0.5)

        scraper = asyncio.create_task(scrape()) if sample is not None else None
        try:
            await asyncio.gather(*(one(i) for i in range(len(reqs))))
        finally:
            if scraper is not None:
                scraper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scraper
    return results, t0, samples


def run_load(
    redis_url: str,
    namespace: str,
    reqs: list[BenchRequest],
    arrivals: list[float],
    *,
    timeout: float,
    sample: Worker | None = None,
) -> tuple[list[ReqResult], float, list[dict]]:
    return asyncio.run(drive(redis_url, namespace, reqs, arrivals, timeout=timeout, sample=sample))


def summarize(results: list[ReqResult], slo_ttft: float, slo_tpot: float, *, keep_samples: bool = False) -> dict:
    ok = [r for r in results if r.ok]
    start = min((r.t_submit for r in results), default=math.nan)
    end = max((r.t_end for r in results), default=math.nan)
    duration = end - start
    out_tokens = sum(r.tokens for r in ok)
    itl = [g for r in ok for _, g in r.gaps()]
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tokens <= 1 or r.tpot <= slo_tpot)]
    chunks = sum(len(r.chunks) for r in ok)
    s = {
        "requests": len(results),
        "ok": len(ok),
        "errors": sorted({r.error or f"{r.tokens}/{r.max_tokens} tokens" for r in results if not r.ok})[:5],
        "duration_s": duration,
        "out_tok_s": out_tokens / duration if duration > 0 else math.nan,
        "total_tok_s": (out_tokens + sum(r.prompt_len for r in ok)) / duration if duration > 0 else math.nan,
        "req_s": len(ok) / duration if duration > 0 else math.nan,
        "goodput_req_s": len(good) / duration if duration > 0 else math.nan,
        "slo_met": len(good) / len(results) if results else math.nan,
        "ttft_s": dist(r.ttft for r in ok),
        "itl_s": dist(itl),
        "tpot_s": dist(r.tpot for r in ok),
        "e2e_s": dist(r.e2e for r in ok),
        "tokens_per_chunk": out_tokens / chunks if chunks else math.nan,
    }
    if keep_samples:
        step = max(1, len(itl) // MAX_SAMPLES)
        s["samples"] = {"ttft": [r.ttft for r in ok], "itl": sorted(itl)[::step]}
    return s


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


def plan_units(args: argparse.Namespace) -> int:
    n = 0
    for s in args.systems:
        n += 1 + sat_repeats(s, args) + len(args.rates)  # start + saturation + rates
        n += 2 if s.startswith("pagedq") else 0
    return n


def worker_engine(system: str, args: argparse.Namespace) -> dict:
    """Engine options of a serving worker. Prefix caching is off: the saturation repeats, the Poisson
    sweep and the long-prompt run send the same prompts again, and cache hits would flatter them
    (the offline run, with unique prompts, gets none; the prefix benchmark measures caching)."""
    if system == "pagedq":
        return {"long_prefill_token_threshold": args.chunk_cap, "enable_prefix_caching": False}
    if system == "pagedq-nochunk":
        return {"enable_chunked_prefill": False, "enable_prefix_caching": False}
    return {}


def run(args: argparse.Namespace, progress: Progress, context: dict | None = None) -> dict:
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
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "rate_fractions": args.rates,
        "systems": {},
    }
    sat_rate = None
    with RedisProcess() as server:
        for system in args.systems:
            ns = f"bench-{system}-{uuid.uuid4().hex[:6]}"
            engine = worker_engine(system, args)
            progress.start(f"serve {system}: starting worker")
            worker = Worker(system, args, server.url, ns, kv_blocks=kv_blocks, engine=engine)
            entry: dict = {"worker_cmd": worker.cmd[2:], "engine": engine}
            out["systems"][system] = entry
            try:
                worker.start()
                warm = warmup_requests(vocab)
                run_load(server.url, ns, warm, [0.0] * len(warm), timeout=args.child_timeout)
                progress.done()
                sat_runs = []
                for rep in range(sat_repeats(system, args)):
                    progress.start(f"serve {system}: saturation {rep + 1}")
                    sample = worker if system.startswith("pagedq") and rep == 0 else None
                    res, _, samples = run_load(
                        server.url, ns, wl.requests, [0.0] * len(wl), timeout=args.child_timeout, sample=sample
                    )
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
                if sat_rate is None:
                    sat_rate = entry["saturation"]["req_s"]
                    out["saturation_rate_req_s"] = sat_rate
                entry["sweep"] = []
                for frac in args.rates:
                    rate = frac * sat_rate
                    progress.start(f"serve {system}: {frac:g}x ({rate:.2f} req/s)")
                    arrivals = poisson_arrivals(len(poisson_wl), rate, args.seed)
                    res, _, _ = run_load(server.url, ns, poisson_wl.requests, arrivals, timeout=args.child_timeout)
                    summary = summarize(res, args.slo_ttft, args.slo_tpot, keep_samples=True)
                    entry["sweep"].append({"fraction": frac, "rate_req_s": rate, **summary})
                    progress.done(note=f"p50 TTFT {summary['ttft_s']['p50']:.2f}s")
                if system.startswith("pagedq"):
                    progress.start(f"serve {system}: long prompts")
                    entry["long_prompt"] = long_prompt_run(server.url, ns, long_wl, args)
                    progress.done(2, note=f"ITL p99 x{entry['long_prompt']['p99_ratio_during']:.1f}")
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"
                progress.write(f"[serve] {system} failed: {entry['error'].splitlines()[0]}")
            finally:
                worker.stop()
    out["offline_ref"] = _offline_ref(out, args, context or {})
    return out


def _offline_ref(out: dict, args: argparse.Namespace, context: dict) -> dict:
    """pagedq's offline throughput on the same workload (this run's, else the latest matching one)."""
    off = context.get("offline") or load_latest(args.out).get("offline")
    same = (
        off
        and off.get("workload") == out["workload"]
        and off.get("dtype") == args.dtype
        and off.get("threads") == args.threads
        and off.get("model", {}).get("folder") == out["model"]["folder"]
    )
    pq = out["systems"].get("pagedq", {}).get("saturation")
    if not same or not pq:
        return {"available": False}
    offline_rate = off["systems"].get("pagedq", {}).get("out_tok_s")
    return {
        "available": bool(offline_rate),
        "from_this_run": "offline" in context,
        "offline_out_tok_s": offline_rate,
        "serve_out_tok_s": pq["out_tok_s"],
        "ratio": pq["out_tok_s"] / offline_rate if offline_rate else math.nan,
    }
