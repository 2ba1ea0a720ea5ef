"""Files in Redis: one hash per file (`keys.file_record`: `m` its FileObject as JSON, `t` its tenant,
`d` its bytes) and one sorted set per tenant listing them (`keys.file_index`). A file is kept until
deleted. Another tenant's file is reported missing (404), never forbidden."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from gateway import errors
from producer_sdk.contract import keys

BATCH, BATCH_OUTPUT = "batch", "batch_output"


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def _tenant_field(tenant: str | None) -> bytes:
    return (tenant or "").encode()


class FileStore:
    def __init__(self, redis: Any) -> None:
        self.redis = redis

    async def create(
        self, tenant: str | None, filename: str, purpose: str, data: bytes, *, file_id: str | None = None
    ) -> dict[str, Any]:
        """Store a file (under `file_id` when given: writing the same id again replaces it)."""
        obj = {
            "id": file_id or new_file_id(),
            "object": "file",
            "bytes": len(data),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }
        await self.redis.hset(
            keys.file_record(obj["id"]), mapping={"m": json.dumps(obj), "t": _tenant_field(tenant), "d": data}
        )
        await self.redis.zadd(keys.file_index(tenant), {obj["id"]: obj["created_at"]})
        return obj

    async def get(self, tenant: str | None, file_id: str) -> dict[str, Any]:
        meta, owner = await self.redis.hmget(keys.file_record(file_id), ["m", "t"])
        if meta is None or owner != _tenant_field(tenant):
            raise errors.not_found(f"No such File object: {file_id}", code=None)
        return json.loads(meta)

    async def content(self, tenant: str | None, file_id: str) -> bytes:
        await self.get(tenant, file_id)
        data = await self.redis.hget(keys.file_record(file_id), "d")
        if data is None:  # deleted in between
            raise errors.not_found(f"No such File object: {file_id}", code=None)
        return data

    async def list(self, tenant: str | None, *, purpose: str | None = None) -> list[dict[str, Any]]:
        """The tenant's files, newest first."""
        ids = await self.redis.zrevrange(keys.file_index(tenant), 0, -1)
        out = []
        for fid in ids:
            meta = await self.redis.hget(keys.file_record(fid.decode()), "m")
            if meta is None:
                continue
            obj = json.loads(meta)
            if purpose is None or obj["purpose"] == purpose:
                out.append(obj)
        return out

    async def delete(self, tenant: str | None, file_id: str) -> dict[str, Any]:
        await self.get(tenant, file_id)
        await self.redis.delete(keys.file_record(file_id))
        await self.redis.zrem(keys.file_index(tenant), file_id)
        return {"id": file_id, "object": "file", "deleted": True}
