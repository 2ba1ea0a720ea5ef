"""Options of `pagedq gateway` (each also read from a PAGEDQ_* environment variable)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from producer_sdk.constants import DEFAULT_RESULT_TTL_S

# A day: the worker's default --max-result-ttl, the longest retention a request can ask for.
DEFAULT_RESPONSE_TTL_S = 86_400.0

# Limits against hostile or broken clients (docs/gateway.md, "Limits").
DEFAULT_HEADER_READ_TIMEOUT_S = 10.0
DEFAULT_BODY_READ_TIMEOUT_S = 60.0
DEFAULT_SEND_TIMEOUT_S = 60.0
DEFAULT_MAX_HEADER_BYTES = 64 << 10
DEFAULT_WRITE_BUFFER_BYTES = 64 << 10  # asyncio's own default high-water mark
DEFAULT_LIMIT_CONCURRENCY = 2048
DEFAULT_MAX_STREAMS_PER_KEY = 64
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0  # uvicorn's default
DEFAULT_BACKLOG = 2048  # uvicorn's default


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get("PAGEDQ_" + name.upper(), default)


def _flag(name: str) -> bool:
    return (_env(name) or "").lower() in ("1", "true", "yes", "on")


@dataclass
class GatewayConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: str | None = None  # path of the key file; None: no authentication
    queue_without_workers: bool = False
    result_ttl_s: float = DEFAULT_RESULT_TTL_S  # the requests' retention: docs/sdk.md
    response_ttl_s: float = DEFAULT_RESPONSE_TTL_S  # stored /v1/responses: docs/responses.md
    max_body_bytes: int = 4 << 20
    max_file_bytes: int = 32 << 20  # an uploaded file (/v1/files): docs/batch.md
    batch_lease_s: float = 30.0  # a batch runner's lease: another gateway takes a batch over after it
    batch_window: int = 256  # requests of one batch in flight at once
    request_timeout_s: float | None = None  # default deadline of every request (None: none)
    retry_after_s: int = 1
    registry_refresh_s: float = 1.0
    return_tokens_as_token_ids: bool = False  # vLLM's flag: logprobs name tokens "token_id:N"
    log_level: str = "info"
    # Limits on what one client can hold (docs/gateway.md, "Limits"); None or 0: no limit.
    header_read_timeout_s: float | None = DEFAULT_HEADER_READ_TIMEOUT_S
    body_read_timeout_s: float | None = DEFAULT_BODY_READ_TIMEOUT_S
    send_timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    write_buffer_bytes: int = DEFAULT_WRITE_BUFFER_BYTES
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY
    max_streams_per_key: int = DEFAULT_MAX_STREAMS_PER_KEY
    timeout_keep_alive_s: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    backlog: int = DEFAULT_BACKLOG

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("gateway")
        g.add_argument(
            "--redis-url",
            default=None,
            help="Redis of the queue (env PAGEDQ_REDIS_URL): redis://, rediss://, redis+sentinel://",
        )
        g.add_argument("--host", default=_env("gateway_host") or "127.0.0.1", help="address to listen on")
        g.add_argument("--port", type=int, default=int(_env("gateway_port") or 8000), help="port to listen on")
        g.add_argument(
            "--api-keys",
            default=_env("api_keys"),
            metavar="FILE",
            help="JSON file mapping API keys to a tenant and its models (default: no keys needed)",
        )
        g.add_argument(
            "--queue-without-workers",
            action=argparse.BooleanOptionalAction,
            default=_flag("queue_without_workers"),
            help="enqueue requests for a known model with no live worker (default: answer 503)",
        )
        g.add_argument(
            "--result-ttl",
            type=float,
            default=float(_env("result_ttl") or DEFAULT_RESULT_TTL_S),
            help="seconds a finished answer stays retrievable and resumable (GET .../{id}), from its final "
            "event; each request carries it to the worker, which expires the answer and this gateway's "
            "record together (capped by the worker's --max-result-ttl): docs/sdk.md, 'How long an answer "
            "can be fetched'",
        )
        g.add_argument(
            "--response-ttl",
            type=float,
            default=float(_env("response_ttl") or DEFAULT_RESPONSE_TTL_S),
            help="seconds a stored /v1/responses response (store: true) stays retrievable and can be "
            "continued with previous_response_id, from its final event (capped by the worker's "
            "--max-result-ttl): docs/responses.md",
        )
        g.add_argument("--max-body-bytes", type=int, default=int(_env("max_body_bytes") or 4 << 20), help="larger: 413")
        g.add_argument(
            "--max-file-bytes",
            type=int,
            default=int(_env("max_file_bytes") or 32 << 20),
            help="largest file POST /v1/files takes, in bytes (larger: 413); its bytes are kept in Redis",
        )
        g.add_argument(
            "--batch-lease",
            type=float,
            default=float(_env("batch_lease") or 30.0),
            help="seconds a gateway's claim on a batch lasts unrenewed: after a crash, another gateway (or "
            "this one restarted) takes the batch over once it expired",
        )
        g.add_argument(
            "--batch-window",
            type=int,
            default=int(_env("batch_window") or 256),
            help="requests of one batch in flight at once (each batch's lines go on the low lane)",
        )
        g.add_argument(
            "--request-timeout",
            type=float,
            default=float(_env("request_timeout") or 0) or None,
            help="deadline in seconds of every request (504 after it; default: none). A request may "
            "ask for a shorter one with the header `pagedq-timeout: SECONDS`",
        )
        g.add_argument(
            "--return-tokens-as-token-ids",
            action=argparse.BooleanOptionalAction,
            default=_flag("return_tokens_as_token_ids"),
            help='logprobs name each token "token_id:N" (vLLM\'s flag), not by its text; a request can ask '
            "for it with the extra field return_tokens_as_token_ids",
        )
        g.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds of a 429 (queue full)")
        g.add_argument("--log-level", default=(_env("log_level") or "info").lower())
        _add_limit_args(p)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, redis_url: str) -> GatewayConfig:
        return cls(
            redis_url=redis_url,
            host=args.host,
            port=args.port,
            api_keys=args.api_keys,
            queue_without_workers=args.queue_without_workers,
            result_ttl_s=args.result_ttl,
            response_ttl_s=args.response_ttl,
            max_body_bytes=args.max_body_bytes,
            max_file_bytes=args.max_file_bytes,
            batch_lease_s=args.batch_lease,
            batch_window=args.batch_window,
            request_timeout_s=args.request_timeout,
            retry_after_s=args.retry_after,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            log_level=args.log_level.lower(),
            header_read_timeout_s=args.header_read_timeout or None,
            body_read_timeout_s=args.body_read_timeout or None,
            send_timeout_s=args.send_timeout or None,
            max_header_bytes=args.max_header_bytes,
            write_buffer_bytes=args.write_buffer_bytes,
            limit_concurrency=args.limit_concurrency or None,
            max_streams_per_key=args.max_streams_per_key,
            timeout_keep_alive_s=args.timeout_keep_alive,
            backlog=args.backlog,
        )


def _at_least_0(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
        return value

    return parse


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """What one client can hold of a gateway: time to send a request, bytes of headers, a stalled
    reader's buffer, connections, streams per key (docs/gateway.md, "Limits")."""
    g = p.add_argument_group("limits (hostile or broken clients)")
    seconds, count = _at_least_0(float), _at_least_0(int)

    g.add_argument(
        "--header-read-timeout",
        type=seconds,
        default=float(_env("header_read_timeout") or DEFAULT_HEADER_READ_TIMEOUT_S),
        help="seconds a connection has to send a request's headers, from its opening or its previous "
        "answer: then 408 (if a byte came) and the connection is closed (0: no limit)",
    )
    g.add_argument(
        "--body-read-timeout",
        type=seconds,
        default=float(_env("body_read_timeout") or DEFAULT_BODY_READ_TIMEOUT_S),
        help="seconds a request's whole body has to arrive, from the end of its headers: then 408 and the "
        "connection is closed (0: no limit)",
    )
    g.add_argument(
        "--send-timeout",
        type=seconds,
        default=float(_env("send_timeout") or DEFAULT_SEND_TIMEOUT_S),
        help="seconds an answer (an SSE stream above all) may wait on a client that does not read, its "
        "write buffer full: then the connection is dropped (a resumable request goes on; GET .../{id}?stream=true; "
        "0: no limit)",
    )
    g.add_argument(
        "--max-header-bytes",
        type=count,
        default=int(_env("max_header_bytes") or DEFAULT_MAX_HEADER_BYTES),
        help="bytes of a request line and headers: more is a 431 and the connection is closed (0: no limit)",
    )
    g.add_argument(
        "--write-buffer-bytes",
        type=count,
        default=int(_env("write_buffer_bytes") or DEFAULT_WRITE_BUFFER_BYTES),
        help="bytes of answers one connection may hold unsent, twice: the transport's write buffer (its "
        "high-water mark) and the kernel's socket send buffer (SO_SNDBUF, which Linux doubles); a client that "
        "does not read holds about 3x this (0: the defaults: 64 KiB and the kernel's autotuning, up to 4 MiB)",
    )
    g.add_argument(
        "--limit-concurrency",
        type=count,
        default=int(_env("limit_concurrency") or DEFAULT_LIMIT_CONCURRENCY),
        help="connections open at once (uvicorn's flag): a request on any beyond it is a 503 "
        "too_many_connections and its connection is closed (/health, /ready, /metrics are answered; 0: no limit)",
    )
    g.add_argument(
        "--max-streams-per-key",
        type=count,
        default=int(_env("max_streams_per_key") or DEFAULT_MAX_STREAMS_PER_KEY),
        help="SSE streams one API key may hold open on this gateway process (requests without keys count "
        "as one key): one more is a 429 too_many_streams with Retry-After (0: no limit)",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=seconds,
        default=float(_env("timeout_keep_alive") or DEFAULT_TIMEOUT_KEEP_ALIVE_S),
        help="seconds an idle keep-alive connection stays open after an answer (uvicorn's flag)",
    )
    g.add_argument(
        "--backlog",
        type=count,
        default=int(_env("backlog") or DEFAULT_BACKLOG),
        help="connections the kernel queues before the gateway accepts them (uvicorn's flag)",
    )
