"""`pagedq` command line. Heavy imports (torch, transformers) happen inside the subcommands."""

from __future__ import annotations

import argparse
import logging
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


def add_process_args(parser: argparse.ArgumentParser) -> None:
    """Options of the process rather than the service: threads and logging."""
    g = parser.add_argument_group("process")
    g.add_argument(
        "--threads", type=int, default=int(_env("threads", 0)), help="CPU threads for torch (default: torch's choice)"
    )
    g.add_argument("--log-level", default=_env("log_level", "INFO"))
    g.add_argument(
        "--log-json",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="JSON log lines (default: JSON unless stderr is a terminal)",
    )


def _cmd_worker(args: argparse.Namespace) -> int:

    from worker.service.logging import configure_logging, get_logger

    configure_logging(args.log_level, json=args.log_json)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.service.config import ServiceConfig
    from worker.service.server import WorkerService

    log = get_logger("pagedq")
    if not args.model:
        print("error: --model is required (a model folder, or run `pagedq up` for the bundled one)", file=sys.stderr)
        return 2
    from worker.engine.config import ConfigError
    from worker.models.loader import ModelLoadError
    from worker.service.tracing import TracingUnavailable, check_tracing, tracing_settings

    try:
        service_config = ServiceConfig.from_cli_args(args)
        check_tracing(tracing_settings(service_config))
    except (ValueError, TracingUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        config = EngineConfig.from_cli_args(args)
        log.info("loading model", model=config.model, dtype=config.dtype, device=config.device)
        engine = LLMEngine(config)
    except (ConfigError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    limits = engine.limits
    log.info(
        "model loaded",
        kv_blocks=limits.num_kv_blocks,
        block_size=limits.block_size,
        max_model_len=limits.max_model_len,
        dtype=limits.dtype,
        # --generation-config: the model's sampling defaults for what a request leaves unset ({}: none)
        generation_defaults=engine.input_processor.generation_defaults,
    )
    from worker.service.runner import run_to_exit

    service = WorkerService(engine, service_config)
    rc = run_to_exit(service.run())
    # Everything the worker owes is in Redis by now (spans exported, handed over, heartbeat gone): exit
    # without the interpreter's teardown, which took about a second (torch, thread pools) and would wait
    # for the thread of a task abandoned at exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _cmd_up(args: argparse.Namespace) -> int:
    from worker.local import run_up

    return run_up(args)


def _cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.config import GatewayConfig
    from gateway.server import run
    from worker.local import default_redis_url

    return run(GatewayConfig.from_cli_args(args, redis_url=args.redis_url or default_redis_url()))


def _cmd_batch_run(args: argparse.Namespace) -> int:
    from gateway.batches.cli import cmd_batch_run
    from worker.local import default_redis_url

    return cmd_batch_run(args, redis_url=args.redis_url or _env("redis_url") or default_redis_url())


def _cmd_bench(args: argparse.Namespace) -> int:
    return _run_bench(args.rest)


def _bench_checkout() -> str | None:
    """The source checkout this `worker` package was imported from, if it holds ops/bench (None for a
    wheel install: ops/ is the checkout's tooling and is never installed)."""
    import worker

    root = os.path.dirname(os.path.dirname(os.path.realpath(worker.__file__)))
    return root if os.path.isfile(os.path.join(root, "ops", "bench", "__main__.py")) else None


def _run_bench(argv: list[str]) -> int:
    """`pagedq bench ...` runs `python -m ops.bench ...` of the source checkout in a child process, with
    everything after `bench` (options included); the product itself never imports `ops`."""
    import subprocess

    root = _bench_checkout()
    if root is None:
        print(
            "error: `pagedq bench` runs the benchmarks of a source checkout (ops/bench/), and this pagedq "
            "is not installed from one. Clone the repository and run `make bench`, or `pip install -e "
            "'.[worker,bench]'` there and run `pagedq bench` again.",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen([sys.executable, "-m", "ops.bench", *argv], env=env)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # the child got the same Ctrl-C: let it write what it has
        rc = proc.wait()
    return rc if rc >= 0 else 128 - rc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedq",
        description="Redis-fed LLM inference with continuous batching on a paged KV cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from worker.engine.config import EngineConfig
    from worker.service.config import ServiceConfig

    worker = sub.add_parser("worker", help="serve requests from Redis with one engine")
    EngineConfig.add_cli_args(worker)
    ServiceConfig.add_cli_args(worker)
    add_process_args(worker)
    worker.set_defaults(func=_cmd_worker)

    up = sub.add_parser("up", help="local stack: private redis-server + the bundled model + one worker")
    EngineConfig.add_cli_args(up)
    ServiceConfig.add_cli_args(up)
    add_process_args(up)
    # `up` starts its own redis-server unless --redis-url (or PAGEDQ_REDIS_URL) names one.
    up.set_defaults(redis_url=_env("redis_url"))
    up.add_argument("--redis-port", type=int, default=None, help="port of the private redis-server (default: free)")
    from worker.local import add_gateway_args

    add_gateway_args(up)
    up.set_defaults(func=_cmd_up, log_level="WARNING")

    from gateway.config import GatewayConfig

    gateway = sub.add_parser("gateway", help="OpenAI-compatible HTTP gateway onto the queue (extra: gateway)")
    GatewayConfig.add_cli_args(gateway)
    gateway.set_defaults(func=_cmd_gateway)

    from gateway.batches.cli import add_batch_args

    batch = sub.add_parser("batch", help="run a batch file (OpenAI's batch JSONL) on the queue (extra: gateway)")
    add_batch_args(batch).set_defaults(func=_cmd_batch_run)

    from worker.cli_client import add_stats_args, add_submit_args, cmd_stats, cmd_submit

    submit = sub.add_parser("submit", help="send a prompt and stream the answer to the terminal")
    add_submit_args(submit)
    submit.set_defaults(func=cmd_submit)
    stats = sub.add_parser("stats", help="queue lengths and workers with their load")
    add_stats_args(stats)
    stats.set_defaults(func=cmd_stats)
    from worker.cli_tenant import add_tenant_args

    add_tenant_args(sub.add_parser("tenant", help="tenant quotas: set, show, delete, recount"))
    from producer_sdk.contract.acl import add_acl_args, cmd_acl

    acl = sub.add_parser("acl", help="Redis ACL users for the producer, gateway, worker and operator roles")
    add_acl_args(acl).set_defaults(func=cmd_acl)
    from worker.cli_migrate import add_migrate_args

    add_migrate_args(sub.add_parser("migrate", help="move a Redis node's keys from the layout before hash tags"))

    bench = sub.add_parser("bench", help="benchmarks (from a source checkout: ops/bench)", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)

    model = sub.add_parser("model", help="prepare local model folders")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    prep = model_sub.add_parser("prepare", help="turn a bundled GGUF model into an HF folder (once)")
    prep.add_argument("name", choices=["smollm2"], help="which bundled model")
    prep.add_argument("--out", default=None, help="target folder (default ~/.cache/pagedq/models/...)")
    prep.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    prep.set_defaults(func=_cmd_model_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _run_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
