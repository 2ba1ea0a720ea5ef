"""Running one gateway process: bind, serve with uvicorn, stop on SIGINT/SIGTERM.

`pagedq gateway ...` and `python -m gateway ...` both end here.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys

from gateway.config import GatewayConfig
from producer_sdk.contract.connection import redact_url

GRACEFUL_SHUTDOWN_S = 5.0  # open streams get this long to end before their connections are closed


def say(msg: str) -> None:
    print(f"[pagedq gateway] {msg}", file=sys.stderr, flush=True)


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def raise_open_files_limit() -> None:
    """Each open stream holds two sockets (the client's and a Redis connection): lift the soft limit
    on open files to the hard one, as servers do."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(config: GatewayConfig) -> int:
    try:
        import uvicorn

        from gateway.app import create_app
        from gateway.auth import KeyFileError
        from gateway.protocol import ConnectionLimits, limited_protocol
    except ImportError as e:
        say(f"error: {e.name} is missing: install the gateway extra (pip install 'pagedq[gateway]')")
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(config)
    except KeyFileError as e:
        say(f"error: {e}")
        return 2
    raise_open_files_limit()
    try:
        sock = bind(config.host, config.port, config.backlog)
    except OSError as e:
        say(f"error: cannot listen on {config.host}:{config.port}: {e.strerror or e}")
        return 1
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    keys = f"; API keys from {config.api_keys}" if config.api_keys else ""
    say(f"listening on http://{shown}:{port}/v1 (OpenAI-compatible); queue at {redact_url(config.redis_url)}{keys}")
    limits = ConnectionLimits(
        header_read_timeout_s=config.header_read_timeout_s,
        max_header_bytes=config.max_header_bytes,
        send_timeout_s=config.send_timeout_s,
        write_buffer_bytes=config.write_buffer_bytes,
        limit_concurrency=config.limit_concurrency,
    )
    uv = uvicorn.Config(
        app,
        http=limited_protocol(limits, app.metrics),  # uvicorn's own limit_concurrency stays off: ours answers
        log_level=config.log_level if config.log_level != "info" else "warning",
        access_log=False,
        server_header=False,
        timeout_keep_alive=config.timeout_keep_alive_s,  # type: ignore[arg-type]  (a float works)
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        lifespan="on",
        **({"h11_max_incomplete_event_size": config.max_header_bytes} if config.max_header_bytes else {}),
    )
    server = uvicorn.Server(uv)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    say("stopped")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedq gateway", description="OpenAI-compatible HTTP gateway onto the queue")
    GatewayConfig.add_cli_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    url = args.redis_url or os.environ.get("PAGEDQ_REDIS_URL") or "redis://127.0.0.1:6379/0"
    return run(GatewayConfig.from_cli_args(args, redis_url=url))
