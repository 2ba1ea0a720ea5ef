"""Redis key names and stream entry fields: the one place that spells them (worker and SDK)."""

from __future__ import annotations

PREFIX = "pagedq"
LANES = ("high", "normal", "low")  # read in this order

# Fields of a request entry: the request id (readable even when the payload is not) and the payload.
ENTRY_ID_FIELD = "id"
ENTRY_DATA_FIELD = "d"
ENTRY_TENANT_FIELD = "t"  # the tenant the entry is counted under (absent in entries of older SDKs)
# Fields of a response entry: the msgpack event and its seq (what writers deduplicate on).
EVENT_FIELD = "e"
EVENT_SEQ_FIELD = "s"


def lane_for_priority(priority: int) -> str:
    """Priority lane of a request: > 0 "high", 0 "normal", < 0 "low"."""
    return "high" if priority > 0 else "low" if priority < 0 else "normal"


def lane_stream(model: str, lane: str = "normal") -> str:
    """Request stream of a priority lane: pagedq:{model}:requests[:high|:low]."""
    if lane not in LANES:
        raise ValueError(f"unknown priority lane {lane!r}; choose from {LANES}")
    base = f"{PREFIX}:{model}:requests"
    return base if lane == "normal" else f"{base}:{lane}"


def models() -> str:
    """Sorted set of the model names workers serve: name -> last heartbeat (ms). Producers check it
    before submitting (an unknown name fails at once instead of waiting for a worker that never comes)."""
    return f"{PREFIX}:models"


def group(model: str) -> str:
    """Consumer group of the workers serving `model` (created on every lane stream)."""
    return f"{PREFIX}:{model}:workers"


def dead_letters(model: str) -> str:
    return f"{PREFIX}:{model}:dead"


def control_channel(model: str) -> str:
    """Pub/sub channel for cancels (and future control messages)."""
    return f"{PREFIX}:{model}:control"


def config(model: str) -> str:
    """Hash the workers publish their limits into (max_queue_len, max_model_len, ...)."""
    return f"{PREFIX}:{model}:config"


def heartbeats(model: str) -> str:
    """Sorted set: worker name -> last heartbeat (ms)."""
    return f"{PREFIX}:{model}:heartbeats"


def worker_state(model: str, worker: str) -> str:
    """JSON load report of one worker, with a TTL a few heartbeats long."""
    return f"{PREFIX}:{model}:worker:{worker}"


def response_stream(request_id: str) -> str:
    return f"{PREFIX}:resp:{request_id}"


def cancel_flag(request_id: str) -> str:
    return f"{PREFIX}:cancel:{request_id}"


def gateway_record(request_id: str) -> str:
    """What an HTTP gateway keeps of a request it took (model, kind, n, ...), so that any gateway can
    resume or fetch it; expires with the result."""
    return f"{PREFIX}:gw:{request_id}"


def submitted_marker(request_id: str) -> str:
    """Set (NX, with TTL) by the enqueue script: makes resubmitting the same request id a no-op."""
    return f"{PREFIX}:req:{request_id}"


# --- tenants ----------------------------------------------------------------------------------------


def tenants() -> str:
    """Set of the tenant names that have a quota (`tenant_quota`)."""
    return f"{PREFIX}:tenants"


def tenant_quota(tenant: str) -> str:
    """Hash of a tenant's quota: max_queued (per model), requests_per_minute and tokens_per_minute (all
    models); absent or 0: unlimited. The enqueue step reads it (and the final publish, for tokens)."""
    return f"{PREFIX}:tenant:{tenant}:quota"


def tenant_rate(tenant: str) -> str:
    """Hash of a tenant's current rate window: w (the window's number: unix ms // window length) and
    n (requests enqueued in it); expires after the window."""
    return f"{PREFIX}:tenant:{tenant}:rate"


def tenant_tokens(tenant: str) -> str:
    """Hash of a tenant's current token window: w (the window's number, as in `tenant_rate`) and n
    (prompt + completion tokens of the requests finished in it, added by the worker's final publish);
    expires after the window."""
    return f"{PREFIX}:tenant:{tenant}:tokens"


def tenant_queued(model: str) -> str:
    """Hash: tenant -> outstanding entries (queued + in flight) of the model, counted by the enqueue
    step and decremented by the step that deletes the entry."""
    return f"{PREFIX}:{model}:tenant_queued"
