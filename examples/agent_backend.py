"""An asyncio agent backend that sends its LLM calls to pagedq workers through Redis.

    pagedq up                            # a local stack: redis-server + SmolLM2 + one worker
    python examples/agent_backend.py     # in another terminal: finds that stack by itself

The Redis URL comes from --redis-url, else PAGEDQ_REDIS_URL, else the running `pagedq up`
(`producer_sdk.discovery`), else redis://127.0.0.1:6379/0. (On a host with an NVIDIA GPU and the
NVIDIA Container Toolkit, `docker compose up -d` from the repository root serves Redis on
localhost:6379 instead; see ops/README.md.)

It streams one answer token by token, fans out 20 tool-choosing calls concurrently with a per-call
deadline (each asks the model which of the agent's tools fits a step; a constrained choice, vLLM's
`structured_outputs={"choice": [...]}`, makes the answer exactly one of the tool names), shows the
queue, and cancels a request it no longer needs.
"""

from __future__ import annotations

import argparse
import asyncio

from producer_sdk import AsyncClient, Cancelled, DeadlineExceeded, QueueFull, RequestTimeout
from producer_sdk.discovery import default_redis_url

TOOLS = ("search_docs", "read_ticket", "send_reply", "order_status", "escalate_to_human")


async def main(redis_url: str, model: str) -> None:
    async with AsyncClient(redis_url, model) as client:
        # 1. Stream a chat answer (the worker renders the messages with the model's chat template).
        messages = [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three uses of Redis streams."},
        ]
        # metadata travels with the request (and into a dead letter's copy); pagedq does not interpret it.
        handle = await client.submit(messages=messages, max_tokens=96, temperature=0.7, metadata={"tenant": "demo"})
        async for chunk in handle.stream(timeout=120):
            print(chunk.text, end="", flush=True)
        print(f"\n[{handle.finish_reason}] {handle.usage.completion_tokens} tokens, ttft {handle.timings.ttft_ms} ms")

        # 2. Fan out: for 20 steps at once, ask which tool fits (greedy, a 20 s deadline each). The answer is
        #    constrained to the tool names: the grammar masks every other token, so even a small model
        #    answers with exactly one of them. The workers batch the calls together (continuous
        #    batching), so 20 calls cost far less than 20 times one call.
        tasks = ["search the docs", "summarise the ticket", "draft a reply", "check the order status", "escalate"]
        steps = [f"{task} (case {i // len(tasks) + 1})" for i, task in enumerate(tasks * 4)]
        system = "You plan tool calls. Tools: " + ", ".join(TOOLS) + ". Answer with the one tool that fits."
        calls = [
            {"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Step: {s}."}]}
            for s in steps
        ]
        handles = await client.submit_many(
            calls,
            structured_outputs={"choice": list(TOOLS)},
            max_tokens=16,
            temperature=0.0,
            priority=1,
            deadline=20,
        )
        results = await asyncio.gather(*(h.result(timeout=60) for h in handles), return_exceptions=True)
        for step, res in zip(steps, results):
            if isinstance(res, DeadlineExceeded):
                print(f"{step}: deadline hit after {len(res.completion.token_ids)} tokens")
            elif isinstance(res, (QueueFull, RequestTimeout)):
                print(f"{step}: {res}")
            else:
                print(f"{step}: {res.text}")  # exactly one of TOOLS

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
    parser.add_argument(
        "--redis-url", default=None, help="default: PAGEDQ_REDIS_URL, a running `pagedq up`, localhost:6379"
    )
    parser.add_argument("--model", default="default", help="the worker's --model-name")
    args = parser.parse_args()
    asyncio.run(main(args.redis_url or default_redis_url(), args.model))
