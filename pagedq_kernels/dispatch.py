"""The one dispatch point: Triton for CUDA tensors; on the CPU the C++ decode kernel with the torch
reference for prefill ("cpu", see pagedq_kernels/cpu.py), or the plain reference ("torch").

The choice can be forced, for tests and benchmarks, by `set_backend(name)`, the `use_backend(name)`
context manager, or the environment variable PAGEDQ_ATTENTION_BACKEND, in that order of precedence.
Under TRITON_INTERPRET=1 the Triton backend runs on CPU tensors (that is how the kernel tests work).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from pagedq_kernels.metadata import AttentionMetadata

BACKENDS = ("triton", "cpu", "torch")
ENV_VAR = "PAGEDQ_ATTENTION_BACKEND"

_forced: str | None = None


def _check(name: str | None) -> str | None:
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    return name


def set_backend(name: str | None) -> None:
    """Force every call onto `name` (one of BACKENDS); None restores the automatic choice."""
    global _forced
    _forced = _check(name)


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """`with use_backend("triton"): ...` forces the backend inside the block, then restores it."""
    global _forced
    previous = _forced
    _forced = _check(name)
    try:
        yield
    finally:
        _forced = previous


def backend_for(tensor: torch.Tensor) -> str:
    """The backend a call on `tensor` goes to."""
    if _forced is not None:
        return _forced
    env = os.environ.get(ENV_VAR)
    if env:
        return _check(env.strip().lower())
    return "triton" if tensor.is_cuda else "cpu"


def need_triton() -> None:
    """Raise a clear error when a call went to the Triton backend and Triton is not installed."""
    from pagedq_kernels.triton_compat import HAS_TRITON

    if not HAS_TRITON:
        raise RuntimeError("the triton backend needs the triton package, which is not installed")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value `[T, Hkv, D]` at `slot_mapping` (block_id * block_size + offset; < 0 = skip)."""
    if backend_for(k_cache) == "triton":
        from pagedq_kernels.cache_ops import write_kv_triton

        need_triton()
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        from pagedq_kernels.reference import write_kv_ref

        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query` `[T, Hq, D]` over the paged cache; returns `[T, Hq, D]` in query's dtype.

    Causal inside each request's chunk, full over its earlier context; with `sliding_window` w a key
    is visible iff q_pos - k_pos < w. `out`, when given, receives the result and is returned.
    """
    if backend_for(query) == "triton":
        from pagedq_kernels.paged_attention import paged_attention_triton

        need_triton()
        return paged_attention_triton(
            query, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window, out=out
        )
    if backend_for(query) == "cpu":
        from pagedq_kernels.cpu import paged_attention_cpu

        return paged_attention_cpu(query, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window, out=out)
    from pagedq_kernels.reference import paged_attention_ref

    return paged_attention_ref(query, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window, out=out)
