"""Request and sequence state.

A `Request` is what a user submitted: one prompt and its sampling parameters. It produces `n`
samples; each sample is a `Sequence`, the unit the scheduler and the KV cache work with. A request
with n > 1 starts as one sequence; when its prompt is computed it forks into n sequences that share
the prompt's blocks (prefilled once).

Lifecycle of a sequence: WAITING -> RUNNING -> FINISHED_*. A sequence preempted by recompute goes back
to WAITING (with nothing computed) and runs again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from worker.engine.detokenizer import IncrementalDetokenizer
    from worker.engine.tool_parsers import ToolParser


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_DEADLINE = "deadline"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    SeqStatus.FINISHED_STOPPED,
    SeqStatus.FINISHED_LENGTH,
    SeqStatus.FINISHED_ABORTED,
    SeqStatus.FINISHED_DEADLINE,
}


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's life, plus counters."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


class Sequence:
    """One sample stream: prompt + generated tokens, how many are in the KV cache, its status."""

    def __init__(self, seq_id: str, request: Request, token_ids: list[int], index: int = 0) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index  # which of the request's n samples
        self.token_ids = token_ids  # prompt + output
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.status = SeqStatus.WAITING
        self.stop_reason: str | int | None = None
        self.detokenizer: IncrementalDetokenizer | None = None
        self.generator: torch.Generator | None = None
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.logprob_offset = 0  # output tokens without logprobs (delivered by a previous worker)
        # With logprobs: each token's text and bytes, and its top tokens' (`worker.engine.token_text`);
        # `held_bytes`: the bytes of a character not yet complete after the last token.
        self.token_texts: list[str] = []
        self.token_bytes: list[bytes] = []
        self.top_texts: list[list[str]] = []
        self.top_bytes: list[list[bytes]] = []
        self.held_bytes = b""
        self.num_emitted = 0  # output tokens already handed out in RequestOutputs
        self.pending_text = ""  # detokenized text not yet handed out
        self.matcher: Any = None  # its xgrammar GrammarMatcher, when the request is constrained
        self.tool_parser: ToolParser | None = None  # when the request has tools to parse

    @property
    def finish_reason(self) -> str | None:
        """vLLM's reasons, and "tool_calls" for a sample that stopped after writing tool calls."""
        if self.status == SeqStatus.FINISHED_STOPPED and self.tool_parser and self.tool_parser.num_complete:
            return "tool_calls"
        return self.status.finish_reason

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {self.status.value}, {self.num_computed_tokens}/{self.num_tokens})"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        deadline: float | None = None,
        cache_salt: str | None = None,
        resume: list[list[int]] | None = None,
        isolated: bool = False,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.deadline = deadline  # absolute time.time() seconds
        self.cache_salt = cache_salt
        self.metrics = RequestMetrics(arrival=self.arrival_time)
        self.seqs: list[Sequence] = [Sequence(f"{request_id}#0", self, list(prompt_token_ids))]
        self.forked = sampling_params.n == 1
        self.error: str | None = None  # why the engine gave up on it, when it did
        self.error_code: str | None = None  # a short word for it (default: engine_error)
        self.grammar: Future | None = None  # the compile of its output constraint, when it has one
        self.grammar_deadline = 0.0  # time.monotonic() by which the grammar must have compiled
        self.tools: list[dict[str, Any]] | None = None  # rendered into the prompt; parsed in the output
        self.tool_parser: type[ToolParser] | None = None
        self.resume = resume  # per sample, tokens a previous worker delivered
        self.isolated = isolated  # scheduled in steps of its own (suspected of failing a step)
        self.tenant = tenant  # whose request: the scheduler's fair share between tenants
        self.tenant_weight = tenant_weight

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def sort_key(self, policy: str) -> tuple:
        """Scheduling order: smaller first. `priority` policy: higher priority first, then arrival."""
        if policy == "priority":
            return (-self.priority, self.arrival_time)
        return (self.arrival_time,)
