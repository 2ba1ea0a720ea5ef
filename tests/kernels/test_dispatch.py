"""Which backend a call goes to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedq_kernels
from pagedq_kernels.dispatch import ENV_VAR, backend_for


def test_cpu_defaults_to_the_cpu_backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert backend_for(torch.zeros(1)) == "cpu"


def test_env_var_then_set_backend_then_context(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    assert backend_for(torch.zeros(1)) == "triton"
    try:
        pagedq_kernels.set_backend("torch")
        assert backend_for(torch.zeros(1)) == "torch"
        with pagedq_kernels.use_backend("triton"):
            assert backend_for(torch.zeros(1)) == "triton"
            with pagedq_kernels.use_backend(None):  # automatic again (here: the env var)
                assert backend_for(torch.zeros(1)) == "triton"
        assert backend_for(torch.zeros(1)) == "torch"
    finally:
        pagedq_kernels.set_backend(None)
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="bogus"):
        backend_for(torch.zeros(1))


def test_unknown_backend_rejected():
    with pytest.raises(ValueError, match="cuda-graphs"):
        pagedq_kernels.set_backend("cuda-graphs")
    with pytest.raises(ValueError), pagedq_kernels.use_backend("nope"):
        pass
    assert pagedq_kernels.dispatch._forced is None


def test_public_names():
    for name in ("AttentionMetadata", "write_kv", "paged_attention", "copy_blocks", "use_backend", "set_backend"):
        assert hasattr(pagedq_kernels, name)


def test_package_attribute_stays_the_function():
    """Importing the Triton submodule must not rebind `pagedq_kernels.paged_attention` to the module."""
    import pagedq_kernels.paged_attention
    from pagedq_kernels.paged_attention import paged_attention_triton  # noqa: F401

    assert callable(pagedq_kernels.paged_attention)
    assert pagedq_kernels.paged_attention is pagedq_kernels.dispatch.paged_attention


def test_imports_and_runs_without_triton():
    """Platforms without a Triton wheel still get the torch path."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, pagedq_kernels\n"
        "k = torch.zeros(2, 16, 1, 64); v = torch.zeros_like(k)\n"
        "pagedq_kernels.write_kv(torch.ones(1, 1, 64), torch.ones(1, 1, 64), k, v, torch.tensor([3]))\n"
        "assert k.sum() == 64\n"
        "try:\n"
        "    with pagedq_kernels.use_backend('triton'):\n"
        "        pagedq_kernels.write_kv(torch.ones(1, 1, 64), torch.ones(1, 1, 64), k, v, torch.tensor([3]))\n"
        "except RuntimeError as exc:\n"
        "    assert 'not installed' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
