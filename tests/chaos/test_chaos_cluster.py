"""Redis Cluster under faults: 3 masters + 3 replicas, producers and the worker knowing only the
redis+cluster:// URL. Both rows are forced, not raced:

- the master holding the model's slot (its queue, its markers, a third of the response streams) is
  SIGKILLed once the replica has every write (replication is asynchronous: what a failover may lose
  otherwise is documented in ops/README.md), and the replica is promoted by the cluster itself;
- the model's slot, and the slot of a request in flight, are moved to another master with the
  resharding protocol while requests stream, each held half-moved for a while, so that the clients
  meet ASK (keys already moved), TRYAGAIN (a step whose keys are split) and then MOVED.

Scored as every chaos row: every request completes, its greedy tokens equal to an undisturbed
offline run, 0 lost, 0 duplicated, with `--wait-replicas 1`."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from producer_sdk.contract import keys
from tests.chaos.harness import Outcome, Traffic, mid_flight, score, wait_for, worker
from tests.cluster_proc import RedisCluster
from tests.service.worker_proc import wait_acked
from worker import LLM, SamplingParams

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.cluster]

MAX_TOKENS = 60
N_REQUESTS = 16


@pytest.fixture
def cluster():
    with RedisCluster() as c:
        yield c


@pytest.fixture(scope="module")
def reference(llama_dir):
    rng = random.Random(37)
    prompts = {
        f"cluster-{i:04d}": [rng.randrange(5, 500) for _ in range(rng.randint(3, 40))] for i in range(N_REQUESTS)
    }
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    outs = llm.generate(
        list(prompts.values()), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    return {rid: (p, o.outputs[0].token_ids) for (rid, p), o in zip(prompts.items(), outs, strict=True)}


def _run(llama_dir, cluster: RedisCluster, reference, fault: str, strike) -> tuple[Outcome, Traffic, str]:
    prompts = {rid: p for rid, (p, _) in reference.items()}
    expected = {rid: t for rid, (_, t) in reference.items()}
    url = cluster.url
    w = worker(llama_dir, url, "cluster-worker", "--wait-replicas", "1").start()
    traffic = Traffic(url, prompts, MAX_TOKENS)
    fault_at = 0.0

    async def during():
        nonlocal fault_at
        await wait_for(lambda: mid_flight(url, prompts, MAX_TOKENS) >= 8, 60, "8 requests mid-generation")
        fault_at = time.monotonic()
        await asyncio.to_thread(strike, prompts)

    try:
        asyncio.run(traffic.run(during))
        assert w.proc.poll() is None, "the worker died"
        wait_acked(url)
    finally:
        w.stop()
    o = score(Outcome(fault, len(prompts)), url, list(prompts), expected, traffic.streamed)
    o.recovery_s = round(max(traffic.finished_at.values()) - fault_at, 2)
    return o, traffic, w.log_path.read_text(errors="replace")


def _assert_clean(o: Outcome, traffic: Traffic) -> None:
    assert (o.lost, o.duplicated, o.wrong, o.errored) == (0, 0, 0, 0), (o, traffic.errors)
    assert o.completed == o.requests and not traffic.errors, traffic.errors


def test_the_models_master_sigkilled_its_replica_promoted(llama_dir, cluster, reference):
    model_slot = cluster.slot_of(keys.lane_stream("default"))
    old = cluster.master_of_slot(model_slot)
    promoted = cluster.replica_of(old)

    def strike(prompts) -> None:
        assert cluster.kill_master_and_promote(old) is promoted
        cluster.restart_as_replica(old)  # so that --wait-replicas 1 is met again

    o, traffic, log = _run(llama_dir, cluster, reference, "cluster: model's master SIGKILL", strike)
    _assert_clean(o.record(), traffic)
    assert cluster.master_of_slot(model_slot) is promoted
    assert "ConnectionError" in log  # the fault struck the worker


def test_slots_migrated_during_traffic(llama_dir, cluster, reference):
    model_slot = cluster.slot_of(keys.lane_stream("default"))
    seen_mid_flight: list[int] = []

    def strike(prompts) -> None:
        url = cluster.url

        def hold() -> None:  # half-moved, with requests streaming
            seen_mid_flight.append(mid_flight(url, prompts, MAX_TOKENS))
            time.sleep(0.25)

        target = next(m for m in cluster.masters() if m is not cluster.master_of_slot(model_slot))
        cluster.migrate_slot(model_slot, target, batch=2, between=hold)
        for rid in prompts:  # a request in flight whose keys live elsewhere than the model's
            slot = cluster.slot_of(keys.response_stream(rid))
            if cluster.master_of_slot(slot) is not target:
                break
        others = [m for m in cluster.masters() if m is not cluster.master_of_slot(slot)]
        cluster.migrate_slot(slot, others[0], batch=1, between=hold)

    o, traffic, _ = _run(llama_dir, cluster, reference, "cluster: slots migrated mid-run", strike)
    _assert_clean(o.record(), traffic)
    assert max(seen_mid_flight) > 0  # the migrations overlapped the traffic
