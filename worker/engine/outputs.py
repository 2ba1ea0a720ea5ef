"""What the engine hands back after a step: vLLM's RequestOutput shape, plus per-step deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from producer_sdk.chat import ToolCall, ToolCallDelta
from worker.engine.request import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | deadline | tool_calls
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With logprobs: each token's text and UTF-8 bytes, and those of its top_logprobs tokens
    # (`worker.engine.token_text`); set once the sample finished (the deltas below carry them before).
    token_texts: list[str] | None = None
    token_bytes: list[bytes] | None = None
    top_token_texts: list[list[str]] | None = None
    top_token_bytes: list[list[bytes]] | None = None
    # What this step added (for streaming); the fields above are cumulative.
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_logprobs: list[float] | None = None
    delta_top_logprobs: list[list[tuple[int, float]]] | None = None
    delta_token_texts: list[str] | None = None
    delta_token_bytes: list[bytes] | None = None
    delta_top_token_texts: list[list[str]] | None = None
    delta_top_token_bytes: list[list[bytes]] | None = None
    # Requests with tools: `text` without tool-call markup, and the calls parsed from it (the last one
    # partial when max_tokens cut it); per step, the content added and the calls' deltas (id and name
    # once, argument fragments).
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    delta_content: str | None = None
    delta_tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request failed inside the engine (finish_reason abort)
    error_code: str | None = None  # a short word for `error` (invalid_grammar, grammar_unsatisfiable, ...)

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens
