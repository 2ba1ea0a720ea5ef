"""`/v1/responses`: create (plain, streamed, background), retrieve (and resume its event stream),
cancel, delete, input items.

A response is a chat request on the durable queue plus a stored record (`store`). Nothing about it
lives in a gateway's memory: any gateway answers for any response, and a background response goes on
through gateway and worker crashes like any queued request. Its events are a pure function of its
response stream (`events.ResponseEvents`), so a stream resumed with `starting_after=N` is the same
rendering from event N + 1 on: each event once, sequence numbers contiguous.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import errors, records
from gateway.auth import Caller
from gateway.render import tool_call
from gateway.responses import request as rq
from gateway.responses import store
from gateway.responses.events import ResponseEvents, ResponseView, error_object, response_object, sse, status_of
from gateway.responses.request import api_error_mappers
from gateway.stream_limit import Slot, StreamLimit
from gateway.streams import EventStream, Reading, until_done_or_gone
from producer_sdk.client import AsyncClient
from producer_sdk.constants import UNFINISHED_TTL_S
from producer_sdk.contract import keys
from producer_sdk.errors import PagedqError, RequestFailed
from producer_sdk.results import Completion

# `store: false`: the answer is kept only as long as the gateway reading it needs.
UNSTORED_TTL_S = 60.0
CANCEL_WAIT_S = 10.0  # how long POST .../cancel waits for the worker to stop the response
REQUEST_ID_HEADER = "pagedq-request-id"


class GatewayParts(Protocol):
    """What the responses endpoints use of the gateway (`gateway.app.Gateway`)."""

    redis: Any
    config: Any
    registry: Any
    metrics: Any
    streams: StreamLimit

    def caller(self, request: Request) -> Caller: ...
    async def body(self, request: Request) -> bytes: ...
    def deadline_s(self, request: Request) -> float | None: ...
    def client(self, model: str, result_ttl_s: float | None = None) -> AsyncClient: ...


class ResponsesApi:
    def __init__(self, gw: GatewayParts) -> None:
        self.gw = gw

    # --- POST /v1/responses ---------------------------------------------------------------------

    async def create(self, request: Request) -> Response | EventStream:
        gw = self.gw
        caller = gw.caller(request)
        m = rq.map_request(rq.decode(await gw.body(request)))
        history = await self._history(m.previous, caller.tenant) if m.previous else []
        submit = dict(m.submit, messages=rq.messages_for(m, history))
        await gw.registry.check(
            m.model, allowed=caller.allowed_or_none, queue_without_workers=gw.config.queue_without_workers
        )
        with gw.streams.reserve(caller.key_id, m.stream) as slot:
            return await self._submit(request, caller, m, history, submit, slot)

    async def _submit(
        self,
        request: Request,
        caller: Caller,
        m: rq.MappedResponse,
        history: list[dict[str, Any]],
        submit: dict[str, Any],
        slot: Slot | None,
    ) -> Response | EventStream:
        gw = self.gw
        idem = request.headers.get("idempotency-key")
        rid = records.request_id_for(idem or request.headers.get("x-request-id"), caller.tenant)
        request.state.request_id = rid
        if caller.tenant is not None:
            submit["metadata"] = {**submit.get("metadata", {}), "tenant": caller.tenant}
            submit["tenant"] = caller.tenant
        created = int(time.time())
        retention = gw.config.response_ttl_s if m.store else UNSTORED_TTL_S
        client = gw.client(m.model, retention)
        writes: list[Awaitable[Any]] = [client.submit(request_id=rid, deadline=gw.deadline_s(request), **submit)]
        if m.store:
            stored = records.StoredResponse(
                echo=m.echo,
                input=store.with_ids(rid, m.items),
                history=history + m.turn,
                previous=m.previous,
                background=m.background,
                constraint=m.constraint,
            )
            record = records.Record(
                kind="response", model=m.model, created=created, tenant=caller.tenant, response=stored
            )
            ttl_ms = int(max(retention, UNFINISHED_TTL_S) * 1000)
            writes.append(gw.redis.set(keys.gateway_record(rid), records.encode(record), px=ttl_ms, nx=True))
        handle, *rest = await asyncio.gather(*writes, return_exceptions=True)
        if isinstance(handle, BaseException):
            if rest and rest[0] is True:
                await gw.redis.delete(keys.gateway_record(rid))
            raise self._api_error(handle, m.constraint) if isinstance(handle, PagedqError) else handle
        if rest and isinstance(rest[0], BaseException):
            raise rest[0]
        if handle.duplicate:  # a retry: the first POST's record holds, and must be a response's
            earlier = records.decode(await gw.redis.get(keys.gateway_record(rid)))
            if earlier is None or earlier.kind != "response":
                raise errors.idempotency_key_reused()
            created = earlier.created
        view = ResponseView(id=store.response_id(rid), created_at=created, model=m.model, echo=m.echo)
        headers = {REQUEST_ID_HEADER: rid}
        cancel = None if m.background else self._canceller(client, rid)
        if m.stream:
            frames = self._frames(client, rid, view, "queued" if m.background else "in_progress", m.constraint)
            return EventStream(frames, metrics=gw.metrics, on_disconnect=cancel, headers=headers, slot=slot)
        if m.background:
            return JSONResponse(response_object(view, "queued"), headers=headers)
        try:
            ok, body = await until_done_or_gone(
                self._whole(client, rid, view, m.constraint, answer_4xx=True), request.receive
            )
        except errors.ApiError:
            if m.store:  # a refused request creates nothing, as OpenAI's 400 does
                await gw.redis.delete(keys.gateway_record(rid))
            raise
        if not ok:
            if cancel is not None:
                await cancel()
            return Response(status_code=499)
        return JSONResponse(body, headers=headers)

    async def _history(self, previous: str, tenant: str | None) -> list[dict[str, Any]]:
        """The chat before the next turn: the previous response's history, input and output."""
        param = "previous_response_id"
        rid, record = await store.load(self.gw.redis, previous, tenant, param=param)
        assert record.response is not None
        if await store.stage(self.gw.redis, rid) != store.FINISHED:
            raise errors.invalid(f"Response {store.response_id(rid)!r} has not finished yet.", param)
        try:
            done = await self.gw.client(record.model).handle(rid).result(partial_ok=True)
        except PagedqError as e:
            raise errors.invalid(
                f"Response {store.response_id(rid)!r} failed ({e}); it cannot be continued.", param
            ) from None
        calls = [tool_call(c) for c in done.tool_calls or []]
        return [*record.response.history, rq.output_message(done.content if calls else done.text, calls)]

    # --- GET /v1/responses/{id} -------------------------------------------------------------------

    async def retrieve(self, request: Request) -> Response | EventStream:
        caller = self.gw.caller(request)
        rid, record = await store.load(self.gw.redis, request.path_params["id"], caller.tenant)
        request.state.request_id = rid
        assert record.response is not None
        view = ResponseView(
            id=store.response_id(rid), created_at=record.created, model=record.model, echo=record.response.echo
        )
        client = self.gw.client(record.model)
        headers = {REQUEST_ID_HEADER: rid}
        if request.query_params.get("stream", "false").lower() == "true":
            after = self._starting_after(request)
            with self.gw.streams.reserve(caller.key_id) as slot:  # (a reader leaving never cancels)
                frames = await self._resumed(client, rid, view, record.response, after)
                return EventStream(frames, metrics=self.gw.metrics, headers=headers, slot=slot)
        stage = await store.stage(self.gw.redis, rid)
        if stage != store.FINISHED:
            return JSONResponse(response_object(view, stage), headers=headers)
        ok, body = await until_done_or_gone(self._whole(client, rid, view, None), request.receive)
        return JSONResponse(body, headers=headers) if ok else Response(status_code=499)

    async def _resumed(
        self, client: AsyncClient, rid: str, view: ResponseView, stored: records.StoredResponse, after: int
    ) -> AsyncIterator[bytes]:
        """The SSE body of GET .../{id}?stream=true from event `after` + 1 on (-1: from the start)."""
        if after >= 0 and await store.stage(self.gw.redis, rid) == store.FINISHED:
            # Finished: render it once, check starting_after against it, send the tail from there.
            events = await self._all_events(client, rid, view, stored)
            if after >= len(events) - 1:
                raise errors.invalid(
                    f"starting_after={after} is at or beyond the last event ({len(events) - 1}).", "starting_after"
                )
            return _one(b"".join(sse(e) for e in events[after + 1 :]))  # sequence number = index
        first = "queued" if stored.background else "in_progress"
        return self._frames(client, rid, view, first, stored.constraint, after=after)

    @staticmethod
    def _starting_after(request: Request) -> int:
        raw = request.query_params.get("starting_after")
        if raw is None or raw == "":
            return -1
        try:
            after = int(raw)
        except ValueError:
            after = -2
        if after < 0:
            raise errors.invalid("starting_after must be a sequence number (an integer >= 0).", "starting_after")
        return after

    # --- POST /v1/responses/{id}/cancel, DELETE /v1/responses/{id}, GET .../input_items -----------

    async def cancel(self, request: Request) -> Response:
        caller = self.gw.caller(request)
        rid, record = await store.load(self.gw.redis, request.path_params["id"], caller.tenant)
        request.state.request_id = rid
        assert record.response is not None
        if not record.response.background:
            raise errors.invalid("Only responses created with background=true can be cancelled.", None)
        client = self.gw.client(record.model)
        view = ResponseView(
            id=store.response_id(rid), created_at=record.created, model=record.model, echo=record.response.echo
        )
        if await store.stage(self.gw.redis, rid) != store.FINISHED:
            await client.cancel(rid)
            try:  # a worker stops it within a step; a queued one when a worker takes it
                async with asyncio.timeout(CANCEL_WAIT_S):
                    while await store.stage(self.gw.redis, rid) != store.FINISHED:
                        await asyncio.sleep(0.05)
            except TimeoutError:
                return JSONResponse(response_object(view, await store.stage(self.gw.redis, rid)))
        return JSONResponse(await self._whole(client, rid, view, None))

    async def delete(self, request: Request) -> Response:
        caller = self.gw.caller(request)
        rid, record = await store.load(self.gw.redis, request.path_params["id"], caller.tenant)
        if await store.stage(self.gw.redis, rid) != store.FINISHED:
            await self.gw.client(record.model).cancel(rid)  # nobody could read it any more
        await self.gw.redis.delete(keys.gateway_record(rid))
        return JSONResponse({"id": store.response_id(rid), "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        caller = self.gw.caller(request)
        _, record = await store.load(self.gw.redis, request.path_params["id"], caller.tenant)
        assert record.response is not None
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise errors.invalid("order must be asc or desc", "order")
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise errors.invalid("limit must be an integer from 1 to 100", "limit")
        items = list(record.response.input)
        if order == "desc":
            items.reverse()
        after = q.get("after")
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise errors.invalid(f"No input item with id {after!r} in this response.", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    # --- reading a response -------------------------------------------------------------------------

    async def _events(
        self, client: AsyncClient, rid: str, view: ResponseView, first: str, constraint: str | None
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """Every event of the response, from sequence number 0, in batches as its stream grows."""
        events = ResponseEvents(view)
        yield events.start(first)
        reading = Reading(client.handle(rid))
        try:
            async for batch in reading.batches():
                out = [e for c in batch for e in events.chunk(c)]
                if out:
                    yield out
        except RequestFailed as e:
            yield events.fail(e.code, e.error_message, self._api_error(e, constraint).body.param)
            return
        except PagedqError as e:
            api = self._api_error(e, constraint)
            yield events.fail(api.body.code or "server_error", api.body.message, api.body.param)
            return
        assert reading.completion is not None
        yield events.finish(reading.completion)

    async def _all_events(
        self, client: AsyncClient, rid: str, view: ResponseView, stored: records.StoredResponse
    ) -> list[dict]:
        first = "queued" if stored.background else "in_progress"
        return [e async for batch in self._events(client, rid, view, first, stored.constraint) for e in batch]

    async def _frames(
        self, client: AsyncClient, rid: str, view: ResponseView, first: str, constraint: str | None, *, after: int = -1
    ) -> AsyncIterator[bytes]:
        async for batch in self._events(client, rid, view, first, constraint):
            frames = b"".join(sse(e) for e in batch if e["sequence_number"] > after)
            if frames:
                yield frames

    async def _whole(
        self, client: AsyncClient, rid: str, view: ResponseView, constraint: str | None, *, answer_4xx: bool = False
    ) -> dict:
        """The Response object once finished; with `answer_4xx` (the POST that waits for it) a request
        the worker refused as the client's fault raises its 4xx instead, as chat does."""
        try:
            done: Completion = await client.handle(rid).result(partial_ok=True)
        except RequestFailed as e:
            if answer_4xx and e.code in errors.CLIENT_ERROR_CODES:
                raise self._api_error(e, constraint) from None
            return response_object(view, "failed", error=error_object(e.code, e.error_message))
        return response_object(view, status_of(done), done)

    def _canceller(self, client: AsyncClient, rid: str) -> Callable[[], Awaitable[None]]:
        async def cancel() -> None:
            try:
                await client.cancel(rid)
                self.gw.metrics.cancels.inc()
            except PagedqError:
                pass

        return cancel

    def _api_error(self, e: PagedqError, constraint: str | None) -> errors.ApiError:
        param_of, failure_param = api_error_mappers(constraint)
        return errors.from_sdk(
            e, param_of=param_of, failure_param=failure_param, retry_after_s=self.gw.config.retry_after_s
        )


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data
