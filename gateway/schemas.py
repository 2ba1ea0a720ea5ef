"""Request bodies of the OpenAI API as msgspec Structs (decoded strictly: an unknown field is a 400).

Fields are None when not given. OpenAI's own parameters come first, then vLLM's extra body fields
with vLLM's names, then parameters pagedq cannot honour yet: they are declared only so that the
answer names them ("not supported yet") instead of calling them unknown. Tools, tool calls, response
formats and structured outputs are decoded into the wire's own structs (`producer_sdk.chat`), whose
names are OpenAI's and vLLM's.
"""

from __future__ import annotations

from typing import Any

import msgspec

from producer_sdk.chat import NamedToolChoice, ResponseFormat, StructuredOutputsParams, Tool, ToolCall


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's; not supported yet


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (history)
    tool_call_id: str | None = None  # a tool turn: the call it answers
    function_call: Any = None
    refusal: Any = None
    audio: Any = None


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What chat and completions share."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra body fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputsParams | None = None
    response_format: ResponseFormat | None = None  # OpenAI's for chat; vLLM's extra field for completions
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:N"


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    parallel_tool_calls: bool | None = None
    safety_identifier: str | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    add_generation_prompt: bool | None = None  # vLLM's
    # not supported yet
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any = None  # a string, one token-id list, or a list holding one of those
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


CHAT_UNSUPPORTED = (
    "functions",
    "function_call",
    "audio",
    "prediction",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "moderation",
)

chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_decoder = msgspec.json.Decoder(CompletionRequest)
