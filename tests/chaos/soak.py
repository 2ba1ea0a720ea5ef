"""Soak: thousands of mixed requests through one real worker, then leak and orphan checks.

    python -m tests.chaos.soak [--requests 2000] [--concurrency 64] [--seed 0]      (make soak)

Traffic: greedy requests of random prompt/output lengths on random priority lanes; some are cancelled
mid-way, some carry deadlines that expire, some entries are malformed. At the end:
- every good request completed with exactly the tokens of an offline run (cancelled / expired ones
  with a prefix of them),
- every bad entry has an Error event and a dead-letter copy,
- the worker holds no request and no KV block (its metrics),
- its RSS did not grow after warm-up,
- Redis holds no orphan keys once the result TTL has passed (response streams, submit markers and
  cancel flags all expire).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import msgspec
import redis

from producer_sdk import AsyncClient
from producer_sdk.constants import DEFAULT_TENANT
from producer_sdk.contract import keys, scripts
from producer_sdk.errors import Cancelled, DeadlineExceeded, RequestFailed
from tests.service.worker_proc import WorkerProc
from worker.service.redis_proc import RedisProcess

RESULT_TTL_S = 15


@dataclass
class SoakReport:
    requests: int
    good: int = 0
    completed_exact: int = 0
    cancelled_prefix: int = 0
    deadline_prefix: int = 0
    bad_entries: int = 0
    bad_answered: int = 0
    wrong: list[str] = field(default_factory=list)
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0
    kv_usage_end: float = -1.0
    running_end: float = -1.0
    orphan_keys: list[str] = field(default_factory=list)
    seconds: float = 0.0
    worker_log: str = ""  # the worker's log file (kept: it says what happened to a leftover)

    @property
    def ok(self) -> bool:
        return (
            not self.wrong
            and self.completed_exact + self.cancelled_prefix + self.deadline_prefix == self.good
            and self.bad_answered == self.bad_entries
            and self.kv_usage_end == 0.0
            and self.running_end == 0.0
            and self.rss_end_mib <= self.rss_warm_mib * 1.10 + 16
            and not self.orphan_keys
        )


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _plan(n: int, seed: int, vocab: int):
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        kind = rng.choices(["good", "cancel", "deadline", "bad"], [80, 8, 7, 5])[0]
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(1, 120))]
        plan.append(
            {
                "id": f"soak-{seed}-{i:05d}",
                "kind": kind,
                "prompt": prompt,
                "max_tokens": rng.randint(1, 48),
                "priority": rng.choice([-1, 0, 0, 0, 1]),
                "delay": rng.random() * 0.02,
            }
        )
    return plan


def _reference(model_dir: str, plan: list[dict]) -> dict[str, list[int]]:
    from worker import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", device="cpu")
    good = [p for p in plan if p["kind"] != "bad"]
    params = [SamplingParams(temperature=0, max_tokens=p["max_tokens"], ignore_eos=True) for p in good]
    outs = llm.generate([p["prompt"] for p in good], params, use_tqdm=False)
    return {p["id"]: o.outputs[0].token_ids for p, o in zip(good, outs, strict=True)}


async def _drive(url: str, plan: list[dict], expected: dict, report: SoakReport, concurrency: int, w: WorkerProc):
    sem = asyncio.Semaphore(concurrency)
    r = redis.asyncio.Redis.from_url(url)
    warm_at = len(plan) // 5
    done = 0

    async with AsyncClient(url, result_ttl_s=RESULT_TTL_S) as client:

        async def one(p: dict) -> None:
            nonlocal done
            async with sem:
                await asyncio.sleep(p["delay"])
                if p["kind"] == "bad":
                    body = {"v": 1, "request_id": p["id"], "prompt": "x", "sampling": {"max_tokens": -1}}
                    await r.xadd(keys.lane_stream("default"), {"id": p["id"], "d": msgspec.msgpack.encode(body)})
                    report.bad_entries += 1
                    for _ in range(400):
                        if await r.exists(keys.response_stream(p["id"])):
                            report.bad_answered += 1
                            break
                        await asyncio.sleep(0.05)
                else:
                    await _good(client, p, expected[p["id"]], report)
                done += 1
                if done == warm_at:
                    report.rss_warm_mib = _rss_mib(w.proc.pid)

        await asyncio.gather(*(one(p) for p in plan))
    await r.aclose()


async def _good(client: AsyncClient, p: dict, want: list[int], report: SoakReport) -> None:
    report.good += 1
    kw = dict(
        prompt_token_ids=p["prompt"],
        max_tokens=p["max_tokens"],
        temperature=0,
        ignore_eos=True,
        priority=p["priority"],
        request_id=p["id"],
    )
    if p["kind"] == "deadline":
        kw["deadline"] = 0.05
    handle = await client.submit(**kw)
    tokens: list[int] = []
    try:
        async for chunk in handle.stream(timeout=300):
            tokens += chunk.token_ids
            if p["kind"] == "cancel" and len(tokens) >= 1:
                await handle.cancel()
        exact = tokens == want
        report.completed_exact += exact
        if not exact:
            report.wrong.append(p["id"])
    except Cancelled:
        ok = tokens == want[: len(tokens)]
        report.cancelled_prefix += ok
        if not ok:
            report.wrong.append(p["id"])
    except DeadlineExceeded:
        ok = tokens == want[: len(tokens)]
        report.deadline_prefix += ok
        if not ok:
            report.wrong.append(p["id"])
    except RequestFailed as e:
        report.wrong.append(f"{p['id']}: {e}")


def _orphans(url: str) -> list[str]:
    r = redis.Redis.from_url(url)
    allowed = {keys.lane_stream("default", lane) for lane in keys.LANES} | {
        keys.dead_letters("default"),
        keys.config("default"),
        keys.heartbeats("default"),
        keys.models(),  # the registry of served model names (bounded: one member per model)
    }
    window_s = 2 * scripts.RATE_WINDOW_MS // 1000  # a tenant's token window lives at most two windows
    left = []
    for k in r.scan_iter("*"):
        name = k.decode()
        if name in allowed or name.startswith(keys.worker_state("default", "")):
            continue
        if name == keys.tenant_tokens("default", DEFAULT_TENANT) and 0 < r.ttl(k) <= window_s:
            continue  # this minute's tokens of the soak's tenant: it expires by itself
        what = r.hgetall(k) if r.type(k) == b"hash" else ""  # (a count left behind says whose)
        left.append(f"{name} (ttl {r.ttl(k)}) {what}".rstrip())
    for lane in keys.LANES:  # every entry is acked and deleted once its request ends
        stream = keys.lane_stream("default", lane)
        for entry_id, fields in r.xrange(stream):
            left.append(f"{stream} entry {entry_id.decode()} id={fields.get(b'id', b'').decode()}")
    r.close()
    return left


def run_soak(model_dir: str, requests: int, concurrency: int, seed: int) -> SoakReport:
    import transformers

    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    plan = _plan(requests, seed, vocab)
    expected = _reference(model_dir, plan)
    report = SoakReport(requests=requests)
    t0 = time.monotonic()
    with RedisProcess() as server:
        w = WorkerProc(
            model_dir, server.url, "--result-ttl", str(RESULT_TTL_S), "--max-num-seqs", "32", "--max-model-len", "256"
        ).start()
        report.worker_log = str(w.log_path)
        try:
            asyncio.run(_drive(server.url, plan, expected, report, concurrency, w))
            time.sleep(2.5)  # one heartbeat / gauge refresh after the last request
            report.rss_end_mib = _rss_mib(w.proc.pid)
            report.kv_usage_end = w.metric("pagedq_kv_cache_usage_perc")
            report.running_end = w.metric("pagedq_num_requests_running") + w.metric("pagedq_num_requests_waiting")
            time.sleep(RESULT_TTL_S + 1)
            report.orphan_keys = _orphans(server.url)
        finally:
            w.stop()
    report.seconds = round(time.monotonic() - t0, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model folder (default: a tiny random Llama built now)")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from worker.models.tiny import build_tiny_model

        model = str(build_tiny_model("llama", tempfile.mkdtemp(prefix="pagedq-soak-")))
    report = run_soak(model, args.requests, args.concurrency, args.seed)
    print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    print("SOAK", "PASSED" if report.ok else "FAILED")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
