"""LLMEngine: requests in, one scheduled forward per `step()`, outputs out.

Thread model: `add_request` / `abort_request` may be called from any thread (they only queue a
command); everything else, `step()` included, runs on one engine thread. Commands are applied at
the start of the next step, so an abort frees its blocks within one step.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from worker.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.kv_cache import KVCacheManager
from worker.engine.model_runner import ModelRunner, SampleRow
from worker.engine.outputs import CompletionOutput, RequestOutput
from worker.engine.request import Request, SeqStatus, Sequence
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler, SchedulerOutput
from worker.models.loader import load_model, load_tokenizer


class RequestError(ValueError):
    """A request cannot be accepted (empty or too long prompt, duplicate id, bad parameters)."""

    code = "invalid_request"


class PromptTooLong(RequestError):
    code = "prompt_too_long"


class StepFailed(RuntimeError):
    """The forward of one step raised. `request_ids` were in that step (one of them may be a poison
    request); `outputs` are what the step produced before it failed (deadlines, aborts). The engine is
    still usable once the caller `discard`s or retries those requests."""

    def __init__(self, request_ids: list[str], outputs: list[RequestOutput], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} requests: {cause!r}")
        self.request_ids = request_ids
        self.outputs = outputs


@dataclass
class EngineStats:
    """Counters since start, and the last step's shape (the service turns them into metrics)."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    num_preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    last_step_tokens: int = 0
    last_step_seqs: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **options) -> None:
        self.config = config or EngineConfig(**options)
        cfg = self.config
        if not cfg.model:
            raise ValueError("EngineConfig.model is required")
        loaded = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, tokenizer=cfg.tokenizer)
        self.model_config = loaded.config
        self.tokenizer = load_tokenizer(loaded.tokenizer_path, loaded.gguf_file)
        model_limit = int(getattr(loaded.config, "max_position_embeddings", 0) or 2048)
        self.max_model_len = min(cfg.max_model_len or model_limit, model_limit)
        if cfg.max_model_len and cfg.max_model_len > model_limit:
            raise ValueError(f"--max-model-len={cfg.max_model_len} exceeds the model's limit of {model_limit}")
        chunked = cfg.enable_chunked_prefill
        budget = cfg.max_num_batched_tokens or (2048 if chunked else self.max_model_len)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=chunked,
            policy=cfg.scheduling_policy,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            max_num_partial_prefills=cfg.max_num_partial_prefills,
        )
        self.runner = ModelRunner(
            loaded,
            block_size=cfg.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=budget,
            num_kv_blocks=cfg.num_kv_blocks,
            kv_cache_memory=cfg.kv_cache_memory,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
        )
        self.cache_config = CacheConfig(
            cfg.block_size, self.runner.num_blocks, cfg.enable_prefix_caching, cfg.watermark
        )
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            cfg.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            watermark=cfg.watermark,
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        self.eos_token_ids = self._eos_ids(loaded)
        self.runner.eos_token_ids = self.eos_token_ids
        self.requests: dict[str, Request] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._accepted: set[str] = set()  # ids added and not yet finished (any thread may read)
        self._auto_id = itertools.count()
        self.stats = EngineStats()
        torch.manual_seed(cfg.seed)

    def _eos_ids(self, loaded) -> frozenset[int]:
        from pathlib import Path

        ids: list[int] = []
        try:
            from transformers import GenerationConfig

            folder = Path(loaded.tokenizer_path)
            if (folder / "generation_config.json").exists():
                eos = GenerationConfig.from_pretrained(folder).eos_token_id
                ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
        except (OSError, ValueError):
            pass
        if not ids:
            eos = getattr(loaded.config, "eos_token_id", None) or self.tokenizer.eos_token_id
            ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
        return frozenset(ids)

    # --- requests in -------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        if messages is not None:
            if not self.tokenizer.chat_template:
                raise RequestError("this model has no chat template: send a prompt instead of messages")
            # transformers renders templates in jinja2's immutable sandbox: a template cannot reach Python
            # internals, and message contents are data, never template code. Whatever the template raises
            # (its own raise_exception on bad roles, a sandbox violation) is this request's error.
            try:
                rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:
                raise RequestError(f"chat template failed: {type(e).__name__}: {e}") from e
            return self.tokenizer(rendered, add_special_tokens=False).input_ids
        return self.tokenizer(prompt).input_ids

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
    ) -> str:
        """Queue a request for the next step; returns its id. Raises `RequestError` if it cannot run.

        `resume` continues a request another worker started: per sample, the output tokens already
        delivered. They are recomputed as context (not sampled again) and count toward max_tokens.
        `isolated` runs the request in steps of its own (a suspect after a failed step).
        """
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._auto_id)}"
        if request_id in self._accepted:
            raise RequestError(f"request id {request_id!r} is already running")
        if prompt is not None and not isinstance(prompt, str):
            prompt_token_ids, prompt = list(prompt), None
        if prompt_token_ids is None:
            prompt_token_ids = self.encode_prompt(prompt, messages)
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestError(f"request {request_id}: the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"request {request_id}: prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(
                f"request {request_id}: prompt has {len(ids)} tokens, max_model_len is {self.max_model_len} "
                "(prompt + at least one generated token must fit)"
            )
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise RequestError(f"request {request_id}: logprobs={params.logprobs} > max_logprobs")
        if resume is not None and len(resume) != params.n:
            raise RequestError(f"request {request_id}: resume holds {len(resume)} samples, n={params.n}")
        req = Request(
            request_id,
            ids,
            params,
            prompt=prompt,
            priority=priority,
            arrival_time=arrival_time,
            deadline=deadline,
            cache_salt=cache_salt,
        )
        req.resume = [list(r) for r in resume] if resume is not None else None
        req.isolated = isolated
        self._accepted.add(request_id)
        self._inbox.put(("add", req))
        return request_id

    def abort_request(self, request_ids: str | Seq[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self._inbox.put(("abort", rid))

    def discard(self, request_ids: Seq[str]) -> None:
        """Drop requests at once, silently (no output), freeing their blocks. Engine thread only."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.finished:
                    self.scheduler.finish(seq, SeqStatus.FINISHED_ABORTED)
            self._accepted.discard(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self._accepted) or not self._inbox.empty()

    def get_num_unfinished_requests(self) -> int:
        return len(self._accepted)

    # --- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        self._apply_commands(outputs)
        self._expire_deadlines(outputs)
        sched = self.scheduler.schedule()
        self.stats.num_preemptions += len(sched.preempted)
        if sched.is_empty:
            self._fail_unschedulable(outputs)
            return list(outputs.values())
        rows, forks = self._sample_rows(sched)
        try:
            result = self.runner.execute(sched, rows, self.kv)
        except Exception as e:
            ids = list(dict.fromkeys(s.seq.request.request_id for s in sched.scheduled))
            raise StepFailed(ids, list(outputs.values()), e) from e
        self._advance(sched)
        for child, parent in forks:
            child.num_computed_tokens = parent.num_computed_tokens
            self.kv.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
        if result is not None:
            self._append_tokens(rows, result, outputs)
        self.stats.steps += 1
        self.stats.last_step_tokens = sched.num_batched_tokens
        self.stats.last_step_seqs = len(sched.scheduled)
        return list(outputs.values())

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
        shares what the samples have in common). The detokenizer replays them, so its held-back text
        and stop-string state are what the first worker had; a sample that had already stopped ends here."""
        p = req.sampling_params
        req.forked = True
        req.seqs = []
        for k, delivered in enumerate(req.resume or []):
            seq = Sequence(f"{req.request_id}#{k}", req, list(req.prompt_token_ids), index=k)
            req.seqs.append(seq)
            self._equip(seq, None if p.seed is None else (p.seed + k) % 2**64)
            status = None
            for token in delivered:
                seq.token_ids.append(token)
                status = self._stop_status(seq, token)
            seq.pending_text = ""  # already delivered
            seq.num_emitted = seq.logprob_offset = seq.num_output_tokens
            if status is None:
                self.scheduler.add(seq)
            else:
                seq.status = status
                seq.pending_text = seq.detokenizer.flush()
        if req.finished:
            self._emit(req, outputs)
            self._retire(req)

    def _equip(self, seq: Sequence, seed: int | None) -> None:
        p = seq.request.sampling_params
        seq.detokenizer = IncrementalDetokenizer.from_sampling_params(self.tokenizer, seq.request.prompt_token_ids, p)
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
        """Rows to sample this step; a request finishing its prompt with n > 1 forks its samples here."""
        rows: list[SampleRow] = []
        forks: list[tuple[Sequence, Sequence]] = []
        for i, s in enumerate(sched.scheduled):
            if not s.samples:
                continue
            rows.append(SampleRow(i, s.seq))
            req = s.seq.request
            if not req.forked:
                req.forked = True
                seed = req.sampling_params.seed
                for k in range(1, req.sampling_params.n):
                    child = Sequence(f"{req.request_id}#{k}", req, list(s.seq.token_ids), index=k)
                    self._equip(child, None if seed is None else (seed + k) % 2**64)
                    req.seqs.append(child)
                    rows.append(SampleRow(i, child))
                    forks.append((child, s.seq))
        return rows, forks

    def _advance(self, sched: SchedulerOutput) -> None:
        """The scheduled tokens are now in the cache: count them and name full blocks for reuse."""
        for s in sched.scheduled:
            seq = s.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.stats.prompt_tokens += min(s.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += s.num_new_tokens
            self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.request.cache_salt)

    def _append_tokens(self, rows: list[SampleRow], result, outputs: dict[str, RequestOutput]) -> None:
        now = time.time()
        tokens = result.token_ids.tolist()
        want_logprobs = result.logprobs is not None
        if want_logprobs:
            lp = result.logprobs.tolist()
            top_ids = result.top_token_ids.tolist() if result.top_token_ids is not None else None
            top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        for r, (row, token) in enumerate(zip(rows, tokens, strict=True)):
            seq = row.seq
            req = seq.request
            p = req.sampling_params
            seq.token_ids.append(token)
            m = req.metrics
            if m.first_token is None:
                m.first_token = now
            elif seq.index == 0 and m.last_token is not None:
                m.inter_token_latencies.append(now - m.last_token)
            if seq.index == 0:
                m.last_token = now
            self.stats.generation_tokens += 1
            if want_logprobs and p.logprobs is not None:
                seq.logprobs.append(lp[r])
                k = p.logprobs
                seq.top_logprobs.append(list(zip(top_ids[r][:k], top_lp[r][:k], strict=True)) if k and top_ids else [])
            status = self._stop_status(seq, token)
            if status is not None:
                self.scheduler.finish(seq, status)
                seq.pending_text += seq.detokenizer.flush()
            self._emit(req, outputs)
            if req.finished:
                self._retire(req)

    def _stop_status(self, seq: Sequence, token: int) -> SeqStatus | None:
        """Feed the new token to the detokenizer (unless it is the stop token) and apply vLLM's stops."""
        p = seq.request.sampling_params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return SeqStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return SeqStatus.FINISHED_STOPPED
        seq.pending_text += seq.detokenizer.update(token)
        if seq.detokenizer.stopped:
            seq.stop_reason = seq.detokenizer.stop_reason
            return SeqStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return SeqStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.max_model_len:
            return SeqStatus.FINISHED_LENGTH
        return None

    # --- requests out ------------------------------------------------------------------------

    def _finish_request(self, req: Request, status: SeqStatus, outputs: dict[str, RequestOutput]) -> None:
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, status)
                if seq.detokenizer:
                    seq.pending_text += seq.detokenizer.flush()
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
        """(Re)build the request's output for this step, with what each sample added since last time."""
        prev = outputs.get(req.request_id)
        want_lp = req.sampling_params.logprobs is not None
        completions = []
        for seq in req.seqs:
            start = seq.num_emitted
            new_ids = seq.output_token_ids[start:]
            seq.num_emitted = seq.num_output_tokens
            delta, seq.pending_text = seq.pending_text, ""
            old = prev.outputs[seq.index] if prev and seq.index < len(prev.outputs) else None
            out = CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.output_text if seq.detokenizer else "",
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
                delta_token_ids=(old.delta_token_ids if old else []) + new_ids,
                delta_text=(old.delta_text if old else "") + delta,
            )
            if want_lp:  # tokens a previous worker delivered (resume) have none
                lp_start = max(start - seq.logprob_offset, 0)
                out.logprobs, out.top_logprobs = list(seq.logprobs), list(seq.top_logprobs)
                out.delta_logprobs = (old.delta_logprobs if old else []) + seq.logprobs[lp_start:]
                out.delta_top_logprobs = (old.delta_top_logprobs if old else []) + seq.top_logprobs[lp_start:]
            completions.append(out)
        outputs[req.request_id] = RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=req.finished,
            metrics=req.metrics,
            error=req.error,
        )
