"""Attention over the paged KV cache: Triton on CUDA, plain torch elsewhere (see dispatch.py)."""

# The submodule kernels.paged_attention is loaded here, before the function of the same name is bound:
# loaded later (lazily, by the dispatcher) it would rebind the package attribute `paged_attention`
# from the function to the module.
from kernels import paged_attention as _triton_attention_module  # noqa: F401
from kernels.cache_ops import copy_blocks
from kernels.dispatch import paged_attention, set_backend, use_backend, write_kv
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "copy_blocks", "paged_attention", "set_backend", "use_backend", "write_kv"]
