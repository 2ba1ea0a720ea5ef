"""A worker process under test and the asyncio client that loads it through Redis, shared by the
serve, prefix and memory benchmarks.

`Worker` starts `pagedq worker` (or ops/bench/baseline_worker.py) on its own key namespace and scrapes
its /metrics; `run_load` sends requests at given arrival times with `producer_sdk.AsyncClient` and
records when each streamed chunk arrives; `summarize` turns that into TTFT, inter-token latency, TPOT,
end-to-end latency, throughput and goodput.
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
from dataclasses import dataclass, field
from pathlib import Path

from ops.bench.common import REPO, child_env, stop_process
from ops.bench.stats import dist
from ops.bench.workloads import BenchRequest

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
        stop_process(self.proc, getattr(self, "_log", None))

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
    worker_queue_s: float = math.nan  # the worker's own count: from the submit to the first schedule
    worker_ttft_s: float = math.nan  # ... and to the first token computed (before it is published)

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
    tenant: str | None = None,
) -> tuple[list[ReqResult], float, list[dict]]:
    """Send `reqs` at `arrivals` (seconds from start) and stream them all back (as `tenant`'s, else the
    default tenant's). Returns the results, the start time (perf_counter) and, with `sample`, the
    worker's metrics every 0.5 s."""
    from producer_sdk import AsyncClient

    results = [ReqResult(i, r.kind, len(r.prompt), r.max_tokens) for i, r in enumerate(reqs)]
    samples: list[dict] = []
    options = {"tenant": tenant} if tenant else {}
    async with AsyncClient(redis_url, model=namespace, **options) as client:
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
                timings = handle.timings
                if timings is not None and timings.queue_ms is not None and timings.ttft_ms is not None:
                    res.worker_queue_s, res.worker_ttft_s = timings.queue_ms / 1000, timings.ttft_ms / 1000
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
    tenant: str | None = None,
) -> tuple[list[ReqResult], float, list[dict]]:
    return asyncio.run(drive(redis_url, namespace, reqs, arrivals, timeout=timeout, sample=sample, tenant=tenant))


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


# --- engine options of the pagedq workers ------------------------------------------------------


def worker_engine(system: str, args: argparse.Namespace) -> dict:
    """Engine options of a serving worker. Prefix caching is off: the saturation repeats, the Poisson
    sweep and the long-prompt run send the same prompts again, and cache hits would flatter them
    (the offline run, with unique prompts, gets none; the prefix benchmark measures caching)."""
    if system == "pagedq":
        cap = {"long_prefill_token_threshold": args.chunk_cap} if args.chunk_cap else {}
        return {**cap, "enable_prefix_caching": False}
    if system == "pagedq-nochunk":
        return {"enable_chunked_prefill": False, "enable_prefix_caching": False}
    return {}
