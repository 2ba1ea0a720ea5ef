"""Batch API beside interactive traffic: interactive chat's time to first token with and without a large
batch running on the low lane, and how much of the idle machine's capacity the batch gets meanwhile.

    pagedq bench batch                                   # SmolLM2, a 2,000-line batch
    pagedq bench batch --quick                           # tiny random model, 300 lines: a smoke run
    pagedq bench batch --batch-lines 500 --duration 60   # (python -m ops.bench batch ...: the same)

Setup: a private redis-server, one `pagedq worker` (prefix caching off: both batches send the same
prompts) and one gateway (`python -m gateway`, its batch runner submitting each batch's lines on the
low lane, at most `--batch-window` in flight). Interactive requests are streamed chat completions
through the gateway (`--prompt-words` words of text, `--max-tokens` output tokens, `ignore_eos`,
greedy), read with a small HTTP/SSE client (ops/bench/gateway_proc.py); TTFT is from sending the
request to the first chunk carrying content (the role chunk is not a token).

Phases:
0. saturation: `--sat-requests` interactive requests sent at once; their requests/s is the
   saturation rate (as `pagedq bench serve` defines it), and the interactive rate is `--load` (0.5)
   of it (or `--rate` requests/s, given);
1. interactive alone: Poisson arrivals at that rate for `--duration` s -> TTFT p50/p99, throughput;
2. the same arrivals while a `--batch-lines`-line batch (`--batch-max-tokens` output tokens a line)
   runs, uploaded and created with the official `openai` client (`files.create(purpose="batch")`,
   `batches.create(endpoint="/v1/chat/completions")`); the interactive load starts once the batch is
   in progress and `--lead` s later. The batch's output tokens/s over the interactive run is the
   worker's generated tokens (its /metrics counter) minus the interactive requests' own, over the
   run's wall time. Then the batch is waited for to its end, and its output file checked (every line
   once, all completed);
3. the same lines as a new batch on the idle machine: its output tokens/s over a window as long as
   phase 2's, started `--lead` s after it went in progress, then waited for to its end.

With `--cancel-after-window` each batch is cancelled once its window is measured instead of waited for to
its end (the issue's 2,000-line batch would take about 30 minutes on 2 cores; the windows measure the same
steady state): the check is then that every line is in the output at most once and the counts add up.

Goals: interactive TTFT p99 with the batch <= 1.2x of it alone; batch tokens/s with interactive load
over batch tokens/s idle says how much of the idle capacity the batch used (no goal: the rest is what
the interactive requests took, and what priority cost). The result goes to
ops/bench/results/batch-<timestamp>.json (and latest/batch.json).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import random
import sys
import threading
import time
import uuid

from ops.bench.common import BLOCK_SIZE, model_info
from ops.bench.entry import run_and_save
from ops.bench.gateway_proc import GatewayProcess, SSEStream, wait_for_model
from ops.bench.progress import Progress
from ops.bench.serving import ReqResult
from ops.bench.stats import dist
from ops.bench.workloads import poisson_arrivals

GOAL_RATIO = 1.2
CHAT = "/v1/chat/completions"
GEN_TOKENS = "pagedq_generation_tokens_total"
DONE_STATES = frozenset({"completed", "failed", "expired", "cancelled"})
UNITS = 6  # start, saturation, interactive alone, with the batch, the batch's end, the batch alone
_WORDS = (  # the words of the prompts: plain English, a token or two each
    "river stone quiet morning garden window paper light music story winter letter bridge market "
    "forest yellow travel summer kitchen orange mountain silver planet engine record harbor lantern "
    "meadow copper island thunder velvet marble canvas pencil rocket signal button candle castle"
)
WORDS = _WORDS.split()


# --- requests -----------------------------------------------------------------------------------------


def prompts(n: int, words: int, seed: str) -> list[str]:
    """`n` distinct user messages of `words` plain words each."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def chat_body(model: str, text: str, max_tokens: int, *, stream: bool) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def batch_file(model: str, texts: list[str], max_tokens: int) -> bytes:
    rows = [
        {"custom_id": f"line-{i}", "method": "POST", "url": CHAT, "body": chat_body(model, t, max_tokens, stream=False)}
        for i, t in enumerate(texts)
    ]
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


