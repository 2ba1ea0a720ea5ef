"""Options of the Redis-facing worker service, each a `--flag` with a `PAGEDQ_<FIELD>` env default."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from producer_sdk.constants import DEFAULT_RESULT_TTL_S, UNFINISHED_TTL_S
from producer_sdk.validation import DEFAULT_LIMITS, Limits, validate_model_name
from worker.options import add_cli_args, from_cli_args, option
from worker.service.watchdog import STALL_ACTIONS


@dataclass
class ServiceConfig:
    redis_url: str = option(
        "redis://127.0.0.1:6379/0",
        "Redis to serve (env PAGEDQ_REDIS_URL); redis://user:pass@host, rediss:// for TLS, "
        "redis+sentinel://host1:26379,host2:26379/service/db through Sentinel, "
        "redis+cluster://host1:6379,host2:6379 for Redis Cluster",
    )
    model_name: str = option("default", "key namespace pagedq:{<name>}:*, braces literal (the SDK's model=)")
    consumer: str | None = option(None, "consumer name (default host-pid)")
    max_queue_len: int | None = option(
        None,
        "refuse submits (QueueFull) beyond this many outstanding entries of the model, all lanes "
        "together (default: the SDK's built-in cap of 10000)",
        type=int,
    )
    metrics_port: int | None = option(
        None, "serve /metrics, /health and /ready on this port (0 = any free port)", type=int
    )
    drain_timeout: float = option(30.0, "seconds to finish in-flight work on SIGTERM before handing it over")
    claim_idle_ms: int = option(30_000, "an entry idle this long is taken over from its (dead) worker")
    max_deliveries: int = option(3, "dead-letter a request delivered this many times without finishing")
    result_ttl: int = option(
        DEFAULT_RESULT_TTL_S,
        "seconds a finished answer is kept, from its final event, for requests that do not say (older SDKs); "
        "a request carries its producer's retention: docs/sdk.md, 'How long an answer can be fetched'",
    )
    max_result_ttl: int = option(
        UNFINISHED_TTL_S,
        "the longest retention a request may ask for, in seconds (longer: cut to this); bounds the Redis memory "
        "that finished answers take",
    )
    live_ttl: int = option(3600, "seconds an unfinished request's response stream is kept after its last write")
    dead_letter_ttl: int = option(7 * 86400, "seconds dead letters are kept (the stream is trimmed by age)")
    stream_interval: int = option(
        1,
        "tokens per streamed event of a request (as vLLM's flag): its first and final events go out at once, "
        "the tokens between are written every this many tokens, fewer events and Redis calls per step",
    )
    wait_replicas: int = option(
        0,
        "after writing final events, WAIT until this many replicas hold them (bounded by --wait-timeout-ms): "
        "a failover then cannot lose a finished answer, at the cost of a round trip per flush",
    )
    wait_timeout_ms: int = option(1000, "longest WAIT for --wait-replicas, in ms")
    health_stall_s: float = option(
        60.0,
        "the engine is wedged when its loop has not come round for this many seconds (it does on every step "
        "and every idle wait): /health answers 503, and --health-stall-action applies",
    )
    health_stall_action: str = option(
        "exit",
        "what a worker with a wedged engine does: exit (hand its requests over and exit with status 3, so "
        "that Docker or Kubernetes restarts it) or report (only log it and fail /health)",
    )
    max_tenant_labels: int = option(
        20, 'distinct tenant label values on metrics; later tenants are counted as tenant="other"', type=int
    )
    fair_share_window: int | None = option(
        None,
        "fair share between tenants: read up to this many entries beyond the free seats, hold them, and "
        "admit in weighted fair order (weights: pagedq tenant set T --weight W), highest lane first; "
        "0: admit in the order read (FIFO per lane). Default: max-num-seqs // 4",
        type=int,
    )
    arq_queue: str | None = option(
        None, "also serve pagedq_generate jobs of this arq queue (pip install 'pagedq[arq]')"
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "send OpenTelemetry spans of each request to this OTLP endpoint (as vLLM's flag; the standard "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT also turns it on): pip install 'pagedq[otel]' and an OTLP exporter",
    )
    otel_traces_file: str | None = option(
        None, "write those spans to this file, one JSON object a line, with or without OTLP (debugging, tests)"
    )
    # Derived from claim_idle_ms unless set: renewal well inside the idle timeout.
    renew_interval_s: float | None = None
    reclaim_interval_s: float | None = None
    heartbeat_interval_s: float = 2.0
    summary_interval_s: float = 10.0
    intake_headroom: int | None = None  # sequences pulled beyond free sequence slots
    limits: Limits = field(default_factory=lambda: DEFAULT_LIMITS)

    def __post_init__(self) -> None:
        validate_model_name(self.model_name)
        if self.renew_interval_s is None:
            self.renew_interval_s = min(5.0, self.claim_idle_ms / 4000)
        if self.reclaim_interval_s is None:
            self.reclaim_interval_s = min(5.0, self.claim_idle_ms / 2000)
        if self.renew_interval_s * 1000 * 2 > self.claim_idle_ms:
            raise ValueError("renew_interval_s must be well inside claim_idle_ms (at most half)")
        for name in ("result_ttl", "max_result_ttl", "live_ttl", "dead_letter_ttl"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1 second")
        if self.result_ttl > self.max_result_ttl:
            raise ValueError("--result-ttl must not exceed --max-result-ttl")
        if self.wait_replicas < 0:
            raise ValueError("--wait-replicas must be >= 0")
        if self.fair_share_window is not None and self.fair_share_window < 0:
            raise ValueError("--fair-share-window must be >= 0")
        if self.health_stall_s <= 0:
            raise ValueError("--health-stall-s must be positive")
        if self.health_stall_action not in STALL_ACTIONS:
            raise ValueError(f"--health-stall-action must be one of {', '.join(STALL_ACTIONS)}")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be at least 1")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
        add_cli_args(cls, parser, "service", skip=skip)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> ServiceConfig:
        return from_cli_args(cls, args, **overrides)
