"""Named background tasks, supervised: the first one to die stops the worker.

Each duty handles the failures it expects (Redis outages and transient errors, with backoff). An
exception that escapes a duty, or a duty that returns, is a failure the worker cannot reason about:
the supervisor logs it and calls `on_failure`, and the service then stops pulling, hands its work
over and exits non-zero, so that its own supervisor (systemd, Kubernetes, compose) restarts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from producer_sdk.contract.redis_errors import is_transient


class Supervisor:
    def __init__(self, log, on_failure: Callable[[str, BaseException | None], None]) -> None:
        self.log = log
        self.on_failure = on_failure
        self.tasks: dict[str, asyncio.Task] = {}
        self.failures: list[tuple[str, BaseException | None]] = []

    def start(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=name)
        self.tasks[name] = task
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        name = task.get_name()
        if task.cancelled() or self.tasks.get(name) is not task:
            return
        error = task.exception()
        self.failures.append((name, error))
        if error is not None:
            self.log.error("background task died", task=name, error=f"{type(error).__name__}: {error}", exc_info=error)
        else:
            self.log.error("background task ended unexpectedly", task=name)
        self.on_failure(name, error)

    async def finish(self, name: str, timeout: float) -> None:
        """Wait up to `timeout` seconds for a task told to stop (a flag it reads) to end by itself, then
        cancel it: a command cancelled half-way can leave a task hanging (redis-py's asyncio cluster
        client), one that ends between two commands never does."""
        task = self.tasks.pop(name, None)
        if task is None:
            return
        _, running = await asyncio.wait([task], timeout=timeout)
        if running:
            self.tasks[name] = task
            await self.cancel(name)

    async def cancel(self, *names: str, timeout: float = 5.0) -> None:
        """Cancel the named tasks (all when none is named) and wait for them to end, for at most
        `timeout` seconds: shutdown must not hang on a task stuck in a socket read."""
        tasks = [self.tasks.pop(n) for n in (names or list(self.tasks)) if n in self.tasks]
        for t in tasks:
            t.cancel()
        if not tasks:
            return
        _, stuck = await asyncio.wait(tasks, timeout=timeout)
        if stuck:
            self.log.warning("tasks did not stop in time", tasks=sorted(t.get_name() for t in stuck))


async def every(interval_s: float, duty: Callable[[], Awaitable[None]], log, what: str) -> None:
    """Run `duty` every `interval_s` seconds forever; a Redis outage or transient error is logged
    and tried again next time, anything else escapes (to the supervisor)."""
    while True:
        try:
            await duty()
        except Exception as e:
            if not is_transient(e):
                raise
            log.warning(f"{what}: redis unavailable", error=f"{type(e).__name__}: {e}")
        await asyncio.sleep(interval_s)
