"""Input processing: from what a caller submits to a validated `Request` the engine can schedule.

Tokenizes a prompt or renders a chat (and its tools) with the model's chat template, fills the sampling
parameters a request left unset with the model's generation defaults, checks the prompt against the
vocabulary and `max_model_len`, and the request-level limits the sampling parameters cannot know
(`max_logprobs`, resumed samples). A constrained request (structured outputs, a forced tool call)
has its grammar compile started here. Runs on the caller's thread: it reads no engine state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

from worker.engine.errors import PromptTooLong, RequestError
from worker.engine.request import Request
from worker.engine.sampling_params import SamplingParams
from worker.engine.structured import StructuredOutputManager, spec_from_params
from worker.engine.tool_calling import (
    calls_as_text,
    forced_function,
    json_call_parser,
    request_parser,
    template_messages,
    tool_grammar,
    tools_preamble,
    with_preamble,
)
from worker.engine.tool_parsers import ToolParser


def find_eos_token_ids(tokenizer_path: str, model_config: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end generation: generation_config.json's `eos_token_id` (transformers reads it there
    first, and chat models often list several), else the model config's, else the tokenizer's."""
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        folder = Path(tokenizer_path)
        if (folder / "generation_config.json").exists():
            ids += _as_list(GenerationConfig.from_pretrained(folder).eos_token_id)
    except (OSError, ValueError):
        pass
    if not ids:
        ids += _as_list(getattr(model_config, "eos_token_id", None) or tokenizer.eos_token_id)
    return frozenset(ids)


def _as_list(eos: int | list[int] | None) -> list[int]:
    return eos if isinstance(eos, list) else [] if eos is None else [eos]


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        max_model_len: int,
        max_logprobs: int,
        structured: StructuredOutputManager | None = None,
        tool_parser: type[ToolParser] | None = None,
        generation_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # The model's sampling defaults (generation_defaults.load_generation_defaults): they fill what a
        # request leaves None, before anything reads its parameters.
        self.generation_defaults = dict(generation_defaults or {})
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.structured = structured
        self.tool_parser = tool_parser
        # Markup of the tool-call format that is a single special token of this tokenizer: kept in the
        # text (skip_special_tokens off) and matched as a token by the grammar.
        special = set(getattr(tokenizer, "all_special_tokens", ()))
        self.token_markers = frozenset(m for m in (tool_parser.markers if tool_parser else ()) if m in special)

    @cached_property
    def template_renders_tools(self) -> bool:
        """Whether the chat template shows a request's tools: a probe chat rendered with a tool and
        without differs (a template that fails on tools shows none)."""
        chat = [{"role": "user", "content": "?"}]
        probe = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}
        render = self.tokenizer.apply_chat_template
        try:
            return render(chat, tools=[probe], tokenize=False) != render(chat, tokenize=False)
        except Exception:
            return False

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
        """Token ids of a text prompt, or of a chat (and its tools) rendered with the chat template. A
        forced call for a model without a tool-call format (`tool_choice` "required" or a named function)
        shows its tools in TOOLS_PREAMBLE when the template renders none; with such a template, the tool
        calls of assistant turns are written into their text."""
        if messages is None:
            if prompt is None:
                raise RequestError("no prompt: pass a prompt, prompt_token_ids or messages")
            return self.tokenizer(prompt).input_ids
        if not self.tokenizer.chat_template:
            raise RequestError("this model has no chat template: send a prompt instead of messages")
        messages = template_messages(messages)
        if not self.template_renders_tools and any(m.get("tool_calls") for m in messages):
            messages = calls_as_text(messages)
        if tools and self.tool_parser is None and forced_function(tool_choice)[0] and not self.template_renders_tools:
            messages = with_preamble(messages, tools_preamble(tools, tool_choice, parallel_tool_calls))
            tools = None
        # transformers renders templates in jinja2's immutable sandbox: a template cannot reach Python
        # internals, and message contents are data, never template code. Whatever the template raises
        # (its own raise_exception on bad roles, a sandbox violation) is this request's error.
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as e:
            raise RequestError(f"chat template failed: {type(e).__name__}: {e}") from e
        return self.tokenizer(rendered, add_special_tokens=False).input_ids

    def process(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None,
        params: SamplingParams,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: list[dict] | None = None,
        add_generation_prompt: bool = True,
        resume: Sequence[Sequence[int]] | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
        **request_options: Any,
    ) -> Request:
        """A `Request` ready to queue, or `RequestError`. `request_options` go to `Request` as they are."""
        if prompt is not None and not isinstance(prompt, str):
            prompt_token_ids, prompt = list(prompt), None
        params = params.with_defaults(self.generation_defaults)
        parser = None
        if tools and tool_choice != "none":
            if self.tool_parser is None:
                parser = json_call_parser(tool_choice)  # a forced call as plain JSON; auto is refused
            else:
                parser = self.tool_parser
                if self.token_markers and params.skip_special_tokens:
                    params = replace(params, skip_special_tokens=False)
        if prompt_token_ids is None:
            prompt_token_ids = self.encode_prompt(
                prompt,
                messages,
                add_generation_prompt,
                tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
            )
        ids = list(prompt_token_ids)
        self._check_prompt(request_id, ids)
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise RequestError(f"request {request_id}: logprobs={params.logprobs} > max_logprobs")
        if resume is not None and len(resume) != params.n:
            raise RequestError(f"request {request_id}: resume holds {len(resume)} samples, n={params.n}")
        req = Request(
            request_id,
            ids,
            params,
            prompt=prompt,
            resume=[list(r) for r in resume] if resume is not None else None,
            **request_options,
        )
        self._constrain(req, parser, tools, tool_choice, parallel_tool_calls)
        return req

    def _constrain(
        self,
        req: Request,
        parser: type[ToolParser] | None,
        tools: list[dict] | None,
        tool_choice: str | dict | None,
        parallel: bool,
    ) -> None:
        """Tools to parse and the grammar to follow; the grammar's compile starts now."""
        req.tools = tools
        req.tool_parser = request_parser(parser, tool_choice) if parser is not None else None
        spec = None
        if req.sampling_params.structured_outputs is not None:
            if parser is not None:
                raise RequestError("structured_outputs and tools both constrain the output: use one")
            spec = spec_from_params(req.sampling_params.structured_outputs)
        elif parser is not None and tools:
            spec = tool_grammar(parser, tools, tool_choice, self.token_markers, parallel=parallel)
        if spec is not None:
            if self.structured is None:
                raise RequestError("this engine has no structured-output support")
            self.structured.prepare(req, spec)

    def _check_prompt(self, request_id: str, ids: list[int]) -> None:
        if not ids:
            raise RequestError(f"request {request_id}: the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestError(f"request {request_id}: prompt token ids must be in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(
                f"request {request_id}: prompt has {len(ids)} tokens, max_model_len is {self.max_model_len} "
                "(prompt + at least one generated token must fit)"
            )
