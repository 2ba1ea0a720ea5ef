"""POST /v1/batches, GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel, and
`BatchApi`: the Files and Batch API of one gateway (its routes, and its runner in the lifespan)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import errors
from gateway.batches.endpoints import BATCH_URLS
from gateway.batches.file_routes import FileRoutes
from gateway.batches.files import BATCH, FileStore
from gateway.batches.runner import BatchRunner
from gateway.batches.store import CANCELLING, IN_PROGRESS, VALIDATING, BatchStore
from gateway.json_body import check_depth, too_deep

MAX_METADATA_KEYS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    ok = isinstance(value, dict) and len(value) <= MAX_METADATA_KEYS
    ok = ok and all(
        isinstance(k, str)
        and isinstance(v, str)
        and len(k) <= MAX_METADATA_KEY_CHARS
        and len(v) <= MAX_METADATA_VALUE_CHARS
        for k, v in value.items()
    )
    if not ok:
        raise errors.invalid(
            f"metadata must be an object of at most {MAX_METADATA_KEYS} string values "
            f"(keys up to {MAX_METADATA_KEY_CHARS} characters, values up to {MAX_METADATA_VALUE_CHARS})",
            "metadata",
        )
    return value


class BatchRoutes:
    def __init__(self, gw: Any, store: BatchStore, files: FileStore, runner: BatchRunner) -> None:
        self.gw, self.store, self.files, self.runner = gw, store, files, runner

    async def create(self, request: Request) -> Response:
        caller = self.gw.caller(request)
        try:
            body = json.loads(await self.gw.body(request))
        except ValueError:
            raise errors.invalid("The body is not valid JSON.", None, "invalid_json") from None
        except RecursionError:
            raise too_deep() from None
        check_depth(body)
        if not isinstance(body, dict):
            raise errors.invalid("The body must be a JSON object.", None)
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise errors.invalid("input_file_id is required", "input_file_id", "missing_required_parameter")
        endpoint = body.get("endpoint")
        if endpoint not in BATCH_URLS:
            raise errors.invalid(f"endpoint must be one of {', '.join(BATCH_URLS)}", "endpoint")
        if body.get("completion_window") != "24h":
            raise errors.invalid("completion_window must be '24h'", "completion_window")
        metadata = _metadata(body.get("metadata"))
        known = {"input_file_id", "endpoint", "completion_window", "metadata"}
        for name in body:
            if name not in known:
                raise errors.invalid(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
        f = await self.files.get(caller.tenant, input_file_id)
        if f["purpose"] != BATCH:
            raise errors.invalid(f"File {input_file_id} has purpose {f['purpose']!r}, not 'batch'.", "input_file_id")
        models = None if caller.models is None else sorted(caller.models)
        batch = await self.store.create(caller.tenant, endpoint, input_file_id, metadata, models)
        self.runner.poke()
        return JSONResponse(batch)

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(await self.store.view(self.gw.caller(request).tenant, request.path_params["id"]))

    async def list(self, request: Request) -> Response:
        caller = self.gw.caller(request)
        raw_limit = request.query_params.get("limit", "20")
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
            raise errors.invalid("limit must be an integer from 1 to 100", "limit")
        data, more = await self.store.list(caller.tenant, request.query_params.get("after"), int(raw_limit))
        first = data[0]["id"] if data else None
        last = data[-1]["id"] if data else None
        return JSONResponse({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more})

    async def cancel(self, request: Request) -> Response:
        caller, bid = self.gw.caller(request), request.path_params["id"]
        await self.store.view(caller.tenant, bid)  # 404 unless the caller's
        if await self.store.transition(bid, CANCELLING, (VALIDATING, IN_PROGRESS), cancelling_at=int(time.time())):
            self.runner.poke()
        return JSONResponse(await self.store.view(caller.tenant, bid))


class BatchApi:
    """The Files and Batch API of one gateway `gw` (gateway.app.Gateway)."""

    def __init__(self, gw: Any) -> None:
        files, store = FileStore(gw.redis), BatchStore(gw.redis)
        self.runner = BatchRunner(gw, store, files)
        self.files = FileRoutes(gw, files)
        self.batches = BatchRoutes(gw, store, files, self.runner)

    def routes(self, guarded: Callable[[Any], Any]) -> list[Route]:
        f, b = self.files, self.batches
        return [
            Route("/v1/files", guarded(f.upload), methods=["POST"]),
            Route("/v1/files", guarded(f.list), methods=["GET"]),
            Route("/v1/files/{id}", guarded(f.retrieve), methods=["GET"]),
            Route("/v1/files/{id}", guarded(f.delete), methods=["DELETE"]),
            Route("/v1/files/{id}/content", guarded(f.content), methods=["GET"]),
            Route("/v1/batches", guarded(b.create), methods=["POST"]),
            Route("/v1/batches", guarded(b.list), methods=["GET"]),
            Route("/v1/batches/{id}", guarded(b.retrieve), methods=["GET"]),
            Route("/v1/batches/{id}/cancel", guarded(b.cancel), methods=["POST"]),
        ]

    def lifespan(self, inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`inner` (the gateway's lifespan) with the batch runner running inside it."""

        @contextlib.asynccontextmanager
        async def lifespan(app: Any):
            async with inner(app):
                task = asyncio.create_task(self.runner.run())
                try:
                    yield
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await self.runner.close()

        return lifespan
