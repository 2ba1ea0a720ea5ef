"""From an OpenAI request body to the SDK's `submit` arguments, and back from protocol field paths to
OpenAI parameter names (so a 400 names the parameter the client sent).

Nothing is dropped silently: a parameter pagedq cannot honour is refused with a 400 naming it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway import errors, json_body, mapping_chat
from gateway.schemas import (
    CHAT_UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    chat_decoder,
    completion_decoder,
)

CHAT, COMPLETION = "chat", "completion"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
RESERVED_METADATA = ("tenant",)
_SAMPLING_COPY = (
    "n",
    "seed",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
)


class Mapped(msgspec.Struct):
    """A decoded request: what to submit and how to answer."""

    kind: str  # CHAT | COMPLETION
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool
    submit: dict[str, Any]  # keyword arguments of AsyncClient.submit
    param_names: dict[str, str]  # protocol field -> the OpenAI parameter the client used
    constraint: str | None = None  # the parameter that constrains the output (response_format, ...)
    token_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"

    def failure_param(self, code: str) -> str | None:
        """The parameter a worker's error event (by its code) is about, if any."""
        return mapping_chat.failure_param(self.kind == CHAT, self.constraint, code)


def decode(kind: str, body: bytes) -> Any:
    """The body as a Struct; a 400 naming the field on malformed JSON, a wrong type or too deep a body."""
    return json_body.decode(chat_decoder if kind == CHAT else completion_decoder, body)


def map_chat(body: ChatCompletionRequest) -> Mapped:
    for name in CHAT_UNSUPPORTED:
        value = getattr(body, name)
        if value is not None and not _harmless(name, value):
            raise errors.unsupported(name)
    if body.modalities is not None and body.modalities != ["text"]:
        raise errors.unsupported("modalities", 'only ["text"]')
    names: dict[str, str] = {}
    submit = _sampling(body, names)
    if body.max_completion_tokens is not None:
        if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise errors.invalid("max_tokens and max_completion_tokens disagree; set one", "max_completion_tokens")
        submit["max_tokens"] = body.max_completion_tokens
        names["max_tokens"] = "max_completion_tokens"
    elif body.max_tokens is None:
        submit["max_tokens"] = None  # up to the model's length, as OpenAI does
    if body.top_logprobs is not None and not body.logprobs:
        raise errors.invalid("top_logprobs needs logprobs=true", "top_logprobs")
    if body.logprobs:
        submit["logprobs"] = body.top_logprobs or 0
        names["logprobs"] = "top_logprobs"
    submit["messages"] = [mapping_chat.message(i, m) for i, m in enumerate(body.messages)]
    names["messages"] = "messages"
    mapping_chat.tools(body, submit)
    if body.add_generation_prompt is not None:
        submit["add_generation_prompt"] = body.add_generation_prompt
    metadata = _metadata(body.metadata, body.user, body.safety_identifier)
    if metadata:
        submit["metadata"] = metadata
    return Mapped(
        CHAT,
        body.model,
        bool(body.stream),
        _include_usage(body),
        bool(body.logprobs),
        submit,
        names,
        mapping_chat.constraint_param(submit),
        bool(body.return_tokens_as_token_ids),
    )


def _harmless(name: str, value: Any) -> bool:
    """Values of unsupported parameters that ask for exactly what pagedq does anyway."""
    if name == "service_tier":
        return value in ("auto", "default")
    return False


def map_completion(body: CompletionRequest) -> Mapped:
    if body.echo:
        raise errors.unsupported("echo")
    if body.suffix:
        raise errors.unsupported("suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise errors.unsupported("best_of", "only best_of equal to n")
    names: dict[str, str] = {}
    submit = _sampling(body, names)
    if body.max_tokens is None:
        submit["max_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS
    if body.logprobs is not None:
        submit["logprobs"] = body.logprobs
        names["logprobs"] = "logprobs"
    submit.update(_prompt(body.prompt))
    names["prompt_token_ids"] = names["prompt"] = "prompt"
    metadata = _metadata(None, body.user, None)
    if metadata:
        submit["metadata"] = metadata
    return Mapped(
        COMPLETION,
        body.model,
        bool(body.stream),
        _include_usage(body),
        body.logprobs is not None,
        submit,
        names,
        mapping_chat.constraint_param(submit),
        bool(body.return_tokens_as_token_ids),
    )


def _sampling(body: Any, names: dict[str, str]) -> dict[str, Any]:
    if body.logit_bias:
        raise errors.unsupported("logit_bias")
    so = body.stream_options
    if so is not None and not body.stream:
        raise errors.invalid("stream_options is only allowed with stream=true", "stream_options")
    if so is not None and so.continuous_usage_stats:
        raise errors.unsupported("stream_options.continuous_usage_stats")
    out: dict[str, Any] = {name: getattr(body, name) for name in _SAMPLING_COPY if getattr(body, name) is not None}
    if body.max_tokens is not None:
        out["max_tokens"] = body.max_tokens
    if body.stop is not None:
        out["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.priority is not None:
        # vLLM: lower means earlier. pagedq: higher means earlier (and > 0 is the high lane).
        out["priority"] = -body.priority
    mapping_chat.output_format(body, out)
    return out


def _include_usage(body: Any) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise errors.unsupported("prompt", "one prompt per request (send a batch as separate requests)")
    if prompt is None:
        raise errors.invalid("prompt is required", "prompt", "missing_required_parameter")
    raise errors.invalid("prompt must be a string or a list of token ids", "prompt")


def _metadata(given: dict[str, str] | None, user: str | None, safety_identifier: str | None) -> dict[str, str]:
    out = dict(given or {})
    for key in RESERVED_METADATA:
        if key in out:
            raise errors.invalid(f"metadata key {key!r} is reserved", f"metadata.{key}")
    if user is not None:
        out["user"] = user
    if safety_identifier is not None:
        out["safety_identifier"] = safety_identifier
    return out


def param_of(mapped: Mapped, field: str) -> str:
    """The OpenAI parameter behind a protocol field path from a ValidationError."""
    head, _, rest = field.partition(".")
    if head == "sampling" and rest:
        name = rest.split(".", 1)[0]
        return mapped.param_names.get(name, name) + rest[len(name) :]
    base = head.split("[", 1)[0]
    if base in mapped.param_names:
        return mapped.param_names[base] + field[len(base) :]
    if head == "metadata":
        return "user" if rest == "user" else field
    return field
