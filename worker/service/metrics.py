"""Prometheus metrics of a worker, vLLM-style names under `pagedq_`.

Each worker process owns one `WorkerMetrics` with its own registry (tests run several in one
process). Labels: `model` on everything (the key namespace), plus `lane` / `finished_reason` /
`code` / `tenant` where named. Tenant labels are bounded: the first `max_tenant_labels` tenants
this worker sees get their own value, later ones are counted under `OTHER_TENANT`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1,
    1.5,
    2,
    3,
    5,
    7.5,
    10,
    20,
    40,
    80,
    160,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
OTHER_TENANT = "other"  # the label of the tenants beyond max_tenant_labels
DEFAULT_MAX_TENANT_LABELS = 20


class TenantLabels:
    """A bounded set of tenant label values: the first `limit` tenants seen keep their name."""

    def __init__(self, limit: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        self.limit = max(0, limit)
        self.named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self.named:
            return tenant
        if len(self.named) < self.limit:
            self.named.add(tenant)
            return tenant
        return OTHER_TENANT


class WorkerMetrics:
    def __init__(
        self, model: str, registry: CollectorRegistry | None = None, max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.model = model
        self.tenant_label = TenantLabels(max_tenant_labels)
        r, m = self.registry, ["model"]

        def gauge(name: str, doc: str, labels: list[str] = m) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, labels: list[str] = m) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r)

        self.requests_running = gauge("pagedq_num_requests_running", "Sequences in the running batch")
        self.requests_waiting = gauge("pagedq_num_requests_waiting", "Sequences admitted by intake, waiting for KV")
        self.queue_length = gauge(
            "pagedq_queue_length", "Entries outstanding in a Redis request lane (queued + in flight)", [*m, "lane"]
        )
        self.queue_lag = gauge(
            "pagedq_queue_lag", "Entries in a lane no worker has taken yet (consumer-group lag)", [*m, "lane"]
        )
        self.queue_oldest_age = gauge(
            "pagedq_queue_oldest_waiting_seconds",
            "Age of the oldest entry in a lane that no worker has taken yet (0 when none waits)",
            [*m, "lane"],
        )
        self.fair_share_held = gauge(
            "pagedq_fair_share_held_entries",
            "Entries this worker read and holds for fair share, not yet admitted (not in pagedq_queue_lag)",
            [*m, "lane", "tenant"],
        )
        self.kv_usage = gauge("pagedq_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        self.kv_waste = gauge("pagedq_kv_cache_waste_perc", "Allocated KV slots holding no live token (0-1)")
        self.prefix_queries = counter("pagedq_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("pagedq_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = counter("pagedq_num_preemptions", "Sequences preempted (recomputed later)")
        self.prompt_tokens = counter("pagedq_prompt_tokens", "Prompt tokens computed (prefix hits excluded)")
        self.generation_tokens = counter("pagedq_generation_tokens", "Tokens generated")
        self.requests_finished = counter(
            "pagedq_request_success", "Requests finished, by finish reason", [*m, "finished_reason"]
        )
        self.requests_failed = counter("pagedq_request_errors", "Requests answered with an Error event", [*m, "code"])
        self.tenant_requests = counter(
            "pagedq_tenant_requests_finished",
            "Requests ended, by tenant and finish reason (error: an Error event)",
            [*m, "tenant", "finished_reason"],
        )
        self.tenant_completion_tokens = counter(
            "pagedq_tenant_completion_tokens",
            "Completion tokens (as in usage) of the requests finished, by tenant",
            [*m, "tenant"],
        )
        self.dead_letters = counter("pagedq_dead_letters", "Entries moved to the dead-letter stream", [*m, "code"])
        self.reclaimed = counter("pagedq_requests_reclaimed", "Requests taken over from a dead worker")
        self.redis_errors = counter("pagedq_redis_errors", "Redis calls that failed (and were retried)")
        self.replication_lag = counter(
            "pagedq_final_events_unreplicated",
            "Flushes whose final events fewer than --wait-replicas replicas confirmed in time",
        )
        self.engine_stalled = gauge(
            "pagedq_engine_stalled_seconds",
            "Seconds since the engine loop last came round (it does on every step and every idle wait); "
            "above --health-stall-s the engine is wedged",
        )
        self.healthy = gauge("pagedq_healthy", "1 while /health answers 200, 0 while it answers 503")
        self.queue_time = hist(
            "pagedq_request_queue_time_seconds", "Arrival (submit) to first scheduled", _LATENCY_BUCKETS
        )
        self.ttft = hist("pagedq_time_to_first_token_seconds", "Arrival (submit) to first token", _LATENCY_BUCKETS)
        self.itl = hist("pagedq_inter_token_latency_seconds", "Time between two tokens of a request", _ITL_BUCKETS)
        self.e2e = hist("pagedq_e2e_request_latency_seconds", "Arrival (submit) to finish", _LATENCY_BUCKETS)
        self.step_tokens = hist("pagedq_iteration_tokens", "Tokens in one engine step", _STEP_TOKEN_BUCKETS)
        self.step_seconds = hist("pagedq_iteration_seconds", "Duration of one engine step", _ITL_BUCKETS)

    def labels(self, metric, **labels):
        return metric.labels(model=self.model, **labels)

    def tenant_finished(self, tenant: str, finished_reason: str, completion_tokens: int = 0) -> None:
        """Count a request of `tenant` that ended ("error" for an Error event)."""
        label = self.tenant_label(tenant)
        self.labels(self.tenant_requests, tenant=label, finished_reason=finished_reason).inc()
        if completion_tokens:
            self.labels(self.tenant_completion_tokens, tenant=label).inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
