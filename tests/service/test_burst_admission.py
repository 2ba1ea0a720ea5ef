"""A burst that reaches an idle worker joins the engine together: its first step holds all of it.

The worker waits in its blocking read (one entry) when the burst lands; the burst is written in one
MULTI/EXEC, so every entry is in the stream when that read returns. Each request needs one step
(`max_tokens=1`: the prefill samples its only token), so the step count says how many groups the
burst was admitted in. Before the fix it was two or more: the blocking read took one entry, and the
admission handed the engine each request as soon as it was tokenized.
"""

from __future__ import annotations

import asyncio

import pytest
import redis

from producer_sdk import AsyncClient, Client
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.protocol import Finished, GenerateRequest, SamplingParams
from producer_sdk.request_codec import encode_request
from producer_sdk.validation import DEFAULT_LIMITS
from tests.service.worker_proc import WorkerProc, response_events, wait_until

pytestmark = pytest.mark.single_node  # reads CLIENT LIST of one server

MODEL = "burst"
STEPS = "pagedq_iteration_tokens_count"


def blocked_reads(admin: redis.Redis) -> int:
    lines = admin.execute_command("CLIENT", "LIST", "TYPE", "normal").decode().splitlines()
    return sum(1 for line in lines if " cmd=xreadgroup " in line and "flags=b" in line)


@pytest.mark.parametrize("warm", [False, True], ids=["first-work", "after-a-request"])
def test_a_burst_at_an_idle_worker_runs_in_one_step(llama_dir, redis_url, warm):
    """A fresh worker reads its first entry alone (to learn the requests' n), then the rest of its burst."""
    admin = connect(redis_url, asyncio=False, socket_timeout=10)
    w = WorkerProc(llama_dir, redis_url, name="burst-w", model=MODEL).start()
    try:
        if warm:
            with Client(redis_url, model=MODEL) as client:
                assert client.generate("warm up", max_tokens=1, temperature=0).finish_reason == "length"
            wait_until(lambda: w.metric(STEPS) == 1, what="the warm-up step to be counted")
        wait_until(lambda: blocked_reads(admin) == 1, what="the worker to wait in its blocking read")

        ids = [f"burst-request-{i}" for i in range(8)]
        sampling = SamplingParams(max_tokens=1, temperature=0.0)
        pipe = admin.pipeline(transaction=True)
        for i, rid in enumerate(ids):
            req = GenerateRequest(v=1, request_id=rid, prompt=f"prompt number {i}", sampling=sampling)
            pipe.xadd(keys.lane_stream(MODEL), {"id": rid, "d": encode_request(req, DEFAULT_LIMITS)})
        pipe.execute()

        def finished():
            return all((ev := response_events(redis_url, rid)) and isinstance(ev[-1], Finished) for rid in ids)

        wait_until(finished, timeout=60, what="every request of the burst to finish")
        assert w.metric(STEPS) == 1 + warm, "the burst took more than one engine step: it was admitted in parts"
    finally:
        w.stop()
        admin.close()


def test_concurrent_submits_of_an_async_client_run_in_one_step(llama_dir, redis_url):
    """Submits gathered on one AsyncClient reach Redis in one pipeline (producer_sdk._submit_batch): the
    worker reads them as one burst. Sent one by one, they were admitted over several steps."""
    admin = connect(redis_url, asyncio=False, socket_timeout=10)
    w = WorkerProc(llama_dir, redis_url, name="burst-async-w", model=MODEL).start()
    try:
        with Client(redis_url, model=MODEL) as client:
            assert client.generate("warm up", max_tokens=1, temperature=0).finish_reason == "length"
        wait_until(lambda: w.metric(STEPS) == 1, what="the warm-up step to be counted")
        wait_until(lambda: blocked_reads(admin) == 1, what="the worker to wait in its blocking read")

        async def burst() -> list[str]:
            async with AsyncClient(redis_url, model=MODEL) as c:
                handles = await asyncio.gather(
                    *(c.submit(f"prompt number {i}", max_tokens=1, temperature=0, ignore_eos=True) for i in range(8))
                )
                done = await asyncio.gather(*(h.result(timeout=60) for h in handles))
            return [d.finish_reason for d in done]

        assert asyncio.run(burst()) == ["length"] * 8
        assert w.metric(STEPS) == 2, "the gathered submits took more than one engine step"
    finally:
        w.stop()
        admin.close()
