"""Attention over the paged KV cache: Triton on CUDA, plain torch elsewhere (see dispatch.py)."""

from kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
