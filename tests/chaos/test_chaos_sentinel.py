"""Sentinel fails the primary over to its replica mid-run; producers and the worker only know the
redis+sentinel:// URL. Both rows are forced, not raced: writes are paused on the primary until the
replica holds every one of them (Redis replication is asynchronous: what a failover may lose
otherwise is documented in ops/README.md), then the switch happens. Scored as every chaos row: every
request completes, its greedy tokens equal to an undisturbed offline run, 0 lost, 0 duplicated."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tests.chaos.harness import Outcome, Traffic, mid_flight, score, wait_for, worker
from tests.service.sentinel_proc import SentinelGroup
from worker import LLM, SamplingParams

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

MAX_TOKENS = 60
N_REQUESTS = 16


@pytest.fixture
def group():
    with SentinelGroup(sentinels=1) as g:
        yield g


@pytest.fixture(scope="module")
def reference(llama_dir):
    rng = random.Random(31)
    prompts = {
        f"sentinel-{i:04d}": [rng.randrange(5, 500) for _ in range(rng.randint(3, 40))] for i in range(N_REQUESTS)
    }
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    outs = llm.generate(
        list(prompts.values()), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    return {rid: (p, o.outputs[0].token_ids) for (rid, p), o in zip(prompts.items(), outs, strict=True)}


def _pause_until_replicated(group: SentinelGroup) -> None:
    """Writes wait on the primary (up to 10 s) until the replica has every one written so far."""
    old, new = group.primary(), group.replica()
    admin = group.admin(old)
    try:
        admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    finally:
        admin.close()
    in_sync = lambda: group.info(old, "master_repl_offset") == group.info(new, "slave_repl_offset")
    deadline = time.monotonic() + 5
    while not in_sync():
        assert time.monotonic() < deadline, "the replica did not catch up"
        time.sleep(0.01)


def _wait_promoted(group: SentinelGroup, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while group.primary_port() != port or group.info(group.primary(), "role") != "master":
        assert time.monotonic() < deadline, "Sentinel did not promote the replica"
        time.sleep(0.05)


def planned_failover(group: SentinelGroup) -> None:
    """The switchover ops/README.md describes: writes paused on the primary until the replica has
    them all, `SENTINEL FAILOVER`, the old primary made a replica of the new one by hand (Sentinel
    would do it only some seconds later, and until then the old primary would take writes that are
    then lost), writes resumed: those that waited are refused with READONLY and retried."""
    old, new = group.primary(), group.replica()
    _pause_until_replicated(group)
    sentinel = group.sentinels[0].client()
    try:
        sentinel.execute_command("SENTINEL", "FAILOVER", group.service)
    finally:
        sentinel.close()
    _wait_promoted(group, new.port, 15)
    admin = group.admin(old)
    try:
        admin.execute_command("REPLICAOF", "127.0.0.1", new.port)
        admin.execute_command("CLIENT", "UNPAUSE")
    finally:
        admin.close()


def crash_failover(group: SentinelGroup) -> None:
    """SIGKILL the primary; Sentinel sees it down (1 s) and promotes the replica; the dead node is
    then restarted as a replica of the new primary, so `--wait-replicas 1` is met again."""
    old, new = group.primary(), group.replica()
    _pause_until_replicated(group)
    old.stop(kill=True)
    _wait_promoted(group, new.port, 20)
    old.extra_args += ["--replicaof", "127.0.0.1", str(new.port)]
    old.start()


def _failover_run(llama_dir, group, reference, fault: str, failover) -> tuple[Outcome, Traffic, str]:
    prompts = {rid: p for rid, (p, _) in reference.items()}
    expected = {rid: t for rid, (_, t) in reference.items()}
    url = group.url
    promoted = group.replica().port
    w = worker(llama_dir, url, "sentinel-worker", "--wait-replicas", "1").start()
    traffic = Traffic(url, prompts, MAX_TOKENS)
    fault_at = 0.0

    async def during():
        nonlocal fault_at
        await wait_for(lambda: mid_flight(url, prompts, MAX_TOKENS) >= 8, 60, "8 requests mid-generation")
        fault_at = time.monotonic()
        await asyncio.to_thread(failover, group)

    try:
        asyncio.run(traffic.run(during))
        assert w.proc.poll() is None, "the worker died"
    finally:
        w.stop()
    assert group.primary_port() == promoted, group.sentinels[0].log()
    o = score(Outcome(fault, len(prompts)), url, list(prompts), expected, traffic.streamed)
    o.recovery_s = round(max(traffic.finished_at.values()) - fault_at, 2)
    return o, traffic, w.log_path.read_text(errors="replace")


def _assert_clean(o: Outcome, traffic: Traffic) -> None:
    assert (o.lost, o.duplicated, o.wrong, o.errored) == (0, 0, 0, 0), o
    assert o.completed == o.requests and not traffic.errors, traffic.errors


def test_sentinel_failover_mid_run(llama_dir, group, reference):
    o, traffic, log = _failover_run(llama_dir, group, reference, "SENTINEL FAILOVER mid-run", planned_failover)
    _assert_clean(o.record(), traffic)
    assert "The previous master is now a slave" in log  # READONLY: redis-py dropped the connection


def test_primary_sigkilled_sentinel_promotes_replica(llama_dir, group, reference):
    o, traffic, log = _failover_run(llama_dir, group, reference, "primary SIGKILL, Sentinel promotes", crash_failover)
    _assert_clean(o.record(), traffic)
    assert "ConnectionError" in log  # the fault struck
