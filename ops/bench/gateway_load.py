"""`pagedq bench serve --via gateway`: the OpenAI-compatible gateway against the SDK path, in one run.

One redis-server, one `pagedq` worker (the serve benchmark's engine options) and one gateway process
(`python -m gateway`) on the same Redis. Measured, the two paths alternating:

1. saturation: the `random` workload submitted at once, through the SDK (`producer_sdk.AsyncClient`)
   and through the gateway (streamed `POST /v1/completions` with the same token-id prompts, greedy,
   `ignore_eos`); --repeats runs each, medians; goal: gateway >= 95% of the SDK's output tokens/s;
2. added time to first token: short requests (32-token prompts, 8 tokens out; --single-requests, at
   least 24) one at a time through each path, alternating;
   goal: p50 TTFT through the gateway minus p50 through the SDK < 5 ms;
3. --gateway-streams concurrent SSE streams held open by one gateway (chat requests queued for a
   model name that has no worker, so every stream stays open, waiting, for as long as the check
   takes); the gateway's resident memory before and while holding them gives the memory per stream.
   Requests to the served model are answered while they are held (3, one a second: median TTFT).

The HTTP client is a small asyncio HTTP/1.1 + SSE reader (ops/bench/gateway_proc.py). An SSE chunk
without logprobs does not say how many tokens it carries: each counts as one, and the last one gets
what the usage chunk says is left.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from ops.bench.common import kv_blocks_for, model_info
from ops.bench.gateway_proc import GatewayProcess, SSEStream
from ops.bench.progress import Progress
from ops.bench.serving import ReqResult, Worker, run_load, summarize, worker_engine
from ops.bench.stats import dist, median
from ops.bench.workloads import BenchRequest, make_workload, warmup_requests

GOAL_THROUGHPUT_RATIO = 0.95
GOAL_ADDED_TTFT_S = 0.005
MIN_SINGLE_REQUESTS = 24
IDLE_MODEL = "bench-idle"  # a served-once model name with no worker: its streams wait


def completion_body(model: str, r: BenchRequest) -> dict:
    return {
        "model": model,
        "prompt": list(r.prompt),
        "max_tokens": r.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _one_http(port: int, model: str, r: BenchRequest, res: ReqResult) -> None:
    s = SSEStream(port, "/v1/completions", completion_body(model, r))
    res.t_submit = time.perf_counter()
    try:
        await s.open()
        async for data in s.events():
            if data == b"[DONE]":
                break
            if b'"finish_reason":null' in data:  # a token chunk (no JSON parse: the client stays light)
                now = time.perf_counter()
                if not res.chunks:
                    res.t_first = now
                res.chunks.append((now, 1))
            elif b'"choices":[]' in data:  # the usage chunk
                left = json.loads(data)["usage"]["completion_tokens"] - res.tokens
                if res.chunks and left:
                    t, n = res.chunks[-1]
                    res.chunks[-1] = (t, n + left)
        res.t_end = time.perf_counter()
    except Exception as e:  # recorded, the run goes on
        res.error = f"{type(e).__name__}: {e}"
        res.t_end = time.perf_counter()
    finally:
        s.close()


def run_load_gateway(port: int, model: str, reqs: list[BenchRequest], arrivals: list[float]) -> list[ReqResult]:
    async def main() -> list[ReqResult]:
        results = [ReqResult(i, r.kind, len(r.prompt), r.max_tokens) for i, r in enumerate(reqs)]
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            await _one_http(port, model, reqs[i], results[i])

        await asyncio.gather(*(one(i) for i in range(len(reqs))))
        return results

    return asyncio.run(main())


# --- the three measurements -------------------------------------------------------------------------


def single_ttft(redis_url: str, ns: str, port: int, reqs: list[BenchRequest], timeout: float) -> dict:
    """Each request alone, through the SDK then through the gateway."""
    sdk, gw = [], []
    for r in reqs:
        sdk += run_load(redis_url, ns, [r], [0.0], timeout=timeout)[0]
        gw += run_load_gateway(port, ns, [r], [0.0])
    t_sdk, t_gw = dist(x.ttft for x in sdk if x.ok), dist(x.ttft for x in gw if x.ok)
    return {
        "requests": len(reqs),
        "errors": sorted({x.error for x in sdk + gw if x.error})[:5],
        "sdk_ttft_s": t_sdk,
        "gateway_ttft_s": t_gw,
        "added_p50_s": t_gw["p50"] - t_sdk["p50"],
    }


def hold_streams(redis_url: str, gateway: GatewayProcess, ns: str, n: int, probe: BenchRequest) -> dict:
    """`n` chat streams held open at once (queued for IDLE_MODEL), and one answer meanwhile."""
    import redis

    from producer_sdk.contract import keys

    r = redis.Redis.from_url(redis_url)
    r.zadd(keys.models(), {IDLE_MODEL: int(time.time() * 1000)})
    time.sleep(1.2)  # the gateway rereads the registry every second: then it knows the name
    body = {"model": IDLE_MODEL, "messages": [{"role": "user", "content": "wait"}], "max_tokens": 4, "stream": True}

    async def main() -> dict:
        before = gateway.rss_bytes()
        streams = [SSEStream(gateway.port, "/v1/chat/completions", body) for _ in range(n)]

        async def opened(s: SSEStream) -> None:
            await s.open()
            async for _ in s.events():  # the role chunk: the stream is up
                return

        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(opened(s) for s in streams), return_exceptions=True)
        t_open = time.perf_counter() - t0
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        held = await asyncio.to_thread(gateway.metric, "pagedq_gateway_open_streams")
        rss = gateway.rss_bytes()
        probes = []
        for _ in range(3):  # once the burst of 1,000 openings has settled (its Redis connections made)
            await asyncio.sleep(1.0)
            probes.append(ReqResult(0, "chat", len(probe.prompt), probe.max_tokens))
            await _one_http(gateway.port, ns, probe, probes[-1])
        for s in streams:
            s.close()
        return {
            "streams": n,
            "failed": len(failed),
            "errors": sorted({f"{type(o).__name__}: {o}" for o in failed})[:3],
            "open_s": t_open,
            "open_streams_gauge": held,
            "rss_before_mib": before / 2**20,
            "rss_holding_mib": rss / 2**20,
            "per_stream_kib": (rss - before) / max(n - len(failed), 1) / 1024,
            "probe_ok": all(p.ok for p in probes),
            "probe_ttft_s": median(p.ttft for p in probes),
        }

    try:
        return asyncio.run(main())
    finally:
        r.zrem(keys.models(), IDLE_MODEL)
        r.delete(*(keys.lane_stream(IDLE_MODEL, lane) for lane in keys.LANES))
        r.close()


# --- the benchmark ------------------------------------------------------------------------------------


def plan_units(args) -> int:
    return 2 + 2 * args.repeats + 1 + 1


def run(args, progress: Progress) -> dict:
    from worker.service.redis_proc import RedisProcess

    info = model_info(args.model_dir)
    vocab, max_len = info["prompt_vocab"], info["max_model_len"]
    wl = make_workload(args.workload, args.requests, args.seed, vocab, max_len)
    n_single = max(args.single_requests, MIN_SINGLE_REQUESTS)
    singles = [BenchRequest(r.prompt[:32], 8) for r in make_workload("random", n_single, args.seed + 1, vocab).requests]
    n_streams = args.gateway_streams
    out: dict = {
        "kind": "serve-gateway",
        "model": info,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "repeats": args.repeats,
        "workload": wl.describe(),
    }
    with RedisProcess() as server:
        ns = f"bench-gw-{uuid.uuid4().hex[:6]}"
        engine = worker_engine("pagedq", args)
        progress.start("serve via gateway: starting worker and gateway")
        worker = Worker("pagedq", args, server.url, ns, kv_blocks=kv_blocks_for(wl, max_len), engine=engine)
        # --gateway-streams may ask for more than --limit-concurrency, which is not what it measures.
        no_limits = ("--limit-concurrency", "0")
        gateway = GatewayProcess(server.url, "--queue-without-workers", *no_limits)
        out["worker_cmd"], out["gateway_cmd"] = worker.cmd[2:], gateway.cmd[2:]
        try:
            worker.start()
            gateway.start()
            warm = warmup_requests(vocab)
            run_load(server.url, ns, warm, [0.0] * len(warm), timeout=args.child_timeout)
            run_load_gateway(gateway.port, ns, warm, [0.0] * len(warm))
            progress.done()
            runs: dict[str, list[dict]] = {"sdk": [], "gateway": []}
            for rep in range(args.repeats):
                for path in ("sdk", "gateway"):
                    progress.start(f"serve via gateway: saturation {rep + 1}, {path}")
                    if path == "sdk":
                        res = run_load(server.url, ns, wl.requests, [0.0] * len(wl), timeout=args.child_timeout)[0]
                    else:
                        res = run_load_gateway(gateway.port, ns, wl.requests, [0.0] * len(wl))
                    s = summarize(res, args.slo_ttft, args.slo_tpot)
                    runs[path].append(s)
                    progress.done(note=f"{path} {s['out_tok_s']:.1f} tok/s")
            sat = {p: {"runs": v, "out_tok_s": median(s["out_tok_s"] for s in v)} for p, v in runs.items()}
            sat["ratio"] = sat["gateway"]["out_tok_s"] / sat["sdk"]["out_tok_s"]
            out["saturation"] = sat
            progress.start("serve via gateway: single requests (added TTFT)")
            out["single"] = single_ttft(server.url, ns, gateway.port, singles, args.child_timeout)
            progress.done(note=f"+{out['single']['added_p50_s'] * 1000:.2f} ms p50")
            progress.start(f"serve via gateway: {n_streams} concurrent streams")
            out["streams"] = hold_streams(server.url, gateway, ns, n_streams, singles[0])
            progress.done(2, note=f"{out['streams']['per_stream_kib']:.0f} KiB/stream")
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
            progress.write(f"[serve via gateway] failed: {out['error'].splitlines()[0]}")
        finally:
            gateway.stop()
            worker.stop()
    out["goals"] = goals(out)
    for line in report_lines(out):
        progress.write(line)
    return out


def goals(out: dict) -> list[dict]:
    sat, single, streams = out.get("saturation"), out.get("single"), out.get("streams")
    rows = []
    if sat:
        rows.append(
            {
                "goal": "saturation throughput, gateway vs SDK",
                "target": f">= {GOAL_THROUGHPUT_RATIO:.0%}",
                "measured": sat["ratio"],
                "pass": sat["ratio"] >= GOAL_THROUGHPUT_RATIO,
            }
        )
    if single:
        added = single["added_p50_s"]
        rows.append(
            {
                "goal": "added TTFT p50 through the gateway",
                "target": f"< {GOAL_ADDED_TTFT_S * 1000:g} ms",
                "measured": added,
                "pass": added < GOAL_ADDED_TTFT_S,
            }
        )
    if streams:
        ok = streams["failed"] == 0 and streams["open_streams_gauge"] == streams["streams"] and streams["probe_ok"]
        rows.append(
            {
                "goal": f"one gateway holds {streams['streams']} concurrent SSE streams",
                "target": "all open",
                "measured": streams["per_stream_kib"],
                "pass": ok,
            }
        )
    return rows


def report_lines(out: dict) -> list[str]:
    lines = []
    if "saturation" in out:
        sat = out["saturation"]
        lines.append(
            f"[serve via gateway] saturation: SDK {sat['sdk']['out_tok_s']:.1f} tok/s, gateway "
            f"{sat['gateway']['out_tok_s']:.1f} tok/s ({sat['ratio']:.1%})"
        )
    if "single" in out:
        s = out["single"]
        lines.append(
            f"[serve via gateway] TTFT p50 one at a time: SDK {s['sdk_ttft_s']['p50'] * 1000:.2f} ms, gateway "
            f"{s['gateway_ttft_s']['p50'] * 1000:.2f} ms (added {s['added_p50_s'] * 1000:.2f} ms)"
        )
    if "streams" in out:
        h = out["streams"]
        probe = "ok" if h["probe_ok"] else "failed"
        lines.append(
            f"[serve via gateway] {h['streams']} streams held ({h['failed']} failed, gauge "
            f"{h['open_streams_gauge']:.0f}): RSS {h['rss_before_mib']:.1f} -> {h['rss_holding_mib']:.1f} MiB, "
            f"{h['per_stream_kib']:.1f} KiB per stream; a request meanwhile: TTFT "
            f"{h['probe_ttft_s'] * 1000:.1f} ms ({probe})"
        )
    return lines


__all__ = ["plan_units", "run", "run_load_gateway"]
