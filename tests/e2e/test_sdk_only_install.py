"""`pip install .` without extras: the producer SDK imports, and neither torch nor the worker's
dependencies were installed."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pip_install_without_extras_has_no_torch(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # A copy of the sources, so the build leaves nothing behind in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("producer_sdk", "gateway", "worker", "pagedq_kernels", "pyproject.toml", "README.md"):
        subprocess.run(["cp", "-r", str(ROOT / name), str(src)], check=True)
    out = subprocess.run([str(py), "-m", "pip", "install", "-q", str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True)
    names = {line.split("==")[0].lower() for line in listed.stdout.splitlines()}
    assert {"redis", "msgspec", "pagedq"} <= names
    assert not names & {"torch", "transformers", "triton", "numpy", "safetensors"}, names
    check = "import producer_sdk, sys; from producer_sdk import AsyncClient, Client; assert 'torch' not in sys.modules"
    run = subprocess.run([str(py), "-c", check], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
