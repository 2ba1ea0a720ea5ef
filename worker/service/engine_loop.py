"""The engine thread: `engine.step()` back to back while there is work.

It never waits for the network: outputs go to the event loop with `call_soon_threadsafe`. A step
that fails is reported with its requests (the service retries each alone, the poison one ends in the
dead letters); anything else that escapes is fatal and stops the worker. `beat` is refreshed on
every pass, idle or busy, so a wedged forward shows as a stale beat (/health, and the watchdog that
ends a wedged worker: watchdog.py).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable

from worker.engine.engine import LLMEngine, StepFailed
from worker.engine.omp_pool import release_calling_thread_pool
from worker.engine.outputs import RequestOutput
from worker.service.metrics import WorkerMetrics

IDLE_WAIT_S = 0.05
# Fault injection for the chaos tests (off unless set): each step takes at least this long, so a
# scenario can be sure requests are still mid-generation when it strikes.
_STEP_DELAY_S = float(os.environ.get("PAGEDQ_FAULT_STEP_DELAY_S", "0") or 0)
# Fault injection for the health tests (off unless set): after this many steps the engine thread
# blocks for good, as a forward that never returns would.
_WEDGE_AFTER_STEPS = int(os.environ.get("PAGEDQ_FAULT_WEDGE_AFTER_STEPS", "0") or 0)


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        metrics: WorkerMetrics,
        *,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_step_failed: Callable[[list[str], str], None],
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.on_outputs, self.on_step_failed, self.on_fatal = on_outputs, on_step_failed, on_fatal
        self.error: BaseException | None = None
        self.beat = time.monotonic()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen = engine.snapshot()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        # The model was loaded and warmed on this thread: free its OpenMP helpers, so the engine
        # thread's are the only ones and keep spinning between parallel regions (omp_pool.py).
        release_calling_thread_pool()
        self.beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(loop,), name="engine", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stalled_s(self) -> float:
        """Seconds since the running loop last passed through (idle or stepping). 0 once it was asked to
        stop, so a worker shutting down on purpose never reads as wedged, and 0 once the thread ended
        (a failure of its own, reported through `on_fatal`)."""
        if self._stop.is_set() or (self._thread is not None and not self._thread.is_alive()):
            return 0.0
        return max(0.0, time.monotonic() - self.beat)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        eng = self.engine
        steps = 0
        try:
            while not self._stop.is_set():
                self.beat = time.monotonic()
                if not eng.has_unfinished_requests():
                    self._record()
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                if _WEDGE_AFTER_STEPS and steps >= _WEDGE_AFTER_STEPS:
                    threading.Event().wait()  # fault injection: wedged for good (only os._exit ends it)
                steps += 1
                try:
                    outputs = eng.step()
                except StepFailed as e:
                    eng.discard(e.request_ids)
                    if e.outputs:
                        loop.call_soon_threadsafe(self.on_outputs, e.outputs)
                    loop.call_soon_threadsafe(self.on_step_failed, e.request_ids, repr(e.__cause__))
                    continue
                self._record()
                if outputs:
                    loop.call_soon_threadsafe(self.on_outputs, outputs)
                if _STEP_DELAY_S:
                    time.sleep(_STEP_DELAY_S)
        except BaseException as e:  # not a request's fault: stop serving, hand everything over
            self.error = e
            loop.call_soon_threadsafe(self.on_fatal, e)

    def _record(self) -> None:
        """Metrics from the snapshot the engine built after its step: counter deltas, gauges."""
        snap, before, m = self.engine.snapshot(), self._seen, self.metrics
        if snap is before:
            return
        self._seen = snap
        for metric, now, then in (
            (m.prompt_tokens, snap.prompt_tokens, before.prompt_tokens),
            (m.generation_tokens, snap.generation_tokens, before.generation_tokens),
            (m.preemptions, snap.num_preemptions, before.num_preemptions),
            (m.prefix_queries, snap.prefix_queries_tokens, before.prefix_queries_tokens),
            (m.prefix_hits, snap.prefix_hits_tokens, before.prefix_hits_tokens),
        ):
            if now > then:
                m.labels(metric).inc(now - then)
        if snap.steps > before.steps and snap.last_step_tokens:
            m.labels(m.step_tokens).observe(snap.last_step_tokens)
            m.labels(m.step_seconds).observe(snap.last_step_seconds)
        m.labels(m.requests_running).set(snap.running)
        m.labels(m.requests_waiting).set(snap.waiting)
        m.labels(m.kv_usage).set(snap.kv_usage)
        m.labels(m.kv_waste).set(snap.kv_waste)
