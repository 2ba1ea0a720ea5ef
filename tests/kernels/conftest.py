"""The `device` the Triton kernel tests run on.

"cpu": CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, what tests/conftest.py sets
unless the environment says otherwise). "cuda": real kernels on a GPU, marked `gpu`; run them with
`TRITON_INTERPRET=0 python -m pytest -m gpu tests/kernels tests/gpu` (the interpreter must be off
before the kernels are defined, so one process runs either set, never both).
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_CPU = pytest.param(
    "cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
)
_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(
            INTERPRETED and torch.cuda.is_available(),
            reason="real kernels need TRITON_INTERPRET=0 (TRITON_INTERPRET=0 pytest -m gpu)",
        ),
    ],
)


@pytest.fixture(params=[_CPU, _CUDA])
def device(request) -> str:
    return request.param


def _target(device: str, dtype_name: str):
    base = _CPU if device == "cpu" else _CUDA
    return pytest.param((device, getattr(torch, dtype_name)), marks=base.marks, id=f"{device}-{dtype_name}")


# bf16 only on CUDA: the interpreter's bf16 arithmetic is not the GPU's.
_TARGETS = [
    _target("cpu", "float32"),
    _target("cpu", "float16"),
    _target("cuda", "float32"),
    _target("cuda", "float16"),
    _target("cuda", "bfloat16"),
]


@pytest.fixture(params=_TARGETS)
def target(request):
    """(device, dtype) pairs for kernel tests."""
    return request.param
