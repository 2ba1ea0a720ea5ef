"""How `LLMEngine` builds its parts from an `EngineConfig` and the loaded model: one builder per part that
takes more than its constructor (the tokenizer and its chat template, the context length, the scheduler's
options with their CPU and GPU defaults resolved, the model runner, the input processor, the limits)."""

from __future__ import annotations

from worker.engine.config import EngineConfig, SchedulerConfig
from worker.engine.generation_defaults import load_generation_defaults
from worker.engine.input_processor import InputProcessor
from worker.engine.model_runner import ModelRunner
from worker.engine.prefill_cost import attention_cost_context
from worker.engine.stats import EngineLimits
from worker.engine.structured import StructuredOutputManager
from worker.engine.tool_calling import choose_tool_parser, read_chat_template
from worker.models.loader import LoadedModel, load_tokenizer

MIN_CPU_CHUNK = 256  # smallest default prompt chunk on CPU, in tokens


def build_tokenizer(cfg: EngineConfig, loaded: LoadedModel):
    tokenizer = load_tokenizer(loaded.tokenizer_path, loaded.gguf_file)
    if cfg.chat_template:
        tokenizer.chat_template = read_chat_template(cfg.chat_template)
    return tokenizer


def resolve_max_model_len(cfg: EngineConfig, loaded: LoadedModel) -> int:
    """--max-model-len, else the model's limit (2048 if it states none); never above the model's limit."""
    model_limit = int(getattr(loaded.config, "max_position_embeddings", 0) or 2048)
    if cfg.max_model_len and cfg.max_model_len > model_limit:
        raise ValueError(f"--max-model-len={cfg.max_model_len} exceeds the model's limit of {model_limit}")
    return min(cfg.max_model_len or model_limit, model_limit)


def build_scheduler_config(cfg: EngineConfig, loaded: LoadedModel, max_model_len: int) -> SchedulerConfig:
    chunked = cfg.enable_chunked_prefill
    budget = cfg.max_num_batched_tokens or (2048 if chunked else max_model_len)
    # Chunk sizing defaults measured on CPU (ops/bench serve --long-prompt-only); GPU keeps vLLM's.
    on_cpu = chunked and loaded.device.type == "cpu"
    # 4% of the context, but never chunks so small that a step is mostly overhead (a short
    # --max-model-len once gave 7-token chunks and a 10x slower prefill).
    cpu_threshold = max(MIN_CPU_CHUNK, max_model_len * 4 // 100)
    threshold = cfg.long_prefill_token_threshold or (cpu_threshold if on_cpu else 0)
    long_budget = cfg.long_prefill_budget if cfg.long_prefill_budget is not None else (32 if on_cpu else 0)
    return SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        policy=cfg.scheduling_policy,
        long_prefill_token_threshold=threshold,
        max_num_partial_prefills=cfg.max_num_partial_prefills,
        max_long_partial_prefills=cfg.max_long_partial_prefills or cfg.max_num_partial_prefills,
        long_prefill_budget=long_budget,
        attention_cost_context=attention_cost_context(loaded.config),
        fair_share_prefill_tokens=cfg.fair_share_prefill_tokens,
        low_priority_max_seqs=low_priority_max_seqs(cfg, loaded),
        low_priority_max_batched_tokens=low_priority_max_batched_tokens(cfg, loaded),
    )


def low_priority_max_seqs(cfg: EngineConfig, loaded: LoadedModel) -> int:
    """--low-priority-max-seqs, else 2 on CPU, where every sequence in a step costs compute (measured:
    ops/bench/RESULTS.md, "Batch API beside interactive traffic"), and max-num-seqs // 16 on a GPU, where a
    decode step costs about the same for a few more sequences (not measured yet)."""
    if cfg.low_priority_max_seqs is not None:
        return cfg.low_priority_max_seqs
    return 2 if loaded.device.type == "cpu" else max(1, cfg.max_num_seqs // 16)


def low_priority_max_batched_tokens(cfg: EngineConfig, loaded: LoadedModel) -> int:
    """--low-priority-max-batched-tokens, else 128 on CPU: a step of batch work alone then takes about 0.1 s
    with SmolLM2 on 2 cores (a 2,048-token prompt chunk took 1.3 s, and an interactive request arriving
    meanwhile waited for all of it; ops/bench/RESULTS.md, "Batch API beside interactive traffic"); 0 (no
    bound) on a GPU, where steps are short (not measured)."""
    if cfg.low_priority_max_batched_tokens is not None:
        return cfg.low_priority_max_batched_tokens
    return 128 if loaded.device.type == "cpu" else 0


def build_model_runner(
    cfg: EngineConfig, loaded: LoadedModel, sched: SchedulerConfig, eos_token_ids: frozenset[int]
) -> ModelRunner:
    """The model on its device with the KV cache allocated (sized from the config or the free memory)."""
    return ModelRunner(
        loaded,
        eos_token_ids=eos_token_ids,
        block_size=cfg.block_size,
        max_model_len=sched.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        num_kv_blocks=cfg.num_kv_blocks,
        kv_cache_memory=cfg.kv_cache_memory,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=cfg.enforce_eager,
    )


def build_input_processor(
    cfg: EngineConfig, loaded: LoadedModel, tokenizer, max_model_len: int, structured: StructuredOutputManager
) -> InputProcessor:
    return InputProcessor(
        tokenizer,
        vocab_size=int(loaded.config.vocab_size),
        max_model_len=max_model_len,
        max_logprobs=cfg.max_logprobs,
        structured=structured,
        tool_parser=choose_tool_parser(cfg.tool_call_parser, tokenizer.chat_template),
        generation_defaults=load_generation_defaults(cfg.generation_config, cfg.model),
    )


def build_limits(cfg: EngineConfig, loaded: LoadedModel, runner: ModelRunner, sched: SchedulerConfig) -> EngineLimits:
    return EngineLimits(
        model=cfg.model,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=sched.max_model_len,
        block_size=cfg.block_size,
        num_kv_blocks=runner.num_blocks,
        kv_cache_bytes=runner.num_blocks * runner.bytes_per_block,
        dtype=str(runner.dtype).removeprefix("torch."),
        device=str(runner.device),
        max_logprobs=cfg.max_logprobs,
        vocab_size=int(loaded.config.vocab_size),
    )
