"""The Lua steps of the Redis contract (`pagedq.lua`), with their arguments built and replies read here.

Each step is the whole library plus one `return <step>(KEYS, ARGV)` line, run with EVALSHA
(`producer_sdk.contract.steps`). The builders and readers do no I/O, so the async and the blocking
clients, and the worker, share them. Every call's keys share one hash slot (Redis Cluster).
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

import msgspec

from producer_sdk.constants import DEFAULT_TENANT
from producer_sdk.contract import keys
from producer_sdk.contract.replies import as_text

LIBRARY = resources.files("producer_sdk.contract").joinpath("pagedq.lua").read_text(encoding="utf-8")


def _step(name: str) -> str:
    return f"{LIBRARY}\nreturn {name}(KEYS, ARGV)\n"


ENQUEUE = _step("enqueue")
ACQUIRE = _step("acquire")
PUBLISH = _step("publish")
ACK = _step("ack")
DROP = _step("drop")
CLAIM_OWN = _step("claim_own")
RECOUNT = _step("recount")

DEFAULT_MAX_QUEUE_LEN = 10_000  # per model, all lanes together, unless a worker or the SDK sets one
HANDOVER_IDLE_MS = 10**12  # "idle forever": the next XAUTOCLAIM of any worker takes the entry
RATE_WINDOW_MS = 60_000  # the window of a tenant's requests_per_minute and tokens_per_minute
QUEUED_RETRY_AFTER_MS = 1_000  # the retry-after answered when a tenant's max_queued is reached
QUOTA_FIELDS = ("max_queued", "requests_per_minute", "tokens_per_minute")  # of keys.tenant_quota(tenant)


def _int(raw: Any) -> int:
    try:
        return max(0, int(raw))
    except (TypeError, ValueError):
        return 0


# --- enqueue ------------------------------------------------------------------------------------


class Quota(msgspec.Struct, frozen=True):
    """A tenant's limits per model as the enqueue step applies them (0: unlimited)."""

    max_queued: int = 0
    requests_per_minute: int = 0
    tokens_per_minute: int = 0


def read_quota(values: Sequence[Any]) -> Quota:
    """The reply of ``HMGET keys.tenant_quota(tenant) *QUOTA_FIELDS`` (absent or broken: 0)."""
    return Quota(*(_int(v) for v in values))


