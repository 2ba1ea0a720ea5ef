"""`make demo`: start `pagedq up`, stream three answers through Redis, print a summary, then ask
once more through the OpenAI-compatible gateway (as `curl` would), and stop.

The second request is sent while the first is still generating, so continuous batching shows:
its first token arrives long before the first request ends. The third shares the first one's
system prompt, so its prompt is mostly served from the prefix cache.

The answers are greedy. The worker applies the model's own generation_config.json to what a request
leaves unset; where it sets no repetition penalty (SmolLM2's sets none), the demo asks for 1.1, without
which a greedy 135M model loops ("a never-ending cycle of endless tasks, a never-ending cycle of ...").

    python -m worker.demo [--model DIR] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

SYSTEM = (
    "You are a concise assistant for engineers who run LLM inference services. Answer in plain words, "
    "in at most three sentences, and prefer concrete numbers and mechanisms over general statements."
)
DEMO_REPETITION_PENALTY = 1.1
QUESTIONS = [
    "What does a paged KV cache change compared to reserving memory for the longest possible answer?",
    "Write a haiku about a queue of requests waiting for a GPU.",
    "Why does continuous batching raise throughput?",
]


@dataclass
class Run:
    label: str
    question: str
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    text: list[str] = field(default_factory=list)
    cached: int = 0
    prompt_tokens: int = 0


def demo_sampling(model_dir: str) -> dict[str, float]:
    """The demo's sampling parameters: greedy, with DEMO_REPETITION_PENALTY unless the model's
    generation_config.json sets a repetition penalty (the worker applies that one then)."""
    from worker.engine.config import ConfigError
    from worker.engine.generation_defaults import load_generation_defaults

    try:
        model_sets = "repetition_penalty" in load_generation_defaults("auto", model_dir)
    except ConfigError:
        model_sets = False
    return {"temperature": 0.0} if model_sets else {"temperature": 0.0, "repetition_penalty": DEMO_REPETITION_PENALTY}


def _print(msg: str = "") -> None:
    print(msg, flush=True)


async def _stream(client, run: Run, max_tokens: int, sampling: dict, echo: bool, t0: float) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": run.question}]
    run.sent = time.monotonic() - t0
    handle = await client.submit(messages=messages, max_tokens=max_tokens, **sampling)
    async for chunk in handle.stream(timeout=600):
        now = time.monotonic() - t0
        if run.first is None:
            run.first = now
        run.tokens += len(chunk.token_ids)
        run.text.append(chunk.text)
        if echo:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    run.done = time.monotonic() - t0
    result = await handle.result()
    run.cached, run.prompt_tokens = result.usage.cached_tokens, result.usage.prompt_tokens


async def _conversation(url: str, max_tokens: int, sampling: dict) -> list[Run]:
    from producer_sdk import AsyncClient

    runs = [Run(f"#{i + 1}", q) for i, q in enumerate(QUESTIONS)]
    t0 = time.monotonic()
    async with AsyncClient(url) as client:
        _print(f"\n>>> {runs[0].label} {runs[0].question}\n")
        first = asyncio.create_task(_stream(client, runs[0], max_tokens, sampling, True, t0))
        while runs[0].tokens < 8 and not first.done():  # the first answer is under way ...
            await asyncio.sleep(0.05)
        second = asyncio.create_task(_stream(client, runs[1], max_tokens, sampling, False, t0))  # ... send another
        await first
        await second
        _print(
            f"\n\n>>> {runs[1].label} {runs[1].question}\n    (sent at {runs[1].sent:.1f}s while #1 was generating; "
            f"its first token came at {runs[1].first:.1f}s, #1 finished at {runs[0].done:.1f}s)\n"
        )
        _print("".join(runs[1].text))
        _print(f"\n>>> {runs[2].label} {runs[2].question}  (same system prompt as #1)\n")
        await _stream(client, runs[2], max_tokens, sampling, True, t0)
        stats = await _stats_counting(client, len(runs))
    _print("\n")
    _summary(runs, stats)
    return runs


async def _stats_counting(client, finished: int, timeout: float = 10.0):
    """The queue's stats once a worker's heartbeat counts `finished` requests: heartbeats come every
    couple of seconds, so the one read right after the last answer may not count it yet."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await client.queue_stats()
        counted = max((w.requests_finished for w in stats.workers), default=0)
        if counted >= finished or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


