"""The gateway's HTTP surface (Starlette on uvicorn): OpenAI's endpoints onto the pagedq queue.

Stateless: requests go through the SDK, answers are read from the response streams, and the little
a gateway must know to serve a request it did not take lives in Redis (`records`).

Headers a client may send: `Authorization: Bearer <key>` (with `--api-keys`), `Idempotency-Key` or
`X-Request-Id` (the request id: a retry attaches to the same generation), `pagedq-resumable: true`
(a disconnect does not cancel; resume with GET .../{id}?stream=true and `Last-Event-ID`),
`pagedq-timeout: SECONDS` (deadline; 504 after it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import errors, json_body, mapping, records
from gateway.auth import ANONYMOUS, Caller, KeyRing
from gateway.config import GatewayConfig
from gateway.metrics import CountRequests, GatewayMetrics
from gateway.registry import Registry
from gateway.render import Renderer, request_id_of
from gateway.responses.service import ResponsesApi
from gateway.stream_limit import Slot, StreamLimit
from gateway.streams import Clock, EventStream, Reading, sse_frames, until_done_or_gone
from producer_sdk.client import AsyncClient
from producer_sdk.constants import REQUEST_ID_PATTERN, UNFINISHED_TTL_S
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.contract.redis_errors import REDIS_ERRORS
from producer_sdk.errors import DeadlineExceeded, PagedqError
from producer_sdk.validation import trace_context_problems

log = logging.getLogger("pagedq.gateway")
REQUEST_ID_HEADER = "pagedq-request-id"  # on every answer about a request that has an id, errors included
REDIS_SOCKET_TIMEOUT_S = 30.0  # above the SDK's XREAD BLOCK slices
# A waiting stream rechecks that its request still exists after each idle XREAD BLOCK of this long:
# longer than the SDK's 2 s, so a gateway holding thousands of idle streams stays quiet.
IDLE_BLOCK_MS = 10_000


def trace_headers(headers: Any) -> dict[str, str]:
    """The caller's W3C Trace Context, carried to the worker. As the spec asks of a receiver, a
    malformed `traceparent` is ignored (the worker's spans then start their own trace); a malformed
    `tracestate` is dropped and the `traceparent` kept."""
    parent = headers.get("traceparent", "").strip()
    if not parent or any(trace_context_problems(parent, None)):
        return {}
    state = headers.get("tracestate", "").strip()
    if state and not any(trace_context_problems(parent, state)):
        return {"traceparent": parent, "tracestate": state}
    return {"traceparent": parent}


def json_response(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def error_response(e: errors.ApiError) -> Response:
    return json_response(e.json(), e.status, e.headers)


class Gateway:
    def __init__(self, config: GatewayConfig, redis: Any = None) -> None:
        self.config = config
        self.redis = redis or connect(config.redis_url, asyncio=True, socket_timeout=REDIS_SOCKET_TIMEOUT_S)
        self.keys = KeyRing.load(config.api_keys) if config.api_keys else None
        self.registry = Registry(self.redis, refresh_s=config.registry_refresh_s)
        self.metrics = GatewayMetrics()
        self.streams = StreamLimit(config.max_streams_per_key, self.metrics, config.retry_after_s)
        self._clients: dict[tuple[str, float], AsyncClient] = {}
        self.responses = ResponsesApi(self)
        self._refresher: asyncio.Task | None = None

    # --- lifecycle --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any):
        with contextlib.suppress(Exception):
            await self.registry.refresh()
        self._refresher = asyncio.create_task(self.registry.run())
        try:
            yield
        finally:
            self._refresher.cancel()
            await self.redis.aclose()

    def client(self, model: str, result_ttl_s: float | None = None) -> AsyncClient:
        """The SDK client of a model, submitting with the given retention (default --result-ttl)."""
        ttl = self.config.result_ttl_s if result_ttl_s is None else result_ttl_s
        c = self._clients.get((model, ttl))
        if c is None:
            c = AsyncClient(self.redis, model=model, check_model=False, result_ttl_s=ttl, block_ms=IDLE_BLOCK_MS)
            self._clients[(model, ttl)] = c
        return c

    def caller(self, request: Request) -> Caller:
        if self.keys is None:
            return ANONYMOUS
        return self.keys.caller(request.headers.get("authorization"))

    async def body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes

        def over(declared: int | None) -> errors.ApiError:
            if declared is not None:
                return errors.too_large(f"The body is {declared} bytes, more than the limit of {limit}.")
            return errors.too_large(f"The body is more than the limit of {limit} bytes.")

        return await self.read_body(request, limit, over)

    async def read_body(self, request: Request, limit: int, over: Any) -> bytes:
        """`json_body.read_capped` within --body-read-timeout (a 408 after it, counted)."""
        try:
            return await json_body.read_capped(request, limit, over, self.config.body_read_timeout_s)
        except errors.BodyTimeout:
            self.metrics.limit_closes.labels("body_timeout").inc()
            raise

    def deadline_s(self, request: Request) -> float | None:
        raw = request.headers.get("pagedq-timeout")
        asked = None
        if raw is not None:
            try:
                asked = float(raw)
            except ValueError:
                asked = math.nan
            if not math.isfinite(asked) or asked <= 0:
                raise errors.invalid("The header pagedq-timeout must be a positive number of seconds.", None)
        limits = [x for x in (asked, self.config.request_timeout_s) if x]
        return min(limits) if limits else None

    # --- POST /v1/chat/completions and /v1/completions --------------------------------------------

    async def create(self, request: Request, kind: str) -> Response | EventStream:
        clock = Clock(self.metrics, _route(request))
        caller = self.caller(request)
        decoded = mapping.decode(kind, await self.body(request))
        m = mapping.map_chat(decoded) if kind == mapping.CHAT else mapping.map_completion(decoded)
        await self.registry.check(
            m.model, allowed=caller.allowed_or_none, queue_without_workers=self.config.queue_without_workers
        )
        with self.streams.reserve(caller.key_id, m.stream) as slot:
            return await self._submit(request, kind, caller, m, clock, slot)

    async def _submit(
        self, request: Request, kind: str, caller: Caller, m: mapping.Mapped, clock: Clock, slot: Slot | None
    ) -> Response | EventStream:
        headers = request.headers
        idem = headers.get("idempotency-key")
        rid = records.request_id_for(idem or headers.get("x-request-id"), caller.tenant)
        request.state.request_id = rid  # from here on, an error answer names the request too
        resumable_header = headers.get("pagedq-resumable", "").lower()
        # A client that sends an Idempotency-Key means to retry after a network error: its request
        # must outlive the connection (unless it says otherwise).
        resumable = resumable_header == "true" or (bool(idem) and resumable_header != "false")
        submit = dict(m.submit)
        if caller.tenant is not None:
            submit["metadata"] = {**submit.get("metadata", {}), "tenant": caller.tenant}
            submit["tenant"] = caller.tenant  # its quota applies
        submit.update(trace_headers(headers))
        deadline = self.deadline_s(request)
        created = int(time.time())
        n = int(submit.get("n", 1))
        token_ids = m.token_ids or self.config.return_tokens_as_token_ids
        record = records.Record(
            kind=kind,
            model=m.model,
            created=created,
            n=n,
            include_usage=m.include_usage,
            tenant=caller.tenant,
            token_ids=token_ids,
        )
        client = self.client(m.model)
        # Until the request runs, its record outlives any queueing; from then on the worker gives it the
        # response stream's TTL (the retention from the final event), so both expire together.
        record_ttl_ms = int(max(self.config.result_ttl_s, UNFINISHED_TTL_S) * 1000)
        handle, stored = await asyncio.gather(
            client.submit(request_id=rid, deadline=deadline, **submit),
            self.redis.set(keys.gateway_record(rid), records.encode(record), px=record_ttl_ms, nx=True),
            return_exceptions=True,
        )

        def api_error(e: PagedqError) -> errors.ApiError:
            return errors.from_sdk(
                e,
                param_of=lambda f: mapping.param_of(m, f),
                failure_param=m.failure_param,
                retry_after_s=self.config.retry_after_s,
            )

        if isinstance(handle, BaseException):
            if stored is True:
                await self.redis.delete(keys.gateway_record(rid))
            if isinstance(handle, PagedqError):
                raise api_error(handle)
            raise handle
        if isinstance(stored, BaseException):
            raise stored
        if handle.duplicate and stored is not True:
            earlier = records.decode(await self.redis.get(keys.gateway_record(rid)))
            if earlier is not None and earlier.kind != kind:
                raise errors.idempotency_key_reused()
            if earlier is not None:
                created = earlier.created
        renderer = Renderer(kind, rid, m.model, created, include_usage=m.include_usage, token_ids=token_ids)
        cancel = None if resumable else self._canceller(client, rid)
        reply_headers = {REQUEST_ID_HEADER: rid}
        if m.stream:
            reading = Reading(handle, for_sse=True)
            frames = sse_frames(reading, renderer, n=n, on_first_token=clock.first_byte, api_error=api_error)
            return EventStream(frames, metrics=self.metrics, on_disconnect=cancel, headers=reply_headers, slot=slot)
        try:
            ok, done = await until_done_or_gone(Reading(handle).result(), request.receive)
        except PagedqError as e:
            raise api_error(e) from None
        if not ok:
            if cancel is not None:
                await cancel()
            return Response(status_code=499)
        return self._whole(renderer, done, clock, reply_headers)

    def _canceller(self, client: AsyncClient, rid: str):
        async def cancel() -> None:
            try:
                await client.cancel(rid)
                self.metrics.cancels.inc()
            except PagedqError as e:
                log.warning("could not cancel %s after its client left: %s", rid, e)

        return cancel

    def _whole(self, renderer: Renderer, done: Any, clock: Clock, headers: dict[str, str]) -> Response:
        if done.finish_reason == "deadline":
            raise errors.from_sdk(DeadlineExceeded("", request_id=done.request_id, completion=done))
        clock.first_byte()
        return json_response(renderer.whole(done), headers=headers)

    # --- GET /v1/chat/completions/{id} (and /v1/completions/{id}) ---------------------------------

    async def retrieve(self, request: Request, kind: str) -> Response | EventStream:
        clock = Clock(self.metrics, _route(request))
        caller = self.caller(request)
        given = request.path_params["id"]
        rid = request_id_of(kind, given)
        record = None
        if REQUEST_ID_PATTERN.fullmatch(rid):
            record = records.decode(await self.redis.get(keys.gateway_record(rid)))
        if record is None or record.kind != kind or (self.keys is not None and record.tenant != caller.tenant):
            raise errors.not_found(f"No {kind} completion with id {given!r} (or it expired).")
        request.state.request_id = rid
        stream = request.query_params.get("stream", "false").lower() == "true"
        renderer = Renderer(
            kind,
            rid,
            record.model,
            record.created,
            include_usage=record.include_usage,
            token_ids=record.token_ids or self.config.return_tokens_as_token_ids,
        )
        handle = self.client(record.model).handle(rid)
        if stream:
            after = self._last_event_id(request)
            reading = Reading(handle, for_sse=True)
            frames = sse_frames(reading, renderer, n=record.n, after=after, on_first_token=clock.first_byte)
            # A reader leaving never cancels: the request belongs to whoever POSTed it.
            slot = self.streams.acquire(caller.key_id)
            return EventStream(frames, metrics=self.metrics, headers={REQUEST_ID_HEADER: rid}, slot=slot)
        ok, done = await until_done_or_gone(Reading(handle).result(), request.receive)
        if not ok:
            return Response(status_code=499)
        return self._whole(renderer, done, clock, {REQUEST_ID_HEADER: rid})

    @staticmethod
    def _last_event_id(request: Request) -> int:
        raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
        if raw is None or raw == "":
            return -1
        try:
            return int(raw)
        except ValueError:
            raise errors.invalid("Last-Event-ID must be an event id this gateway sent (an integer).", None) from None

    # --- models, health ---------------------------------------------------------------------------

    async def list_models(self, request: Request) -> Response:
        caller = self.caller(request)
        await self.registry._fresh_if_stale()
        data = [self._model_obj(v) for v in self.registry.listed(caller.allowed_or_none)]
        return JSONResponse({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        caller = self.caller(request)
        model = request.path_params["model"]
        await self.registry._fresh_if_stale()
        views = {v.name: v for v in self.registry.listed(caller.allowed_or_none)}
        if model not in views:
            raise errors.model_not_found(model, sorted(views))
        return JSONResponse(self._model_obj(views[model]))

    @staticmethod
    def _model_obj(v: Any) -> dict[str, Any]:
        return {
            "id": v.name,
            "object": "model",
            "created": v.created,
            "owned_by": "pagedq",
            "root": v.name,
            "parent": None,
            "max_model_len": v.max_model_len,
        }

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        try:
            await asyncio.wait_for(self.redis.ping(), timeout=2.0)
        except Exception as e:
            return JSONResponse({"status": "unavailable", "redis": f"{type(e).__name__}: {e}"}, status_code=503)
        return JSONResponse({"status": "ready", "models": [v.name for v in self.registry.listed()]})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _route(request: Request) -> str:
    return getattr(request.scope.get("route"), "path", "other")


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405, in OpenAI's error shape."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "") or "error"
    return error_response(errors.ApiError(status, f"{request.method} {request.url.path}: {detail}", code=None))


def _internal(request: Request, exc: BaseException | None = None) -> errors.ApiError:
    """Anything unexpected: logged with its traceback, answered in OpenAI's shape without internals."""
    rid = getattr(request.state, "request_id", None)
    where = (request.method, request.url.path, rid)
    log.error("unexpected error in %s %s (request %s)", *where, exc_info=exc or True)
    more = f" (request {rid})" if rid else ""
    return errors.ApiError(
        500, f"The gateway failed on this request{more}; it is logged.", type="server_error", code="internal_error"
    )


async def _unexpected(request: Request, exc: Exception) -> Response:
    """Starlette's last resort (outside the guarded endpoints): the same answer."""
    return error_response(_internal(request, exc))


def _guarded(handler):
    async def endpoint(request: Request):
        try:
            return await handler(request)
        except errors.ApiError as e:
            error = e
        except PagedqError as e:
            error = errors.from_sdk(e)
        except REDIS_ERRORS as e:
            error = errors.redis_unavailable(e)
        except Exception:
            error = _internal(request)
        rid = getattr(request.state, "request_id", None)  # set once the request has its id
        if rid is not None:
            error.headers.setdefault(REQUEST_ID_HEADER, rid)
        return error_response(error)

    return endpoint


def create_app(config: GatewayConfig, redis: Any = None) -> CountRequests:
    """The ASGI application of one gateway (counted by the metrics middleware)."""
    from gateway.batches.routes import BatchApi
    from gateway.openapi import docs_routes

    gw = Gateway(config, redis)
    batches = BatchApi(gw)  # /v1/files, /v1/batches and the batch runner (docs/batch.md)
    chat, completion = mapping.CHAT, mapping.COMPLETION
    routes = [
        Route("/v1/chat/completions", _guarded(lambda r: gw.create(r, chat)), methods=["POST"]),
        Route("/v1/completions", _guarded(lambda r: gw.create(r, completion)), methods=["POST"]),
        Route("/v1/chat/completions/{id}", _guarded(lambda r: gw.retrieve(r, chat)), methods=["GET"]),
        Route("/v1/completions/{id}", _guarded(lambda r: gw.retrieve(r, completion)), methods=["GET"]),
        Route("/v1/responses", _guarded(gw.responses.create), methods=["POST"]),
        Route("/v1/responses/{id}", _guarded(gw.responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{id}", _guarded(gw.responses.delete), methods=["DELETE"]),
        Route("/v1/responses/{id}/cancel", _guarded(gw.responses.cancel), methods=["POST"]),
        Route("/v1/responses/{id}/input_items", _guarded(gw.responses.input_items), methods=["GET"]),
        Route("/v1/models", _guarded(gw.list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", _guarded(gw.get_model), methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/ready", gw.ready, methods=["GET"]),
        Route("/metrics", gw.prometheus, methods=["GET"]),
        *batches.routes(_guarded),
        *docs_routes(),
    ]
    app = Starlette(
        routes=routes,
        lifespan=batches.lifespan(gw.lifespan),
        exception_handlers={404: _http_error, 405: _http_error, Exception: _unexpected},
    )
    app.state.gateway = gw
    return CountRequests(app, gw.metrics)