async def _one_chat(port: int, body: dict, res: ReqResult) -> None:
    """One streamed chat completion; a chunk with content counts one token, the last one gets what the
    usage chunk says is left (chat chunks do not say how many tokens they carry)."""
    s = SSEStream(port, CHAT, body)
    res.t_submit = time.perf_counter()
    try:
        await s.open()
        async for data in s.events():
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                res.error = f"error event: {event['error']}"
                break
            choices = event.get("choices") or []
            if not choices:
                usage = event.get("usage") or {}
                left = usage.get("completion_tokens", 0) - res.tokens
                if res.chunks and left:
                    t, n = res.chunks[-1]
                    res.chunks[-1] = (t, n + left)
                continue
            delta = choices[0].get("delta") or {}
            if "role" in delta or not delta.get("content"):
                continue
            now = time.perf_counter()
            if not res.chunks:
                res.t_first = now
            res.chunks.append((now, 1))
        res.t_end = time.perf_counter()
    except Exception as e:  # recorded, the run goes on
        res.error = f"{type(e).__name__}: {e}"
        res.t_end = time.perf_counter()
    finally:
        s.close()


def run_chat(port: int, bodies: list[dict], arrivals: list[float]) -> list[ReqResult]:
    """Send `bodies` at `arrivals` (seconds from now), each streamed on its own connection."""

    async def main() -> list[ReqResult]:
        results = [ReqResult(i, "chat", 0, b["max_tokens"]) for i, b in enumerate(bodies)]
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            await _one_chat(port, bodies[i], results[i])

        await asyncio.gather(*(one(i) for i in range(len(bodies))))
        return results

    return asyncio.run(main())


def interactive_summary(results: list[ReqResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": sorted({r.error or f"{r.tokens}/{r.max_tokens} tokens" for r in results if not r.ok})[:5],
        "wall_s": wall,
        "ttft_s": dist(r.ttft for r in ok),
        "itl_s": dist(g for r in ok for _, g in r.gaps()),
        "e2e_s": dist(r.e2e for r in ok),
        "req_s": len(ok) / wall if wall > 0 else math.nan,
        "out_tok_s": out_tokens / wall if wall > 0 else math.nan,
        "out_tokens": sum(r.tokens for r in results),
        "ttft_samples_s": [round(r.ttft, 5) for r in ok],
    }


# --- the batch ----------------------------------------------------------------------------------------


class BatchDriver:
    """The Batch API through the official `openai` client: upload once, create, poll, check the output."""

    def __init__(self, port: int, data: bytes) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=2)
        self.file = self.client.files.create(file=("batch-mix.jsonl", io.BytesIO(data)), purpose="batch")
        self.lines = data.count(b"\n")

    def create(self):
        return self.client.batches.create(
            input_file_id=self.file.id,
            endpoint=CHAT,
            completion_window="24h",
            metadata={"bench": "batch_mix"},
        )

    def wait(self, batch_id: str, until, timeout: float, progress: Progress, what: str, poll: float = 0.25):
        """Poll until `until(batch)`; the batch then. Shows its progress on the bar."""
        deadline = time.monotonic() + timeout
        while True:
            b = self.client.batches.retrieve(batch_id)
            c = b.request_counts
            if progress.bar is not None:
                progress.bar.set_postfix_str(f"{what}: {b.status} {c.completed + c.failed}/{c.total}", refresh=True)
            if until(b):
                return b
            if b.status in DONE_STATES - {"completed"}:
                raise RuntimeError(f"batch {batch_id} ended {b.status}: {b.errors}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} not done in {timeout:.0f}s: {b.status}, {c}")
            time.sleep(poll)

    def check(self, b) -> dict:
        """The finished batch's counts, and what its output file holds."""
        out: dict = {
            "id": b.id,
            "status": b.status,
            "total": b.request_counts.total,
            "completed": b.request_counts.completed,
            "failed": b.request_counts.failed,
        }
        rows = []
        if b.output_file_id:
            text = self.client.files.content(b.output_file_id).text
            rows = [json.loads(x) for x in text.splitlines() if x.strip()]
        ids = [r["custom_id"] for r in rows]
        tokens = [r["response"]["body"]["usage"]["completion_tokens"] for r in rows if r.get("response")]
        out.update(
            output_lines=len(rows),
            distinct_custom_ids=len(set(ids)),
            every_line_once=sorted(ids) == sorted(f"line-{i}" for i in range(self.lines)),
            no_line_twice=len(set(ids)) == len(ids) and set(ids) <= {f"line-{i}" for i in range(self.lines)},
            output_tokens=sum(tokens),
        )
        if b.error_file_id:
            errs = self.client.files.content(b.error_file_id).text.splitlines()
            out["error_examples"] = errs[:3]
        return out


