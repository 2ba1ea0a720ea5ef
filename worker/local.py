"""`pagedq up`: the whole stack in one process tree, for a laptop or a single GPU box.

Starts a private redis-server (AOF on, data in a temporary folder) unless `--redis-url` is given,
prepares the bundled SmolLM2-135M-Instruct unless `--model` is given, starts an OpenAI-compatible
gateway process on port 8000 (`--gateway-port`, `--no-gateway`) and runs one worker in this process.
Ctrl-C (or SIGTERM) drains the worker, stops the gateway and redis-server and removes the temporary
folder; the model cache stays. While it runs, `~/.cache/pagedq/up.json` tells `pagedq submit`,
`pagedq stats`, the examples and any producer that uses `producer_sdk.discovery` where Redis and the
gateway are. A port that is taken (`--redis-port`, `--gateway-port`) is named, with the flag that changes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# Where clients find this stack: the SDK's discovery module (no torch), re-exported for the CLI modules.
from producer_sdk.discovery import (  # noqa: F401
    REDIS_URL_HELP,
    STATE_FILE,
    default_redis_url,
    discovered_redis_url,
    state_path,
)

GATEWAY_START_S = 20.0


def _remove_own_state(state: Path) -> None:
    try:
        if json.loads(state.read_text()).get("pid") == os.getpid():
            state.unlink()
    except (OSError, ValueError):
        pass


def say(msg: str) -> None:
    print(f"[pagedq up] {msg}", file=sys.stderr, flush=True)


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    """`pagedq up`'s options for the gateway it starts."""
    g = parser.add_argument_group("gateway")
    g.add_argument(
        "--gateway-port",
        type=int,
        default=int(os.environ.get("PAGEDQ_GATEWAY_PORT", "8000")),
        help="port of the OpenAI-compatible gateway on 127.0.0.1 (default 8000)",
    )
    g.add_argument("--no-gateway", action="store_true", help="start no gateway")


_GATEWAY_PORT_HINT = "choose another with --gateway-port PORT (or PAGEDQ_GATEWAY_PORT), or start none with --no-gateway"


def start_gateway(redis_url: str, port: int) -> subprocess.Popen:
    """The gateway as a child process (it is one in production too; it never imports torch)."""
    cmd = [sys.executable, "-m", "gateway", "--redis-url", redis_url, "--port", str(port)]
    return subprocess.Popen(cmd, env={**os.environ, "PAGEDQ_LOG_LEVEL": "warning"})


def gateway_missing() -> str | None:
    """Why the gateway cannot run in this install (its extra is not installed), or None."""
    import importlib.util

    absent = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if absent:
        return f"{' and '.join(absent)} not installed (pip install 'pagedq[gateway]', or --no-gateway)"
    return None


def wait_gateway(proc: subprocess.Popen, port: int, timeout: float = GATEWAY_START_S) -> str | None:
    """The gateway's base URL once it answers /health, or None if it exited or never answered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                if resp.status == 200:
                    return f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.1)
    return None


def stop_gateway(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _example(name: str) -> str | None:
    """The path to show for examples/`name` of the source checkout this runs from (None for a wheel)."""
    path = Path(__file__).resolve().parents[1] / "examples" / name
    if not path.is_file():
        return None
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else str(path)


def run_up(args: argparse.Namespace) -> int:
    from worker.service.logging import configure_logging
    from worker.service.runner import run_to_exit

    configure_logging(args.log_level, json=args.log_json)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    redis_proc = None
    gateway = None
    tmp = None
    state = state_path()
    try:
        if args.redis_url:
            redis_url = args.redis_url
        else:
            from worker.service.redis_proc import PortInUse, RedisProcess

            tmp = Path(tempfile.mkdtemp(prefix="pagedq-up-"))
            try:
                redis_proc = RedisProcess(args.redis_port, appendonly=True, data_dir=tmp / "redis").start()
            except PortInUse as e:
                say(
                    f"error: port {e.port} is taken, so redis-server cannot start: choose another with "
                    "--redis-port PORT, or leave --redis-port out for a free port (or use a running Redis: "
                    "--redis-url / PAGEDQ_REDIS_URL)"
                )
                return 2
            redis_url = redis_proc.url
            say(f"redis-server started on {redis_url} (AOF on, data in {tmp})")
        if not getattr(args, "no_gateway", True):
            from worker.service.redis_proc import port_in_use

            if port_in_use(args.gateway_port):
                say(f"port {args.gateway_port} is taken: {_GATEWAY_PORT_HINT}; going on without a gateway")
            elif missing := gateway_missing():
                say(f"no gateway: {missing}; going on without it")
            else:
                gateway = start_gateway(redis_url, args.gateway_port)  # starts while the model loads
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
        gateway_url = wait_gateway(gateway, args.gateway_port) if gateway is not None else None
        if gateway is not None and gateway_url is None:
            say(
                f"the gateway did not start on port {args.gateway_port} (see above; if the port is taken: "
                f"{_GATEWAY_PORT_HINT}); going on without it"
            )
            stop_gateway(gateway)
        state.parent.mkdir(parents=True, exist_ok=True)
        info = {"pid": os.getpid(), "redis_url": redis_url, "model": args.model_name, "gateway_url": gateway_url}
        state.write_text(json.dumps(info))
        from producer_sdk.contract.connection import redact_url

        say(f"serving model name {args.model_name!r}; point producers at {redact_url(redis_url)}")
        if gateway_url:
            say(f"OpenAI-compatible gateway on {gateway_url} (model {args.model_name!r})")
        defaults = engine.input_processor.generation_defaults
        if defaults:
            shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
            say(f"the model's sampling defaults (generation_config.json) fill what a request leaves unset: {shown}")
        say('try:  pagedq submit "Hello!" --chat      (Ctrl-C here stops everything)')
        example = _example("sync_client.py")
        if example:  # a source checkout
            say(f"  or:  python {example}      (the examples and `pagedq submit` find this stack in {state})")
        if gateway_url:
            say(
                f"  or:  curl {gateway_url}/chat/completions -H 'Content-Type: application/json' "
                f'-d \'{{"model": "{args.model_name}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\''
            )
        return run_to_exit(service.run())
    except KeyboardInterrupt:
        return 0
    finally:
        _remove_own_state(state)
        stop_gateway(gateway)
        if redis_proc is not None:
            redis_proc.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        say("stopped")
