"""The worker process: the engine loop on its own thread, Redis I/O on asyncio beside it.

    engine thread:  step() back to back while there is work  --outputs-->  publisher (asyncio)
    asyncio:        intake (XREADGROUP) --add_request-->  engine
                    control (cancels, renewal, reclaim, heartbeats, gauges, summary)

The engine never waits for the network and the network never waits for a forward pass.
Shutdown (SIGTERM/SIGINT): stop pulling, let in-flight work finish for up to `drain_timeout`, then
hand the rest over (its tokens so far are published, its entry is released un-acked so another
worker resumes it at once), and exit.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time

import redis.asyncio as aioredis

from producer_sdk.contract import keys
from worker.engine.engine import LLMEngine, StepFailed
from worker.service.closer import EntryCloser
from worker.service.config import ServiceConfig
from worker.service.control import HANDOVER_IDLE_MS, Control, every
from worker.service.inflight import Entry, InFlight, InFlightTable
from worker.service.intake import Intake
from worker.service.logging import get_logger
from worker.service.metrics import WorkerMetrics
from worker.service.publisher import Publisher, PublisherHooks
from worker.service.retry import REDIS_DOWN


class WorkerService:
    def __init__(self, engine: LLMEngine, config: ServiceConfig, metrics: WorkerMetrics | None = None) -> None:
        self.engine = engine
        self.config = config
        self.model = config.model_name
        self.consumer = config.consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = metrics or WorkerMetrics(self.model)
        self.inflight = InFlightTable()
        self.log = get_logger("pagedq.worker", worker=self.consumer, model=self.model)
        self.stopping = asyncio.Event()
        self.metrics_port: int | None = None
        self._engine_wake = threading.Event()
        self._engine_stop = threading.Event()
        self._engine_error: BaseException | None = None
        self._last_counts = (0, 0, 0, 0, 0)
        self._gauges_at: float | None = None
        self.kv_stats = engine.kv.stats()
        self._background: set[asyncio.Task] = set()
        seqs = engine.scheduler_config.max_num_seqs
        self.headroom = config.intake_headroom if config.intake_headroom is not None else max(1, seqs // 8)

    # --- shared helpers -----------------------------------------------------------------------

    def capacity(self) -> int:
        """New entries this worker can take now: free sequence slots plus a little headroom."""
        if self.stopping.is_set():
            return 0
        seqs = self.engine.scheduler_config.max_num_seqs
        return seqs + self.headroom - len(self.inflight)

    def wake_engine(self) -> None:
        self._engine_wake.set()

    def _on_done(self, rec: InFlight) -> None:
        self.intake.capacity_changed.set()

    def _on_lost(self, rec_or_id) -> None:
        rid = rec_or_id if isinstance(rec_or_id, str) else rec_or_id.request_id
        rec = self.inflight.pop(rid, None)
        if rec is not None:
            rec.lost = True
            self.engine.abort_request(rid)
            self.intake.capacity_changed.set()

    def _on_gap(self, rec: InFlight, last_seq: int) -> None:
        """The response stream holds less than we wrote (Redis lost writes in a failover): stop this
        attempt and release the entry, so a new attempt resumes from what the stream holds."""
        self.log.error(
            "response stream lost events; restarting the request", request_id=rec.request_id, last_seq=last_seq
        )
        self._on_lost(rec)
        self._spawn(self.control.renew(HANDOVER_IDLE_MS, [rec]))

    def _on_failed(self, rec: InFlight, error: BaseException) -> None:
        """Redis refuses this request's writes for good (say its stream key holds another type)."""
        self._on_lost(rec)
        entry = Entry(rec.lane, rec.stream, rec.entry_id, {}, rec.deliveries)
        msg = f"the response stream cannot be written: {type(error).__name__}: {error}"
        self._spawn(self.closer.refuse(entry, rec.request_id, "stream_unwritable", msg, seq=None))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- the engine thread --------------------------------------------------------------------

    def _engine_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        eng = self.engine
        while not self._engine_stop.is_set():
            if not eng.has_unfinished_requests():
                if self._gauges_at is not None:  # went idle: the gauges show it at once
                    self._record_gauges(force=True)
                    self._gauges_at = None
                self._engine_wake.wait(0.05)
                self._engine_wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                outputs = eng.step()
            except StepFailed as e:
                eng.discard(e.request_ids)
                if e.outputs:
                    loop.call_soon_threadsafe(self.publisher.put, e.outputs)
                loop.call_soon_threadsafe(self._step_failed, e.request_ids, repr(e.__cause__))
                continue
            except BaseException as e:  # not a request's fault: stop serving, hand everything over
                self._engine_error = e
                loop.call_soon_threadsafe(self.stopping.set)
                return
            self._record_step(time.perf_counter() - t0)
            if outputs:
                loop.call_soon_threadsafe(self.publisher.put, outputs)

    def _record_step(self, seconds: float) -> None:
        eng, m = self.engine, self.metrics
        st, kv = eng.stats, eng.kv
        counts = (
            st.prompt_tokens,
            st.generation_tokens,
            st.num_preemptions,
            kv.prefix_queries_tokens,
            kv.prefix_hits_tokens,
        )
        last = self._last_counts
        for metric, now, before in zip(
            (m.prompt_tokens, m.generation_tokens, m.preemptions, m.prefix_queries, m.prefix_hits),
            counts,
            last,
            strict=True,
        ):
            if now > before:
                m.labels(metric).inc(now - before)
        self._last_counts = counts
        if st.last_step_tokens:
            m.labels(m.step_tokens).observe(st.last_step_tokens)
            m.labels(m.step_seconds).observe(seconds)
        self._record_gauges()

    def _record_gauges(self, force: bool = False) -> None:
        """Engine gauges, from the engine thread (the only one that may walk the KV tables), at most
        twice a second."""
        now = time.monotonic()
        if not force and self._gauges_at is not None and now - self._gauges_at < 0.5:
            return
        self._gauges_at = now
        eng, m = self.engine, self.metrics
        self.kv_stats = eng.kv.stats()
        m.labels(m.requests_running).set(len(eng.scheduler.running))
        m.labels(m.requests_waiting).set(len(eng.scheduler.waiting))
        m.labels(m.kv_usage).set(self.kv_stats.usage)
        m.labels(m.kv_waste).set(self.kv_stats.waste)

    # --- a failed step -------------------------------------------------------------------------

    def _step_failed(self, request_ids: list[str], error: str) -> None:
        self.log.error("engine step failed", request_ids=request_ids, error=error)
        self._spawn(self._retry_or_dead_letter(request_ids, error))

    async def _retry_or_dead_letter(self, request_ids: list[str], error: str) -> None:
        """Each request of a failed step runs again alone, from the tokens already delivered; one that
        keeps failing (the poison) is dead-lettered once its deliveries reach max_deliveries."""
        await self.publisher.wait_idle()  # `delivered` must include everything already published
        for rid in request_ids:
            rec = self.inflight.get(rid)
            if rec is None or not rec.live:
                continue
            rec.engine_failures += 1
            if rec.deliveries + rec.engine_failures > self.config.max_deliveries:
                self.inflight.pop(rid, None)
                msg = f"the engine failed on this request {rec.engine_failures} times: {error}"
                await self.intake.dead_letter_record(rec, "engine_error", msg)
                self.intake.capacity_changed.set()
                continue
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.intake.add_to_engine, rec, True)
            except Exception as e:
                self.inflight.pop(rid, None)
                await self.intake.dead_letter_record(rec, "engine_error", f"cannot retry: {e}")
                self.intake.capacity_changed.set()
        self.wake_engine()

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self, *, install_signal_handlers: bool = True) -> int:
        cfg = self.config
        # Two clients: a blocking XREADGROUP must not hold up publishing.
        self.redis = aioredis.Redis.from_url(cfg.redis_url, health_check_interval=10)
        self.blocking_redis = aioredis.Redis.from_url(cfg.redis_url, socket_timeout=None)
        ttl_ms = cfg.result_ttl_s * 1000
        group = keys.group(self.model)
        self.closer = EntryCloser(
            self.redis,
            model=self.model,
            group=group,
            consumer=self.consumer,
            result_ttl_ms=ttl_ms,
            dead_letter_ttl_ms=7 * 24 * 3600 * 1000,
            metrics=self.metrics,
        )
        self.intake = Intake(
            self.redis,
            self.blocking_redis,
            self.engine,
            self.inflight,
            model=self.model,
            consumer=self.consumer,
            limits=cfg.limits,
            closer=self.closer,
            metrics=self.metrics,
            capacity=self.capacity,
            wake_engine=self.wake_engine,
        )
        self.publisher = Publisher(
            self.redis,
            self.inflight,
            PublisherHooks(
                on_done=self._on_done, on_lost=self._on_lost, on_gap=self._on_gap, on_failed=self._on_failed
            ),
            model=self.model,
            group=group,
            consumer=self.consumer,
            live_ttl_ms=ttl_ms,
            result_ttl_ms=ttl_ms,
            metrics=self.metrics,
        )
        self.control = Control(
            self.redis,
            self.engine,
            self.inflight,
            self.intake,
            model=self.model,
            consumer=self.consumer,
            metrics=self.metrics,
            claim_idle_ms=cfg.claim_idle_ms,
            max_deliveries=cfg.max_deliveries,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            capacity=self.capacity,
            on_lost=self._on_lost,
        )
        self.intake.recently_cancelled = self.control.recently_cancelled
        loop = asyncio.get_running_loop()
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(cfg.metrics_port)
        await self._connect()
        engine_thread = threading.Thread(target=self._engine_loop, args=(loop,), name="engine", daemon=True)
        engine_thread.start()
        c = self.control
        tasks = [
            asyncio.create_task(self.publisher.run(), name="publisher"),
            asyncio.create_task(self._guard(self.intake.run()), name="intake"),
            asyncio.create_task(c.listen_for_cancels(), name="cancels"),
            asyncio.create_task(every(cfg.renew_interval_s, c.renew, self.log, "renew"), name="renew"),
            asyncio.create_task(every(cfg.reclaim_interval_s, c.reclaim, self.log, "reclaim"), name="reclaim"),
            asyncio.create_task(every(cfg.heartbeat_interval_s, self._beat, self.log, "heartbeat"), name="beat"),
            asyncio.create_task(every(cfg.summary_interval_s, self._summary, self.log, "summary"), name="summary"),
            asyncio.create_task(every(2.0, c.sweep_cancels, self.log, "cancel sweep"), name="sweep"),
        ]
        arq_worker = self._start_arq(tasks) if cfg.arq_queue else None
        self.log.info(
            "worker started",
            redis=_redact(cfg.redis_url),
            metrics_port=self.metrics_port,
            max_num_seqs=self.engine.scheduler_config.max_num_seqs,
            kv_blocks=self.engine.kv.num_blocks,
        )
        await self.stopping.wait()
        if arq_worker is not None:
            # Jobs still waiting are retried by arq elsewhere; they resubmit the same request id,
            # so they follow the request already running instead of starting it again.
            await arq_worker.close()
        tasks[1].cancel()  # intake: stop pulling first
        for t in tasks[4:5]:  # and stop reclaiming
            t.cancel()
        rc = 0
        if self._engine_error is not None:
            self.log.error("engine failed", error=repr(self._engine_error))
            rc = 1
        else:
            await self._drain()
        await self._handover()
        self._engine_stop.set()
        self._engine_wake.set()
        engine_thread.join(timeout=10)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self.redis.zrem(keys.heartbeats(self.model), self.consumer)
            await self.redis.delete(keys.worker_state(self.model, self.consumer))
        except REDIS_DOWN:
            pass
        await self.redis.aclose()
        await self.blocking_redis.aclose()
        self.log.info("worker stopped", exit_code=rc)
        return rc

    async def _summary(self) -> None:
        self.control.summary(self.kv_stats)

    def stop(self) -> None:
        if not self.stopping.is_set():
            self.log.info(
                "stopping: draining in-flight requests",
                in_flight=len(self.inflight),
                drain_timeout_s=self.config.drain_timeout,
            )
            self.stopping.set()

    def _start_arq(self, tasks: list[asyncio.Task]):
        from arq.worker import Worker

        from producer_sdk.arq_bridge import arq_worker_settings

        settings = arq_worker_settings(self.config.redis_url, self.model, self.config.arq_queue)
        arq_worker = Worker(**settings, handle_signals=False)
        tasks.append(asyncio.create_task(arq_worker.async_run(), name="arq"))
        self.log.info("serving arq queue", queue=self.config.arq_queue)
        return arq_worker

    async def _connect(self) -> None:
        delay = 0.1
        while True:
            try:
                await self.intake.ensure_groups()
                cfg = {"max_model_len": self.engine.max_model_len, "block_size": self.engine.kv.block_size}
                if self.config.max_queue_len:
                    cfg["max_queue_len"] = self.config.max_queue_len
                await self.redis.hset(keys.config(self.model), mapping=cfg)
                return
            except REDIS_DOWN as e:
                self.log.warning("waiting for redis", error=str(e), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _guard(self, coro) -> None:
        """Intake survives Redis outages (and its own bugs, logged): restart it with backoff."""
        delay = 0.1
        while True:
            try:
                await coro
                return
            except REDIS_DOWN as e:
                self.metrics.labels(self.metrics.redis_errors).inc()
                self.log.warning("intake: redis unavailable", error=str(e), retry_in_s=delay)
            except Exception:
                self.log.exception("intake failed; restarting it", retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            coro = self.intake.run()

    async def _beat(self) -> None:
        await self.control.heartbeat()
        if self.config.max_queue_len:
            await self.redis.hset(keys.config(self.model), "max_queue_len", self.config.max_queue_len)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _handover(self) -> None:
        """Give what is still running to another worker: publish its tokens, release its entries."""
        if not self.inflight:
            return
        left = list(self.inflight.values())
        self.log.info("handing over unfinished requests", count=len(left))
        for rec in left:
            rec.handover = True
            self.engine.abort_request(rec.request_id)
        self.wake_engine()
        deadline = time.monotonic() + 10
        while self.inflight and time.monotonic() < deadline and self._engine_error is None:
            await asyncio.sleep(0.02)
        try:
            await self.publisher.wait_idle()
            await self.control.renew(HANDOVER_IDLE_MS, left)
        except REDIS_DOWN as e:
            self.log.warning(
                "handover: redis unavailable; entries will be reclaimed after the idle timeout", error=str(e)
            )


def _redact(url: str) -> str:
    """The URL without its password, for logs."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
