"""`pagedq up`: the whole stack in one process tree, for a laptop or a single GPU box.

Starts a private redis-server (AOF on, data in a temporary folder) unless `--redis-url` is given,
prepares the bundled SmolLM2-135M-Instruct unless `--model` is given, and runs one worker in this
process. Ctrl-C (or SIGTERM) drains the worker, stops redis-server and removes the temporary folder;
the model cache stays. While it runs, `~/.cache/pagedq/up.json` tells `pagedq submit` and
`pagedq stats` where Redis is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

STATE_FILE = "up.json"


def state_path() -> Path:
    return Path(os.environ.get("PAGEDQ_CACHE", Path.home() / ".cache" / "pagedq")) / STATE_FILE


def discovered_redis_url() -> str | None:
    """The Redis URL of a running `pagedq up`, if one is running."""
    try:
        state = json.loads(state_path().read_text())
    except (OSError, ValueError):
        return None
    pid = state.get("pid")
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError):
        return None
    return state.get("redis_url")


def default_redis_url() -> str:
    return os.environ.get("PAGEDQ_REDIS_URL") or discovered_redis_url() or "redis://127.0.0.1:6379/0"


def _remove_own_state(state: Path) -> None:
    try:
        if json.loads(state.read_text()).get("pid") == os.getpid():
            state.unlink()
    except (OSError, ValueError):
        pass


def say(msg: str) -> None:
    print(f"[pagedq up] {msg}", file=sys.stderr, flush=True)


def run_up(args: argparse.Namespace) -> int:
    from worker.service.logging import configure_logging

    configure_logging(args.log_level, json=args.log_json)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    redis_proc = None
    tmp = None
    state = state_path()
    try:
        if args.redis_url:
            redis_url = args.redis_url
        else:
            from worker.service.redis_proc import RedisProcess

            tmp = Path(tempfile.mkdtemp(prefix="pagedq-up-"))
            redis_proc = RedisProcess(args.redis_port, appendonly=True, data_dir=tmp / "redis").start()
            redis_url = redis_proc.url
            say(f"redis-server started on {redis_url} (AOF on, data in {tmp})")
        model = args.model
        if not model:
            from worker.models.prepare import default_dir, is_prepared, prepare

            if not is_prepared(default_dir("smollm2")):
                say("preparing SmolLM2-135M-Instruct (once; about half a minute) ...")
            model = str(prepare("smollm2"))
        say(f"loading {model} ...")
        t0 = time.monotonic()
        from worker.engine.config import ConfigError, EngineConfig
        from worker.engine.engine import LLMEngine
        from worker.models.loader import ModelLoadError

        try:
            engine = LLMEngine(EngineConfig.from_cli_args(args, model=model))
        except (ConfigError, ModelLoadError) as e:
            say(f"error: {e}")
            return 2
        lim = engine.limits
        say(
            f"model loaded in {time.monotonic() - t0:.1f}s ({lim.dtype}, {lim.device}); "
            f"KV cache {lim.num_kv_blocks} blocks x {lim.block_size} tokens = {lim.kv_cache_bytes / 2**20:.0f} MiB"
        )
        from worker.service.config import ServiceConfig
        from worker.service.server import WorkerService

        service = WorkerService(engine, ServiceConfig.from_cli_args(args, redis_url=redis_url))
        state.parent.mkdir(parents=True, exist_ok=True)
        state.write_text(json.dumps({"pid": os.getpid(), "redis_url": redis_url, "model": args.model_name}))
        say(f"serving model name {args.model_name!r}; point producers at {redis_url}")
        say('try:  pagedq submit "Hello!" --chat      (Ctrl-C here stops everything)')
        return asyncio.run(service.run())
    except KeyboardInterrupt:
        return 0
    finally:
        _remove_own_state(state)
        if redis_proc is not None:
            redis_proc.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        say("stopped")
