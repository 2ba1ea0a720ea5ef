"""Attention over the paged KV cache and the fused layer ops: Triton on CUDA, plain torch elsewhere
(see dispatch.py)."""

# The submodule pagedq_kernels.paged_attention is loaded here, before the function of the same name is bound:
# loaded later (lazily, by the dispatcher) it would rebind the package attribute `paged_attention`
# from the function to the module.
from pagedq_kernels import paged_attention as _triton_attention_module  # noqa: F401
from pagedq_kernels.cache_ops import copy_blocks
from pagedq_kernels.decode import decode_num_partitions, reserve_decode_workspace
from pagedq_kernels.dispatch import paged_attention, set_backend, use_backend, write_kv
from pagedq_kernels.fused import add_rms_norm, rms_norm, rotary_embedding, rotary_write_kv, silu_and_mul
from pagedq_kernels.metadata import AttentionMetadata, DecodeWorkspace

__all__ = [
    "AttentionMetadata",
    "DecodeWorkspace",
    "add_rms_norm",
    "copy_blocks",
    "decode_num_partitions",
    "paged_attention",
    "reserve_decode_workspace",
    "rms_norm",
    "rotary_embedding",
    "rotary_write_kv",
    "set_backend",
    "silu_and_mul",
    "use_backend",
    "write_kv",
]