SAMPLED = {  # worker gauges sampled during the interactive runs (summed over their labels)
    "pagedq_num_requests_running": "engine_running",
    "pagedq_num_requests_waiting": "engine_waiting",
    "pagedq_fair_share_held_entries": "intake_held",
    "pagedq_queue_lag": "lanes_unread",
}


class Sampler:
    """Every `period` s on a thread: the worker's running and waiting sequences, the entries its intake
    holds, and the entries no worker has read yet."""

    def __init__(self, worker, period: float = 0.5) -> None:
        self.worker, self.period = worker, period
        self.samples: dict[str, list[float]] = {k: [] for k in SAMPLED.values()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                m = self.worker.metrics()
            except OSError:
                continue
            for name, key in SAMPLED.items():
                self.samples[key].append(m.get(name, math.nan))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        return {k: dist(v) for k, v in self.samples.items()}


def gen_tokens(worker) -> float:
    return worker.metrics().get(GEN_TOKENS, math.nan)


def _started(b) -> bool:
    """In progress (its lines counted), or already over (a small batch on a fast model)."""
    return (b.status == "in_progress" and b.request_counts.total > 0) or b.status in DONE_STATES


def _rate_window(worker, seconds: float, batch_id: str, driver: BatchDriver) -> dict:
    """The worker's generated tokens over `seconds`, cut short when the batch ends first."""
    g0, t0 = gen_tokens(worker), time.perf_counter()
    deadline = t0 + seconds
    ended_early = False
    while time.perf_counter() < deadline:
        time.sleep(min(0.5, max(0.0, deadline - time.perf_counter())))
        if driver.client.batches.retrieve(batch_id).status != "in_progress":
            ended_early = True
            break
    g1, wall = gen_tokens(worker), time.perf_counter() - t0
    return {"wall_s": wall, "tokens": g1 - g0, "tok_s": (g1 - g0) / wall, "batch_ended_in_window": ended_early}


# --- the benchmark ------------------------------------------------------------------------------------


def run(args: argparse.Namespace, progress: Progress) -> dict:
    from ops.bench.serving import Worker
    from worker.service.redis_proc import RedisProcess

    info = model_info(args.model_dir)
    ns = f"bench-batch-{uuid.uuid4().hex[:6]}"
    in_flight = args.batch_window + args.sat_requests + 32
    longest = 2 * args.prompt_words + 64 + max(args.max_tokens, args.batch_max_tokens)  # chat template included
    kv_blocks = (math.ceil(longest / BLOCK_SIZE) + 1) * in_flight
    batch_texts = prompts(args.batch_lines, args.prompt_words, f"batch:{args.seed}")
    out: dict = {
        "model": info,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "kv_blocks": kv_blocks,
        "goal_ratio": GOAL_RATIO,
        "interactive": {
            "prompt_words": args.prompt_words,
            "max_tokens": args.max_tokens,
            "duration_s": args.duration,
            "load": args.load,
        },
        "batch": {
            "lines": args.batch_lines,
            "prompt_words": args.prompt_words,
            "max_tokens": args.batch_max_tokens,
            "window": args.batch_window,
            "lead_s": args.lead,
        },
        "phases": {},
    }
    with RedisProcess() as server:
        wargs = argparse.Namespace(
            model_dir=args.model_dir, dtype=args.dtype, device=args.device, threads=args.threads, engine={}
        )
        worker = Worker("pagedq", wargs, server.url, ns, kv_blocks=kv_blocks, engine={"enable_prefix_caching": False})
        gateway = GatewayProcess(server.url, "--batch-window", str(args.batch_window))
        out["worker_cmd"], out["gateway_cmd"] = worker.cmd[2:], gateway.cmd[2:]
        try:
            progress.start("batch: starting worker and gateway")
            worker.start()
            gateway.start()
            wait_for_model(gateway.port, ns)
            port = gateway.port
            # Warm-up: a few alone, then a burst the size of the saturation run (the engine's larger shapes).
            warm = [chat_body(ns, t, 4, stream=True) for t in prompts(4, args.prompt_words, "warmup")]
            run_chat(port, warm, [0.0] * len(warm))
            warm = [chat_body(ns, t, 8, stream=True) for t in prompts(args.sat_requests, args.prompt_words, "warm2")]
            run_chat(port, warm, [0.0] * len(warm))
            driver = BatchDriver(port, batch_file(ns, batch_texts, args.batch_max_tokens))
            out["batch"]["input_file_id"] = driver.file.id
            progress.done()

            # 0. saturation
            progress.start(f"batch: saturation, {args.sat_requests} requests at once")
            sat_texts = prompts(args.sat_requests, args.prompt_words, f"sat:{args.seed}")
            t0 = time.perf_counter()
            sat_bodies = [chat_body(ns, t, args.max_tokens, stream=True) for t in sat_texts]
            res = run_chat(port, sat_bodies, [0.0] * len(sat_bodies))
            sat = interactive_summary(res, time.perf_counter() - t0)
            sat.pop("ttft_samples_s")
            out["saturation"] = sat
            rate = args.rate if args.rate else args.load * sat["req_s"]
            out["interactive"]["rate_req_s"] = rate
            progress.done(note=f"{sat['req_s']:.2f} req/s, {sat['out_tok_s']:.0f} tok/s")

            n = max(1, round(rate * args.duration))
            texts = prompts(n, args.prompt_words, f"interactive:{args.seed}")
            bodies = [chat_body(ns, t, args.max_tokens, stream=True) for t in texts]
            arrivals = poisson_arrivals(n, rate, args.seed)
            out["interactive"]["requests"] = n

            def interactive(phase: str) -> dict:
                g0, t0 = gen_tokens(worker), time.perf_counter()
                with Sampler(worker) as sampler:
                    res = run_chat(port, bodies, arrivals)
                wall = time.perf_counter() - t0
                s = {**interactive_summary(res, wall), "worker": sampler.summary()}
                s["worker_gen_tokens"] = gen_tokens(worker) - g0
                out["phases"][phase] = s
                return s

            # 1. interactive alone
            progress.start(f"batch: interactive alone, {n} at {rate:.2f}/s")
            alone = interactive("interactive_alone")
            progress.done(note=f"TTFT p99 {alone['ttft_s']['p99'] * 1000:.0f} ms")

            # 2. interactive with the batch
            progress.start(f"batch: interactive + {args.batch_lines}-line batch")
            b = driver.create()
            t_created = time.perf_counter()
            b = driver.wait(b.id, _started, args.timeout, progress, "batch")
            time.sleep(args.lead)
            mixed = interactive("interactive_with_batch")
            b_end = driver.client.batches.retrieve(b.id)
            batch_tokens = mixed["worker_gen_tokens"] - mixed["out_tokens"]
            mixed["batch_during"] = {
                "tokens": batch_tokens,
                "tok_s": batch_tokens / mixed["wall_s"],
                "lines_done_at_end": b_end.request_counts.completed + b_end.request_counts.failed,
                "batch_ran_whole_window": b_end.status == "in_progress",
            }
            progress.done(note=f"TTFT p99 {mixed['ttft_s']['p99'] * 1000:.0f} ms")
            progress.start("batch: the mixed batch to its end")
            if args.cancel_after_window:
                driver.client.batches.cancel(b.id)
            b = driver.wait(b.id, lambda x: x.status in DONE_STATES, args.timeout, progress, "batch")
            mixed_batch = driver.check(b)
            mixed_batch["wall_s"] = time.perf_counter() - t_created
            out["batch_with_interactive"] = mixed_batch
            progress.done()

            # 3. the batch alone
            progress.start("batch: the batch alone")
            b = driver.create()
            t_created = time.perf_counter()
            b = driver.wait(b.id, _started, args.timeout, progress, "batch alone")
            t_started, g_started = time.perf_counter(), gen_tokens(worker)
            time.sleep(args.lead)
            window = _rate_window(worker, mixed["wall_s"], b.id, driver)
            if args.cancel_after_window:
                driver.client.batches.cancel(b.id)
            b = driver.wait(b.id, lambda x: x.status in DONE_STATES, args.timeout, progress, "batch alone")
            idle_batch = driver.check(b)
            t_done = time.perf_counter()
            idle_batch["wall_s"] = t_done - t_created
            # From its first sight in progress to its end: every token the worker made was the batch's.
            whole = gen_tokens(worker) - g_started
            idle_batch["whole_run"] = {
                "wall_s": t_done - t_started,
                "tokens": whole,
                "tok_s": whole / (t_done - t_started),
            }
            idle_batch["window"] = window
            out["batch_alone"] = idle_batch
            progress.done(note=f"{window['tok_s']:.0f} tok/s")
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
            progress.write(f"[batch] failed: {out['error'].splitlines()[0]}")
        finally:
            gateway.stop()
            worker.stop()
    _ratios(out)
    return out


def _ratios(out: dict) -> None:
    phases = out["phases"]
    alone, mixed = phases.get("interactive_alone"), phases.get("interactive_with_batch")
    if alone and mixed:
        p99a, p99m = alone["ttft_s"]["p99"], mixed["ttft_s"]["p99"]
        out["ttft_p99_ratio"] = p99m / p99a if p99a else math.nan
        out["ttft_p50_ratio"] = mixed["ttft_s"]["p50"] / alone["ttft_s"]["p50"] if alone["ttft_s"]["p50"] else math.nan
        out["goal_met"] = out["ttft_p99_ratio"] <= GOAL_RATIO
    idle = out.get("batch_alone")
    if mixed and idle:
        busy = mixed["batch_during"]["tok_s"]
        # The idle rate over a window as long as the interactive run, started --lead s after the batch
        # went in progress; over the batch's whole run when it ended before the window was 1 s long.
        short = idle["window"]["batch_ended_in_window"] and idle["window"]["wall_s"] < 1.0
        free = idle["whole_run"]["tok_s"] if short else idle["window"]["tok_s"]
        out["batch_idle_rate_from"] = "whole_run" if short else "window"
        out["batch_tok_s_with_interactive"] = busy
        out["batch_tok_s_idle"] = free
        out["batch_share_of_idle"] = busy / free if free else math.nan


def report_lines(r: dict) -> list[str]:
    lines = [
        f"model {r['model']['folder']}, {r['dtype']} on {r['device']}, {r['threads']} threads; interactive "
        f"{r['interactive']['prompt_words']}-word chat, {r['interactive']['max_tokens']} output tokens; batch "
        f"{r['batch']['lines']} lines x {r['batch']['max_tokens']} output tokens, window {r['batch']['window']}"
    ]
    if "error" in r:
        lines.append(f"FAILED: {r['error']}")
    if "saturation" in r:
        s = r["saturation"]
        lines.append(
            f"saturation: {s['ok']}/{s['requests']} at once: {s['req_s']:.2f} req/s, {s['out_tok_s']:.1f} tok/s; "
            f"interactive at {r['interactive']['rate_req_s']:.2f} req/s ({r['interactive'].get('requests')} "
            f"requests, {r['interactive']['duration_s']:g} s)"
        )
    for name, p in r["phases"].items():
        t = p["ttft_s"]
        lines.append(
            f"{name:<23} TTFT p50 {1000 * t['p50']:8.1f} ms  p99 {1000 * t['p99']:8.1f} ms  ITL p50 "
            f"{1000 * p['itl_s']['p50']:6.1f} ms  ({p['ok']}/{p['requests']} ok, {p['out_tok_s']:.1f} tok/s); "
            f"engine running mean {p['worker']['engine_running']['mean']:.0f}, waiting mean "
            f"{p['worker']['engine_waiting']['mean']:.0f} (max {p['worker']['engine_waiting']['max']:.0f})"
        )
    for name in ("batch_with_interactive", "batch_alone"):
        if name in r:
            b = r[name]
            lines.append(
                f"{name:<23} {b['status']}: {b['completed']}/{b['total']} completed, {b['failed']} failed, "
                f"every line once: {b['every_line_once']}, no line twice: {b['no_line_twice']}, "
                f"{b['output_tokens']} tokens in {b['wall_s']:.1f} s"
            )
    if "ttft_p99_ratio" in r:
        lines.append(
            f"interactive TTFT p99 with batch / without: {r['ttft_p99_ratio']:.2f}x (goal <= {GOAL_RATIO}x: "
            f"{'met' if r['goal_met'] else 'MISSED'}); p50 {r['ttft_p50_ratio']:.2f}x"
        )
    if "batch_share_of_idle" in r:
        ran = r["phases"]["interactive_with_batch"]["batch_during"]["batch_ran_whole_window"]
        lines.append(
            f"batch tokens/s with interactive load / idle: {r['batch_tok_s_with_interactive']:.1f} / "
            f"{r['batch_tok_s_idle']:.1f} = {r['batch_share_of_idle']:.0%}"
            + ("" if ran else " (the batch ended before the interactive run did: more --batch-lines)")
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="pagedq bench batch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 300 lines, 4 s phases: a smoke run")
    p.add_argument("--model", default=None, help="model folder, 'smollm2' or 'tiny' (default: smollm2; quick: tiny)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the worker")
    p.add_argument("--batch-lines", type=int, default=None, help="lines of the batch (2000; quick 300)")
    p.add_argument("--batch-max-tokens", type=int, default=None, help="output tokens a batch line (64; quick 16)")
    p.add_argument("--batch-window", type=int, default=256, help="the gateway's --batch-window")
    p.add_argument("--duration", type=float, default=None, help="seconds of interactive arrivals a phase (60; quick 4)")
    p.add_argument("--load", type=float, default=0.5, help="interactive rate as a fraction of saturation")
    p.add_argument("--rate", type=float, default=None, help="interactive requests/s (instead of --load)")
    p.add_argument("--sat-requests", type=int, default=None, help="requests of the saturation burst (64; quick 8)")
    p.add_argument("--prompt-words", type=int, default=48, help="words of each user message")
    p.add_argument("--max-tokens", type=int, default=None, help="interactive output tokens (32; quick 8)")
    p.add_argument("--lead", type=float, default=None, help="seconds the batch runs first (5; quick 1)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a batch may take")
    p.add_argument(
        "--cancel-after-window",
        action="store_true",
        help="cancel each batch once its window is measured instead of waiting for its end (large batches)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results folder (default ops/bench/results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    q = args.quick
    for name, full, quick in (
        ("batch_lines", 2000, 300),
        ("batch_max_tokens", 64, 16),
        ("duration", 60.0, 4.0),
        ("sat_requests", 64, 8),
        ("max_tokens", 32, 8),
        ("lead", 5.0, 1.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.batch_lines < 1 or args.batch_window < 1 or args.sat_requests < 1:
        p.error("--batch-lines, --batch-window and --sat-requests must be at least 1")
    return run_and_save("batch", argv, args, run, report_lines, UNITS)


if __name__ == "__main__":
    raise SystemExit(main())
