"""What a finished request leaves behind on the worker: its metrics and its one log line."""

from __future__ import annotations

from typing import Any

from worker.engine.outputs import RequestOutput
from worker.service.inflight import InFlight
from worker.service.metrics import WorkerMetrics


def record_finish(met: WorkerMetrics, log: Any, rec: InFlight, out: RequestOutput) -> None:
    """Count a request that ended here (its entry acked) and log it: one line per request, with its
    id, tenant, tokens, timings and finish reason."""
    m = out.metrics
    if out.error:
        code = out.error_code or "engine_error"
        met.labels(met.requests_failed, code=code).inc()
        met.tenant_finished(rec.tenant, "error")
        log.warning("request failed", request_id=rec.request_id, code=code, error=out.error, tenant=rec.tenant)
        return
    reason = out.outputs[0].finish_reason or "abort"
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    met.labels(met.requests_finished, finished_reason=reason).inc()
    met.tenant_finished(rec.tenant, reason, completion_tokens)
    for hist, value in ((met.queue_time, m.queue_time), (met.ttft, m.ttft), (met.e2e, m.e2e)):
        if value is not None:
            met.labels(hist).observe(value)
    itl = met.labels(met.itl)
    for gap in m.inter_token_latencies:
        itl.observe(gap)
    ms = lambda s: None if s is None else round(s * 1000, 1)
    log.info(
        "request finished",
        request_id=rec.request_id,
        tenant=rec.tenant,
        finish_reason=reason,
        attempt=rec.attempt,
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=completion_tokens,
        cached_tokens=m.num_cached_tokens,
        queue_ms=ms(m.queue_time),
        ttft_ms=ms(m.ttft),
        e2e_ms=ms(m.e2e),
    )
