"""Chaos scenarios: real redis-server (AOF, fsync always), real worker processes, faults on purpose.

Each scenario submits requests through the SDK with a reader per request, injects its fault, waits
for every request to end, and scores the run against an undisturbed offline run of the same model:

- completed: requests that ended with a Finished event
- lost: requests that never ended
- duplicated: tokens a reader received more than once (raw response streams: repeated seq, or more
  events than tokens)
- wrong: requests whose tokens differ from the undisturbed greedy run
- recovery: seconds from the fault to the last request finishing
- resumed: requests a second attempt (another worker, or a retry) took over
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from producer_sdk import AsyncClient
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.contract.keys import EVENT_FIELD
from producer_sdk.protocol import Error, Finished, Started, Tokens, decode_event
from tests.service.worker_proc import WorkerProc

REPORT = Path(os.environ.get("PAGEDQ_CHAOS_REPORT", Path(__file__).parent / ".chaos-report.jsonl"))


@dataclass
class Outcome:
    fault: str
    requests: int
    completed: int = 0
    errored: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    recovery_s: float = 0.0
    resumed: int = 0  # requests another worker (or attempt) took over
    notes: list[str] = field(default_factory=list)

    def record(self) -> Outcome:
        with REPORT.open("a") as f:
            f.write(json.dumps(asdict(self)) + "\n")
        return self


def _events(r, request_id: str) -> list:
    return [decode_event(f[EVENT_FIELD.encode()]) for _, f in r.xrange(keys.response_stream(request_id))]


def raw_events(url: str, request_id: str) -> list:
    r = connect(url, asyncio=False, socket_timeout=10)
    try:
        return _events(r, request_id)
    finally:
        r.close()


def score(
    outcome: Outcome, url: str, ids: list[str], expected: dict[str, list[int]], streamed: dict[str, list[int]]
) -> Outcome:
    for rid in ids:
        events = raw_events(url, rid)
        seqs = [e.seq for e in events]
        outcome.duplicated += len(seqs) - len(set(seqs))
        outcome.resumed += sum(isinstance(e, Started) for e in events) > 1
        terminal = [e for e in events if isinstance(e, (Finished, Error))]
        if not terminal:
            outcome.lost += 1
            continue
        if isinstance(terminal[-1], Error):
            outcome.errored += 1
            continue
        outcome.completed += 1
        raw_tokens = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
        want = expected.get(rid)
        if want is not None:
            got = streamed.get(rid, raw_tokens)
            if len(raw_tokens) > len(want):
                outcome.duplicated += len(raw_tokens) - len(want)
            if got != want or raw_tokens != want:
                outcome.wrong += 1
                outcome.notes.append(
                    f"{rid}: streamed {len(got)} tokens, stored {len(raw_tokens)}, expected {len(want)}; first "
                    f"difference at {next((i for i, (a, b) in enumerate(zip(raw_tokens, want)) if a != b), None)}"
                )
    return outcome


@dataclass
class Traffic:
    """Requests submitted up front, each followed by an SDK reader (the way producers read)."""

    url: str
    prompts: dict[str, list[int]]
    max_tokens: int
    streamed: dict[str, list[int]] = field(default_factory=dict)
    finished_at: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    async def run(self, during) -> None:
        async with AsyncClient(self.url, reconnect_attempts=60) as client:
            handles = [
                await client.submit(
                    prompt_token_ids=p, request_id=rid, max_tokens=self.max_tokens, temperature=0, ignore_eos=True
                )
                for rid, p in self.prompts.items()
            ]

            async def read(h) -> None:
                tokens: list[int] = []
                try:
                    async for chunk in h.stream(timeout=180):
                        tokens += chunk.token_ids
                except Exception as e:
                    self.errors[h.request_id] = f"{type(e).__name__}: {e}"
                self.streamed[h.request_id] = tokens
                self.finished_at[h.request_id] = time.monotonic()

            readers = [asyncio.create_task(read(h)) for h in handles]
            await during()
            await asyncio.gather(*readers)


def progress(url: str, ids: list[str]) -> list[int]:
    """Tokens each request has in its response stream so far, read over one connection: a connection
    per request (on a cluster, each one learning the slot map) made one poll take so long that its
    counts were stale, and a fault meant for mid-generation could strike after the last token."""
    r = connect(url, asyncio=False, socket_timeout=10)
    try:
        return [sum(len(e.token_ids) for e in _events(r, rid) if isinstance(e, Tokens)) for rid in ids]
    finally:
        r.close()


def mid_flight(url: str, prompts: dict, max_tokens: int) -> int:
    """Requests that have streamed some tokens but not all: the moment to inject a fault."""
    return sum(0 < n < max_tokens for n in progress(url, list(prompts)))


async def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(cond):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# Every step of a chaos worker takes at least this long (a fault hook), so requests are surely still
# mid-generation when a scenario strikes, however fast the machine: faults are forced, not raced.
STEP_DELAY_S = "0.02"


def worker(model_dir, url: str, name: str, *args: str, env: dict | None = None) -> WorkerProc:
    env = {"PAGEDQ_FAULT_STEP_DELAY_S": STEP_DELAY_S, **(env or {})}
    return WorkerProc(
        model_dir, url, "--claim-idle-ms", "1500", "--max-num-seqs", "64", *args, name=name, metrics=False, env=env
    )
