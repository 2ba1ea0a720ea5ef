"""Redis key names and stream entry fields: the one place that spells them (worker and SDK).

The layout is the same on one node, through Sentinel and on Redis Cluster. Every atomic step touches
the keys of one hash slot only (`{...}` is the part Redis Cluster hashes):

- a model's keys, ``pagedq:{<model>}:*``: its lanes, consumer group, dead letters, config, heartbeats,
  worker states, submitted markers and tenant counters (the enqueue step and the ack need them together),
  and each async client's reader wake stream;
- a request's keys, ``pagedq:<kind>:{<request id>}``: its response stream, lease and cancel flag (and
  the gateway's record), which the publish step writes together;
- keys used alone: the served-model registry, the tenant set and each tenant's quota.

`pagedq migrate` renames the keys of the layout before this one (``pagedq:<model>:*``, ``pagedq:resp:<id>``).
"""

from __future__ import annotations

PREFIX = "pagedq"
LANES = ("high", "normal", "low")  # read in this order

# Fields of a request entry: the request id (readable even when the payload is not) and the payload.
ENTRY_ID_FIELD = "id"
ENTRY_DATA_FIELD = "d"
ENTRY_TENANT_FIELD = "t"  # the tenant the entry is counted under (absent in entries of older SDKs)
# How long the request's answer is kept after its final event, in ms: the producer's retention
# (`result_ttl_s`), which the worker applies to the response stream, the lease, the submitted marker
# and the gateway's record. Absent in entries of older SDKs: the worker's --result-ttl.
ENTRY_RETENTION_FIELD = "r"
# Fields of a response entry: the msgpack event and its seq (what writers deduplicate on).
EVENT_FIELD = "e"
EVENT_SEQ_FIELD = "s"


def lane_for_priority(priority: int) -> str:
    """Priority lane of a request: > 0 "high", 0 "normal", < 0 "low"."""
    return "high" if priority > 0 else "low" if priority < 0 else "normal"


def model_prefix(model: str) -> str:
    """What every key of a model starts with: pagedq:{model}: (one hash slot per model)."""
    return f"{PREFIX}:{{{model}}}:"


def lane_stream(model: str, lane: str = "normal") -> str:
    """Request stream of a priority lane: pagedq:{model}:requests[:high|:low]."""
    if lane not in LANES:
        raise ValueError(f"unknown priority lane {lane!r}; choose from {LANES}")
    base = f"{model_prefix(model)}requests"
    return base if lane == "normal" else f"{base}:{lane}"


def models() -> str:
    """Sorted set of the model names workers serve: name -> last heartbeat (ms). Producers check it
    before submitting (an unknown name fails at once instead of waiting for a worker that never comes)."""
    return f"{PREFIX}:models"


def group(model: str) -> str:
    """Consumer group of the workers serving `model` (created on every lane stream). A name inside
    the streams, not a key: it is what it was before hash tags, so renamed lanes keep their group."""
    return f"{PREFIX}:{model}:workers"


def dead_letters(model: str) -> str:
    return f"{model_prefix(model)}dead"


def control_channel(model: str) -> str:
    """Pub/sub channel for cancels (and future control messages)."""
    return f"{model_prefix(model)}control"


def config(model: str) -> str:
    """Hash the workers publish their limits into (max_queue_len, max_model_len, ...)."""
    return f"{model_prefix(model)}config"


def heartbeats(model: str) -> str:
    """Sorted set: worker name -> last heartbeat (ms)."""
    return f"{model_prefix(model)}heartbeats"


def worker_state(model: str, worker: str) -> str:
    """JSON load report of one worker, with a TTL a few heartbeats long."""
    return f"{model_prefix(model)}worker:{worker}"


def reader_wake(model: str, client_id: str) -> str:
    """Stream (one entry, expiring) that an AsyncClient writes to make its own blocked XREAD over
    the response streams it reads return early, when a new reader joins (producer_sdk._mux)."""
    return f"{model_prefix(model)}wake:{client_id}"


def submitted_marker(model: str, request_id: str) -> str:
    """Set (with TTL) by the enqueue step: makes resubmitting the same request id a no-op. In the
    model's slot, so that the check and the XADD are one atomic step."""
    return f"{model_prefix(model)}req:{request_id}"


# --- a request's own keys (one hash slot per request) -------------------------------------------


