"""LLMEngine: requests in, one scheduled forward per `step()`, outputs out.

One step reads as schedule -> execute -> update: the `Scheduler` (scheduler.py) picks the sequences
and their token counts and hands over their block tables, the `ModelRunner` (model_runner.py) runs
one forward over that batch and samples, and the `OutputProcessor` (output_processor.py) appends the
tokens, applies the stops and builds the outputs. Prompts become requests in input_processor.py.

Thread model: `add_request` / `abort_request` may be called from any thread (they tokenize on the
caller's thread and queue a command), and so may `snapshot()` and `limits`; everything else, `step()`
included, runs on one engine thread. Commands are applied at the start of the next step, so an abort
frees its blocks within one step.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Sequence as Seq

import torch

from worker.engine.config import EngineConfig, SchedulerConfig
from worker.engine.errors import PromptTooLong, RequestError, StepFailed
from worker.engine.input_processor import InputProcessor, find_eos_token_ids
from worker.engine.kv_cache import KVCacheManager
from worker.engine.model_runner import ModelRunner, SampleRow
from worker.engine.output_processor import OutputProcessor
from worker.engine.outputs import RequestOutput
from worker.engine.request import Request, SeqStatus, Sequence
from worker.engine.sampler import SamplerOutput
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler, SchedulerOutput, attention_cost_context
from worker.engine.stats import EngineLimits, EngineSnapshot, EngineStats, SnapshotMaker
from worker.models.loader import load_model, load_tokenizer

__all__ = ["EngineLimits", "EngineSnapshot", "LLMEngine", "PromptTooLong", "RequestError", "StepFailed"]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **options) -> None:
        self.config = config or EngineConfig(**options)
        cfg = self.config
        if not cfg.model:
            raise ValueError("EngineConfig.model is required")
        loaded = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, tokenizer=cfg.tokenizer)
        self.tokenizer = load_tokenizer(loaded.tokenizer_path, loaded.gguf_file)
        model_limit = int(getattr(loaded.config, "max_position_embeddings", 0) or 2048)
        self.max_model_len = min(cfg.max_model_len or model_limit, model_limit)
        if cfg.max_model_len and cfg.max_model_len > model_limit:
            raise ValueError(f"--max-model-len={cfg.max_model_len} exceeds the model's limit of {model_limit}")
        chunked = cfg.enable_chunked_prefill
        budget = cfg.max_num_batched_tokens or (2048 if chunked else self.max_model_len)
        # Chunk sizing defaults measured on CPU (ops/bench serve --long-prompt-only); GPU keeps vLLM's.
        on_cpu = chunked and loaded.device.type == "cpu"
        threshold = cfg.long_prefill_token_threshold or (max(1, self.max_model_len * 4 // 100) if on_cpu else 0)
        long_budget = cfg.long_prefill_budget if cfg.long_prefill_budget is not None else (32 if on_cpu else 0)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=chunked,
            policy=cfg.scheduling_policy,
            long_prefill_token_threshold=threshold,
            max_num_partial_prefills=cfg.max_num_partial_prefills,
            max_long_partial_prefills=cfg.max_long_partial_prefills or cfg.max_num_partial_prefills,
            long_prefill_budget=long_budget,
            attention_cost_context=attention_cost_context(loaded.config),
        )
        self.eos_token_ids = find_eos_token_ids(loaded.tokenizer_path, loaded.config, self.tokenizer)
        self.runner = ModelRunner(
            loaded,
            eos_token_ids=self.eos_token_ids,
            block_size=cfg.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=budget,
            num_kv_blocks=cfg.num_kv_blocks,
            kv_cache_memory=cfg.kv_cache_memory,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
        )
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            cfg.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            watermark=cfg.watermark,
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        vocab_size = int(loaded.config.vocab_size)
        self.input_processor = InputProcessor(
            self.tokenizer, vocab_size=vocab_size, max_model_len=self.max_model_len, max_logprobs=cfg.max_logprobs
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len
        )
        self.limits = EngineLimits(
            model=cfg.model,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            block_size=cfg.block_size,
            num_kv_blocks=self.runner.num_blocks,
            kv_cache_bytes=self.runner.num_blocks * self.runner.bytes_per_block,
            dtype=str(self.runner.dtype).removeprefix("torch."),
            device=str(self.runner.device),
            max_logprobs=cfg.max_logprobs,
            vocab_size=vocab_size,
        )
        self.requests: dict[str, Request] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._accepted: set[str] = set()  # ids added and not yet finished (any thread may read)
        self._auto_id = itertools.count()
        self.stats = EngineStats()
        self._snapshots = SnapshotMaker(self.stats, self.scheduler, self.kv)
        self._snapshot = self._snapshots(len(self._accepted))
        torch.manual_seed(cfg.seed)

    # --- requests in (any thread) ------------------------------------------------------------

    def encode_prompt(
        self, prompt: str | None = None, messages: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        return self.input_processor.encode_prompt(prompt, messages, add_generation_prompt)

    def add_request(
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
        add_generation_prompt: bool = True,
    ) -> str:
        """Queue a request for the next step; returns its id. Raises `RequestError` if it cannot run.

        `resume` continues a request another worker started: per sample, the output tokens already
        delivered. They are recomputed as context (not sampled again) and count toward max_tokens.
        `isolated` runs the request in steps of its own (a suspect after a failed step).
        `add_generation_prompt` is passed to the chat template (`messages` only).
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
            priority=priority,
            arrival_time=arrival_time,
            deadline=deadline,
            cache_salt=cache_salt,
            isolated=isolated,
        )
        self._accepted.add(request_id)
        self._inbox.put(("add", req))
        return request_id

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

    # --- engine thread -----------------------------------------------------------------------

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

    def step(self) -> list[RequestOutput]:
        """Apply queued commands and deadlines, then schedule -> execute -> update; returns the outputs of
        every request that changed (new tokens, finished). Raises `StepFailed` when the forward raised."""
        started = time.perf_counter()
        outputs: dict[str, RequestOutput] = {}
        self._apply_commands(outputs)
        self._expire_deadlines(outputs)
        sched = self.scheduler.schedule()
        self.stats.num_preemptions += len(sched.preempted)
        if sched.is_empty:
            self._fail_unschedulable(outputs)
        else:
            rows, forks = self._sample_rows(sched)
            result = self._execute(sched, rows, outputs)
            self._update(sched, rows, forks, result, outputs)
            self._count_step(sched, time.perf_counter() - started)
        self._snapshot = self._snapshots(len(self._accepted))
        return list(outputs.values())

    # --- schedule: commands, deadlines, forks --------------------------------------------------

    def _apply_commands(self, outputs: dict[str, RequestOutput]) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self._admit(arg, outputs)
                except Exception as e:  # a request that cannot even start must not stop the engine
                    arg.error = f"request cannot start: {e!r}"
                    self.requests[arg.request_id] = arg
                    self._finish_request(arg, SeqStatus.FINISHED_ABORTED, outputs)
            elif kind == "abort" and arg in self.requests:
                self._finish_request(self.requests[arg], SeqStatus.FINISHED_ABORTED, outputs)

    def _admit(self, req: Request, outputs: dict[str, RequestOutput]) -> None:
        self.requests[req.request_id] = req
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
            self._equip(seq, _sample_seed(req.sampling_params.seed, k))
            status = self.output_processor.replay(seq, delivered)
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
                    self._equip(child, _sample_seed(req.sampling_params.seed, k))
                    req.seqs.append(child)
                    rows.append(SampleRow(i, child))
                    forks.append((child, s.seq))
        return rows, forks

    # --- execute -----------------------------------------------------------------------------

    def _execute(
        self, sched: SchedulerOutput, rows: list[SampleRow], outputs: dict[str, RequestOutput]
    ) -> SamplerOutput | None:
        try:
            return self.runner.execute(sched, rows)
        except Exception as e:
            ids = list(dict.fromkeys(s.seq.request.request_id for s in sched.scheduled))
            self._snapshot = self._snapshots(len(self._accepted))
            raise StepFailed(ids, list(outputs.values()), e) from e

    # --- update ------------------------------------------------------------------------------

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
        for s in sched.scheduled:
            seq = s.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.stats.prompt_tokens += min(s.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += s.num_new_tokens
            self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.request.cache_salt)
        for child, parent in forks:
            child.num_computed_tokens = parent.num_computed_tokens
            self.kv.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
        if result is None:
            return
        seqs = [r.seq for r in rows]
        statuses = self.output_processor.append_sampled(seqs, result, time.time())
        self.stats.generation_tokens += len(seqs)
        touched: dict[str, Request] = {}
        for seq, status in zip(seqs, statuses, strict=True):
            if status is not None:
                self.scheduler.finish(seq, status)
                self.output_processor.flush(seq)
            touched[seq.request.request_id] = seq.request
        for req in touched.values():
            self._emit(req, outputs)
            if req.finished:
                self._retire(req)

    def _count_step(self, sched: SchedulerOutput, seconds: float) -> None:
        st = self.stats
        st.steps += 1
        st.last_step_tokens = sched.num_batched_tokens
        st.last_step_seqs = len(sched.scheduled)
        st.last_step_seconds = seconds
        st.last_progress = time.monotonic()

    # --- requests out ------------------------------------------------------------------------

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


def _sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index` of a seeded request draws from its own generator (kept in 64 bits)."""
    return None if seed is None else (seed + index) % 2**64
