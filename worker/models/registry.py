"""`architectures` in config.json -> the model class that runs it. Adding a family is one file plus
one line here."""

from __future__ import annotations

from worker.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


# GGUF files carry a model type but no `architectures` list.
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedArchitecture(ValueError):
    pass


def model_class(architectures: list[str] | None, model_type: str | None = None) -> type:
    if not architectures and model_type in MODEL_TYPES:
        architectures = [MODEL_TYPES[model_type]]
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedArchitecture(
        f"architecture {architectures} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
