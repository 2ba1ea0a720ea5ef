"""An asyncio agent backend that sends its LLM calls to pagedq workers through Redis.

    pagedq up                                   # or: docker compose up (redis + a worker)
    python examples/agent_backend.py --redis-url redis://localhost:6379/0

It streams one answer token by token, fans out 20 tool-planning calls concurrently with a
per-call deadline, shows the queue, and cancels a request it no longer needs.
"""

from __future__ import annotations

import argparse
import asyncio

from producer_sdk import AsyncClient, Cancelled, DeadlineExceeded, QueueFull, RequestTimeout


async def main(redis_url: str, model: str) -> None:
    async with AsyncClient(redis_url, model) as client:
        # 1. Stream a chat answer (the worker renders the messages with the model's chat template).
        messages = [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three uses of Redis streams."},
        ]
        handle = await client.submit(messages=messages, max_tokens=96, temperature=0.7, metadata={"tenant": "demo"})
        async for chunk in handle.stream(timeout=120):
            print(chunk.text, end="", flush=True)
        print(f"\n[{handle.finish_reason}] {handle.usage.completion_tokens} tokens, ttft {handle.timings.ttft_ms} ms")

        # 2. Fan out: 20 short planning calls at once, each with a 20 s deadline, greedy. The workers batch
        #    them together (continuous batching), so 20 calls cost far less than 20 times one call.
        tasks = ["search the docs", "summarise the ticket", "draft a reply", "check the order status", "escalate"]
        steps = [f"{task} (case {i // len(tasks) + 1})" for i, task in enumerate(tasks * 4)]
        handles = await client.submit_many(
            [{"prompt": f"Plan step: {s}.", "priority": 1} for s in steps], max_tokens=32, temperature=0.0, deadline=20
        )
        results = await asyncio.gather(*(h.result(timeout=60) for h in handles), return_exceptions=True)
        for step, res in zip(steps, results):
            if isinstance(res, DeadlineExceeded):
                print(f"{step}: deadline hit after {len(res.completion.token_ids)} tokens")
            elif isinstance(res, (QueueFull, RequestTimeout)):
                print(f"{step}: {res}")
            else:
                print(f"{step}: {res.text.strip()!r}")

        # 3. Queue and workers.
        stats = await client.queue_stats()
        print(f"queued per lane: {stats.lanes}; workers: {[(w.worker, w.running, w.kv_usage) for w in stats.workers]}")

        # 4. Cancel a request the agent no longer needs.
        speculative = await client.submit("Write a long essay about queues.", max_tokens=1024, priority=-1)
        await speculative.cancel()
        try:
            await speculative.result(timeout=60)
        except Cancelled as e:
            print(f"cancelled after {len(e.completion.token_ids)} tokens")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://localhost:6379/0")
    parser.add_argument("--model", default="default", help="the worker's --model-name")
    args = parser.parse_args()
    asyncio.run(main(args.redis_url, args.model))
