"""The arq bridge, through a real arq worker (in-process, burst mode) and the real redis-server."""

from __future__ import annotations

import pytest

arq = pytest.importorskip("arq")

from arq.connections import RedisSettings, create_pool  # noqa: E402
from arq.worker import Worker  # noqa: E402
from sdk_fake_worker import FakeWorker  # noqa: E402

from producer_sdk import RequestFailed  # noqa: E402
from producer_sdk.arq_bridge import arq_worker_settings, enqueue_generation  # noqa: E402

QUEUE = "pagedq:arq:test"
# arq's own Worker.close calls redis-py's deprecated close()
pytestmark = [
    pytest.mark.filterwarnings("ignore:Call to deprecated close:DeprecationWarning"),
    pytest.mark.single_node,
]  # arq runs on one node only


async def run_arq_burst(redis_url: str) -> Worker:
    settings = arq_worker_settings(redis_url, "default", QUEUE, block_ms=100)
    worker = Worker(**settings, burst=True, handle_signals=False, poll_delay=0.01)
    try:
        await worker.main()
    finally:
        await worker.close()
    return worker


async def test_generation_through_arq(redis_url):
    from opentelemetry.sdk.trace import TracerProvider

    pool = await create_pool(RedisSettings.from_dsn(redis_url))
    try:
        with TracerProvider().get_tracer("enqueuer").start_as_current_span("enqueue") as span:
            job = await enqueue_generation(pool, queue_name=QUEUE, prompt="Hi", max_tokens=3, metadata={"t": "a"})
        again = await enqueue_generation(pool, queue_name=QUEUE, request_id=job.job_id, prompt="Hi")
        failing = await enqueue_generation(pool, queue_name=QUEUE, prompt="fail", deadline=30)
        async with FakeWorker(redis_url) as pagedq_worker:
            worker = await run_arq_burst(redis_url)
        assert worker.jobs_complete == 1 and worker.jobs_failed == 1
        result = await job.result(timeout=5)
        assert await again.result(timeout=5) == result  # same job: idempotent
        assert result["text"] == "w0 w1 w2 " and result["finish_reason"] == "length"
        assert result["request_id"] == job.job_id and result["usage"]["completion_tokens"] == 3
        with pytest.raises(RequestFailed) as info:
            await failing.result(timeout=5)
        assert info.value.code == "engine_error"
        by_id = {r.request_id: r for r in pagedq_worker.requests}  # arq runs the jobs concurrently
        assert len(pagedq_worker.requests) == 2 and set(by_id) == {job.job_id, failing.job_id}
        assert by_id[job.job_id].metadata == {"t": "a"}
        assert by_id[failing.job_id].deadline_ms is not None
        ctx = span.get_span_context()  # the enqueuer's span is the parent, across arq and pagedq
        assert by_id[job.job_id].traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
        assert by_id[failing.job_id].traceparent is None
    finally:
        await pool.aclose()
