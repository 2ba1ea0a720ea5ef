"""Hostile clients against one gateway: its memory, the other clients' latency, and the limits that close
the hostile connections (issue 48, item 3; docs/gateway.md, "Limits").

    pagedq bench hostile                 # tiny model, about 2-3 minutes
    pagedq bench hostile --quick         # a smoke run (50 stalled streams, 20 slowloris, 4 s phases)

Setup: a private redis-server, one `pagedq worker` (the tiny random Llama by default) and one gateway
with API keys: `sk-normal` for the measured clients, `sk-hostile-0..7` (one tenant) for the attacks, and
the gateway's default limits but `--body-read-timeout` and `--send-timeout` (shorter, so that the run
sees them act). Normal clients stream chat completions through the gateway at a Poisson `--rate` for
`--phase-s` s per phase (TTFT: request sent to the first chunk with content). The attacks run in another
process (ops/bench/hostile_clients.py):

0. baseline: normal clients alone;
1. stall: `--stalled` (500) connections that GET-stream a finished long answer (`--stall-tokens` tokens
   with `--top-logprobs` alternatives each: large frames, no worker time) and never read, a 4 KiB
   receive window each, the first key holding `--max-streams-per-key` of them and the other keys the
   rest. Once every write buffer is full (the gateway's stalled-connections gauge), one stream more
   on the first key must be a 429; then the normal clients run; then the send timeout must drop every
   stalled connection;
2. slowloris: `--slowloris` (200) connections sending a byte a second, half inside their headers and
   half inside a body, each reopened when the gateway closes it, while the normal clients run;
3. disconnect: `--disconnect-loops` (8) loops that open a stream, read its first token and hang up
   (half with a reset), `--disconnect-rate` (20) hang-ups a second in all, while the normal clients
   run; then no stream may be left open. (Each hang-up is a request the worker starts and then
   cancels: unpaced, the loops are a load test of the worker, which tenant quotas bound.)

The gateway's RSS (/proc/<pid>/status VmRSS) before, at its peak during, and after each attack, the
limits' counters (pagedq_gateway_limit_closes_total by reason) and gauges; the result goes to
ops/bench/results/hostile-<timestamp>.json (and latest/hostile.json).

Stated bounds (`goals`): the normal clients' TTFT p50 within 1.5x and p99 within 2x of the baseline in
each phase; at most 256 KiB of gateway RSS per stalled stream; every stalled stream dropped by the send
timeout, every slowloris connection closed by the header or body timeout, and no stream or hostile
connection left open after each phase.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from ops.bench.batch_mix import interactive_summary, prompts
from ops.bench.common import BLOCK_SIZE, REPO, child_env, model_info
from ops.bench.entry import run_and_save
from ops.bench.gateway_proc import (
    GatewayProcess,
    RssSampler,
    SSEStream,
    closes,
    cpu_seconds,
    gateway_metrics,
    gauge,
    wait_for_model,
)
from ops.bench.progress import Progress
from ops.bench.serving import ReqResult
from ops.bench.workloads import poisson_arrivals

CHAT = "/v1/chat/completions"
HOSTILE_KEYS = 8  # 500 stalled streams fit under the default --max-streams-per-key (64) of 8 keys
GOAL_P50_RATIO = 1.5
GOAL_P99_RATIO = 2.0
GOAL_KIB_PER_STALLED = 256
UNITS = 5  # start, baseline, stall, slowloris, disconnect


def mib(n: float) -> float:
    return n / (1 << 20)


def wait_for(cond, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s")


# --- the normal clients -------------------------------------------------------------------------------------


async def _chat(port: int, body: dict, key: str, res: ReqResult) -> None:
    """One streamed chat; a chunk with content counts one token, the last one gets what the usage chunk
    says is left (a chunk may carry several)."""
    s = SSEStream(port, CHAT, body, headers={"Authorization": f"Bearer {key}"})
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
                left = (event.get("usage") or {}).get("completion_tokens", 0) - res.tokens
                if res.chunks and left:
                    res.chunks[-1] = (res.chunks[-1][0], res.chunks[-1][1] + left)
                continue
            if (choices[0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                if not res.chunks:
                    res.t_first = now
                res.chunks.append((now, 1))
    except Exception as e:  # recorded, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.t_end = time.perf_counter()
        s.close()


def normal_clients(port: int, model: str, args: argparse.Namespace, seed: int, duration: float) -> dict:
    """`--rate` streamed chats a second for `duration` s; TTFT and the rest (`interactive_summary`)."""
    n = max(1, round(args.rate * duration))
    arrivals = poisson_arrivals(n, args.rate, seed)
    body = {"model": model, "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    bodies = [
        {**body, "messages": [{"role": "user", "content": t}]} for t in prompts(n, args.prompt_words, f"hostile:{seed}")
    ]

    async def main() -> list[ReqResult]:
        results = [ReqResult(i, "chat", 0, args.max_tokens) for i in range(n)]
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            await _chat(port, bodies[i], "sk-normal", results[i])

        await asyncio.gather(*(one(i) for i in range(n)))
        return results

    t0 = time.perf_counter()
    results = asyncio.run(main())
    return interactive_summary(results, time.perf_counter() - t0)


# --- the attacks ---------------------------------------------------------------------------------------------


class Attack:
    """One `python -m ops.bench.hostile_clients ATTACK ...` process."""

    def __init__(self, attack: str, port: int, keys: list[str], n: int, *extra: str) -> None:
        cmd = [sys.executable, "-m", "ops.bench.hostile_clients", attack, "--port", str(port)]
        cmd += ["--keys", ",".join(keys), "--n", str(n), *extra]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=child_env(1), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def _line(self, event: str, timeout: float) -> dict:
        assert self.proc.stdout is not None
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            raise RuntimeError(f"the attack process gave no {event!r} line within {timeout:.0f}s")
        got = json.loads(box[0])
        if got.get("event") != event:
            raise RuntimeError(f"the attack process said {got}, not {event!r}")
        return got

    def ready(self, timeout: float = 60) -> dict:
        return self._line("ready", timeout)

    def stop(self, timeout: float = 60) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        done = self._line("done", timeout)
        self.proc.wait(10)
        return done

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def per_key_probe(port: int, path: str, key: str, limit: int) -> dict:
    """Streams of `key` opened (their headers read) until one is refused: the (limit + 1)-th at the latest."""
    held: list[http.client.HTTPConnection] = []
    try:
        for n in range(limit + 1):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
            resp = conn.getresponse()
            held.append(conn)
            if resp.status != 200:
                error = json.loads(resp.read()).get("error", {})
                return {
                    "opened_before": n,
                    "refused_status": str(resp.status),
                    "code": error.get("code"),
                    "retry_after": resp.getheader("retry-after"),
                }
        return {"opened_before": limit + 1, "refused_status": None}
    finally:
        for conn in held:
            conn.close()


# --- the benchmark ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, progress: Progress) -> dict:
    from ops.bench.serving import Worker
    from worker.service.redis_proc import RedisProcess

    info = model_info(args.model_dir)
    ns = f"bench-hostile-{uuid.uuid4().hex[:6]}"
    hostile = [f"sk-hostile-{i}" for i in range(HOSTILE_KEYS)]
    tmp = Path(tempfile.mkdtemp(prefix="pagedq-bench-hostile-"))
    key_file = tmp / "keys.json"
    entries = {"sk-normal": {"tenant": "normal"}, **{k: {"tenant": "hostile"} for k in hostile}}
    key_file.write_text(json.dumps(entries))
    seats = 16 + args.disconnect_loops + 2 * math.ceil(args.rate)
    kv_blocks = (math.ceil((args.stall_tokens + 64) / BLOCK_SIZE) + 1) * seats
    flags = ["--body-read-timeout", str(args.body_read_timeout), "--send-timeout", str(args.send_timeout)]
    flags += ["--max-streams-per-key", str(args.max_streams_per_key)]
    out: dict = {
        "model": info,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "normal": {"rate_req_s": args.rate, "phase_s": args.phase_s, "max_tokens": args.max_tokens},
        "gateway_limit_flags": flags,
        "phases": {},
    }
    with RedisProcess() as server:
        wargs = argparse.Namespace(
            model_dir=args.model_dir, dtype=args.dtype, device=args.device, threads=args.threads, engine={}
        )
        worker = Worker("pagedq", wargs, server.url, ns, kv_blocks=kv_blocks)
        gateway = GatewayProcess(server.url, "--api-keys", str(key_file), *flags)
        out["worker_cmd"], out["gateway_cmd"] = worker.cmd[2:], gateway.cmd[2:]
        attack: Attack | None = None
        try:
            progress.start("hostile: starting worker and gateway")
            worker.start()
            gateway.start()
            port, pid = gateway.port, gateway.proc.pid  # type: ignore[union-attr]
            wait_for_model(port, ns, key="sk-normal")
            normal_clients(port, ns, args, args.seed + 100, 2.0)  # warm-up
            long_id = _long_answer(port, ns, hostile[0], args)
            out["stall_answer"] = long_id
            base_conns = gauge(port, "pagedq_gateway_open_connections")
            progress.done()

            def measured(phase: str) -> dict:
                c0 = cpu_seconds(pid)
                with RssSampler(gateway) as rss:  # the same arrivals and prompts in every phase
                    s = normal_clients(port, ns, args, args.seed, args.phase_s)
                s["gateway_rss_peak_mib"] = mib(rss.peak)
                s["gateway_cpu_s"] = cpu_seconds(pid) - c0
                out["phases"][phase] = s
                return s

            # 0. baseline
            progress.start(f"hostile: baseline, normal clients at {args.rate:g}/s")
            base = measured("baseline")
            progress.done(note=f"TTFT p99 {base['ttft_s']['p99'] * 1000:.0f} ms")

            # 1. stalled readers
            progress.start(f"hostile: {args.stalled} streams that never read")
            c0, rss0 = closes(port), gateway.rss_bytes()
            path = f"{CHAT}/{long_id['id']}?stream=true"
            t0 = time.monotonic()
            fill = min(args.stalled, args.max_streams_per_key)  # the first key full: its next stream is a 429
            attack = Attack("stall", port, hostile, args.stalled, "--path", path, "--fill", str(fill))
            opened = attack.ready()["opened"]
            stalled_gauge = "pagedq_gateway_stalled_connections"
            wait_for(lambda: gauge(port, stalled_gauge) >= opened, 120, f"{opened} stalled connections")
            t_stalled = time.monotonic() - t0
            rss_stalled = gateway.rss_bytes()
            probe = per_key_probe(port, path, hostile[0], args.max_streams_per_key)
            stall = measured("stall")
            wait_for(
                lambda: closes(port).get("send_timeout", 0) - c0.get("send_timeout", 0) >= opened,
                args.send_timeout + 60,
                "every stalled connection dropped",
            )
            wait_for(lambda: gauge(port, "pagedq_gateway_open_streams") == 0, 30, "no stream open")
            stall["attack"] = attack.stop()
            attack = None
            c1 = closes(port)
            stall.update(
                stalled=opened,
                seconds_to_stall_all=t_stalled,
                rss_before_mib=mib(rss0),
                rss_stalled_mib=mib(rss_stalled),
                kib_per_stalled=(rss_stalled - rss0) / 1024 / max(1, opened),
                rss_after_mib=mib(gateway.rss_bytes()),
                dropped_by_send_timeout=c1.get("send_timeout", 0) - c0.get("send_timeout", 0),
                per_key_probe=probe,
                open_streams_after=gauge(port, "pagedq_gateway_open_streams"),
            )
            progress.done(note=f"{stall['kib_per_stalled']:.0f} KiB/stalled stream")

            # 2. slowloris
            progress.start(f"hostile: {args.slowloris} slowloris connections")
            c0, rss0 = closes(port), gateway.rss_bytes()
            attack = Attack("slowloris", port, hostile, args.slowloris)
            attack.ready()
            slow = measured("slowloris")
            slow["attack"] = attack.stop()
            attack = None
            c1 = closes(port)
            wait_for(lambda: gauge(port, "pagedq_gateway_open_connections") <= base_conns, 30, "connections closed")
            slow.update(
                rss_before_mib=mib(rss0),
                rss_after_mib=mib(gateway.rss_bytes()),
                closed_by_header_timeout=c1.get("header_timeout", 0) - c0.get("header_timeout", 0),
                closed_by_body_timeout=c1.get("body_timeout", 0) - c0.get("body_timeout", 0),
            )
            progress.done(note=f"{slow['attack']['closed_by_server']} closed")

            # 3. disconnect loop
            progress.start(f"hostile: {args.disconnect_loops} loops hanging up mid-stream")
            m0, rss0 = gateway_metrics(port), gateway.rss_bytes()
            rate = ("--rate", str(args.disconnect_rate))
            attack = Attack("disconnect", port, hostile, args.disconnect_loops, "--model", ns, *rate)
            attack.ready()
            loop = measured("disconnect")
            loop["attack"] = attack.stop()
            attack = None
            wait_for(lambda: gauge(port, "pagedq_gateway_open_streams") == 0, 30, "no stream open")
            wait_for(lambda: gauge(port, "pagedq_gateway_open_connections") <= base_conns, 30, "connections closed")
            wait_for(lambda: worker.metrics().get("pagedq_num_requests_running", 1) == 0, 60, "the worker idle")
            m1 = gateway_metrics(port)
            cancels = "pagedq_gateway_disconnect_cancels_total"
            loop.update(
                rss_before_mib=mib(rss0),
                rss_after_mib=mib(gateway.rss_bytes()),
                disconnect_cancels=m1.get(cancels, 0) - m0.get(cancels, 0),
                open_streams_after=m1.get("pagedq_gateway_open_streams"),
                open_connections_after=m1.get("pagedq_gateway_open_connections"),
            )
            progress.done(note=f"{loop['attack']['cycles']} hang-ups")
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
            progress.write(f"[hostile] failed: {out['error'].splitlines()[0]}")
        finally:
            if attack is not None:
                attack.kill()
            gateway.stop()
            worker.stop()
    out["goals"] = goals(out, args)
    return out


def _long_answer(port: int, model: str, key: str, args: argparse.Namespace) -> dict:
    """A finished answer of `--stall-tokens` tokens with `--top-logprobs` alternatives each, and the size of
    its SSE replay: what each stalled connection asks for."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "a long answer"}],
        "max_tokens": args.stall_tokens,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": args.top_logprobs,
    }
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{CHAT}", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=300) as resp:
        done = json.loads(resp.read())
    req = urllib.request.Request(f"http://127.0.0.1:{port}{CHAT}/{done['id']}?stream=true", headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        size = len(resp.read())
    return {"id": done["id"], "tokens": done["usage"]["completion_tokens"], "sse_bytes": size}


def goals(out: dict, args: argparse.Namespace) -> list[dict]:
    phases = out["phases"]
    rows: list[dict] = []
    base = phases.get("baseline")
    for name in ("stall", "slowloris", "disconnect"):
        p = phases.get(name)
        if not (base and p):
            continue
        p["ttft_p50_ratio"] = p["ttft_s"]["p50"] / base["ttft_s"]["p50"]
        p["ttft_p99_ratio"] = p["ttft_s"]["p99"] / base["ttft_s"]["p99"]
        ok = p["ok"] == p["requests"]
        rows.append(
            {
                "goal": f"normal clients' TTFT during {name}",
                "target": f"p50 <= {GOAL_P50_RATIO}x, p99 <= {GOAL_P99_RATIO}x of baseline, none failed",
                "measured": f"p50 {p['ttft_p50_ratio']:.2f}x, p99 {p['ttft_p99_ratio']:.2f}x, "
                f"{p['ok']}/{p['requests']} ok",
                "pass": ok and p["ttft_p50_ratio"] <= GOAL_P50_RATIO and p["ttft_p99_ratio"] <= GOAL_P99_RATIO,
            }
        )
    stall = phases.get("stall")
    if stall and "stalled" in stall:
        rows.append(
            {
                "goal": f"gateway RSS per stalled stream ({stall['stalled']})",
                "target": f"<= {GOAL_KIB_PER_STALLED} KiB",
                "measured": f"{stall['kib_per_stalled']:.1f} KiB",
                "pass": stall["kib_per_stalled"] <= GOAL_KIB_PER_STALLED,
            }
        )
        rows.append(
            {
                "goal": "stalled streams dropped by --send-timeout; a stream more on a full key is a 429",
                "target": f"{stall['stalled']} dropped, 429, 0 open after",
                "measured": f"{stall['dropped_by_send_timeout']:.0f} dropped, "
                f"{stall['per_key_probe']['refused_status']}, {stall['open_streams_after']:.0f} open",
                "pass": stall["dropped_by_send_timeout"] >= stall["stalled"]
                and stall["per_key_probe"]["refused_status"] == "429"
                and stall["open_streams_after"] == 0,
            }
        )
    slow = phases.get("slowloris")
    if slow and "attack" in slow:
        a = slow["attack"]
        closed = slow["closed_by_header_timeout"] + slow["closed_by_body_timeout"]
        rows.append(
            {
                "goal": "slowloris connections closed by --header-read-timeout / --body-read-timeout",
                "target": "every close the client saw was a 408 of those timeouts",
                "measured": f"{closed:.0f} closed by the timeouts, client saw {a['closed_by_server']} "
                f"({a['statuses']})",
                "pass": a["closed_by_server"] > 0 and a["statuses"].get("408", 0) == a["closed_by_server"],
            }
        )
    loop = phases.get("disconnect")
    if loop and "attack" in loop:
        rows.append(
            {
                "goal": "clients hanging up mid-stream leave nothing open",
                "target": "0 streams open after, every hang-up cancelled",
                "measured": f"{loop['open_streams_after']:.0f} open, {loop['disconnect_cancels']:.0f} cancels "
                f"for {loop['attack']['cycles']} hang-ups",
                "pass": loop["open_streams_after"] == 0 and loop["disconnect_cancels"] >= loop["attack"]["cycles"],
            }
        )
    return rows


def report_lines(r: dict) -> list[str]:
    lines = [
        f"model {r['model']['folder']}, {r['dtype']} on {r['device']}, {r['threads']} worker threads; normal "
        f"clients at {r['normal']['rate_req_s']:g} req/s for {r['normal']['phase_s']:g} s a phase; gateway "
        f"flags beyond the defaults: {' '.join(r['gateway_limit_flags'])}"
    ]
    if "error" in r:
        lines.append(f"FAILED: {r['error']}")
    for name, p in r["phases"].items():
        t = p["ttft_s"]
        ratio = f" ({p['ttft_p50_ratio']:.2f}x, {p['ttft_p99_ratio']:.2f}x)" if "ttft_p50_ratio" in p else ""
        lines.append(
            f"{name:<10} TTFT p50 {1000 * t['p50']:7.1f} ms  p99 {1000 * t['p99']:7.1f} ms{ratio}  "
            f"({p['ok']}/{p['requests']} ok); gateway RSS peak {p['gateway_rss_peak_mib']:.1f} MiB, "
            f"CPU {p['gateway_cpu_s']:.1f} s"
        )
    s = r["phases"].get("stall", {})
    if "stalled" in s:
        lines.append(
            f"stall: {s['stalled']} streams of a {r['stall_answer']['sse_bytes'] / 1024:.0f} KiB answer stalled in "
            f"{s['seconds_to_stall_all']:.1f} s; RSS {s['rss_before_mib']:.1f} -> {s['rss_stalled_mib']:.1f} MiB "
            f"({s['kib_per_stalled']:.1f} KiB each) -> {s['rss_after_mib']:.1f} MiB after; "
            f"{s['dropped_by_send_timeout']:.0f} dropped by --send-timeout; a stream more on a full key: "
            f"{s['per_key_probe']['refused_status']}"
        )
    s = r["phases"].get("slowloris", {})
    if "attack" in s:
        a = s["attack"]
        lines.append(
            f"slowloris: {a['connections']} at a time, {a['opened']} opened, {a['closed_by_server']} closed by the "
            f"gateway ({a['statuses']}), held {a['held_s_min'] or 0:.1f}-{a['held_s_max'] or 0:.1f} s; "
            f"header timeouts {s['closed_by_header_timeout']:.0f}, body timeouts {s['closed_by_body_timeout']:.0f}; "
            f"RSS {s['rss_before_mib']:.1f} -> {s['rss_after_mib']:.1f} MiB"
        )
    s = r["phases"].get("disconnect", {})
    if "attack" in s:
        a = s["attack"]
        lines.append(
            f"disconnect: {a['cycles']} hang-ups by {a['loops']} loops (refused {a['refused']}, errors "
            f"{a['errors']}); {s['disconnect_cancels']:.0f} cancels; open streams after {s['open_streams_after']:.0f}, "
            f"connections {s['open_connections_after']:.0f}; RSS {s['rss_before_mib']:.1f} -> "
            f"{s['rss_after_mib']:.1f} MiB"
        )
    for g in r.get("goals", []):
        lines.append(f"[{'met' if g['pass'] else 'MISSED'}] {g['goal']}: {g['measured']} (target {g['target']})")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="pagedq bench hostile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="50 stalled streams, 20 slowloris, 4 s phases: a smoke run")
    p.add_argument("--model", default="tiny", help="model folder, 'smollm2' or 'tiny' (default: tiny)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    p.add_argument("--rate", type=float, default=4.0, help="normal clients' requests a second (Poisson)")
    p.add_argument("--phase-s", type=float, default=None, help="seconds of normal clients a phase (20; quick 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens of a normal request")
    p.add_argument("--prompt-words", type=int, default=16, help="words of a normal request's message")
    p.add_argument("--stalled", type=int, default=None, help="streams that never read (500; quick 50)")
    p.add_argument("--stall-tokens", type=int, default=400, help="tokens of the answer the stalled streams get")
    p.add_argument("--top-logprobs", type=int, default=20, help="alternatives a token in that answer (big frames)")
    p.add_argument("--slowloris", type=int, default=None, help="slowloris connections at a time (200; quick 20)")
    p.add_argument("--disconnect-loops", type=int, default=8, help="loops hanging up mid-stream at once")
    p.add_argument(
        "--disconnect-rate", type=float, default=20.0, help="hang-ups a second of all the loops (0: as fast as they go)"
    )
    p.add_argument("--body-read-timeout", type=float, default=None, help="the gateway's (10; quick 3)")
    p.add_argument("--send-timeout", type=float, default=None, help="the gateway's (30; quick 8)")
    p.add_argument("--max-streams-per-key", type=int, default=None, help="the gateway's (64, its default; quick 16)")
    p.add_argument("--seed", type=int, default=0, help="the normal clients' arrivals and prompts")
    p.add_argument("--out", default=None, help="results folder (default ops/bench/results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    q = args.quick
    for name, full, quick in (
        ("phase_s", 20.0, 4.0),
        ("stalled", 500, 50),
        ("slowloris", 200, 20),
        ("body_read_timeout", 10.0, 3.0),
        ("send_timeout", 30.0, 8.0),
        ("max_streams_per_key", 64, 16),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.stalled > HOSTILE_KEYS * args.max_streams_per_key or args.max_streams_per_key < 1:
        p.error(f"--stalled: at most {HOSTILE_KEYS} keys x --max-streams-per-key (>= 1) streams")
    if args.send_timeout <= args.phase_s:
        p.error("--send-timeout must be longer than --phase-s: the stalled streams are held while clients run")
    return run_and_save("hostile", argv, args, run, report_lines, UNITS)


if __name__ == "__main__":
    raise SystemExit(main())
