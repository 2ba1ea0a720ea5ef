"""The keyword arguments of `submit`, `generate` and `stream`, typed once for both clients.

`AsyncClient.submit` documents them. A type checker reads `**options: Unpack[SubmitOptions]` as the
keyword list below; at run time they are checked where the request is built (`_core.build_request`),
so a misspelled name raises TypeError there. The sampling names are `SamplingParams`' fields (a test
keeps the two lists equal).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict


class SubmitOptions(TypedDict, total=False):
    # what to generate from, and how the request travels
    prompt_token_ids: Iterable[int] | None
    messages: Iterable[Mapping[str, Any]] | None
    tools: Iterable[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    response_format: Mapping[str, Any] | None
    parallel_tool_calls: bool
    request_id: str | None
    priority: int
    deadline: float | _dt.timedelta | _dt.datetime | None
    metadata: Mapping[str, str] | None
    add_generation_prompt: bool
    traceparent: str | None
    tracestate: str | None
    tenant: str | None
    # sampling (SamplingParams); None or left out: the model's generation_config.json, else vLLM's
    n: int
    max_tokens: int | None
    min_tokens: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: str | list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    repetition_penalty: float | None
    presence_penalty: float
    frequency_penalty: float
    logprobs: int | None
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    structured_outputs: Mapping[str, Any] | None


class WaitOptions(TypedDict, total=False):
    """How `Handle.result` / `Handle.stream` wait (see `Handle.stream`)."""

    timeout: float | None
    cancel_on_timeout: bool
    partial_ok: bool


class GenerateOptions(SubmitOptions, WaitOptions, total=False):
    """`generate` and `stream`: submit, then wait."""


def split_wait(options: dict[str, Any]) -> dict[str, Any]:
    """Take the waiting options out of `options` (left with the submit ones)."""
    return {name: options.pop(name) for name in WaitOptions.__annotations__ if name in options}
