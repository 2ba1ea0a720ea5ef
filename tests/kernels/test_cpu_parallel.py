"""The kernels' scheduler (pagedq_kernels/csrc/cpu_parallel.h): every item runs exactly once, and a thread that
is held up has the rest of its share taken over by the others, the case of a core lent to Redis or the
client for a while. The kernels built on it give the same bits on any number of threads."""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_case

from pagedq_kernels import cpu


@pytest.fixture
def threads():
    before = torch.get_num_threads()

    def use(n: int) -> None:
        torch.set_num_threads(n)

    yield use
    torch.set_num_threads(before)


def _trace(n: int, hold_caller: bool) -> torch.Tensor:
    ext = cpu.extension()
    assert ext is not None
    return ext.shares_trace(n, hold_caller)


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_every_item_runs_exactly_once(threads, n, num_threads):
    threads(num_threads)
    trace = _trace(n, hold_caller=False)
    assert torch.equal(trace[:, 0], torch.ones(n, dtype=torch.long))
    assert set(trace[:, 1].tolist()) <= set(range(num_threads))


def test_a_held_thread_has_its_share_finished_by_the_other(threads):
    threads(2)
    # shares [0, 8) and [8, 16); thread 0 waits on its first item until all the others are done, so it runs
    # that one item (none if the other thread took its whole share before it started), not its share of 8
    trace = _trace(16, hold_caller=True)
    assert torch.equal(trace[:, 0], torch.ones(16, dtype=torch.long))
    assert (trace[:, 1] == 0).sum() <= 1, "thread 0's share was not taken over while it was held"


def test_bad_arguments_are_refused():
    with pytest.raises(RuntimeError, match="n must be positive"):
        _trace(0, hold_caller=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [[3, 64, 65, 200, 17, 90, 33], [200]], ids=["7-requests", "1-request"])
def test_decode_attention_gives_the_same_bits_on_one_two_and_three_threads(threads, dtype, lens):
    case = make_case(lens, [1] * len(lens), num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append(
            cpu.paged_attention_cpu(case.query, case.k_cache, case.v_cache, case.fresh_meta(), scale=case.scale)
        )
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
