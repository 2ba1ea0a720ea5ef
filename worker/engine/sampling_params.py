"""Sampling parameters of one request, with vLLM's names and offline defaults (max_tokens=16).

The fields are exactly those of the wire struct `producer_sdk.protocol.SamplingParams`, which the
service turns into these with `SamplingParams.from_wire`, and both are checked by the one rule set
`producer_sdk.validation.sampling_problems`, here with limits that only bound what the engine can run
(the service's own limits are stricter; `max_logprobs` is the engine config's, checked at admission).

The fields of `MODEL_DEFAULT_FIELDS` may be None: "the model's default". The engine fills them from the
model's generation_config.json (`--generation-config`, `worker.engine.generation_defaults`) when it
admits the request, and where the model sets none, with this class's own default (vLLM's neutral value).
A wire request leaves them None unless the producer set them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import msgspec

from producer_sdk.chat import StructuredOutputsParams
from producer_sdk.validation import Limits, sampling_problems

if TYPE_CHECKING:
    from producer_sdk import protocol

_GREEDY_EPS = 1e-5
_UNBOUNDED = 10**9  # beyond anything a model can run, and still readable in an error message

# Token ids keep the wire's bound (int32); max_logprobs is the engine config's, checked at add_request.
ENGINE_LIMITS = Limits(
    max_n=_UNBOUNDED,
    max_tokens=_UNBOUNDED,
    max_stop=_UNBOUNDED,
    max_stop_chars=_UNBOUNDED,
    max_stop_token_ids=_UNBOUNDED,
    max_logprobs=_UNBOUNDED,
)


# What a model's generation_config.json may set (vLLM's `--generation-config auto` takes these but
# max_new_tokens, whose place `max_tokens` already fills: the service's 256, or the model's length).
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

__all__ = ["MODEL_DEFAULT_FIELDS", "SamplingParams", "SamplingParamsError", "StructuredOutputsParams"]


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    # None in these five (MODEL_DEFAULT_FIELDS): the model's default, filled in by `with_defaults`
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = 0  # 0 or -1: off
    min_p: float | None = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float | None = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: plus the top k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's constrained decoding: StructuredOutputsParams(json=schema | regex= | choice= | grammar= |
    # json_object=True), or the same as a dict
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = msgspec.convert(self.structured_outputs, StructuredOutputsParams)
            except msgspec.ValidationError as e:
                raise SamplingParamsError(f"structured_outputs: {e}") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        for name, why in sampling_problems(self, ENGINE_LIMITS):
            shown = f"={getattr(self, name)!r}" if hasattr(self, name) else ""
            raise SamplingParamsError(f"{name}{shown}: {why}")
        if self.top_k == -1:
            self.top_k = 0

    @classmethod
    def from_wire(cls, wire: protocol.SamplingParams) -> SamplingParams:
        """The engine's parameters for a request's wire `sampling` struct, field for field."""
        return cls(**msgspec.structs.asdict(wire))

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """These parameters with every None of `MODEL_DEFAULT_FIELDS` filled: from `defaults` (the model's
        generation defaults) where it has the field, else with this class's default. Values set stay."""
        unset = [name for name in MODEL_DEFAULT_FIELDS if getattr(self, name) is None]
        if not unset:
            return self
        return replace(self, **{name: defaults.get(name, _NEUTRAL[name]) for name in unset})

    @property
    def greedy(self) -> bool:
        return self.temperature is not None and self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty not in (None, 1.0) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


_NEUTRAL: dict[str, Any] = {f.name: f.default for f in fields(SamplingParams) if f.name in MODEL_DEFAULT_FIELDS}
