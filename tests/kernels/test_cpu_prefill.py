"""The C++ prefill attention (pagedq_kernels/csrc/cpu_prefill.cpp) against float64 dense attention: chunks from
scratch and after a cached context, sliding windows, every group size up to wider than one task, head
sizes of one and several passes of the V product, blocks of keys cut short, the same bits on one thread
and on two, and the checks that refuse what would read outside a tensor."""

from __future__ import annotations

import pytest
import torch
from paged_cases import dense_attention, make_case, rel_err

from pagedq_kernels import cpu
from pagedq_kernels.reference import paged_attention_ref

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.2e-2}
EXT = cpu.extension()


def _built(dtype: torch.dtype, head_dim: int = 64) -> bool:
    return EXT is not None and EXT.prefill_supported(torch.empty(1, 1, head_dim, dtype=dtype))


DTYPES = [
    pytest.param(dt, id=name, marks=pytest.mark.skipif(not _built(dt), reason=f"prefill kernel not built for {name}"))
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
]


def _prefill(case, out: torch.Tensor) -> None:
    m, nd = case.meta, case.meta.num_decodes
    EXT.paged_prefill(case.query, case.k_cache, case.v_cache, m.block_tables[nd:], m.query_start_loc[nd:],
                      m.seq_lens[nd:], out, case.scale, case.window or 0)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "heads", "head_dim", "window"),
    [
        ([146] * 5, [146] * 5, (9, 3), 64, None),  # SmolLM2's heads, whole prompts
        ([1, 2, 63, 64, 65, 129], [1, 2, 63, 64, 65, 129], (9, 3), 64, None),  # key blocks cut short
        ([300, 700], [64, 200], (9, 3), 64, None),  # chunks after a cached context
        ([500], [200], (8, 1), 128, 37),  # a window shorter than the chunk
        ([90, 260], [90, 3], (4, 2), 64, 100),  # a window longer than a block
        ([70, 33], [70, 5], (130, 1), 64, None),  # a group wider than one task's rows
        ([90], [90], (4, 4), 256, None),  # no grouping, the widest head (4 passes of the V product)
        ([97], [97], (6, 2), 96, None),  # a head size of 1.5 passes
        ([50], [50], (2, 1), 32, None),  # the narrowest head bf16 takes (one word column)
    ],
)
def test_matches_dense_attention(dtype, seq_lens, query_lens, heads, head_dim, window):
    if not _built(dtype, head_dim):
        pytest.skip("head size not taken in this dtype")
    case = make_case(seq_lens, query_lens, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                     block_size=16, dtype=dtype, window=window, num_decodes=0)  # fmt: skip
    out = torch.full(case.query.shape, float("nan"), dtype=dtype)  # poisoned: every row must be written
    _prefill(case, out)
    want = dense_attention(case)
    assert rel_err(out, want) < TOL[dtype]
    ref = paged_attention_ref(case.query, case.k_cache, case.v_cache, case.fresh_meta(), scale=case.scale,
                              sliding_window=window)  # fmt: skip
    assert rel_err(out, want) <= 2 * rel_err(ref, want) + 1e-7  # about as exact as the torch reference


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mixed_step_leaves_the_decode_rows_to_the_decode_kernel(dtype):
    case = make_case([40, 200, 17, 300], [1, 1, 17, 150], num_q_heads=9, num_kv_heads=3, head_dim=64,
                     block_size=16, dtype=dtype)  # fmt: skip
    out = torch.full(case.query.shape, float("nan"), dtype=dtype)
    _prefill(case, out)
    assert torch.isnan(out[:2]).all(), "the prefill kernel wrote a decode's rows"
    assert torch.isfinite(out[2:]).all()
    got = cpu.paged_attention_cpu(case.query, case.k_cache, case.v_cache, case.fresh_meta(), scale=case.scale)
    assert rel_err(got, dense_attention(case)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_thread_and_two_give_the_same_bits(dtype):
    case = make_case([146, 300, 64], [146, 120, 64], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                     dtype=dtype, num_decodes=0)  # fmt: skip
    outs = []
    threads = torch.get_num_threads()
    for n in (1, 2):
        torch.set_num_threads(n)
        try:
            out = torch.empty(case.query.shape, dtype=dtype)
            _prefill(case, out)
            outs.append(out)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_what_it_takes_is_what_it_reports():
    assert cpu.supported(torch.empty(1, 1, 64), torch.empty(1, 16, 1, 64))
    if not _built(torch.float32):
        pytest.skip("prefill kernel not built here")
    assert _built(torch.float32, 80)  # fp32: head sizes in multiples of 16
    assert not _built(torch.bfloat16, 80)  # bf16: in multiples of 32
    assert not _built(torch.float16) and not _built(torch.float32, 272)


@pytest.mark.skipif(not _built(torch.float32), reason="prefill kernel not built here")
@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("table", "points outside the cache"),
        ("short", "fewer keys than query rows"),
        ("rows", "outside q"),
        ("width", "more blocks than its table has"),
        ("dtype", "of one dtype"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(breakage, message):
    case = make_case([40, 50], [40, 50], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, num_decodes=0)
    m = case.meta
    tables, starts, lens, k_cache = m.block_tables.clone(), m.query_start_loc.clone(), m.seq_lens.clone(), case.k_cache
    if breakage == "table":
        tables[1, 0] = case.k_cache.shape[0]
    elif breakage == "short":
        lens[0] = 39
    elif breakage == "rows":
        starts[2] = case.query.shape[0] + 1
    elif breakage == "width":
        lens[1] = 16 * tables.shape[1] + 1
    else:
        k_cache = k_cache.double()
    out = torch.full(case.query.shape, 7.0)
    with pytest.raises(RuntimeError, match=message):
        EXT.paged_prefill(case.query, k_cache, case.v_cache, tables, starts, lens, out, case.scale, 0)
    assert torch.all(out == 7.0)


def test_the_switch_sends_prefills_to_the_reference(monkeypatch):
    case = make_case([5, 60], [1, 30], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    calls, reference = [], cpu.prefill_ref
    monkeypatch.setattr(cpu, "prefill_ref", lambda *a, **k: calls.append(1) or reference(*a, **k))
    monkeypatch.setenv(cpu.PREFILL_ENV, "0")
    got = cpu.paged_attention_cpu(case.query, case.k_cache, case.v_cache, case.fresh_meta(), scale=case.scale)
    assert calls and rel_err(got, dense_attention(case)) < 1e-5
    monkeypatch.delenv(cpu.PREFILL_ENV)
    calls.clear()
    got = cpu.paged_attention_cpu(case.query, case.k_cache, case.v_cache, case.fresh_meta(), scale=case.scale)
    assert (not calls) == _built(torch.float32) and rel_err(got, dense_attention(case)) < 1e-5


AMX = {"amx_tile", "amx_bf16"} <= cpu.cpu_flags() and "-mavx512bf16" in cpu._compile_flags()


@pytest.mark.skipif(not AMX or not _built(torch.bfloat16), reason="no AMX tiles on this CPU")
def test_bf16_runs_on_the_amx_tiles_where_the_cpu_has_them(tmp_path):
    """The same prefill with PAGEDQ_CPU_AMX=0 (the vector path, in a child process) sums in another order: some
    outputs differ in their last bits, both within the tolerance of dense attention."""
    import os
    import subprocess
    import sys

    case = make_case([300, 146], [200, 146], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                     dtype=torch.bfloat16, num_decodes=0)  # fmt: skip
    m = case.meta
    args = (case.query, case.k_cache, case.v_cache, m.block_tables, m.query_start_loc, m.seq_lens, case.scale)
    torch.save(args, tmp_path / "in.pt")
    script = (
        "import sys, torch; from pagedq_kernels import cpu; q, k, v, bt, qs, sl, sc = torch.load(sys.argv[1]); "
        "out = torch.empty_like(q); cpu.extension().paged_prefill(q, k, v, bt, qs, sl, out, sc, 0); "
        "torch.save(out, sys.argv[2])"
    )
    env = {**os.environ, "PAGEDQ_CPU_AMX": "0"}
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env, check=True
    )
    vector = torch.load(tmp_path / "out.pt")
    tiles = torch.empty_like(case.query)
    _prefill(case, tiles)
    want = dense_attention(case)
    assert not torch.equal(tiles, vector)
    assert rel_err(tiles, want) < TOL[torch.bfloat16] and rel_err(vector, want) < TOL[torch.bfloat16]
