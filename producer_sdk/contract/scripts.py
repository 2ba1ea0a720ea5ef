"""The Lua steps of the Redis contract (`pagedq.lua`), with their arguments built and replies read here.

Each step is the whole library plus one `return <step>(KEYS, ARGV)` line, run with EVALSHA (redis-py's
`Script` reloads it after a server restart). The builders and readers do no I/O, so the async and the
blocking clients, and the worker, share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

import msgspec

from producer_sdk.constants import DEFAULT_TENANT
from producer_sdk.contract import keys

LIBRARY = resources.files("producer_sdk.contract").joinpath("pagedq.lua").read_text(encoding="utf-8")


def _step(name: str) -> str:
    return f"{LIBRARY}\nreturn {name}(KEYS, ARGV)\n"


ENQUEUE = _step("enqueue")
PUBLISH = _step("publish")
DROP = _step("drop")
CLAIM_OWN = _step("claim_own")
RECOUNT = _step("recount")

DEFAULT_MAX_QUEUE_LEN = 10_000  # per model, all lanes together, unless a worker or the SDK sets one
HANDOVER_IDLE_MS = 10**12  # "idle forever": the next XAUTOCLAIM of any worker takes the entry
RATE_WINDOW_MS = 60_000  # the window of a tenant's requests_per_minute and tokens_per_minute
QUEUED_RETRY_AFTER_MS = 1_000  # the retry-after answered when a tenant's max_queued is reached
QUOTA_FIELDS = ("max_queued", "requests_per_minute", "tokens_per_minute")  # of keys.tenant_quota(tenant)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


# --- enqueue ------------------------------------------------------------------------------------


def enqueue_call(
    model: str,
    lane: str,
    request_id: str,
    payload: bytes,
    max_queue_len: int | None,
    marker_ttl_ms: int,
    tenant: str = DEFAULT_TENANT,
    *,
    now_ms: int = 0,
    window_ms: int = RATE_WINDOW_MS,
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of `enqueue`. `now_ms` 0: the rate window is read from Redis's clock."""
    ks = [
        keys.lane_stream(model, lane),
        keys.submitted_marker(request_id),
        keys.config(model),
        keys.tenant_queued(model),
        keys.tenant_quota(tenant),
        keys.tenant_rate(tenant),
        keys.tenant_tokens(tenant),
        *(keys.lane_stream(model, name) for name in keys.LANES),
    ]
    args = [request_id, payload, int(max_queue_len or 0), max(1, int(marker_ttl_ms)), DEFAULT_MAX_QUEUE_LEN]
    return ks, [*args, tenant, int(now_ms), int(window_ms), QUEUED_RETRY_AFTER_MS]


class EnqueueReply(msgspec.Struct, frozen=True):
    status: str  # ok | duplicate | full | limited
    entry_id: str | None = None
    queued: int = 0  # full: the model's outstanding entries; limited: the tenant's use of `quota`
    limit: int = 0
    quota: str | None = None  # limited: max_queued | requests_per_minute | tokens_per_minute
    retry_after_ms: int = 0  # limited: when to try again


def read_enqueue(reply: Sequence[Any]) -> EnqueueReply:
    status = _s(reply[0])
    if status == "ok":
        return EnqueueReply(status, entry_id=_s(reply[1]))
    if status == "full":
        return EnqueueReply(status, queued=int(reply[1]), limit=int(reply[2]))
    if status == "limited":
        return EnqueueReply(
            status, queued=int(reply[2]), limit=int(reply[3]), quota=_s(reply[1]), retry_after_ms=int(reply[4])
        )
    if status == "duplicate":
        return EnqueueReply(status)
    raise ValueError(f"unexpected reply from the enqueue script: {reply!r}")


# --- publish and drop (worker) ------------------------------------------------------------------


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
    model: str,
    lane: str,
    request_id: str,
    *,
    group: str,
    consumer: str,
    entry_id: str,
    cap: int,
    live_ttl_ms: int,
    result_ttl_ms: int,
    first_seq: int,
    events: Sequence[bytes],
    final: bool,
    dead_letter: DeadLetter | None = None,
    tenant: str = DEFAULT_TENANT,
    tokens: int = 0,
    now_ms: int = 0,
    window_ms: int = RATE_WINDOW_MS,
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of `publish`: events numbered first_seq, first_seq + 1, ...

    `tokens` (final batch only): the request's prompt + completion tokens, added to `tenant`'s
    token window (if it has a tokens_per_minute quota) by the call that deletes the entry, when the
    entry's tenant field is `tenant`. `now_ms` 0: the window is read from Redis's clock."""
    ks = [
        keys.lane_stream(model, lane),
        keys.response_stream(request_id),
        keys.dead_letters(model),
        keys.submitted_marker(request_id),
        keys.tenant_queued(model),
        keys.tenant_quota(tenant),
        keys.tenant_tokens(tenant),
    ]
    args: list[Any] = [group, consumer, entry_id, cap, live_ttl_ms, result_ttl_ms, first_seq, int(final)]
    args += [tenant, max(0, int(tokens)) if final else 0, int(now_ms), int(window_ms)]
    args += [len(events), *events]
    if dead_letter is not None:
        if not final:
            raise ValueError("a dead letter goes with the final batch only")
        args += dead_letter.args()
    return ks, args


class PublishReply(msgspec.Struct, frozen=True):
    status: str  # ok | done | lost | gap
    last_seq: int  # the last seq in the response stream after the call (-1: empty)


def read_publish(reply: Sequence[Any]) -> PublishReply:
    status = _s(reply[0])
    if status not in ("ok", "done", "lost", "gap"):
        raise ValueError(f"unexpected reply from the publish script: {reply!r}")
    return PublishReply(status, int(reply[1]))


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
    return {_s(x) for x in reply}


def recount_call(model: str) -> tuple[list[str], list[Any]]:
    return [keys.tenant_queued(model), *(keys.lane_stream(model, name) for name in keys.LANES)], []


def read_recount(reply: Sequence[Any]) -> dict[str, int]:
    """Tenant -> outstanding entries, as counted again."""
    return {_s(reply[i]): int(reply[i + 1]) for i in range(0, len(reply), 2)}
