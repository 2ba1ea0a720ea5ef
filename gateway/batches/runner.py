"""The batch runner: a task in every gateway process that drives unfinished batches.

Every `poll` it looks at the set of unfinished batches (`keys.batches_active`) and claims each one
nobody holds with a lease (SET NX PX `--batch-lease`, renewed every third of it while it works). Once
claimed, a batch is validated (`validating` -> `in_progress`), its lines are submitted through the SDK
(`AsyncClient.run_batch`: the low lane, deterministic request ids, `--batch-window` in flight) and each
result is stored once per line, and it is finalized (`finalizing` -> `completed`, or `cancelled` /
`expired`): the output and error files are written from the stored results and the counts set from
them. A gateway that crashes loses nothing: after its lease expires another gateway (or itself,
restarted) claims the batch, skips the lines stored, and resubmits the others under their request
ids, which attaches to the requests already queued, running or finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from typing import Any

from gateway import errors
from gateway.batches import lines as L
from gateway.batches.files import BATCH_OUTPUT, FileStore
from gateway.batches.store import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    ERR,
    EXPIRED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    OK,
    TERMINAL,
    VALIDATING,
    BatchStore,
    LeaseLost,
)
from producer_sdk.batch import BatchItem, batch_request_id
from producer_sdk.errors import Cancelled
from producer_sdk.results import Completion

log = logging.getLogger("pagedq.gateway.batches")
WATCH_S = 0.25  # how often a running batch's status is read (a cancel is seen within this)
MAX_DRIVE_FAILURES = 5  # tries (a lease apart) before a batch that keeps failing is failed


def result_file_id(batch_id: str, which: str) -> str:
    """The id of a batch's output or error file: fixed, so that finalizing twice writes one file."""
    return "file-" + hashlib.sha256(f"{batch_id}\x00{which}".encode()).hexdigest()[:32]