def enqueue_call(
    model: str,
    lane: str,
    request_id: str,
    payload: bytes,
    max_queue_len: int | None,
    marker_ttl_ms: int,
    tenant: str = DEFAULT_TENANT,
    quota: Quota | None = None,
    *,
    now_ms: int = 0,
    window_ms: int = RATE_WINDOW_MS,
    retention_ms: int = 0,
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of `enqueue`. `quota`: the tenant's, as just read (`read_quota`). `now_ms` 0: the
    rate window is read from Redis's clock. `retention_ms`: how long the answer is kept after its final
    event (the entry's `r` field; 0: none, the worker's default applies)."""
    q = quota or Quota()
    ks = [
        keys.lane_stream(model, lane),
        keys.submitted_marker(model, request_id),
        keys.config(model),
        keys.tenant_queued(model),
        keys.tenant_rate(model, tenant),
        keys.tenant_tokens(model, tenant),
        *(keys.lane_stream(model, name) for name in keys.LANES),
    ]
    args = [request_id, payload, int(max_queue_len or 0), max(1, int(marker_ttl_ms)), DEFAULT_MAX_QUEUE_LEN]
    args += [tenant, int(now_ms), int(window_ms), QUEUED_RETRY_AFTER_MS]
    return ks, [*args, q.max_queued, q.requests_per_minute, q.tokens_per_minute, max(0, int(retention_ms))]


class EnqueueReply(msgspec.Struct, frozen=True):
    status: str  # ok | duplicate | full | limited
    entry_id: str | None = None
    queued: int = 0  # full: the model's outstanding entries; limited: the tenant's use of `quota`
    limit: int = 0
    quota: str | None = None  # limited: max_queued | requests_per_minute | tokens_per_minute
    retry_after_ms: int = 0  # limited: when to try again


def read_enqueue(reply: Sequence[Any]) -> EnqueueReply:
    status = as_text(reply[0])
    if status == "ok":
        return EnqueueReply(status, entry_id=as_text(reply[1]))
    if status == "full":
        return EnqueueReply(status, queued=int(reply[1]), limit=int(reply[2]))
    if status == "limited":
        return EnqueueReply(
            status, queued=int(reply[2]), limit=int(reply[3]), quota=as_text(reply[1]), retry_after_ms=int(reply[4])
        )
    if status == "duplicate":
        return EnqueueReply(status)
    raise ValueError(f"unexpected reply from the enqueue script: {reply!r}")


# --- the lease (worker) -------------------------------------------------------------------------


def lease_epoch(entry_id: str, deliveries: int) -> str:
    """The fencing token of one delivery of an entry: "<entry id>:<deliveries>". Later entries (a
    resubmit) and later deliveries of one entry (a reclaim) are newer."""
    return f"{entry_id}:{int(deliveries)}"


def acquire_call(request_id: str, *, owner: str, epoch: str, ttl_ms: int) -> tuple[list[str], list[Any]]:
    return [keys.lease(request_id)], [owner, epoch, max(1, int(ttl_ms))]


class AcquireReply(msgspec.Struct, frozen=True):
    ok: bool
    holder_epoch: str | None = None  # stale: who holds the lease
    holder: str | None = None


def read_acquire(reply: Sequence[Any]) -> AcquireReply:
    status = as_text(reply[0])
    if status == "ok":
        return AcquireReply(True)
    if status == "stale":
        return AcquireReply(False, as_text(reply[1]), as_text(reply[2]))
    raise ValueError(f"unexpected reply from the acquire script: {reply!r}")


def epoch_entry(epoch: str) -> str:
    """The entry id part of a lease epoch."""
    return epoch.rsplit(":", 1)[0]


def entry_newer(a: str, b: str) -> bool:
    """Whether stream entry id `a` is after `b` ("ms-seq")."""
    pa, pb = (tuple(int(x) for x in e.split("-", 1)) for e in (a, b))
    return pa > pb


# --- publish, ack and drop (worker) -------------------------------------------------------------


class DeadLetter(msgspec.Struct, frozen=True):
    """What the dead-letter stream keeps of a refused request: never the whole payload."""

    request_id: str
    code: str
    reason: str
    lane: str
    entry_id: str
    worker: str
    payload_head: bytes  # the first bytes of the payload
    payload_len: int
    payload_sha1: str
    min_id: str  # the stream drops letters older than this id (the retention)

    def args(self) -> list[Any]:
        return [
            self.min_id,
            *("id", self.request_id, "code", self.code, "reason", self.reason, "lane", self.lane),
            *("entry", self.entry_id, "worker", self.worker, "payload", self.payload_head),
            *("payload_len", self.payload_len, "payload_sha1", self.payload_sha1),
        ]


def publish_call(
    request_id: str,
    *,
    owner: str,
    epoch: str,
    cap: int,
    live_ttl_ms: int,
    result_ttl_ms: int,
    first_seq: int,
    events: Sequence[bytes],
    final: bool,
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of `publish`: events numbered first_seq, first_seq + 1, ..., written for the
    attempt holding the lease at `epoch`. The gateway's record of the request, where there is one,
    gets the stream's TTL (`live_ttl_ms` while it runs, `result_ttl_ms` from its final event)."""
    ks = [keys.response_stream(request_id), keys.lease(request_id), keys.gateway_record(request_id)]
    args: list[Any] = [owner, epoch, cap, live_ttl_ms, result_ttl_ms, first_seq, int(final), len(events), *events]
    return ks, args


class PublishReply(msgspec.Struct, frozen=True):
    status: str  # ok | lost | gap
    last_seq: int  # the last seq in the response stream after the call (-1: empty)


def read_publish(reply: Sequence[Any]) -> PublishReply:
    status = as_text(reply[0])
    if status not in ("ok", "lost", "gap"):
        raise ValueError(f"unexpected reply from the publish script: {reply!r}")
    return PublishReply(status, int(reply[1]))


def ack_call(
    model: str,
    lane: str,
    request_id: str,
    *,
    group: str,
    entry_id: str,
    result_ttl_ms: int,
    tenant: str = DEFAULT_TENANT,
    tokens: int = 0,
    dead_letter: DeadLetter | None = None,
    now_ms: int = 0,
    window_ms: int = RATE_WINDOW_MS,
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of `ack`, after the request's final event is stored. `tokens`: its prompt +
    completion tokens, added to `tenant`'s token window by the call that deletes the entry, when the
    entry's tenant field is `tenant`. `now_ms` 0: the window is read from Redis's clock."""
    ks = [
        keys.lane_stream(model, lane),
        keys.dead_letters(model),
        keys.tenant_queued(model),
        keys.submitted_marker(model, request_id),
        keys.tenant_tokens(model, tenant),
    ]
    args: list[Any] = [group, entry_id, result_ttl_ms, tenant, max(0, int(tokens)), int(now_ms), int(window_ms)]
    if dead_letter is not None:
        args += dead_letter.args()
    return ks, args


def read_ack(reply: Any) -> bool:
    """Whether this call deleted the entry."""
    return int(reply) == 1


def drop_call(
    model: str, lane: str, *, group: str, consumer: str, entry_id: str, dead_letter: DeadLetter
) -> tuple[list[str], list[Any]]:
    ks = [keys.lane_stream(model, lane), keys.dead_letters(model), keys.tenant_queued(model)]
    return ks, [group, consumer, entry_id, *dead_letter.args()]


def claim_own_call(
    model: str, lane: str, *, group: str, consumer: str, idle_ms: int, entry_ids: Sequence[str]
) -> tuple[list[str], list[Any]]:
    return [keys.lane_stream(model, lane)], [group, consumer, idle_ms, *entry_ids]


def read_claim_own(reply: Sequence[Any]) -> set[str]:
    """The entry ids the consumer no longer owns."""
    return {as_text(x) for x in reply}


def recount_call(model: str) -> tuple[list[str], list[Any]]:
    return [keys.tenant_queued(model), *(keys.lane_stream(model, name) for name in keys.LANES)], []


def read_recount(reply: Sequence[Any]) -> dict[str, int]:
    """Tenant -> outstanding entries, as counted again."""
    return {as_text(reply[i]): int(reply[i + 1]) for i in range(0, len(reply), 2)}
