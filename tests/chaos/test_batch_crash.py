"""A 500-line batch through the gateway survives a worker SIGKILL and a gateway SIGKILL mid-way:
every custom_id comes back exactly once, and each answer equals a direct request's."""

from __future__ import annotations

import io
import json

import openai
import pytest

from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from tests.chaos.harness import worker
from tests.gateway.gateway_proc import GatewayProc
from tests.service.worker_proc import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

LINES, PROMPTS, MAX_TOKENS = 500, 10, 12
LEASE_S = "2"


def body(i: int) -> dict:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": f"crash prompt {i % PROMPTS}"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }


def start_batch(client: openai.OpenAI) -> str:
    rows = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(i)}
        for i in range(LINES)
    ]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    f = client.files.create(file=("crash.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id


def completed(client: openai.OpenAI, batch_id: str) -> int:
    return client.batches.retrieve(batch_id).request_counts.completed


def check_outputs(client: openai.OpenAI, batch_id: str) -> None:
    done = wait_until(
        lambda: (b := client.batches.retrieve(batch_id)).status in ("completed", "failed") and b,
        timeout=120,
        what="the batch to finish",
    )
    assert done.status == "completed", done
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0), counts
    assert done.error_file_id is None
    out = [json.loads(x) for x in client.files.content(done.output_file_id).content.splitlines()]
    assert len(out) == LINES
    assert sorted(o["custom_id"] for o in out) == sorted(f"line-{i}" for i in range(LINES))  # each exactly once
    direct = {}
    for i in range(PROMPTS):
        args = body(i)
        extra = {"ignore_eos": args.pop("ignore_eos")}
        direct[i] = client.chat.completions.create(**args, extra_body=extra).choices[0].message.content
    for o in out:
        i = int(o["custom_id"].split("-")[1])
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["choices"][0]["message"]["content"] == direct[i % PROMPTS], o["custom_id"]


def test_a_worker_sigkill_mid_batch_loses_and_repeats_nothing(llama_dir, redis_url):
    first = worker(llama_dir, redis_url, "first").start()
    second = worker(llama_dir, redis_url, "second")
    g = GatewayProc(redis_url, "--batch-lease", LEASE_S).start()
    try:
        client = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0)
        batch_id = start_batch(client)
        wait_until(lambda: completed(client, batch_id) >= 60, timeout=60, what="some lines done")
        first.kill()
        assert completed(client, batch_id) < LINES  # killed mid-batch
        second.start()
        check_outputs(client, batch_id)
    finally:
        g.stop()
        first.kill()
        second.stop()


def test_a_gateway_sigkill_mid_batch_is_taken_over_by_another(llama_dir, redis_url):
    w = worker(llama_dir, redis_url, "w").start()
    first = GatewayProc(redis_url, "--batch-lease", LEASE_S).start()
    second = GatewayProc(redis_url, "--batch-lease", LEASE_S)
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    try:
        client = openai.OpenAI(base_url=first.base_url, api_key="x", max_retries=0)
        batch_id = start_batch(client)
        wait_until(lambda: completed(client, batch_id) >= 60, timeout=60, what="some lines done")
        assert r.exists(keys.batch_lease(batch_id))  # the first gateway drives it (the only one running)
        second.start()
        first.kill()
        client = openai.OpenAI(base_url=second.base_url, api_key="x", max_retries=0)
        assert completed(client, batch_id) < LINES  # killed mid-batch
        check_outputs(client, batch_id)
    finally:
        r.close()
        first.kill()
        second.stop()
        w.stop()
