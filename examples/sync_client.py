"""The blocking client, for scripts, Flask/Django views and worker threads.

python examples/sync_client.py --redis-url redis://localhost:6379/0 "Why is the sky blue?"
"""

from __future__ import annotations

import argparse
import uuid

from producer_sdk import Client, QueueFull, RequestTimeout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="Why is the sky blue?")
    parser.add_argument("--redis-url", default="redis://localhost:6379/0")
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    with Client(args.redis_url, args.model) as client:
        # One call, whole answer. The id is chosen here, so retrying this call with the same id is idempotent.
        request_id = uuid.uuid4().hex
        try:
            done = client.generate(
                args.prompt, request_id=request_id, max_tokens=args.max_tokens, temperature=0.0, timeout=120
            )
        except QueueFull as e:
            raise SystemExit(f"busy: {e}") from e
        except RequestTimeout as e:
            raise SystemExit(f"no answer in time (request {e.request_id} still runs)") from e
        print(done.text)
        print(f"[{done.finish_reason}] usage={done.usage} timings={done.timings}")

        # Streaming, blocking style.
        for chunk in client.stream(args.prompt, max_tokens=args.max_tokens, seed=1):
            print(chunk.text, end="", flush=True)
        print()


if __name__ == "__main__":
    main()
