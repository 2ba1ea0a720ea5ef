"""Values that change from step to step (the decode count before the prefills, the block-table width,
the decode split, the window) never change a kernel's Triton specialization key: a new value must
not compile a new kernel in the middle of serving.

Every launch of a serving-like sequence of steps is recorded (not run) and bound with Triton's own
binder, which computes the key a real launch compiles under; the keys of one kernel must all agree.
"""

from __future__ import annotations

import pytest
import torch

triton_jit = pytest.importorskip("triton.runtime.jit")
from triton.backends.compiler import BaseBackend  # noqa: E402

import pagedq_kernels.cache_ops as cache_ops  # noqa: E402
import pagedq_kernels.decode as decode  # noqa: E402
import pagedq_kernels.fused_triton as fused  # noqa: E402
import pagedq_kernels.prefill as prefill  # noqa: E402
from pagedq_kernels import AttentionMetadata  # noqa: E402
from pagedq_kernels.fused_triton import rms_norm_triton, rotary_triton, silu_and_mul_triton  # noqa: E402
from pagedq_kernels.paged_attention import paged_attention_triton  # noqa: E402

KERNELS = {
    "prefill": (prefill, "_prefill_kernel"),
    "decode": (decode, "_decode_kernel"),
    "combine": (decode, "_combine_kernel"),
    "write_kv": (cache_ops, "_write_kv_kernel"),
    "rms_norm": (fused, "_rms_norm_kernel"),
    "silu_and_mul": (fused, "_silu_and_mul_kernel"),
    "rotary": (fused, "_rotary_kernel"),
}


def _do_not_specialize(kernel) -> list:
    """The option as declared, whether the kernel is a JITFunction or an interpreter wrapper."""
    if hasattr(kernel, "do_not_specialize"):
        return list(kernel.do_not_specialize)
    return list(kernel.kwargs.get("do_not_specialize") or [])


def _binder(kernel, honour_options: bool = True):
    jf = triton_jit.JITFunction(kernel.fn, do_not_specialize=_do_not_specialize(kernel) if honour_options else None)
    return triton_jit.create_function_from_signature(jf.signature, jf.params, BaseBackend)


class _Recorder:
    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[tuple, dict]]] = {name: [] for name in KERNELS}

    def patch(self, monkeypatch) -> None:
        for name, (module, attr) in KERNELS.items():
            monkeypatch.setattr(module, attr, _Launch(self.calls[name]))


class _Launch:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the arguments, runs nothing."""

    def __init__(self, sink: list) -> None:
        self.sink = sink

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append((args, kwargs))


def _step(num_decodes: int, prefill_lens: list[int], context: int, width: int, **kw) -> None:
    """One layer of one step of a GQA model (8 query heads, 2 KV heads, D=64, blocks of 16)."""
    hq, hkv, d, bs = 8, 2, 64, 16
    n = num_decodes + len(prefill_lens)
    qlens = [1] * num_decodes + prefill_lens
    loc = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    t = int(loc[-1])
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    k_cache = torch.zeros(64, bs, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    seq_lens = [context] * num_decodes + [context + p for p in prefill_lens]
    meta = AttentionMetadata(
        query_start_loc=loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(n, width, dtype=torch.int32),
        slot_mapping=torch.arange(t),
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        seq_lens_host=seq_lens,
    )
    x = torch.randn(t, 256)
    rms_norm_triton(x, torch.ones(256), 1e-6, residual=x)
    silu_and_mul_triton(torch.randn(t, 512))
    cos = sin = torch.randn(4096, d)
    rotary_triton(torch.arange(t), q, k, cos, sin, v, k_cache, v_cache, meta.slot_mapping)
    cache_ops.write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    paged_attention_triton(q, k_cache, v_cache, meta, scale=0.125, **kw)


def _serving_steps() -> None:
    """Decode counts 0, 1, 16, 37; block-table widths 1, 16, 17; 1, 2, 3 and 16 decode partitions."""
    for window in (None, 100):
        _step(0, [5], 0, 1, sliding_window=window)
        _step(1, [33], 40, 1, sliding_window=window)
        _step(16, [7, 64], 200, 16, sliding_window=window)
        _step(37, [3], 250, 17, sliding_window=window)
        _step(1, [], 2000, 16, sliding_window=window, num_partitions=2)
        _step(3, [], 3000, 17, sliding_window=window, num_partitions=3)
        _step(2, [], 5000, 16, sliding_window=window, num_partitions=16)
        _step(16, [], 5000, 1, sliding_window=window)


def _keys(kernel, calls, honour_options: bool = True) -> set[str]:
    bind = _binder(kernel, honour_options)
    keys = set()
    for args, kwargs in calls:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        _, specialization, _ = bind(*args, **kwargs)
        keys.add(str(specialization))
    return keys


@pytest.fixture(scope="module")
def recorded():
    mp = pytest.MonkeyPatch()
    originals = {name: getattr(module, attr) for name, (module, attr) in KERNELS.items()}
    rec = _Recorder()
    rec.patch(mp)
    try:
        _serving_steps()
    finally:
        mp.undo()
    return originals, rec.calls


@pytest.mark.parametrize("name", list(KERNELS))
def test_one_specialization_per_kernel_across_steps(recorded, name):
    originals, calls = recorded
    assert len(calls[name]) >= 4, f"{name} was launched {len(calls[name])} times"
    # The window on/off is a compile-time switch (USE_WINDOW, one per layer kind): one key per value.
    for use_window in (True, False, None):
        group = [c for c in calls[name] if c[1].get("USE_WINDOW") == use_window]
        if group:
            keys = _keys(originals[name], group)
            assert len(keys) == 1, f"{name} with USE_WINDOW={use_window}: {len(keys)} specializations"


@pytest.mark.parametrize("name", ["prefill", "decode", "combine"])
def test_without_the_options_the_keys_would_differ(recorded, name):
    """The check above can fail: Triton's default specialization splits these launches."""
    originals, calls = recorded
    assert len(_keys(originals[name], calls[name], honour_options=False)) > 2
