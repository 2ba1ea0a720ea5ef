"""`pagedq submit` and `pagedq stats`: the producer side from a terminal (the SDK, no torch)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from worker.local import REDIS_URL_HELP, default_redis_url


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
    parser.add_argument("--model-name", default="default", help="key namespace (the worker's --model-name)")


def add_submit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt (with --chat: the user message)")
    add_client_args(p)
    p.add_argument("--chat", action="store_true", help="send as a chat message (the model's chat template)")
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    unset = "unset: the model's generation_config.json, else vLLM's default"
    p.add_argument("--top-p", type=float, default=None, help=unset)
    p.add_argument("--top-k", type=int, default=None, help=unset)
    p.add_argument("--min-p", type=float, default=None, help=unset)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--priority", type=int, default=0, help="> 0 high lane, < 0 low lane")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the whole answer")
    p.add_argument("--json", action="store_true", help="JSON lines: one per chunk, then the completion")
    p.add_argument(
        "--no-check-model",
        dest="check_model",
        action="store_false",
        help="enqueue even if no worker has served --model-name yet (default: fail at once, naming the served models)",
    )


def cmd_submit(args: argparse.Namespace) -> int:
    from producer_sdk import Client, PagedqError

    url = args.redis_url or default_redis_url()
    kwargs = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        priority=args.priority,
    )
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        kwargs["messages"] = messages
    else:
        kwargs["prompt"] = args.prompt
    try:
        with Client(url, model=args.model_name, check_model=args.check_model) as client:
            handle = client.submit(**kwargs)
            t0 = time.monotonic()
            first = None
            for chunk in handle.stream(timeout=args.timeout):
                if first is None:
                    first = time.monotonic() - t0
                if args.json:
                    print(json.dumps({"text": chunk.text, "token_ids": chunk.token_ids, "index": chunk.index}))
                else:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            result = handle.result(timeout=args.timeout)
    except PagedqError as e:
        print(f"\nerror: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                {
                    "request_id": result.request_id,
                    "finish_reason": result.finish_reason,
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "usage": {
                        "prompt_tokens": result.usage.prompt_tokens,
                        "completion_tokens": result.usage.completion_tokens,
                        "cached_tokens": result.usage.cached_tokens,
                    },
                    "ttft_s": first,
                    "worker": result.worker,
                }
            )
        )
    else:
        n = result.usage.completion_tokens
        print(
            f"\n[{result.finish_reason}; {n} tokens; ttft {first or 0:.2f}s; worker {result.worker}]",
            file=sys.stderr,
        )
    return 0


def add_stats_args(p: argparse.ArgumentParser) -> None:
    add_client_args(p)
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds (Ctrl-C to quit)")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--all-models", action="store_true", help="every model a worker served (not only --model-name)")


def render_stats(stats) -> str:
    lines = [
        f"model {stats.model}: queued {stats.queued} "
        f"(high {stats.lanes.get('high', 0)}, normal {stats.lanes.get('normal', 0)}, low {stats.lanes.get('low', 0)})"
        f"{'' if stats.max_queue_len is None else f' of max {stats.max_queue_len}'}; "
        f"dead letters {stats.dead_letters}",
        f"{'worker':<28} {'running':>7} {'waiting':>7} {'kv use':>7} {'gen tok/s':>10} "
        f"{'prompt tok/s':>12} {'done':>6}",
    ]
    for w in stats.workers:
        lines.append(
            f"{w.worker:<28} {w.running:>7} {w.waiting:>7} {w.kv_usage:>7.1%} {w.gen_tokens_per_s:>10.1f} "
            f"{w.prompt_tokens_per_s:>12.1f} {w.requests_finished:>6}"
        )
    if not stats.workers:
        lines.append("(no live worker)")
    return "\n".join(lines)


def cmd_stats(args: argparse.Namespace) -> int:
    import msgspec

    from producer_sdk import Client, PagedqError

    url = args.redis_url or default_redis_url()
    try:
        with Client(url, model=args.model_name, check_model=False) as client:
            while True:
                names = [m.name for m in client.served_models()] if args.all_models else [args.model_name]
                every = [Client(client.redis, model=name, check_model=False).queue_stats() for name in names]
                if args.json:
                    for stats in every:
                        print(msgspec.json.encode(stats).decode(), flush=True)
                else:
                    if args.watch:
                        sys.stdout.write("\x1b[2J\x1b[H")
                    print("\n\n".join(map(render_stats, every)) or "(no model served yet)", flush=True)
                if not args.watch:
                    return 0
                time.sleep(args.interval)
    except PagedqError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
