"""The worker's event loop runner: it returns main's result and exits past a task that ignores its
cancellation (as one stuck in a cancelled Redis Cluster read)."""

from __future__ import annotations

import asyncio
import time

from worker.service.runner import run_to_exit


def test_a_task_that_will_not_end_is_abandoned_and_main_returns():
    ended, tasks = [], []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue  # ignores it, as a read that waits on after its cancel

    async def polite() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            ended.append("polite")

    async def main() -> int:
        tasks.extend([asyncio.create_task(stubborn(), name="stubborn"), asyncio.create_task(polite(), name="polite")])
        await asyncio.sleep(0)
        return 7

    t0 = time.monotonic()
    assert run_to_exit(main(), abandon_after_s=0.2) == 7
    assert time.monotonic() - t0 < 2 and ended == ["polite"]  # cancelled and waited for; the other abandoned
