"""Ends a worker whose engine is wedged, so that Docker or Kubernetes restarts it.

/health turns 503 once the engine thread has not passed through its loop for `--health-stall-s`, but
plain Docker does not restart an unhealthy container (`restart:` acts on exit only), and a worker
that keeps answering /metrics would sit there holding its requests. So a thread of its own watches
the engine's beat; the engine thread cannot notice (it is the one stuck inside a forward) and the
event loop might be the next thing to hang. Once the stall passes `--health-stall-s`, the watchdog
logs how long the engine has been stalled, with the engine thread's stack, and then:

- `exit` (default): asks the service to stop as after a failure (stop pulling, hand the requests over
  so another worker resumes them at once, exit with `STALL_EXIT_CODE`); if the process has not ended
  `grace_s` later, it ends it with `os._exit`, which needs nothing from the stuck threads;
- `report`: only logs (once per stall; /health and the metrics show it), for a supervisor that acts
  on /health itself.

The kernels and torch release the GIL inside a forward, so this thread keeps running while the engine
thread is stuck there.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STALL_ACTIONS = ("exit", "report")
STALL_EXIT_CODE = 3  # a wedged engine: distinct from 1 (a failed duty) in `docker ps` and pod status
EXIT_GRACE_S = 30.0  # handing over takes a few seconds; past this the process ends regardless


@dataclass
class StallWatchdog:
    stalled_s: Callable[[], float]  # seconds since the engine loop last passed through (0: stopping)
    stall_s: float  # --health-stall-s
    action: str  # "exit" | "report"
    on_stall: Callable[[float], None]  # asks the service to stop; called from the watchdog thread
    log: Any  # a bound structlog logger
    engine_thread: Callable[[], threading.Thread | None] = lambda: None
    grace_s: float = EXIT_GRACE_S
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.action not in STALL_ACTIONS:
            raise ValueError(f"unknown stall action {self.action!r}; choose from {STALL_ACTIONS}")

    @property
    def interval_s(self) -> float:
        """How often the beat is looked at: a stall is noticed at most this long after it passes stall_s."""
        return min(1.0, max(0.05, self.stall_s / 4))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        reported = False
        while not self._stop.wait(self.interval_s):
            stalled = self.stalled_s()
            if stalled <= self.stall_s:
                if reported:
                    self.log.warning("engine progressing again", stalled_s=round(stalled, 1))
                reported = False
                continue
            if reported:
                continue
            reported = True
            self._report(stalled)
            if self.action == "exit":
                self.on_stall(stalled)
                if not self._stop.wait(self.grace_s):
                    self._exit_now()
                return

    def _report(self, stalled: float) -> None:
        then = (
            f"exiting with status {STALL_EXIT_CODE} so that the worker is restarted; its requests are handed over"
            if self.action == "exit"
            else "reporting only (--health-stall-action report): /health answers 503"
        )
        self.log.error(
            f"engine stalled for {stalled:.1f} s, longer than --health-stall-s {self.stall_s:g}: {then}",
            stalled_s=round(stalled, 1),
            health_stall_s=self.stall_s,
            action=self.action,
            engine_stack=self._engine_stack(),
        )

    def _engine_stack(self) -> str | None:
        """Where the engine thread is stuck (the innermost frames), for the log line."""
        thread = self.engine_thread()
        frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident else None
        return "".join(traceback.format_stack(frame, limit=12)) if frame is not None else None

    def _exit_now(self) -> None:
        self.log.error(
            f"the worker did not stop within {self.grace_s:g} s of the stall; exiting now",
            exit_code=STALL_EXIT_CODE,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STALL_EXIT_CODE)