def request_tag(request_id: str) -> str:
    return f"{{{request_id}}}"


def response_stream(request_id: str) -> str:
    return f"{PREFIX}:resp:{request_tag(request_id)}"


def lease(request_id: str) -> str:
    """Hash: which attempt may write the response stream (`e` epoch, `o` owner). The publish step
    writes only for the attempt holding it; a new delivery of the entry takes it over (`acquire`)."""
    return f"{PREFIX}:lease:{request_tag(request_id)}"


def cancel_flag(request_id: str) -> str:
    return f"{PREFIX}:cancel:{request_tag(request_id)}"


def gateway_record(request_id: str) -> str:
    """What an HTTP gateway keeps of a request it took (model, kind, n, ...), so that any gateway can
    resume or fetch it. The publish step gives it the response stream's TTL, so both expire together."""
    return f"{PREFIX}:gw:{request_tag(request_id)}"


# --- tenants ----------------------------------------------------------------------------------------


def tenants() -> str:
    """Set of the tenant names that have a quota (`tenant_quota`)."""
    return f"{PREFIX}:tenants"


def tenant_quota(tenant: str) -> str:
    """Hash of a tenant's quota: max_queued, requests_per_minute and tokens_per_minute (each per model);
    absent or 0: unlimited. Producers read it and hand it to the enqueue step."""
    return f"{PREFIX}:tenant:{tenant}:quota"


def tenant_rate(model: str, tenant: str) -> str:
    """Hash of a tenant's current rate window on a model: w (the window's number: unix ms // window
    length) and n (requests enqueued in it); expires after the window."""
    return f"{model_prefix(model)}tenant:{tenant}:rate"


def tenant_tokens(model: str, tenant: str) -> str:
    """Hash of a tenant's current token window on a model: w (the window's number, as in
    `tenant_rate`) and n (prompt + completion tokens of the requests finished in it, added by the
    worker's ack); expires after the window."""
    return f"{model_prefix(model)}tenant:{tenant}:tokens"


def tenant_queued(model: str) -> str:
    """Hash: tenant -> outstanding entries (queued + in flight) of the model, counted by the enqueue
    step and decremented by the step that deletes the entry."""
    return f"{model_prefix(model)}tenant_queued"


# --- files and batches (the gateway's /v1/files and /v1/batches, `pagedq batch run`) ----------------
# A batch's keys share the batch id's hash slot, so that storing a line's result and counting it are
# one atomic step; files, and the indexes used to list them, are keys used alone.


def file_record(file_id: str) -> str:
    """Hash of one uploaded or written file: `m` (its JSON metadata: OpenAI's FileObject and the
    tenant) and `d` (its bytes). Kept until deleted."""
    return f"{PREFIX}:file:{{{file_id}}}"


def file_index(tenant: str | None) -> str:
    """Sorted set of one tenant's file ids (score: created_at); `anon` holds those of callers without
    a tenant (a gateway without --api-keys)."""
    return f"{PREFIX}:files:anon" if tenant is None else f"{PREFIX}:files:tenant:{tenant}"


def batch_record(batch_id: str) -> str:
    """Hash of one batch: `m` (its JSON metadata, set once), `status`, the timestamps (`in_progress_at`,
    ...), `total`, `completed` and `failed` (the counts), `output_file_id`, `error_file_id`, `errors`."""
    return f"{PREFIX}:batch:{{{batch_id}}}"


def batch_results(batch_id: str) -> str:
    """Hash: input line index -> the line's result (`o` + its output line, or `e` + its error line),
    written once per line (HSETNX), so a batch resumed after a crash stores no line twice."""
    return f"{PREFIX}:batch:{{{batch_id}}}:results"


def batch_lease(batch_id: str) -> str:
    """String with a PX expiry: the token of the gateway driving the batch (SET NX, renewed while it
    works); after a crash another gateway takes the batch over once it expired."""
    return f"{PREFIX}:batch:{{{batch_id}}}:lease"


def batch_index(tenant: str | None) -> str:
    """Sorted set of one tenant's batch ids (score: created_at); `anon` as in `file_index`."""
    return f"{PREFIX}:batches:anon" if tenant is None else f"{PREFIX}:batches:tenant:{tenant}"


def batches_active() -> str:
    """Set of the ids of the batches not finished yet: what the gateways' batch runners look for work in."""
    return f"{PREFIX}:batches:active"