def _summary(runs: list[Run], stats) -> None:
    _print(f"{'request':<8} {'sent':>6} {'ttft':>7} {'tokens':>7} {'tok/s':>7} {'prompt':>7} {'cached':>7}")
    for r in runs:
        ttft = (r.first or 0) - r.sent
        gen = (r.done or 0) - (r.first or 0)
        rate = (r.tokens - 1) / gen if gen > 0 and r.tokens > 1 else 0.0
        _print(
            f"{r.label:<8} {r.sent:>5.1f}s {ttft:>6.2f}s {r.tokens:>7} {rate:>7.1f} {r.prompt_tokens:>7} {r.cached:>7}"
        )
    w = stats.workers[0] if stats.workers else None
    if w:
        _print(f"worker {w.worker}: {w.requests_finished} requests done, KV cache in use {w.kv_usage:.1%}")
    hit = runs[2].cached / runs[2].prompt_tokens if runs[2].prompt_tokens else 0
    _print(f"prefix cache: request #3 reused {runs[2].cached} of its {runs[2].prompt_tokens} prompt tokens ({hit:.0%})")


def _through_gateway(port: int, max_tokens: int, sampling: dict) -> None:
    """One chat completion through the gateway, shown as the curl command that does the same."""
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": QUESTIONS[2]}],
        "max_tokens": max_tokens,
        **sampling,  # repetition_penalty: one of vLLM's extra parameters, which the gateway takes too
    }
    _print("\n>>> the same through the OpenAI-compatible gateway:\n")
    _print(f"$ curl {url} -H 'Content-Type: application/json' -d '{json.dumps(body)}'")
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as resp:
            answer = json.loads(resp.read())
    except (urllib.error.URLError, OSError) as e:
        _print(f"(the gateway did not answer: {e})")
        return
    choice, usage = answer["choices"][0], answer["usage"]
    _print(f'{{"id": "{answer["id"]}", "object": "{answer["object"]}", ... }}')
    _print(choice["message"]["content"])
    _print(
        f"(finish_reason {choice['finish_reason']}; {usage['prompt_tokens']} prompt + "
        f"{usage['completion_tokens']} completion tokens. Any OpenAI client works: "
        f"OpenAI(base_url='http://127.0.0.1:{port}/v1', api_key='unused'))"
    )


def _wait_for_worker(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    from producer_sdk import Client
    from producer_sdk.errors import PagedqError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"pagedq up exited with {proc.returncode}")
        try:
            with Client(url) as c:
                if c.queue_stats().workers:
                    return
        except (PagedqError, OSError):
            pass
        time.sleep(0.3)
    raise SystemExit("pagedq up did not start in time")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)

    from worker.service.redis_proc import free_port

    port, gateway_port = free_port(), free_port()
    url = f"redis://127.0.0.1:{port}/0"
    cmd = [sys.executable, "-m", "worker.cli", "up", "--redis-port", str(port), "--dtype", args.dtype]
    cmd += ["--gateway-port", str(gateway_port)]
    if args.model:
        cmd += ["--model", args.model]
    shown = f"--redis-port {port} --gateway-port {gateway_port}{' --model ' + args.model if args.model else ''}"
    _print(f"$ pagedq up {shown}")
    up = subprocess.Popen(cmd, env={**os.environ, "PAGEDQ_LOG_LEVEL": "WARNING"})
    try:
        _wait_for_worker(url, up)  # `pagedq up` has prepared the bundled model by now
        if args.model:
            model_dir = args.model
        else:
            from worker.models.prepare import default_dir

            model_dir = str(default_dir("smollm2"))
        sampling = demo_sampling(model_dir)
        asyncio.run(_conversation(url, args.max_tokens, sampling))
        _through_gateway(gateway_port, args.max_tokens, sampling)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            rc = up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            rc = up.wait()
    _print(
        f'\npagedq up stopped (exit code {rc}). Try it yourself: `pagedq up`, then `pagedq submit "Hi" --chat`, or any '
        "OpenAI client at http://127.0.0.1:8000/v1."
    )
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
