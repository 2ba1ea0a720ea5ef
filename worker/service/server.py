"""The worker process: the engine loop on its own thread, Redis I/O on asyncio beside it.

    engine thread:  step() back to back while there is work  --outputs-->  publisher
    asyncio tasks:  intake (reclaimed + new entries) --admission--> engine
                    publisher, cancels, ownership renewal, heartbeat, summary (all supervised)

The engine never waits for the network and the network never waits for a forward pass. Every
collaborator is built here: `__init__` reads as the list of them, each made by a `_build_*` method;
`run` connects, starts the named tasks and waits.
Shutdown (SIGTERM/SIGINT, or a dead task): stop pulling, let in-flight work finish for up to
`drain_timeout` (not after a failure), hand the rest over (its tokens so far are published, its
entry released for another worker to resume at once), and exit: 0 after a requested stop, 1 after a
failure, 3 after a wedged engine (watchdog.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time

import redis.asyncio as aioredis

from producer_sdk.contract import keys, steps
from producer_sdk.contract.connection import connect, redact_url, reply_parser
from worker.engine.engine import LLMEngine
from worker.service.admission import Admission
from worker.service.cancels import Cancels
from worker.service.closer import EntryCloser
from worker.service.config import ServiceConfig
from worker.service.engine_loop import EngineLoop
from worker.service.health import HealthServer
from worker.service.heartbeat import Heartbeat
from worker.service.inflight import InFlight, InFlightTable
from worker.service.intake import INTAKE_BLOCK_MS, Intake
from worker.service.logging import get_logger
from worker.service.metrics import WorkerMetrics
from worker.service.ownership import Ownership
from worker.service.publisher import Publisher, PublisherHooks
from worker.service.retention import Retention
from worker.service.retry import REDIS_DOWN, Backoff
from worker.service.supervisor import Supervisor, every
from worker.service.tracing import make_tracer
from worker.service.watchdog import STALL_EXIT_CODE, StallWatchdog

HANDOVER_WAIT_S = 10.0


class WorkerService:
    def __init__(self, engine: LLMEngine, config: ServiceConfig, metrics: WorkerMetrics | None = None) -> None:
        cfg = config
        self.engine, self.config = engine, config
        self.model = cfg.model_name
        self.consumer = cfg.consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = metrics or WorkerMetrics(self.model, max_tenant_labels=cfg.max_tenant_labels)
        self.log = get_logger("pagedq.worker", worker=self.consumer, model=self.model)
        self.inflight: InFlightTable = {}
        self.stopping = asyncio.Event()
        self.failed = False
        self.stalled = False  # the watchdog found the engine wedged: exit STALL_EXIT_CODE
        self.metrics_port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._background: set[asyncio.Task] = set()
        default_headroom = max(1, engine.limits.max_num_seqs // 8)
        self.headroom = cfg.intake_headroom if cfg.intake_headroom is not None else default_headroom

        self.redis: aioredis.Redis = connect(cfg.redis_url, asyncio=True, socket_timeout=10.0)
        self.blocking_redis: aioredis.Redis = connect(
            cfg.redis_url, asyncio=True, socket_timeout=INTAKE_BLOCK_MS / 1000 + 10.0
        )
        self.tracer = make_tracer(cfg, **self._names)  # None unless tracing is configured
        retention = Retention(default_ms=cfg.result_ttl * 1000, max_ms=cfg.max_result_ttl * 1000)
        # Requests in: intake reads entries, admission starts them in the engine; ownership, the closer
        # and cancels keep each entry's claim, its end and its cancel.
        self.ownership = self._build_ownership()
        self.closer = self._build_closer(retention)
        self.cancels = self._build_cancels()
        self.admission = self._build_admission()
        self.intake = self._build_intake()
        self.admission.tenant_weight = self.intake.weights.get
        # Outputs out, and the duties that watch the worker.
        self.publisher = self._build_publisher(retention)
        self.heartbeat = self._build_heartbeat()
        self.engine_loop = EngineLoop(
            engine, self.metrics, on_outputs=self.publisher.put, on_step_failed=self._step_failed, on_fatal=self._fatal
        )
        self.watchdog = self._build_watchdog()
        self.supervisor = Supervisor(self.log, on_failure=self._task_failed)
        self.health = self._build_health()

    # --- construction: one builder per collaborator, in the order `__init__` wires them ----------------

    @property
    def _names(self) -> dict[str, str]:
        """Who this worker is, as most collaborators take it (keyword arguments)."""
        return {"model": self.model, "consumer": self.consumer}

    def _build_ownership(self) -> Ownership:
        return Ownership(
            self.redis,
            self.inflight,
            on_lost=self._on_lost,
            held=lambda: self.intake.held_entries(),
            on_held_lost=lambda keys: self.intake.drop_held(keys),
            **self._names,
        )

    def _build_closer(self, retention: Retention) -> EntryCloser:
        return EntryCloser(
            self.redis,
            group=keys.group(self.model),
            retention=retention,
            dead_letter_ttl_ms=self.config.dead_letter_ttl * 1000,
            metrics=self.metrics,
            release=self.ownership.hand_over_entries,
            **self._names,
        )

    def _build_cancels(self) -> Cancels:
        return Cancels(
            self.redis,
            self.inflight,
            abort=self.engine.abort_request,
            held=lambda: self.intake.held_request_ids(),
            on_held_cancel=lambda rid: self._spawn(self.intake.cancel_held(rid)),
            **self._names,
        )

    def _build_admission(self) -> Admission:
        cfg = self.config
        return Admission(
            self.redis,
            self.engine,
            self.inflight,
            self.closer,
            limits=cfg.limits,
            max_deliveries=cfg.max_deliveries,
            metrics=self.metrics,
            recently_cancelled=self.cancels.recently_cancelled,
            wake_engine=self.wake_engine,
            consumer=self.consumer,
            lease_ttl_ms=cfg.live_ttl * 1000,
            tracer=self.tracer,
        )

    def _build_intake(self) -> Intake:
        cfg = self.config
        window = cfg.fair_share_window if cfg.fair_share_window is not None else self.engine.limits.max_num_seqs // 4
        return Intake(
            self.redis,
            self.blocking_redis,
            self.admission,
            capacity=self.capacity,
            claim_idle_ms=cfg.claim_idle_ms,
            reclaim_interval_s=cfg.reclaim_interval_s,
            metrics=self.metrics,
            window=window,
            low_lane_room=self.low_lane_room,
            **self._names,
        )

    def _build_publisher(self, retention: Retention) -> Publisher:
        cfg = self.config
        hooks = PublisherHooks(
            on_done=self._on_done, on_lost=self._on_lease_lost, on_gap=self._on_gap, on_failed=self._on_failed
        )
        return Publisher(
            self.redis,
            self.inflight,
            hooks,
            group=keys.group(self.model),
            live_ttl_ms=cfg.live_ttl * 1000,
            retention=retention,
            wait_replicas=cfg.wait_replicas,
            wait_timeout_ms=cfg.wait_timeout_ms,
            stream_interval=cfg.stream_interval,
            metrics=self.metrics,
            tracer=self.tracer,
            **self._names,
        )

    def _build_heartbeat(self) -> Heartbeat:
        return Heartbeat(
            self.redis,
            self.engine,
            interval_s=self.config.heartbeat_interval_s,
            max_queue_len=self.config.max_queue_len,
            metrics=self.metrics,
            in_flight=lambda: len(self.inflight),
            draining=self.stopping.is_set,
            **self._names,
        )

    def _build_watchdog(self) -> StallWatchdog:
        return StallWatchdog(
            self.engine_loop.stalled_s,
            self.config.health_stall_s,
            self.config.health_stall_action,
            on_stall=self._on_stall,
            log=self.log,
            engine_thread=lambda: self.engine_loop.thread,
        )

    def _build_health(self) -> HealthServer:
        """/health, /ready and /metrics; the metrics read the engine's beat and health at scrape time, so
        /metrics tells what /health tells (and alerts can watch it)."""
        health = HealthServer(self.metrics.render, self._health, self._ready)
        self.metrics.labels(self.metrics.engine_stalled).set_function(self.engine_loop.stalled_s)
        self.metrics.labels(self.metrics.healthy).set_function(lambda: float(self._health()[0]))
        return health

    # --- capacity and callbacks ---------------------------------------------------------------

    def capacity(self) -> int:
        """Sequences this worker can take on now: free slots plus a little headroom. A request with
        n samples occupies n slots."""
        if self.stopping.is_set():
            return 0
        used = sum(rec.seats for rec in self.inflight.values())
        return self.engine.limits.max_num_seqs + self.headroom - used

    def low_lane_room(self) -> int:
        """Seats the low lane (batches) may still take: three quarters of the engine's, so that a batch
        queued in full never keeps the other lanes' requests waiting in Redis (the engine's
        --low-priority-max-seqs then decides how many of the batch's run beside them)."""
        seats = self.engine.limits.max_num_seqs
        limit = seats - max(1, seats // 4) if seats > 1 else seats
        return limit - sum(rec.seats for rec in self.inflight.values() if rec.lane == "low")

    def wake_engine(self) -> None:
        self.engine_loop.wake()

    def _on_done(self, rec: InFlight) -> None:
        self.intake.capacity_changed.set()

    def _on_lost(self, rec: InFlight) -> None:
        if self.inflight.get(rec.request_id) is rec:
            self.inflight.pop(rec.request_id)
        rec.lost = True
        self.engine.abort_request(rec.request_id)
        self.intake.capacity_changed.set()

    def _on_lease_lost(self, rec: InFlight) -> None:
        """Another attempt holds the request's lease (this one stops), or the lease is gone (Redis lost
        it): the entry is released too, fenced on its ownership, so that in the second case the next
        claim resumes the request at once instead of after the claim timeout."""
        self.log.warning("request lease held by another attempt or gone; stopping here", request_id=rec.request_id)
        self._on_lost(rec)
        self._spawn(self.ownership.hand_over([rec]))

    def _on_gap(self, rec: InFlight, last_seq: int) -> None:
        """The response stream holds less than this worker wrote (Redis lost writes in a failover):
        end this attempt and release the entry, so a new one resumes from what the stream holds."""
        self.log.error(
            "response stream lost events; restarting the request", request_id=rec.request_id, last_seq=last_seq
        )
        self._on_lost(rec)
        self._spawn(self.ownership.hand_over([rec]))

    def _on_failed(self, rec: InFlight, error: BaseException) -> None:
        """Redis refuses this request's writes for good (say its stream key holds another type)."""
        self._on_lost(rec)
        msg = f"the response stream cannot be written: {type(error).__name__}: {error}"
        self._spawn(self.closer.refuse(rec.entry(), rec.request_id, "stream_unwritable", msg, seq=None))

    def _spawn(self, coro) -> None:
        """A one-off Redis step for one request; it retries transient errors itself, and a failure
        of another kind fails the worker like a dead duty would."""
        task = asyncio.create_task(coro)
        self._background.add(task)

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.log.error("request step failed", error=repr(t.exception()), exc_info=t.exception())
                self._task_failed("request step", t.exception())

        task.add_done_callback(done)

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
                await self.admission.dead_letter(rec, "engine_error", msg)
                self.intake.capacity_changed.set()
                continue
            try:
                await self.admission.add_to_engine(rec, isolated=True)
            except Exception as e:
                self.inflight.pop(rid, None)
                await self.admission.dead_letter(rec, "engine_error", f"cannot retry: {e}")
                self.intake.capacity_changed.set()
        self.wake_engine()

    def _fatal(self, error: BaseException) -> None:
        self.log.error("engine failed", error=repr(error))
        self._task_failed("engine", error)

    def _task_failed(self, name: str, error: BaseException | None) -> None:
        self.failed = True
        self.stopping.set()

    def _on_stall(self, stalled_s: float) -> None:
        """From the watchdog thread: stop as after a failure; the engine cannot finish anything now."""
        loop = self._loop

        def fail() -> None:
            self.stalled = True
            self._task_failed("engine", None)

        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fail)

    # --- health -------------------------------------------------------------------------------

    def _health(self) -> tuple[bool, dict]:
        stalled_s = round(self.engine_loop.stalled_s(), 1)
        ok = self.engine_loop.alive and stalled_s <= self.config.health_stall_s and not self.failed
        return ok, {
            "engine_alive": self.engine_loop.alive,
            "engine_beat_age_s": stalled_s,
            "failed": self.failed,
            "stalled": self.stalled,
        }

    def _ready(self) -> tuple[bool, dict]:
        last = self.heartbeat.last_ok
        redis_age = None if last is None else round(time.monotonic() - last, 1)
        redis_ok = redis_age is not None and redis_age <= 3 * self.config.heartbeat_interval_s + 1
        draining = self.stopping.is_set()
        return self.engine_loop.alive and redis_ok and not draining, {
            "model_loaded": True,
            "redis_ok": redis_ok,
            "redis_age_s": redis_age,
            "draining": draining,
        }

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self, *, install_signal_handlers: bool = True) -> int:
        cfg = self.config
        loop = self._loop = asyncio.get_running_loop()
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        if cfg.metrics_port is not None:
            self.metrics_port = self.health.start(cfg.metrics_port)
        # The engine loop runs before the first heartbeat: a worker that others can see is live.
        self.engine_loop.start(loop)
        self.watchdog.start()
        await self._connect()
        sup, log = self.supervisor, self.log
        sup.start("publisher", self.publisher.run())
        sup.start("intake", self.intake.run())
        sup.start("cancels", self.cancels.listen())
        sup.start("cancel-sweep", every(2.0, self.cancels.sweep, log, "cancel sweep"))
        sup.start("renew", every(cfg.renew_interval_s, self.ownership.renew, log, "renew"))
        sup.start("heartbeat", every(cfg.heartbeat_interval_s, self.heartbeat.beat, log, "heartbeat"))
        sup.start("summary", every(cfg.summary_interval_s, self.heartbeat.summary, log, "summary"))
        arq_worker = self._start_arq() if cfg.arq_queue else None
        lim = self.engine.limits
        log.info(
            "worker started",
            redis=redact_url(cfg.redis_url),
            redis_parser=reply_parser(),
            metrics_port=self.metrics_port,
            max_num_seqs=lim.max_num_seqs,
            kv_blocks=lim.num_kv_blocks,
            tracing=self.tracer is not None,
        )
        await self.stopping.wait()
        if arq_worker is not None:
            # Jobs still waiting are retried by arq elsewhere; they resubmit the same request id,
            # so they follow the request already running instead of starting it again.
            await arq_worker.close()
        self.intake.stop()  # stop pulling first, between two reads
        await sup.finish("intake", timeout=self.intake.block_ms / 1000 + 2.0)
        await self._hand_over_held()
        if not self.failed:
            await self._drain()
        await self._hand_over()
        self.engine_loop.stop(timeout=1.0 if self.stalled else 10.0)  # a wedged thread never joins
        await sup.cancel()
        for t in list(self._background):
            t.cancel()
        with contextlib.suppress(REDIS_DOWN):
            await self.heartbeat.leave()
        self.admission.close()
        self.health.stop()
        await self.redis.aclose()
        await self.blocking_redis.aclose()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # exports the spans still buffered
        rc = STALL_EXIT_CODE if self.stalled else 1 if self.failed else 0
        log.info("worker stopped", exit_code=rc)
        self.watchdog.stop()  # its deadline covered the shutdown of a wedged worker up to here
        return rc

    def stop(self) -> None:
        if not self.stopping.is_set():
            self.log.info(
                "stopping: draining in-flight requests",
                in_flight=len(self.inflight),
                drain_timeout_s=self.config.drain_timeout,
            )
            self.stopping.set()

    async def _connect(self) -> None:
        backoff = Backoff(base_s=0.1, max_s=5.0)
        while True:
            try:
                await steps.load(self.redis)  # on every primary of a cluster
                await self.intake.ensure_groups()
                await self.heartbeat.publish_config()
                await self.heartbeat.beat()
                return
            except REDIS_DOWN as e:
                delay = backoff.next()
                self.log.warning("waiting for redis", error=str(e), retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)

    def _start_arq(self):
        from arq.worker import Worker

        from producer_sdk.arq_bridge import arq_worker_settings

        settings = arq_worker_settings(self.config.redis_url, self.model, self.config.arq_queue)
        arq_worker = Worker(**settings, handle_signals=False)
        self.supervisor.start("arq", arq_worker.async_run())
        self.log.info("serving arq queue", queue=self.config.arq_queue)
        return arq_worker

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _hand_over_held(self) -> None:
        """Entries read for fair share and never admitted go back at once: another worker's next
        claim takes them (as a dead worker's, one more delivery counted)."""
        held = self.intake.release_held(set(self.inflight))
        if not held:
            return
        self.log.info("handing over held entries", count=len(held))
        try:
            await self.ownership.hand_over_entries(held)
        except REDIS_DOWN as e:
            self.log.warning("held entries not handed over; reclaimed after the idle timeout", error=str(e))

    async def _hand_over(self) -> None:
        """Give what is still running to another worker: publish its tokens, release its entries."""
        if not self.inflight:
            return
        left = list(self.inflight.values())
        self.log.info("handing over unfinished requests", count=len(left))
        for rec in left:
            rec.handover = True
            self.engine.abort_request(rec.request_id)
        self.wake_engine()
        deadline = time.monotonic() + HANDOVER_WAIT_S
        publishing = "publisher" in self.supervisor.tasks
        engine_ok = lambda: self.engine_loop.error is None and not self.stalled  # a wedged engine aborts nothing
        while publishing and self.inflight and time.monotonic() < deadline and engine_ok():
            await asyncio.sleep(0.02)
        try:
            if publishing:
                await asyncio.wait_for(self.publisher.wait_idle(), HANDOVER_WAIT_S)
            await self.ownership.hand_over(left)
        except (*REDIS_DOWN, asyncio.TimeoutError) as e:
            self.log.warning("handover incomplete; entries will be reclaimed after the idle timeout", error=str(e))
