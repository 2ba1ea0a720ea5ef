"""The blocking client, for scripts, Flask/Django views and worker threads.

    pagedq up                                               # a local stack, in one terminal
    python examples/sync_client.py "Why is the sky blue?"   # in another: finds that stack by itself

The Redis URL comes from --redis-url, else PAGEDQ_REDIS_URL, else the running `pagedq up`
(`producer_sdk.discovery`), else redis://127.0.0.1:6379/0. The question goes as a chat message: an
instruct model (like `pagedq up`'s SmolLM2-135M-Instruct) answers a chat, rendered with its chat
template by the worker; a raw prompt is plain text continuation.
"""

from __future__ import annotations

import argparse
import uuid

from producer_sdk import Client, QueueFull, RequestTimeout
from producer_sdk.discovery import default_redis_url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="Why is the sky blue?")
    parser.add_argument(
        "--redis-url", default=None, help="default: PAGEDQ_REDIS_URL, a running `pagedq up`, localhost:6379"
    )
    parser.add_argument("--model", default="default", help="the worker's --model-name")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    messages = [
        {"role": "system", "content": "You are a concise assistant. Answer in two sentences."},
        {"role": "user", "content": args.question},
    ]

    with Client(args.redis_url or default_redis_url(), args.model) as client:
        # One call, whole answer. The id is chosen here, so retrying this call with the same id is idempotent.
        request_id = uuid.uuid4().hex
        try:
            done = client.generate(
                messages=messages, request_id=request_id, max_tokens=args.max_tokens, temperature=0.0, timeout=120
            )
        except QueueFull as e:
            raise SystemExit(f"busy: {e}") from e
        except RequestTimeout as e:
            raise SystemExit(f"no answer in time (request {e.request_id} still runs)") from e
        print(done.text)
        print(f"[{done.finish_reason}] usage={done.usage} timings={done.timings}")

        # Streaming, blocking style: sampled this time (temperature 0.7, a fixed seed: the same answer each run).
        for chunk in client.stream(messages=messages, max_tokens=args.max_tokens, temperature=0.7, seed=1, timeout=120):
            print(chunk.text, end="", flush=True)
        print()


if __name__ == "__main__":
    main()
