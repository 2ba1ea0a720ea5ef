"""Engine options, with vLLM's names. One flat `EngineConfig` is what users set; the scheduler gets the
derived, resolved `SchedulerConfig` once the model is known."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from worker.options import add_cli_args, from_cli_args
from worker.options import option as _opt

TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral")
QUANTIZATION_METHODS = ("int8",)  # worker/models/quantization.py METHODS


class ConfigError(ValueError):
    """An engine option is invalid; the message names the option and why."""


@dataclass
class EngineConfig:
    model: str = _opt("", "Hugging Face model folder (config.json + safetensors) or a .gguf file")
    tokenizer: str | None = _opt(None, "tokenizer folder (default: the model folder)")
    dtype: str = _opt(
        "auto",
        "auto | float32 | float16 | bfloat16 (auto: the checkpoint's; on CPU bf16 only with native bf16, else fp32)",
    )
    device: str = _opt("auto", "auto | cpu | cuda | cuda:N")
    quantization: str | None = _opt(
        None, "int8: weight-only int8 per output channel, quantized at load (CPU only; default: the checkpoint's dtype)"
    )
    seed: int = _opt(0, "seed of the default sampling generator")
    block_size: int = _opt(16, "tokens per KV cache block")
    max_num_seqs: int = _opt(256, "most sequences running at once")
    max_num_batched_tokens: int | None = _opt(
        None, "token budget of one step (default: 2048 with chunked prefill, else max-model-len)"
    )
    max_model_len: int | None = _opt(None, "longest prompt + output (default: the model's limit)")
    enable_chunked_prefill: bool = _opt(
        True, "split long prompts into chunks mixed with decodes; off: prefill-only and decode-only steps"
    )
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of shared prompt prefixes")
    gpu_memory_utilization: float = _opt(0.9, "fraction of GPU memory for weights, activations and KV")
    kv_cache_memory: int | None = _opt(
        None, "KV cache bytes (CPU default: 1 GiB); overrides --gpu-memory-utilization", type=int
    )
    num_kv_blocks: int | None = _opt(None, "exact number of KV blocks (tests and benchmarks)")
    scheduling_policy: str = _opt("fcfs", "fcfs | priority (higher priority first, then arrival)")
    low_priority_max_seqs: int | None = _opt(
        None,
        "while sequences of priority >= 0 are in the engine (or left less than 2 s ago), sequences of "
        "negative priority (the low lane: batches) run at most this many at once; the rest wait and "
        "running ones over it are preempted (default: 2 on CPU, max-num-seqs // 16 on a GPU; 0: no cap)",
        type=int,
    )
    low_priority_max_batched_tokens: int | None = _opt(
        None,
        "tokens a step that sequences of negative priority (batches) may take between them, prompt chunks "
        "and decodes, whether or not others run: bounds how long a step of batch work keeps an arriving "
        "interactive request waiting (default: 128 on CPU, where a token costs about 1 ms of the step on "
        "2 cores with SmolLM2; 0 on a GPU: no bound beyond --max-num-batched-tokens)",
        type=int,
    )
    watermark: float = _opt(0.01, "fraction of KV blocks kept free for running sequences at admission")
    long_prefill_token_threshold: int = _opt(
        0,
        "a prompt with more tokens than this to compute is long; no prompt chunk is longer "
        "(0: 4%% of --max-model-len on CPU, at least 256, where chunks were measured; no cap on GPU)",
    )
    max_num_partial_prefills: int = _opt(1, "prompts that may be part-way through a chunked prefill at once")
    max_long_partial_prefills: int | None = _opt(
        None, "long prompts among them (default: --max-num-partial-prefills); fewer keeps slots for short ones"
    )
    long_prefill_budget: int | None = _opt(
        None,
        "while sequences decode, cost in tokens of one step's long-prompt chunks, a token at position p "
        "costing 1 + p/K (K: the context where attention costs as much as the linear layers); "
        "0: no limit (default: 32 on CPU, where it was measured; 0 on GPU)",
    )
    fair_share_prefill_tokens: int = _opt(
        16,
        "while requests of several tenants are in, prompt tokens a step for tenants that had more than their "
        "weighted share of the recent work (none in a step with another tenant's prompt; 0: no fair share)",
    )
    enforce_eager: bool = _opt(False, "never capture CUDA graphs")
    max_logprobs: int = _opt(20, "most top logprobs a request may ask for")
    chat_template: str | None = _opt(
        None, "a Jinja chat template file used instead of the tokenizer's (e.g. one that renders tools)"
    )
    tool_call_parser: str | None = _opt(
        None, "hermes | llama3_json | mistral: the model's tool-call format (default: detected from the chat template)"
    )
    grammar_compile_timeout: float = _opt(
        10.0, "seconds a structured-output grammar may take to compile before its request fails"
    )
    generation_config: str = _opt(
        "auto",
        "auto | vllm | FOLDER: sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) for "
        "what a request leaves unset: auto: the model folder's generation_config.json; vllm: none (vLLM's); "
        "FOLDER: the generation_config.json there",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"--{name.replace('_', '-')}={getattr(self, name)!r}: {why}")

        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half"):
            raise bad("dtype", "choose auto, float32, float16 or bfloat16")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise bad("quantization", f"choose {', '.join(QUANTIZATION_METHODS)} (or leave it unset)")
        if self.block_size < 1:
            raise bad("block_size", "must be at least 1")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", "must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "must be at least 2")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise bad("kv_cache_memory", "must be a positive number of bytes")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", "must be at least 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise bad("scheduling_policy", "choose fcfs or priority")
        if not 0.0 <= self.watermark < 1.0:
            raise bad("watermark", "must be in [0, 1)")
        if self.long_prefill_token_threshold < 0:
            raise bad("long_prefill_token_threshold", "must be >= 0")
        if self.max_num_partial_prefills < 1:
            raise bad("max_num_partial_prefills", "must be at least 1")
        if self.max_long_partial_prefills is not None and not (
            1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills
        ):
            raise bad("max_long_partial_prefills", "must be at least 1 and at most --max-num-partial-prefills")
        if self.fair_share_prefill_tokens < 0:
            raise bad("fair_share_prefill_tokens", "must be >= 0")
        if self.low_priority_max_seqs is not None and self.low_priority_max_seqs < 0:
            raise bad("low_priority_max_seqs", "must be >= 0")
        if self.low_priority_max_batched_tokens is not None and self.low_priority_max_batched_tokens < 0:
            raise bad("low_priority_max_batched_tokens", "must be >= 0")
        if self.long_prefill_budget is not None and self.long_prefill_budget < 0:
            raise bad("long_prefill_budget", "must be >= 0")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSER_NAMES:
            raise bad("tool_call_parser", f"choose one of {', '.join(TOOL_PARSER_NAMES)}")
        if not self.grammar_compile_timeout > 0:
            raise bad("grammar_compile_timeout", "must be > 0 seconds")
        if not self.generation_config:
            raise bad("generation_config", "choose auto, vllm or a folder")

    # --- command line ----------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
        """One `--flag` per field (env `PAGEDQ_<FIELD>` as the default where set)."""
        add_cli_args(cls, parser, "engine", skip=skip)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        return from_cli_args(cls, args, **overrides)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    policy: str
    long_prefill_token_threshold: int  # resolved by the engine; 0: no prompt is long, chunks are not capped
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_budget: int = 0  # 0: long chunks are not sized by cost
    attention_cost_context: int = 1024  # prefill_cost.attention_cost_context(model config)
    fair_share_prefill_tokens: int = 0  # 0: no fair share between tenants in the step
    low_priority_max_seqs: int = 0  # 0: no cap on negative-priority sequences under contention
    low_priority_max_batched_tokens: int = 0  # 0: negative-priority tokens a step bounded by the step's budget only
    contention_hold_s: float = 2.0  # the cap holds this long after the last priority >= 0 sequence left

    def __post_init__(self) -> None:
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ConfigError(
                f"--max-long-partial-prefills={self.max_long_partial_prefills} must be at least 1 and at most "
                f"--max-num-partial-prefills={self.max_num_partial_prefills}"
            )
        if self.attention_cost_context < 1:
            raise ConfigError(f"attention_cost_context={self.attention_cost_context}: must be at least 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens={self.max_num_batched_tokens} is below --max-model-len="
                f"{self.max_model_len}: without chunked prefill a whole prompt must fit in one step"
            )
