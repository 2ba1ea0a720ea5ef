"""Stored responses: a gateway record of kind "response" (`gateway.records`) next to the request's
response stream, in the request's hash slot. The worker's publish step gives the record the stream's
TTL, so a stored response and its generation expire together, whichever gateway took it.

Where a response stands is read from its stream alone: no stream yet is `queued`, a stream without a
final event is `in_progress`, a final event decides the rest.
"""

from __future__ import annotations

from typing import Any

from gateway import errors, records
from gateway.responses.request import ID_PREFIX, request_id_of
from producer_sdk.constants import REQUEST_ID_PATTERN
from producer_sdk.contract import keys
from producer_sdk.protocol import Error, Finished, decode_event

QUEUED, IN_PROGRESS, FINISHED = "queued", "in_progress", "finished"


async def load(
    redis: Any, response_id: str, tenant: str | None, *, param: str | None = None
) -> tuple[str, records.Record]:
    """(request id, record) of a stored response the caller may see; else 404 (another tenant's
    response is as absent as a missing one, so that ids do not leak)."""
    rid = request_id_of(response_id)
    record = None
    if REQUEST_ID_PATTERN.fullmatch(rid):
        record = records.decode(await redis.get(keys.gateway_record(rid)))
    if record is None or record.kind != "response" or record.response is None or record.tenant != tenant:
        raise errors.ApiError(
            404, f"Response with id {response_id!r} not found (or it expired).", param=param, code="not_found"
        )
    return rid, record


async def stage(redis: Any, rid: str) -> str:
    """QUEUED, IN_PROGRESS or FINISHED, from the last event of the request's response stream."""
    last = await redis.xrevrange(keys.response_stream(rid), count=1)
    if not last:
        return QUEUED
    fields = last[0][1]
    data = fields.get(keys.EVENT_FIELD.encode(), fields.get(keys.EVENT_FIELD))
    try:
        event = decode_event(data)
    except Exception:
        return IN_PROGRESS
    return FINISHED if isinstance(event, (Finished, Error)) else IN_PROGRESS


def response_id(rid: str) -> str:
    return ID_PREFIX + rid


def with_ids(rid: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as GET .../input_items lists them: each with a stable id."""
    out = []
    for i, item in enumerate(items):
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}[item["type"]]
        out.append({"id": f"{prefix}_{rid}_in{i}", **item, "status": "completed"})
    return out
