"""Greedy sampling's argmax on the CPU (pagedq_kernels/csrc/cpu_sample.cpp) against torch's `max(dim=-1).indices`:
the same index in every case torch defines, ties (the first maximum), NaN (the first NaN), rows of -inf,
rows shorter than a vector and rows that are slices of a wider tensor."""

from __future__ import annotations

import pytest
import torch

from pagedq_kernels import cpu
from pagedq_kernels.cpu import greedy_argmax

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


def _want(x: torch.Tensor) -> torch.Tensor:
    return x.max(dim=-1).indices


def test_the_vector_path_is_built_where_the_build_targets_avx512():
    ext = cpu.extension()
    assert ext is not None
    assert ext.greedy_argmax_fast() == ("-mavx512bw" in cpu._compile_flags())


@DTYPES
@pytest.mark.parametrize("rows,n", [(1, 1), (3, 15), (5, 16), (7, 33), (64, 49152), (2, 151936)])
def test_the_index_of_each_rows_first_maximum(dtype, rows, n):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = (torch.randn(rows, n, generator=g) * 4).to(dtype)
    got = greedy_argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, _want(x))


@DTYPES
def test_ties_go_to_the_first_maximum_in_any_lane_or_tail(dtype):
    x = torch.zeros(6, 50, dtype=dtype)
    x[0, [3, 19, 35]] = 2.0  # same lane of three chunks
    x[1, [17, 2]] = 2.0  # an earlier lane in a later chunk loses to the earlier index
    x[2, [49, 48]] = 2.0  # both in the tail
    x[3, [5, 48]] = 2.0  # chunk before tail
    x[4] = 1.0  # every element ties
    x[5, 47] = 3.0  # the last element of the last full chunk
    assert torch.equal(greedy_argmax(x), _want(x))
    assert greedy_argmax(x).tolist() == [3, 2, 48, 5, 0, 47]


@DTYPES
def test_nan_and_infinities_as_torch(dtype):
    x = torch.randn(5, 40).to(dtype)
    x[0, [7, 30]] = float("nan")
    x[1, 39] = float("nan")  # only in the tail
    x[2] = float("-inf")
    x[3, 12] = float("inf")
    x[4, :] = float("-inf")
    x[4, 35] = -1.0
    assert torch.equal(greedy_argmax(x), _want(x))
    assert greedy_argmax(x).tolist()[:4] == [7, 39, 0, 12]


def test_rows_sliced_from_a_wider_tensor_and_other_layouts():
    wide = torch.randn(8, 100)
    x = wide[:, 10:90]  # unit stride, rows 100 apart
    assert torch.equal(greedy_argmax(x), _want(x))
    t = torch.randn(40, 8).t()  # not unit stride on the last dim: torch does it
    assert torch.equal(greedy_argmax(t), _want(t))
    assert greedy_argmax(torch.empty(0, 16)).shape == (0,)
    d = torch.randn(4, 20, dtype=torch.float64)  # a dtype the extension does not take: torch does it
    assert torch.equal(greedy_argmax(d), _want(d))


def test_bad_input_is_a_typed_error():
    ext = cpu.extension()
    with pytest.raises(RuntimeError, match="greedy_argmax"):
        ext.greedy_argmax(torch.randn(3))
    with pytest.raises(RuntimeError, match="greedy_argmax"):
        ext.greedy_argmax(torch.randn(3, 4).double())
