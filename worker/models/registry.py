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


class UnsupportedArchitecture(ValueError):
    pass


def model_class(architectures: list[str] | None) -> type:
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedArchitecture(
        f"architecture {architectures} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
