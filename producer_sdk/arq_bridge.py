"""Generation as an arq job, for backends that already run arq (extra: ``pip install pagedq[arq]``).

    # producer side
    job = await enqueue_generation(arq_pool, prompt="Hi", max_tokens=32)
    completion = await job.result(timeout=60)          # a plain dict (Completion fields)

    # an arq worker process serving the queue (or `pagedq worker --arq-queue NAME`)
    WorkerSettings = arq_worker_settings("redis://localhost:6379/0", model="default")
    #   $ arq mymodule.WorkerSettings

The arq job only submits to pagedq and waits: the GPU work happens in the pagedq workers. The job
id is the pagedq request id, so enqueueing the same request twice yields one job and one request,
and a job that arq retries after an interruption resubmits the same id, which pagedq treats as a
duplicate: the retry follows the request already running.
Errors (QueueFull, Cancelled, RequestFailed, ...) travel back through arq and are re-raised by
``job.result()``.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import msgspec
from arq.connections import ArqRedis, RedisSettings
from arq.jobs import Job
from arq.worker import func

from producer_sdk import trace_context
from producer_sdk._core import new_request_id
from producer_sdk.client import AsyncClient
from producer_sdk.contract.connection import is_sentinel_url, parse_sentinel_url

DEFAULT_QUEUE = "pagedq:arq"
FUNCTION_NAME = "pagedq_generate"
CLIENT_KEY = "pagedq_client"


async def pagedq_generate(ctx: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The arq function: submit `request` (keyword arguments of `AsyncClient.generate`) with
    ``ctx["pagedq_client"]`` and return the Completion as a plain dict."""
    client: AsyncClient = ctx[CLIENT_KEY]
    completion = await client.generate(**request)
    return msgspec.to_builtins(completion)


async def enqueue_generation(arq_pool: ArqRedis, *, queue_name: str = DEFAULT_QUEUE, **request: Any) -> Job:
    """Enqueue one generation as an arq job; ``await job.result()`` is the completion dict.

    `request` holds `AsyncClient.generate` arguments (prompt / messages / prompt_token_ids,
    sampling fields, priority, deadline as seconds, metadata, request_id, timeout, ...).
    The OpenTelemetry span current here (if any) becomes the request's `traceparent`, unless the
    request names its own: the job runs later, in another process.
    """
    request.setdefault("request_id", new_request_id())
    if "traceparent" not in request and "tracestate" not in request:
        traceparent, tracestate = trace_context.current()
        if traceparent is not None:
            request["traceparent"] = traceparent
            if tracestate is not None:
                request["tracestate"] = tracestate
    deadline = request.get("deadline")
    if deadline is not None and not isinstance(deadline, datetime):
        # Relative deadlines count from now, not from when an arq worker picks the job up.
        seconds = deadline.total_seconds() if isinstance(deadline, timedelta) else float(deadline)
        request["deadline"] = datetime.now(timezone.utc) + timedelta(seconds=seconds)
    job_id = request["request_id"]
    job = await arq_pool.enqueue_job(FUNCTION_NAME, request, _job_id=job_id, _queue_name=queue_name)
    if job is None:  # a job with this id exists already: follow it (idempotent resubmit)
        job = Job(job_id, arq_pool, _queue_name=queue_name)
    return job


def arq_worker_settings(
    redis_url: str,
    model: str = "default",
    queue_name: str = DEFAULT_QUEUE,
    *,
    max_jobs: int = 256,
    job_timeout: float = 3600,
    **client_options: Any,
) -> dict[str, Any]:
    """WorkerSettings (a dict arq accepts) for an arq worker that serves `pagedq_generate`.

    Its startup puts an `AsyncClient(redis_url, model, **client_options)` in
    ``ctx["pagedq_client"]`` (unless one is there already) and its shutdown closes it. The arq
    queue lives in the same Redis as pagedq. Jobs mostly wait, so `max_jobs` can be high.
    """

    async def startup(ctx: dict[str, Any]) -> None:
        if CLIENT_KEY not in ctx:
            ctx[CLIENT_KEY] = AsyncClient(redis_url, model, **client_options)
            ctx["_pagedq_owns_client"] = True

    async def shutdown(ctx: dict[str, Any]) -> None:
        if ctx.pop("_pagedq_owns_client", False):
            await ctx.pop(CLIENT_KEY).close()

    return {
        "functions": [func(pagedq_generate, name=FUNCTION_NAME)],
        "queue_name": queue_name,
        "redis_settings": redis_settings(redis_url),
        "on_startup": startup,
        "on_shutdown": shutdown,
        "max_jobs": max_jobs,
        "job_timeout": job_timeout,
    }


def redis_settings(redis_url: str) -> RedisSettings:
    """arq's RedisSettings for a pagedq Redis URL, a Sentinel URL included (arq then asks the
    Sentinels for the primary itself; it has no setting for a Sentinel password)."""
    if not is_sentinel_url(redis_url):
        return RedisSettings.from_dsn(redis_url)
    target = parse_sentinel_url(redis_url)
    if target.sentinel_username or target.sentinel_password:
        raise ValueError("arq cannot authenticate to Sentinels: drop sentinel_username/sentinel_password for arq")
    return RedisSettings(
        host=target.sentinels,
        sentinel=True,
        sentinel_master=target.service_name,
        database=target.db or 0,
        username=target.username,
        password=target.password,
    )


__all__ = ["DEFAULT_QUEUE", "arq_worker_settings", "enqueue_generation", "pagedq_generate"]
