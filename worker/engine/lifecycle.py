"""The engine's request lifecycle on its own thread: queued commands in, requests started (once their
grammar has compiled), resumed, expired, failed, finished and handed out.

`RequestLifecycle` is a part of `LLMEngine` (engine.py), kept apart so each file reads as one job:
engine.py runs the step (schedule -> execute -> update), this module moves requests in and out of it.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

import torch

from worker.engine.outputs import RequestOutput
from worker.engine.request import Request, SeqStatus, Sequence

if TYPE_CHECKING:
    from worker.engine.kv_cache import KVCacheManager
    from worker.engine.model_runner import ModelRunner
    from worker.engine.output_processor import OutputProcessor
    from worker.engine.scheduler import Scheduler
    from worker.engine.stats import EngineSnapshot, EngineStats, SnapshotMaker
    from worker.engine.structured import StructuredOutputManager


COMPILE_POLL_S = 0.01  # an idle engine waits this long for a compile per step


class RequestLifecycle:
    requests: dict[str, Request]
    scheduler: Scheduler
    kv: KVCacheManager
    runner: ModelRunner
    output_processor: OutputProcessor
    structured: StructuredOutputManager
    stats: EngineStats
    _compiling: list[Request]
    _inbox: queue.SimpleQueue
    _accepted: set[str]
    _snapshots: SnapshotMaker
    _snapshot: EngineSnapshot

    def discard(self, request_ids: Seq[str]) -> None:
        """Drop requests at once, silently (no output), freeing their blocks."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.finished:
                    self.scheduler.finish(seq, SeqStatus.FINISHED_ABORTED)
            self._accepted.discard(rid)
        self._snapshot = self._snapshots(len(self._accepted))

    # --- requests in: commands, grammars, resumes, deadlines --------------------------------

    def _apply_commands(self, outputs: dict[str, RequestOutput]) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                for req in arg:
                    try:
                        self._admit(req, outputs)
                    except Exception as e:  # a request that cannot even start must not stop the engine
                        req.error = f"request cannot start: {e!r}"
                        self.requests[req.request_id] = req
                        self._finish_request(req, SeqStatus.FINISHED_ABORTED, outputs)
            elif kind == "abort" and arg in self.requests:
                self._finish_request(self.requests[arg], SeqStatus.FINISHED_ABORTED, outputs)

    def _admit(self, req: Request, outputs: dict[str, RequestOutput]) -> None:
        self.requests[req.request_id] = req
        if req.grammar is not None:
            self._compiling.append(req)  # started by `_admit_compiled` once its grammar has compiled
            return
        self._start(req, outputs)

    def _admit_compiled(self, outputs: dict[str, RequestOutput]) -> None:
        """Requests whose grammar is ready start; those whose compile failed or timed out end."""
        waiting = []
        for req in self._compiling:
            if req.finished:  # aborted or expired while compiling
                continue
            status = self.structured.status(req)
            if status == "waiting":
                waiting.append(req)
            elif status == "ready":
                self._start(req, outputs)
            else:
                self._fail(req, status.code, str(status), outputs)
        self._compiling = waiting

    def _await_compiles(self) -> None:
        if self._compiling:
            wait([r.grammar for r in self._compiling], timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)

    def _start(self, req: Request, outputs: dict[str, RequestOutput]) -> None:
        if req.resume is not None:
            self._admit_resumed(req, outputs)
            return
        seq = req.seqs[0]
        self._equip(seq, req.sampling_params.seed)
        self.scheduler.add(seq)

    def _admit_resumed(self, req: Request, outputs: dict[str, RequestOutput]) -> None:
        """One sequence per sample, each holding the tokens already delivered (no fork: prefix caching
        shares what the samples have in common); a sample that had already stopped ends here."""
        req.forked = True
        req.seqs = []
        for k, delivered in enumerate(req.resume or []):
            seq = Sequence(f"{req.request_id}#{k}", req, list(req.prompt_token_ids), index=k)
            req.seqs.append(seq)
            self._equip(seq, sample_seed(req.sampling_params.seed, k))
            status = self.output_processor.replay(seq, delivered)
            if seq.matcher is not None and not self.structured.replay(seq, delivered):
                self._fail(req, "grammar_unsatisfiable", "the delivered tokens do not follow the grammar", outputs)
                return
            if status is None:
                self.scheduler.add(seq)
            else:
                seq.status = status
                self.output_processor.flush(seq)
        if req.finished:
            self._emit(req, outputs)
            self._retire(req)

    def _equip(self, seq: Sequence, seed: int | None) -> None:
        self.output_processor.attach_detokenizer(seq)
        if seq.request.grammar is not None:
            self.structured.attach(seq)
        if seed is not None:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(seed)

    def _fail_unschedulable(self, outputs: dict[str, RequestOutput]) -> None:
        """Nothing runs, yet the head of the queue was not admitted: it can never fit the KV pool."""
        if self.scheduler.running or not len(self.scheduler.waiting):
            return
        req = self.scheduler.waiting.peek().request
        need = -(-req.seqs[0].num_tokens // self.kv.block_size)
        req.error = (
            f"request needs {need} KV blocks but the pool has {self.kv.num_blocks} "
            f"({self.kv.watermark_blocks} held back): raise the KV cache size or lower max_tokens"
        )
        self._finish_request(req, SeqStatus.FINISHED_ABORTED, outputs)

    def _expire_deadlines(self, outputs: dict[str, RequestOutput]) -> None:
        now = time.time()
        for req in [r for r in self.requests.values() if r.deadline is not None and r.deadline <= now]:
            self._finish_request(req, SeqStatus.FINISHED_DEADLINE, outputs)

    # --- requests out ------------------------------------------------------------------------

    def _fail(self, req: Request, code: str, message: str, outputs: dict[str, RequestOutput]) -> None:
        """End one request with a typed error (an aborted finish carrying `error`)."""
        req.error, req.error_code = message, code
        self._finish_request(req, SeqStatus.FINISHED_ABORTED, outputs)

    def _finish_request(self, req: Request, status: SeqStatus, outputs: dict[str, RequestOutput]) -> None:
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, status)
                self.output_processor.flush(seq)
        self._emit(req, outputs)
        self._retire(req)

    def _retire(self, req: Request) -> None:
        req.metrics.finished = time.time()
        for seq in req.seqs:
            reason = seq.status.finish_reason or "abort"
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        self.requests.pop(req.request_id, None)
        self._accepted.discard(req.request_id)

    def _emit(self, req: Request, outputs: dict[str, RequestOutput]) -> None:
        outputs[req.request_id] = self.output_processor.make_output(req, outputs.get(req.request_id))


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index` of a seeded request draws from its own generator (kept in 64 bits)."""
    return None if seed is None else (seed + index) % 2**64
