"""The noisy tenant of the tenants benchmark (ops/bench/tenants.py), a client in its own process.

It submits a burst of requests every interval, each submit once (a `RateLimited` one is counted, never
retried), reads every accepted answer to its end, and stops sending when the parent sets a Redis key.

    python -m ops.bench.tenant_noisy SPEC.json      # started by NoisyProcess; writes its counts to spec["out"]
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

from ops.bench.common import REPO, child_env
from ops.bench.stats import dist
from ops.bench.workloads import BenchRequest

NOISY = "noisy"


def make_requests(n: int, prompt_len: int, max_tokens: int, vocab: int, seed: str) -> list[BenchRequest]:
    """`n` requests of random prompt ids (above the special tokens) and a fixed output length."""
    rng = random.Random(seed)
    lo = min(1000, vocab // 4)
    return [BenchRequest([rng.randrange(lo, vocab) for _ in range(prompt_len)], max_tokens) for _ in range(n)]


def stop_key(namespace: str) -> str:
    return f"pagedq-bench:{namespace}:noisy-stop"


def started_key(namespace: str) -> str:
    return f"pagedq-bench:{namespace}:noisy-started"


async def noisy_load(spec: dict) -> dict:
    """Bursts of `burst` submits every `interval_s` until the stop key appears; then waits (at most
    `drain_s`) for the accepted requests to finish. Counts what each submit got."""
    import redis.asyncio as aioredis

    from producer_sdk import AsyncClient, RateLimited

    ns = spec["namespace"]
    reqs = make_requests(spec["burst"], spec["prompt_len"], spec["max_tokens"], spec["vocab"], f"noisy:{ns}")
    counts: Counter = Counter()
    by_quota: Counter = Counter()
    accepted_per_burst: list[int] = []
    readers: set[asyncio.Task] = set()
    control = aioredis.Redis.from_url(spec["redis_url"])
    cpu0 = time.process_time()

    async with AsyncClient(spec["redis_url"], model=ns, tenant=NOISY) as client:

        async def read(handle) -> None:
            try:
                await handle.result(timeout=spec["timeout"])
                counts["finished"] += 1
            except Exception as e:
                counts[f"failed: {type(e).__name__}"] += 1

        async def submit(r: BenchRequest) -> bool:
            counts["sent"] += 1
            try:
                handle = await client.submit(
                    prompt_token_ids=list(r.prompt), max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True
                )
            except RateLimited as e:
                counts["rate_limited"] += 1
                by_quota[e.quota] += 1
                return False
            except Exception as e:  # recorded, never retried
                counts[f"refused: {type(e).__name__}"] += 1
                return False
            task = asyncio.create_task(read(handle))
            readers.add(task)
            task.add_done_callback(readers.discard)
            return True

        loop = asyncio.get_running_loop()
        start = loop.time()
        while not await control.exists(stop_key(ns)):
            t = loop.time()
            ok = await asyncio.gather(*(submit(r) for r in reqs))
            accepted_per_burst.append(sum(ok))
            if len(accepted_per_burst) == 1:
                await control.set(started_key(ns), 1)
            await asyncio.sleep(max(0.0, t + spec["interval_s"] - loop.time()))
        sending_s = loop.time() - start
        cpu_sending = time.process_time() - cpu0
        if readers:
            _, late = await asyncio.wait(set(readers), timeout=spec["drain_s"])
            for task in late:
                task.cancel()
            counts["unfinished"] += len(late)
    await control.aclose()
    return {
        "bursts": len(accepted_per_burst),
        "sending_s": sending_s,
        "cpu_s_while_sending": cpu_sending,
        "sent": counts.pop("sent", 0),
        "accepted": sum(accepted_per_burst),
        "rate_limited": counts.pop("rate_limited", 0),
        "rate_limited_by_quota": dict(by_quota),
        "finished": counts.pop("finished", 0),
        "accepted_per_burst": dist(accepted_per_burst),
        "other": dict(counts),
    }


class NoisyProcess:
    """The noisy tenant's client, run as `python -m ops.bench.tenant_noisy SPEC.json`."""

    def __init__(self, spec: dict, tmp: Path, threads: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.spec = {**spec, "out": str(tmp / f"noisy-{tag}.json")}
        self.spec_path = tmp / f"noisy-{tag}.spec.json"
        self.spec_path.write_text(json.dumps(self.spec))
        self.log_path = tmp / f"noisy-{tag}.log"
        self.threads = threads
        self.proc: subprocess.Popen | None = None

    def _log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def start(self, r, timeout: float = 60.0) -> None:
        """Start it and wait until its first burst went out."""
        cmd = [sys.executable, "-m", "ops.bench.tenant_noisy", str(self.spec_path)]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=child_env(self.threads), stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while not r.exists(started_key(self.spec["namespace"])):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"noisy client did not start:\n{self._log()}")
            time.sleep(0.05)

    def stop(self, r) -> dict:
        """Tell it to stop sending; its counts once its accepted requests are done."""
        r.set(stop_key(self.spec["namespace"]), 1)
        assert self.proc is not None
        try:
            self.proc.wait(self.spec["drain_s"] + 30)
        except subprocess.TimeoutExpired:
            self.kill()
            return {"error": "noisy client did not stop"}
        out = Path(self.spec["out"])
        if self.proc.returncode != 0 or not out.exists():
            return {"error": f"noisy client exited {self.proc.returncode}:\n{self._log()}"}
        return json.loads(out.read_text())

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m ops.bench.tenant_noisy SPEC.json (started by ops.bench.tenants)", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    result = asyncio.run(noisy_load(spec))
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
