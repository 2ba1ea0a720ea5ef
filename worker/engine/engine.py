"""LLMEngine: requests in, one scheduled forward per `step()`, outputs out.

One step reads as schedule -> execute -> update: the `Scheduler` (scheduler.py) picks the sequences
and their token counts and hands over their block tables, the `ModelRunner` (model_runner.py) runs
one forward over that batch and samples, and the `OutputProcessor` (output_processor.py) appends the
tokens, applies the stops and builds the outputs. Prompts become requests in input_processor.py.
This file holds the whole engine: construction (its parts built by builders.py), requests in, the
step, and requests moving in and out of the engine thread's state (a grammar-constrained request
waits until its grammar has compiled, see structured/).

Thread model: `add_request` / `abort_request` may be called from any thread (they tokenize on the
caller's thread and queue a command), and so may `prepare_request` / `add_prepared` (the same add in
two halves, so that a burst joins as one command: no step sees part of it), `snapshot()` and `limits`;
everything else, `step()` included, runs on one engine thread. Commands are applied at the start of
the next step, so an abort frees its blocks within one step.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

import torch

from worker.engine import builders
from worker.engine.config import EngineConfig
from worker.engine.errors import PromptTooLong, RequestError, StepFailed
from worker.engine.input_processor import find_eos_token_ids
from worker.engine.kv_cache import KVCacheManager
from worker.engine.model_runner import SampleRow
from worker.engine.output_processor import OutputProcessor
from worker.engine.outputs import RequestOutput
from worker.engine.request import Request, SeqStatus, Sequence
from worker.engine.sampler import SamplerOutput
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler, SchedulerOutput
from worker.engine.stats import EngineLimits, EngineSnapshot, EngineStats, SnapshotMaker
from worker.engine.structured import StructuredOutputManager
from worker.models.loader import load_model

COMPILE_POLL_S = 0.01  # an idle engine waits this long for a compile per step

__all__ = ["EngineLimits", "EngineSnapshot", "LLMEngine", "PromptTooLong", "RequestError", "StepFailed"]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **options) -> None:
        self.config = cfg = config or EngineConfig(**options)
        if not cfg.model:
            raise ValueError("EngineConfig.model is required")
        loaded = load_model(
            cfg.model, dtype=cfg.dtype, device=cfg.device, tokenizer=cfg.tokenizer, quantization=cfg.quantization
        )
        self.tokenizer = builders.build_tokenizer(cfg, loaded)
        self.max_model_len = builders.resolve_max_model_len(cfg, loaded)
        self.scheduler_config = builders.build_scheduler_config(cfg, loaded, self.max_model_len)
        self.eos_token_ids = find_eos_token_ids(loaded.tokenizer_path, loaded.config, self.tokenizer)
        self.runner = builders.build_model_runner(cfg, loaded, self.scheduler_config, self.eos_token_ids)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            cfg.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            watermark=cfg.watermark,
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        self.structured = StructuredOutputManager(
            self.tokenizer,
            vocab_size=self.runner.vocab_size,
            eos_token_ids=self.eos_token_ids,
            compile_timeout=cfg.grammar_compile_timeout,
        )
        self.runner.grammar = self.structured
        self.input_processor = builders.build_input_processor(
            cfg, loaded, self.tokenizer, self.max_model_len, self.structured
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len
        )
        self.limits = builders.build_limits(cfg, loaded, self.runner, self.scheduler_config)
        # Requests on the engine thread: admitted (by id), and those waiting for their grammar to compile.
        self.requests: dict[str, Request] = {}
        self._compiling: list[Request] = []
        # Requests from any thread: queued commands, and the ids added and not yet finished.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._accepted: set[str] = set()
        self._accepting = threading.Lock()  # one check-and-add of ids at a time
        self._auto_id = itertools.count()
        self.stats = EngineStats()
        self._snapshots = SnapshotMaker(self.stats, self.scheduler, self.kv)
        self._snapshot = self._snapshots(len(self._accepted))
        torch.manual_seed(cfg.seed)

    # --- requests in (any thread) ----------------------------------------------------------------

    def encode_prompt(
        self,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        *,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[int]:
        return self.input_processor.encode_prompt(
            prompt,
            messages,
            add_generation_prompt,
            tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
        )

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Seq[int] | None = None,
        params: SamplingParams | None = None,
        **options: Any,
    ) -> str:
        """Queue a request for the next step; returns its id. `prepare_request` lists the options."""
        req = self.prepare_request(request_id, prompt, params, **options)
        self.add_prepared([req])
        return req.request_id

    def add_prepared(self, requests: Seq[Request]) -> None:
        """Queue prepared requests as one command: the step that takes one takes them all. Raises
        `RequestError`, and queues none, when an id is already running or repeats in `requests`."""
        ids = [r.request_id for r in requests]
        repeated = [i for i, n in Counter(ids).items() if n > 1]
        if repeated:
            raise RequestError(f"request id {repeated[0]!r} is given twice")
        with self._accepting:
            running = [i for i in ids if i in self._accepted]
            if running:
                raise RequestError(f"request id {running[0]!r} is already running")
            self._accepted.update(ids)
        if requests:
            self._inbox.put(("add", list(requests)))

    def prepare_request(
        self,
        request_id: str | None,
        prompt: str | Seq[int] | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Seq[int] | None = None,
        messages: list[dict] | None = None,
        priority: int = 0,
        deadline: float | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        resume: Seq[Seq[int]] | None = None,
        isolated: bool = False,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
    ) -> Request:
        """Tokenize and validate a request for `add_prepared`. Raises `RequestError` if it cannot run.

        `resume` continues a request another worker started: per sample, the output tokens already
        delivered. They are recomputed as context (not sampled again) and count toward max_tokens.
        `isolated` runs the request in steps of its own (a suspect after a failed step) until it has
        sampled a token alone. `tenant` (with its fair-share `tenant_weight`) is whose request it is: while
        several tenants have requests in, one over its share gets fewer prompt tokens a step.
        `add_generation_prompt` is passed to the chat template (`messages` only), and so are `tools`
        (OpenAI's function tools); `tool_choice` ("none", "auto", "required" or
        ``{"type": "function", "function": {"name": ...}}``) decides whether calls are parsed and forced;
        a forced "required" makes one call when `parallel_tool_calls` is False, else one or more.
        """
        request_id = request_id or f"req-{next(self._auto_id)}"
        if request_id in self._accepted:
            raise RequestError(f"request id {request_id!r} is already running")
        req = self.input_processor.process(
            request_id,
            prompt,
            params or SamplingParams(),
            prompt_token_ids=prompt_token_ids,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            resume=resume,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            priority=priority,
            arrival_time=arrival_time,
            deadline=deadline,
            cache_salt=cache_salt,
            isolated=isolated,
            tenant=tenant,
            tenant_weight=tenant_weight,
        )
        return req

    def abort_request(self, request_ids: str | Seq[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self._inbox.put(("abort", rid))

    def has_unfinished_requests(self) -> bool:
        return bool(self._accepted) or not self._inbox.empty()

    def get_num_unfinished_requests(self) -> int:
        return len(self._accepted)

    def snapshot(self) -> EngineSnapshot:
        """The state after the latest step (immutable; replaced, never changed, by the engine thread)."""
        return self._snapshot

    # --- engine thread: the step -----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Apply queued commands and deadlines, then schedule -> execute -> update; returns the outputs of
        every request that changed (new tokens, finished). Raises `StepFailed` when the forward raised."""
        started = time.perf_counter()
        outputs: dict[str, RequestOutput] = {}
        self._apply_commands(outputs)
        self._admit_compiled(outputs)
        self._expire_deadlines(outputs)
        sched = self.scheduler.schedule()
        self.stats.num_preemptions += len(sched.preempted)
        if sched.is_empty:
            self._fail_unschedulable(outputs)
            self._await_compiles()  # nothing else to run: wait a moment for a grammar instead of spinning
        else:
            rows, forks = self._sample_rows(sched)
            result = self._execute(sched, rows, outputs)
            self._update(sched, rows, forks, result, outputs)
            self._count_step(sched, time.perf_counter() - started)
        self._snapshot = self._snapshots(len(self._accepted))
        return list(outputs.values())

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

    # --- schedule: commands, grammars, resumes, deadlines, forks ---------------------------------

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

    def _sample_rows(self, sched: SchedulerOutput) -> tuple[list[SampleRow], list[tuple[Sequence, Sequence]]]:
        """Rows to sample this step; a request finishing its prompt with n > 1 forks its samples here
        (children share the parent's logits now, and its blocks once the step ran)."""
        rows: list[SampleRow] = []
        forks: list[tuple[Sequence, Sequence]] = []
        for i, s in enumerate(sched.scheduled):
            if not s.samples:
                continue
            rows.append(SampleRow(i, s.seq))
            req = s.seq.request
            if not req.forked:
                req.forked = True
                for k in range(1, req.sampling_params.n):
                    child = Sequence(f"{req.request_id}#{k}", req, list(s.seq.token_ids), index=k)
                    self._equip(child, sample_seed(req.sampling_params.seed, k))
                    req.seqs.append(child)
                    rows.append(SampleRow(i, child))
                    forks.append((child, s.seq))
        return rows, forks

    # --- execute ---------------------------------------------------------------------------------

    def _execute(
        self, sched: SchedulerOutput, rows: list[SampleRow], outputs: dict[str, RequestOutput]
    ) -> SamplerOutput | None:
        try:
            return self.runner.execute(sched, rows)
        except Exception as e:
            ids = list(dict.fromkeys(s.seq.request.request_id for s in sched.scheduled))
            self._snapshot = self._snapshots(len(self._accepted))
            raise StepFailed(ids, list(outputs.values()), e) from e

    # --- update ----------------------------------------------------------------------------------

    def _update(
        self,
        sched: SchedulerOutput,
        rows: list[SampleRow],
        forks: list[tuple[Sequence, Sequence]],
        result: SamplerOutput | None,
        outputs: dict[str, RequestOutput],
    ) -> None:
        """The scheduled tokens are in the cache: count them, name full blocks for reuse, seat the forked
        samples, then append the sampled tokens and hand out what changed."""
        commit = self.kv.commit
        for s in sched.scheduled:
            seq = s.seq
            computed = seq.num_computed_tokens
            if computed < seq.num_prompt_tokens:
                self.stats.prompt_tokens += min(s.num_new_tokens, seq.num_prompt_tokens - computed)
            seq.num_computed_tokens = computed = computed + s.num_new_tokens
            commit(seq.seq_id, seq.token_ids, computed, seq.request.cache_salt)
        for child, parent in forks:
            child.num_computed_tokens = parent.num_computed_tokens
            self.kv.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
        if result is None:
            return
        seqs = [r.seq for r in rows]
        refused = self._accept_grammar(seqs, result)
        statuses = self.output_processor.append_sampled(seqs, result, time.time(), refused)
        self.stats.generation_tokens += len(seqs) - len(refused)
        touched: dict[str, Request] = {}
        for r, (seq, status) in enumerate(zip(seqs, statuses, strict=True)):
            if refused and r in refused:
                if not seq.request.finished:
                    why = "the grammar allows no token the model can write next (the constraint cannot be met)"
                    self._fail(seq.request, "grammar_unsatisfiable", why, outputs)
                continue
            if status is not None:
                self.scheduler.finish(seq, status)
                self.output_processor.flush(seq)
            touched[seq.request.request_id] = seq.request
        for req in touched.values():
            if req.request_id not in self.requests:
                continue  # failed in this step
            # A suspect that got through a step of its own (its whole context computed, a token sampled)
            # is not what failed: it rejoins the batch instead of running alone to its end.
            req.isolated = False
            if self._emit(req, outputs).finished:
                self._retire(req)

    def _accept_grammar(self, seqs: list[Sequence], result: SamplerOutput) -> frozenset[int]:
        """Advance each constrained sample's matcher; the rows whose grammar allowed no token. Such a row's
        logits were all -inf (the grammar and min_tokens' suppression of the stop tokens left nothing), so
        its "sampled" token is one the grammar refuses or a suppressed one."""
        if not any(s.matcher is not None for s in seqs):
            return frozenset()
        tokens = result.token_ids.tolist()
        refused = set()
        for r, s in enumerate(seqs):
            if s.matcher is None:
                continue
            p = s.request.sampling_params
            if p.min_tokens and s.num_output_tokens < p.min_tokens:
                suppressed = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                if tokens[r] in suppressed:
                    refused.add(r)
                    continue
            if not self.structured.accept(s, tokens[r]):
                refused.add(r)
        return frozenset(refused)

    def _count_step(self, sched: SchedulerOutput, seconds: float) -> None:
        st = self.stats
        st.steps += 1
        st.last_step_tokens = sched.num_batched_tokens
        st.last_step_seqs = len(sched.scheduled)
        st.last_step_seconds = seconds
        st.last_progress = time.monotonic()

    # --- requests out ----------------------------------------------------------------------------

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

    def _emit(self, req: Request, outputs: dict[str, RequestOutput]) -> RequestOutput:
        out = outputs[req.request_id] = self.output_processor.make_output(req, outputs.get(req.request_id))
        return out


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index` of a seeded request draws from its own generator (kept in 64 bits)."""
    return None if seed is None else (seed + index) % 2**64
