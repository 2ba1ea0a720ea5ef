"""Triton, when it is installed: every kernel module imports `triton`, `tl` and `jit` from here.

Without a Triton wheel (some CPU platforms) the kernel modules still import; nothing launches, and the
dispatcher says why. `jit(**options)` forwards options such as `do_not_specialize` to `triton.jit`.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

HAS_TRITON = triton is not None


def jit(fn=None, **options):
    """`triton.jit`, usable bare (`@jit`) or with options (`@jit(do_not_specialize=[...])`)."""
    if triton is None:
        return fn if fn is not None else (lambda f: f)
    return triton.jit(fn, **options) if fn is not None else triton.jit(**options)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
