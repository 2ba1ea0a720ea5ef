"""Redis memory a deployment needs per queued and per finished request (measured, not estimated).

    python -m ops.bench.redis_memory [--model DIR] [--requests 200] [--prompt-chars 2000] [--max-tokens 256]

Queued: requests enqueued with no worker running; the lane stream's MEMORY USAGE over their number.
Finished: the same requests served by a real worker; the response streams' MEMORY USAGE per request
(they live for --result-ttl after the final event), plus the submitted-marker keys. Both are reported
with Redis's whole `used_memory` delta as a cross-check. Without --model a tiny random model is built,
which emits one token per event like any model does under load (the worker merges tokens of one flush
into one event, so a lightly loaded worker writes fewer, larger events).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _usage(r, pattern: str) -> tuple[int, int]:
    keys = list(r.scan_iter(match=pattern, count=1000))
    return len(keys), sum(r.memory_usage(k, samples=0) or 0 for k in keys)


async def _submit(url: str, n: int, prompt: str, max_tokens: int) -> list:
    from producer_sdk import AsyncClient

    async with AsyncClient(url, check_model=False) as client:
        return await client.submit_many([prompt] * n, max_tokens=max_tokens, ignore_eos=True, temperature=0)


async def _wait(url: str, handles) -> None:
    from producer_sdk import AsyncClient

    async with AsyncClient(url) as client:
        await asyncio.gather(*(client.handle(h.request_id).result(timeout=600) for h in handles))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt-chars", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args(argv)

    import redis

    from producer_sdk.contract import keys
    from worker.service.redis_proc import RedisProcess

    model = args.model
    if model is None:
        from worker.models.tiny import build_tiny_model

        model = str(build_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama", seed=0))
    prompt = ("The quick brown fox jumps over the lazy dog. " * 100)[: args.prompt_chars]
    with RedisProcess() as server:
        r = redis.Redis.from_url(server.url)
        base = r.info("memory")["used_memory"]
        handles = asyncio.run(_submit(server.url, args.requests, prompt, args.max_tokens))
        queued = r.memory_usage(keys.lane_stream("default"), samples=0)
        queued_total = r.info("memory")["used_memory"] - base
        worker = subprocess.Popen(
            [
                *(sys.executable, "-m", "worker.cli", "worker", "--model", model, "--redis-url", server.url),
                *("--dtype", "float32", "--device", "cpu", "--max-num-seqs", "64", "--log-level", "WARNING"),
            ],
        )
        try:
            asyncio.run(_wait(server.url, handles))
        finally:
            worker.terminate()
            worker.wait(60)
        n_streams, streams = _usage(r, keys.response_stream("*"))
        n_markers, markers = _usage(r, keys.submitted_marker("default", "*"))
        events = sum(r.xlen(keys.response_stream(h.request_id)) for h in handles) / len(handles)
        result = {
            "requests": args.requests,
            "prompt_chars": args.prompt_chars,
            "max_tokens": args.max_tokens,
            "queued_bytes_per_request": round(queued / args.requests),
            "queued_used_memory_per_request": round(queued_total / args.requests),
            "finished_stream_bytes_per_request": round(streams / max(n_streams, 1)),
            "finished_events_per_request": round(events, 1),
            "marker_bytes_per_request": round(markers / max(n_markers, 1)),
            "finished_used_memory_per_request": round((r.info("memory")["used_memory"] - base) / args.requests),
        }
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
