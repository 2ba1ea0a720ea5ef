"""Batch records in Redis (`keys.batch_record`), their per-line results (`keys.batch_results`), the
runners' leases (`keys.batch_lease`), the tenant indexes and the set of unfinished batches.

Every change of status is a compare-and-set (a status moves only from the statuses it may come
from), and a line's result is stored once (HSETNX) by the holder of the batch's lease only, counted
in the same atomic step: a crash anywhere, or a runner that lost its lease, never stores a line twice.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from gateway import errors
from producer_sdk.contract import keys

VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
FAILED, EXPIRED, CANCELLING, CANCELLED = "failed", "expired", "cancelling", "cancelled"
TERMINAL = (COMPLETED, FAILED, EXPIRED, CANCELLED)
COMPLETION_WINDOW_S = 24 * 3600
OK, ERR = b"o", b"e"  # the first byte of a stored result: an output line or an error line
_TIMESTAMPS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)

# KEYS: record. ARGV: new status, the statuses it may come from (comma-separated), then field/value pairs.
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur or not string.find(',' .. ARGV[2] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
# KEYS: results, record, lease. ARGV: line index, result, count field, lease token.
_STORE = """
if redis.call('GET', KEYS[3]) ~= ARGV[4] then return -1 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseLost(Exception):
    """The runner no longer holds the batch's lease: another one drives it now."""


def _str(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode()


def _int(raw: bytes | None) -> int | None:
    return None if raw is None or raw == b"" else int(raw)


class BatchStore:
    def __init__(self, redis: Any) -> None:
        self.redis = redis

    # --- records ----------------------------------------------------------------------------------

    async def create(
        self, tenant: str | None, endpoint: str, input_file_id: str, metadata: dict | None, models: list | None
    ) -> dict[str, Any]:
        now = int(time.time())
        meta = {
            "id": "batch_" + uuid.uuid4().hex,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "created_at": now,
            "expires_at": now + COMPLETION_WINDOW_S,
            "metadata": metadata,
            "tenant": tenant,
            "models": models,  # the models the caller's key allows (None: all)
        }
        bid = meta["id"]
        await self.redis.hset(
            keys.batch_record(bid),
            mapping={"m": json.dumps(meta), "status": VALIDATING, "total": 0, "completed": 0, "failed": 0},
        )
        await self.redis.zadd(keys.batch_index(tenant), {bid: now})
        await self.redis.sadd(keys.batches_active(), bid)
        return await self.view(tenant, bid)

    async def raw(self, batch_id: str) -> dict[str, bytes]:
        return {k.decode(): v for k, v in (await self.redis.hgetall(keys.batch_record(batch_id))).items()}

    async def view(self, tenant: str | None, batch_id: str) -> dict[str, Any]:
        """The OpenAI Batch object; 404 when missing or another tenant's."""
        raw = await self.raw(batch_id) if batch_id.startswith("batch_") else {}
        meta = json.loads(raw["m"]) if "m" in raw else None
        if meta is None or meta["tenant"] != tenant:
            raise errors.not_found(f"No batch found with id '{batch_id}'.", code=None)
        return batch_object(meta, raw)

    async def list(self, tenant: str | None, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """The tenant's batches, newest first, after the one named `after`; and whether more follow."""
        ids = [i.decode() for i in await self.redis.zrevrange(keys.batch_index(tenant), 0, -1)]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        out = []
        for bid in ids:
            raw = await self.raw(bid)
            if "m" in raw:
                out.append(batch_object(json.loads(raw["m"]), raw))
            if len(out) > limit:
                break
        return out[:limit], len(out) > limit

    async def transition(self, batch_id: str, to: str, came_from: tuple[str, ...], **fields: Any) -> bool:
        """Set the status to `to` (and `fields`) if it is one of `came_from`; whether it was."""
        args: list[Any] = [to, ",".join(came_from)]
        for name, value in fields.items():
            args += [name, value if isinstance(value, (bytes, str, int)) else json.dumps(value)]
        return bool(await self.redis.eval(_TRANSITION, 1, keys.batch_record(batch_id), *args))

    async def count_failure(self, batch_id: str) -> int:
        """One more failed attempt to drive the batch; how many so far."""
        return int(await self.redis.hincrby(keys.batch_record(batch_id), "drive_failures", 1))

    async def finish(self, batch_id: str) -> None:
        """The batch needs no runner any more."""
        await self.redis.srem(keys.batches_active(), batch_id)

    async def active(self) -> list[str]:
        return [i.decode() for i in await self.redis.smembers(keys.batches_active())]

    # --- results ----------------------------------------------------------------------------------

    async def store(self, batch_id: str, token: str, index: int, ok: bool, line: bytes) -> bool:
        """Store line `index`'s result once; False if it was stored already. Raises LeaseLost."""
        got = await self.redis.eval(
            _STORE,
            3,
            keys.batch_results(batch_id),
            keys.batch_record(batch_id),
            keys.batch_lease(batch_id),
            index,
            (OK if ok else ERR) + line,
            "completed" if ok else "failed",
            token,
        )
        if got == -1:
            raise LeaseLost(batch_id)
        return got == 1

    async def stored_indexes(self, batch_id: str) -> set[int]:
        return {int(i) for i in await self.redis.hkeys(keys.batch_results(batch_id))}

    async def results(self, batch_id: str) -> dict[int, bytes]:
        return {int(k): v for k, v in (await self.redis.hgetall(keys.batch_results(batch_id))).items()}

    async def drop_results(self, batch_id: str) -> None:
        await self.redis.delete(keys.batch_results(batch_id))

    # --- leases -----------------------------------------------------------------------------------

    async def acquire(self, batch_id: str, token: str, lease_ms: int) -> bool:
        return bool(await self.redis.set(keys.batch_lease(batch_id), token, nx=True, px=lease_ms))

    async def renew(self, batch_id: str, token: str, lease_ms: int) -> bool:
        return bool(await self.redis.eval(_RENEW, 1, keys.batch_lease(batch_id), token, lease_ms))

    async def release(self, batch_id: str, token: str) -> None:
        await self.redis.eval(_RELEASE, 1, keys.batch_lease(batch_id), token)


def batch_object(meta: dict[str, Any], raw: dict[str, bytes]) -> dict[str, Any]:
    """OpenAI's Batch object from a record."""
    obj: dict[str, Any] = {
        "id": meta["id"],
        "object": "batch",
        "endpoint": meta["endpoint"],
        "model": _str(raw.get("model")) or None,
        "errors": json.loads(raw["errors"]) if raw.get("errors") else None,
        "input_file_id": meta["input_file_id"],
        "completion_window": meta["completion_window"],
        "status": _str(raw.get("status")),
        "output_file_id": _str(raw.get("output_file_id")) or None,
        "error_file_id": _str(raw.get("error_file_id")) or None,
        "created_at": meta["created_at"],
        "expires_at": meta["expires_at"],
    }
    for name in _TIMESTAMPS:
        obj[name] = _int(raw.get(name))
    obj["request_counts"] = {
        "total": _int(raw.get("total")) or 0,
        "completed": _int(raw.get("completed")) or 0,
        "failed": _int(raw.get("failed")) or 0,
    }
    obj["metadata"] = meta["metadata"]
    return obj
