"""Where serving time goes: the engine thread outside the forward, and Redis/client/worker CPU.

    python -m ops.bench.serve_overhead profile            # engine steps at 64 running, forward vs the rest
    python -m ops.bench.serve_overhead ab off s1 s4 ...   # interleaved runs: offline, or served with
                                                          # --stream-interval N (sN), same workload

`ab` runs the 64-request `sharegpt-like` workload (or --workload; seed 0, max_tokens capped by --max-tokens) through
the offline engine in a child process (`off`; `offt` and `offt-kept` step it on a second thread, see
OFFLINE) or through a real redis-server and `pagedq worker` with
the SDK streaming every request (`sN`), one JSON line per run: output tok/s, ITL per event and per
token, and the CPU seconds of redis-server, this client process and the worker's busiest threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ops.bench.common import child_env, kv_blocks_for, model_info, resolve_model

# ab's offline runs: stepped on the loading thread, or on a second thread with that thread's OpenMP
# pool freed (as the worker does) or kept (as the worker did before; worker/engine/omp_pool.py)
OFFLINE = {"off": "main", "offt": "thread", "offt-kept": "thread-kept"}


def _cpu_by_thread(pid: int) -> dict[str, float]:
    """utime + stime seconds of each thread of `pid`."""
    tck, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            f = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (int(f[11]) + int(f[12])) / tck
    return out


def _timed(fn, times: list[float]):
    """`fn`, appending the seconds of each call to `times`."""

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            times.append(time.perf_counter() - t)

    return timed


def profile(args: argparse.Namespace) -> dict:
    """Decode steps with 64 sequences running: step time vs `runner.execute` (forward + sampling)."""
    import random

    import torch

    from worker import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(model=str(resolve_model(args.model)), dtype=args.dtype, device="cpu")
    eng, rng, fwd = llm.engine, random.Random(0), []
    prompts = [[rng.randint(100, 20000) for _ in range(64)] for _ in range(64)]
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    eng.runner.execute = _timed(eng.runner.execute, fwd)
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, SamplingParams(temperature=0, max_tokens=96, ignore_eos=True))
    steps = []
    while eng.has_unfinished_requests():
        full, n, t = eng.snapshot().running == 64, len(fwd), time.perf_counter()
        eng.step()
        if full and len(fwd) > n:
            steps.append((time.perf_counter() - t, fwd[-1]))
    steps = steps[5:]
    total, forward = sum(s for s, _ in steps), sum(f for _, f in steps)
    return {
        "steps": len(steps),
        "step_ms": 1e3 * total / len(steps),
        "forward_ms": 1e3 * forward / len(steps),
        "outside_forward_pct": 100 * (total - forward) / total,
    }


def _offline_child(model: str, wl_path: str, kv: int, dtype: str, threads: int, vocab: int, where: str) -> None:
    """`LLM.generate` of the workload, stepped on the loading thread (`main`) or, as in a worker, on a
    second thread with the loading thread's OpenMP pool freed first (`thread`) or kept (`thread-kept`)."""
    import threading

    import torch

    from ops.bench.workloads import Workload
    from worker import LLM, SamplingParams

    torch.set_num_threads(threads)
    wl = Workload.load(wl_path)
    llm = LLM(model=model, dtype=dtype, device="cpu", enable_prefix_caching=False, num_kv_blocks=kv)

    def gen(reqs):
        ps = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
        return llm.generate([list(r.prompt) for r in reqs], ps, use_tqdm=False)

    result: dict = {}
    if where == "main":
        _timed_generate(llm, gen, wl, vocab, result)
    else:
        if where == "thread":
            from worker.engine.omp_pool import release_calling_thread_pool

            release_calling_thread_pool()
        t = threading.Thread(target=_timed_generate, args=(llm, gen, wl, vocab, result))
        t.start()
        t.join()
    print(json.dumps(result))


def _timed_generate(llm, gen, wl, vocab: int, result: dict) -> None:
    from ops.bench.workloads import warmup_requests

    gen(warmup_requests(vocab))
    eng, step_times = llm.engine, []
    eng.step = _timed(eng.step, step_times)
    t = time.perf_counter()
    outs = gen(wl.requests)
    elapsed = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = len(step_times)
    mean_ms = 1e3 * sum(step_times) / max(steps, 1)
    result.update(out_tok_s=n / elapsed, dur_s=elapsed, tokens=n, steps=steps, mean_step_ms=mean_ms)


