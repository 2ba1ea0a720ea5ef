"""Everything that takes a Redis URL, given a redis+sentinel:// one: `pagedq up` (its worker and its
gateway), the SDK (async and blocking), `pagedq submit`, `stats` and `tenant`. The Redis behind it is
a primary with a replica and three Sentinels, all real processes; the data nodes and the Sentinels
each require their own password, and the URL lists a Sentinel that is down first."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from producer_sdk import AsyncClient, Client
from producer_sdk.errors import Cancelled
from tests.service.sentinel_proc import SentinelGroup
from worker import LLM, SamplingParams
from worker.service.redis_proc import free_port

pytestmark = [pytest.mark.slow, pytest.mark.single_node]  # its own Sentinel group

DATA_PW, SENTINEL_PW = "data-secret", "sentinel-secret"
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15], [100, 200, 300, 400], [42] * 9]


@pytest.fixture(scope="module")
def group():
    with SentinelGroup(sentinels=3, password=DATA_PW, sentinel_password=SENTINEL_PW) as g:
        yield g


@pytest.fixture(scope="module")
def url(group) -> str:
    """The group's URL with a Sentinel that is down listed first."""
    return group.url.replace("@", f"@127.0.0.1:{free_port()},", 1)


@pytest.fixture(scope="module")
def stack(llama_dir, url, tmp_path_factory):
    """`pagedq up --redis-url <sentinel URL>`: its worker in the process, its gateway a child."""
    tmp = tmp_path_factory.mktemp("up")
    gateway_port = free_port()
    env = {
        **os.environ,
        "PAGEDQ_CACHE": str(tmp / "cache"),
        "OMP_NUM_THREADS": "1",
        "PAGEDQ_FAULT_STEP_DELAY_S": "0.02",  # a long request is still running when it is cancelled
    }
    log = tmp / "up.log"
    cmd = [
        *(sys.executable, "-m", "worker.cli", "up", "--model", str(llama_dir), "--redis-url", url),
        *("--dtype", "float32", "--max-model-len", "256", "--gateway-port", str(gateway_port)),
        *("--log-level", "INFO", "--log-json"),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while "OpenAI-compatible gateway on" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.1)
        yield {"log": log, "gateway": f"http://127.0.0.1:{gateway_port}/v1", "env": env}
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def offline(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _log_events(path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_sdk_through_sentinel(url, stack, offline):
    async def run():
        async with AsyncClient(url) as client:
            handles = await client.submit_many([{"prompt_token_ids": p} for p in PROMPTS], max_tokens=8, temperature=0)
            results = await asyncio.gather(*(h.result(timeout=60) for h in handles))
            # A cancel reaches the worker on the control channel (pub/sub through the Sentinel-named
            # primary) while the request runs.
            long = await client.submit(prompt_token_ids=[9, 9, 9], max_tokens=10_000, ignore_eos=True)
            seen = 0
            with pytest.raises(Cancelled):
                async for _ in long.stream(timeout=60):
                    seen += 1
                    if seen == 3:
                        await long.cancel()
            return [r.token_ids for r in results], long.request_id

    tokens, cancelled = asyncio.run(run())
    assert tokens == offline
    with Client(url) as client:
        assert client.generate(prompt_token_ids=PROMPTS[0], max_tokens=8, temperature=0).token_ids == offline[0]
    events = _log_events(stack["log"])
    assert any(e.get("event") == "cancel" and e.get("request_id") == cancelled for e in events)


def test_worker_logs_no_password(stack):
    text = stack["log"].read_text(errors="replace")
    started = [e for e in _log_events(stack["log"]) if e.get("event") == "worker started"]
    assert started and started[0]["redis"].startswith("redis+sentinel://:***@")
    assert DATA_PW not in text and SENTINEL_PW not in text


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_through_sentinel(url, stack):
    env = stack["env"]
    done = _cli("submit", "Hello there", "--max-tokens", "4", "--json", "--redis-url", url, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["finish_reason"] in ("length", "stop")
    stats = _cli("stats", "--json", "--redis-url", url, env=env)
    assert stats.returncode == 0, stats.stderr
    assert len(json.loads(stats.stdout)["workers"]) == 1
    quota = _cli("tenant", "set", "team-s", "--max-queued", "5", "--redis-url", url, env=env)
    assert quota.returncode == 0, quota.stderr
    shown = _cli("tenant", "show", "team-s", "--json", "--redis-url", url, env=env)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)[0]["quota"]["max_queued"] == 5


def test_gateway_through_sentinel(stack):
    base = stack["gateway"]
    with urllib.request.urlopen(f"{base}/models", timeout=30) as resp:
        assert [m["id"] for m in json.loads(resp.read())["data"]] == ["default"]
    body = {"model": "default", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    ask = urllib.request.Request(
        f"{base}/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(ask, timeout=60) as resp:
        answer = json.loads(resp.read())
    assert answer["object"] == "text_completion" and 1 <= answer["usage"]["completion_tokens"] <= 4
