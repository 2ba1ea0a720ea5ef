"""GPU tests: `TRITON_INTERPRET=0 python -m pytest -m gpu tests/kernels tests/gpu` runs them on CUDA
with real Triton kernels (tests/conftest.py turns the interpreter on unless the environment says
otherwise, and Triton reads it when the kernels are defined). Elsewhere they are reported skipped.
Tests here that are not marked `gpu` (the dry run of ops/bench/gpu_check.py) run everywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_HERE = Path(__file__).parent


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    import torch

    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    for item in items:
        if _HERE not in Path(str(item.path)).parents:
            continue
        if item.get_closest_marker("gpu") is not None and interpreted and torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="real kernels need TRITON_INTERPRET=0 (pytest -m gpu)"))
