"""Sampling parameters of one request, with vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: plus the top k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k < 0:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name}={getattr(self, name)!r}: {why}")

        if self.n < 1:
            raise bad("n", "must be at least 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "must be in [0, max_tokens]")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be >= 0")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "token ids are non-negative")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
