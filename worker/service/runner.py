"""Running the worker's event loop to the end, and then exiting whatever a stuck task does."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from worker.service.logging import get_logger

T = TypeVar("T")
ABANDON_AFTER_S = 5.0


def run_to_exit(main: Coroutine[Any, Any, T], abandon_after_s: float = ABANDON_AFTER_S) -> T:
    """`asyncio.run(main)`, but the tasks still running when `main` returns get `abandon_after_s` seconds
    to end once cancelled, and are then abandoned instead of waited for: a read cancelled on a Redis
    Cluster connection can hang (redis-py's asyncio cluster client), and a stopping worker must exit."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                _, stuck = loop.run_until_complete(asyncio.wait(tasks, timeout=abandon_after_s))
                if stuck:
                    names = sorted(t.get_name() for t in stuck)
                    get_logger("pagedq.worker").warning("tasks abandoned at exit", tasks=names)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