def _served(args, server, wl, kv: int, vocab: int, interval: int) -> dict:
    from ops.bench.serving import Worker, run_load, summarize
    from ops.bench.workloads import warmup_requests

    wargs = argparse.Namespace(
        model_dir=args.model_dir, dtype=args.dtype, device="cpu", threads=args.threads, engine={}
    )
    w = Worker("pagedq", wargs, server.url, f"ovh-{uuid.uuid4().hex[:6]}", kv_blocks=kv)
    w.cmd += ["--no-enable-prefix-caching", "--stream-interval", str(interval)]
    w.start()
    try:
        warm = warmup_requests(vocab)
        run_load(server.url, w.namespace, warm, [0.0] * len(warm), timeout=600)
        m0, r0, w0, c0 = w.metrics(), _cpu_by_thread(server.proc.pid), _cpu_by_thread(w.proc.pid), time.process_time()
        res, _, _ = run_load(server.url, w.namespace, wl.requests, [0.0] * len(wl), timeout=args.timeout)
        m1, r1, w1, c1 = w.metrics(), _cpu_by_thread(server.proc.pid), _cpu_by_thread(w.proc.pid), time.process_time()
    finally:
        w.stop()
    s = summarize(res, 2.0, 0.2)
    per_token = sorted(g / n for r in res if r.ok for (_, g), (_, n) in zip(r.gaps(), r.chunks[1:]))

    def pct(p: float) -> float:
        return 1e3 * per_token[min(len(per_token) - 1, int(p * len(per_token)))] if per_token else float("nan")

    steps = m1.get("pagedq_iteration_seconds_count", 0) - m0.get("pagedq_iteration_seconds_count", 0)
    step_s = m1.get("pagedq_iteration_seconds_sum", 0) - m0.get("pagedq_iteration_seconds_sum", 0)
    threads = sorted((round(w1[k] - w0.get(k, 0), 1) for k in w1), reverse=True)[:3]
    return {
        "out_tok_s": s["out_tok_s"],
        "dur_s": s["duration_s"],
        "ok": s["ok"],
        "itl_event_p50_ms": 1e3 * s["itl_s"]["p50"],
        "itl_event_p99_ms": 1e3 * s["itl_s"]["p99"],
        "itl_token_p50_ms": pct(0.5),
        "itl_token_p99_ms": pct(0.99),
        "ttft_p50_ms": 1e3 * s["ttft_s"]["p50"],
        "tokens_per_event": s["tokens_per_chunk"],
        "steps": steps,
        "mean_step_ms": 1e3 * step_s / max(steps, 1),
        "cpu_s": {
            "redis": round(sum(r1.values()) - sum(r0.values()), 1),
            "client": round(c1 - c0, 1),
            "worker_top_threads": threads,  # engine, torch's second thread, event loop
        },
    }


def ab(args: argparse.Namespace) -> list[dict]:
    from ops.bench.workloads import BenchRequest, Workload, make_workload
    from worker.service.redis_proc import RedisProcess

    args.model_dir = resolve_model(args.model)
    info = model_info(args.model_dir)
    vocab, max_len = info["prompt_vocab"], info["max_model_len"]
    wl = make_workload(args.workload, args.requests, 0, vocab, max_len)
    wl = Workload(wl.name, wl.seed, [BenchRequest(r.prompt, min(r.max_tokens, args.max_tokens)) for r in wl.requests])
    kv = kv_blocks_for(wl, max_len)
    wl_path = Path(args.out_dir) / "serve_overhead_workload.json"
    wl.save(wl_path)
    results = []
    with RedisProcess() as server:
        for tag in args.order:
            if tag in OFFLINE:
                cmd = [sys.executable, "-m", "ops.bench.serve_overhead", "_offline", str(args.model_dir), str(wl_path)]
                cmd += [str(kv), args.dtype, str(args.threads), str(vocab), OFFLINE[tag]]
                done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(args.threads), check=True)
                r = json.loads(done.stdout.strip().splitlines()[-1])
            else:
                r = _served(args, server, wl, kv, vocab, int(tag[1:]))
            r["run"] = tag
            results.append(r)
            print(json.dumps(r), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_offline"]:
        _offline_child(argv[1], argv[2], int(argv[3]), argv[4], int(argv[5]), int(argv[6]), argv[7])
        return 0
    p = argparse.ArgumentParser(prog="python -m ops.bench.serve_overhead", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["profile", "ab"])
    p.add_argument(
        "order",
        nargs="*",
        default=["off", "s1", "s4", "off", "s1", "s4"],
        help="ab: off | offt | offt-kept | sN, in order",
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--workload", default="sharegpt-like", help="ab: ops/bench/workloads.py's name (random: bench's)")
    p.add_argument("--max-tokens", type=int, default=128, help="ab: cap on each request's max_tokens")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out-dir", default="/tmp")
    args = p.parse_args(argv)
    if args.what == "profile":
        print(json.dumps(profile(args)))
    else:
        ab(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