class BatchRunner:
    def __init__(self, gw: Any, store: BatchStore, files: FileStore) -> None:
        self.gw, self.store, self.files = gw, store, files
        self._driving: dict[str, asyncio.Task[None]] = {}
        self._wake: asyncio.Event | None = None

    @property
    def lease_ms(self) -> int:
        return max(100, int(self.gw.config.batch_lease_s * 1000))

    @property
    def poll_s(self) -> float:
        return min(1.0, self.gw.config.batch_lease_s / 4)

    def poke(self) -> None:
        """Look for work now (a batch was created or cancelled here)."""
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        self._wake = asyncio.Event()
        while True:
            try:
                await self.claim()
            except Exception as e:  # Redis away: try again at the next tick
                log.warning("batch runner: %s: %s", type(e).__name__, e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()

    async def close(self) -> None:
        tasks = list(self._driving.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def claim(self) -> None:
        for bid in await self.store.active():
            if bid in self._driving:
                continue
            token = uuid.uuid4().hex
            if await self.store.acquire(bid, token, self.lease_ms):
                self._driving[bid] = asyncio.create_task(self._hold(bid, token))

    async def _hold(self, bid: str, token: str) -> None:
        """Drive the batch while renewing its lease; stop when the lease is lost."""
        work = asyncio.create_task(self.drive(bid, token))
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=self.lease_ms / 3000)
                if work.done():
                    break
                try:
                    held = await self.store.renew(bid, token, self.lease_ms)
                except Exception as e:
                    log.warning("batch %s: could not renew its lease: %s", bid, e)
                    continue
                if not held:
                    log.warning("batch %s: lease lost; another gateway drives it now", bid)
                    work.cancel()
            await work
        except (asyncio.CancelledError, LeaseLost):
            work.cancel()
            if not work.done():
                raise
        except Exception as e:
            log.exception("batch %s: stopped (another claim will resume it after its lease)", bid)
            # Keep the lease (it lapses: the next try waits a lease), and give up after a few tries.
            with contextlib.suppress(Exception):
                if await self.store.count_failure(bid) >= MAX_DRIVE_FAILURES:
                    await self._give_up(bid, e)
            self._driving.pop(bid, None)
            return
        self._driving.pop(bid, None)
        with contextlib.suppress(Exception):
            await self.store.release(bid, token)

    async def _give_up(self, bid: str, error: Exception) -> None:
        """Fail a batch that failed to run MAX_DRIVE_FAILURES times (its results so far are lost)."""
        problem = {
            "code": "batch_failed",
            "message": f"The batch failed {MAX_DRIVE_FAILURES} times ({type(error).__name__}; see the gateway's log).",
        }
        now = int(time.time())
        came_from = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)
        if await self.store.transition(
            bid, FAILED, came_from, failed_at=now, errors={"object": "list", "data": [problem]}
        ):
            await self.store.finish(bid)

    # --- one batch --------------------------------------------------------------------------------

    async def drive(self, bid: str, token: str) -> None:
        raw = await self.store.raw(bid)
        if "m" not in raw or raw["status"].decode() in TERMINAL:
            await self.store.finish(bid)
            return
        meta = json.loads(raw["m"])
        status = raw["status"].decode()
        if status == FINALIZING:
            await self.finalize(bid, meta)
            return
        if status in (VALIDATING, IN_PROGRESS) and not self._expired(meta):
            parsed = await self._lines(bid, meta)
            if parsed is None:
                return
            lines, model = parsed
            if status == VALIDATING:
                await self.store.transition(
                    bid,
                    IN_PROGRESS,
                    (VALIDATING,),
                    in_progress_at=int(time.time()),
                    total=len(lines),
                    model=model or "",  # (shown as null)
                )
            if (await self.store.raw(bid))["status"].decode() == IN_PROGRESS:
                await self.run_lines(bid, token, meta, lines, model)
        await self.finalize(bid, meta)

    def _expired(self, meta: dict[str, Any]) -> bool:
        return time.time() >= meta["expires_at"]

    async def _lines(self, bid: str, meta: dict[str, Any]) -> tuple[list[L.Line], str | None] | None:
        """The batch's checked lines; None when the batch failed (its file is gone or refused)."""
        tenant = meta["tenant"]
        try:
            data = await self.files.content(tenant, meta["input_file_id"])
            with contextlib.suppress(Exception):
                await self.gw.registry._fresh_if_stale()
            served = frozenset(self.gw.registry.models)  # a snapshot: the parse runs in a thread
            refuse = lambda model: self._refuse_model(meta, model, served)
            # Seconds for a large file: off the event loop, which serves streams and renews leases.
            return await asyncio.to_thread(L.parse, data, meta["endpoint"], tenant, refuse)
        except errors.ApiError:
            problem = L.FileProblem("input_file_missing", f"The input file {meta['input_file_id']} was deleted.")
        except L.FileProblem as p:
            problem = p
        now = int(time.time())
        came_from = (VALIDATING, IN_PROGRESS)
        if await self.store.transition(
            bid, FAILED, came_from, failed_at=now, errors={"object": "list", "data": [problem.error()]}
        ):
            await self.store.finish(bid)
        return None

    @staticmethod
    def _refuse_model(meta: dict[str, Any], model: str, served: frozenset[str]) -> errors.ApiError | None:
        allowed = meta["models"]
        if allowed is not None and model not in allowed:
            return errors.model_not_found(model, sorted(served & set(allowed)))
        if model not in served:
            return errors.model_not_found(model, sorted(served))
        return None

    async def run_lines(
        self, bid: str, token: str, meta: dict[str, Any], lines: list[L.Line], model: str | None
    ) -> None:
        stored = await self.store.stored_indexes(bid)
        for line in lines:
            if not line.ok and line.index not in stored:
                await self.store.store(bid, token, line.index, False, L.refusal_line(bid, line))
        todo = [line for line in lines if line.ok and line.index not in stored]
        if not todo or model is None:
            return
        by_id = {line.custom_id: line for line in todo}
        items = [BatchItem(line.custom_id, line.prepared.submit, line.index) for line in todo]  # type: ignore[union-attr]
        run = self.gw.client(model).run_batch(items, batch_id=bid, window=self.gw.config.batch_window)
        watcher = asyncio.create_task(self._watch(bid, meta, run))
        try:
            async for custom_id, outcome in run:
                line = by_id[custom_id]
                rid = batch_request_id(bid, line.index)
                if isinstance(outcome, Completion):
                    try:
                        body = line.prepared.render(rid, outcome)  # type: ignore[union-attr]
                    except Exception as e:  # this line's failure, not the batch's
                        log.exception("batch %s: line %d could not be rendered", bid, line.index)
                        err = L.error_line(bid, line, "render_failed", f"{type(e).__name__}: {e}", request_id=rid)
                        await self.store.store(bid, token, line.index, False, err)
                        continue
                    await self.store.store(
                        bid, token, line.index, True, L.output_line(bid, line.index, custom_id, rid, body)
                    )
                elif isinstance(outcome, Cancelled):
                    if not run.cancelled:  # cancelled by someone else than this batch
                        err = L.error_line(bid, line, "request_cancelled", "The request was cancelled.", request_id=rid)
                        await self.store.store(bid, token, line.index, False, err)
                else:
                    p = line.prepared
                    api = errors.from_sdk(outcome, param_of=p.param_of, failure_param=p.failure_param)  # type: ignore[union-attr]
                    err = L.error_line(bid, line, api.body.code or "error", api.body.message, request_id=rid, api=api)
                    await self.store.store(bid, token, line.index, False, err)
        finally:
            watcher.cancel()

    async def _watch(self, bid: str, meta: dict[str, Any], run: Any) -> None:
        """Cancel the run when the batch is cancelled or expires."""
        while True:
            await asyncio.sleep(WATCH_S)
            with contextlib.suppress(Exception):
                status = (await self.store.raw(bid)).get("status", b"").decode()
                if status == CANCELLING or self._expired(meta):
                    await run.cancel()
                    return

    async def finalize(self, bid: str, meta: dict[str, Any]) -> None:
        """Write the output and error files from the stored results, set the counts from them and the
        final status. Idempotent: a crash part-way and a second call write the same files."""
        now = int(time.time())
        status = (await self.store.raw(bid))["status"].decode()
        if status == IN_PROGRESS and not self._expired(meta):
            await self.store.transition(bid, FINALIZING, (IN_PROGRESS,), finalizing_at=now)
            status = (await self.store.raw(bid))["status"].decode()
        if status in TERMINAL:
            await self.store.finish(bid)
            return
        target = {FINALIZING: COMPLETED, CANCELLING: CANCELLED}.get(status, EXPIRED)
        results = await self.store.results(bid)
        ok = [v[1:] for _, v in sorted(results.items()) if v[:1] == OK]
        failed = [v[1:] for _, v in sorted(results.items()) if v[:1] == ERR]
        tenant = meta["tenant"]
        out_id = err_id = ""
        if ok:
            out_id = result_file_id(bid, "output")
            data = b"\n".join(ok) + b"\n"
            await self.files.create(tenant, f"{bid}_output.jsonl", BATCH_OUTPUT, data, file_id=out_id)
        if failed:
            err_id = result_file_id(bid, "error")
            data = b"\n".join(failed) + b"\n"
            await self.files.create(tenant, f"{bid}_error.jsonl", BATCH_OUTPUT, data, file_id=err_id)
        fields = {f"{target}_at": now, "output_file_id": out_id, "error_file_id": err_id}
        if await self.store.transition(bid, target, (status,), completed=len(ok), failed=len(failed), **fields):
            await self.store.drop_results(bid)
            await self.store.finish(bid)
