"""pagedq as users install it: the wheel, installed non-editable into a fresh venv, serves a request.

Every other test runs the editable checkout, where every file of the tree is at hand; a wheel carries
only what pyproject.toml packages (the C++ kernels' headers were once left out, and every installed
worker crashed at start). The fresh venv reuses the checkout venv's dependencies (a path line, not its
.pth files, so the checkout's editable pagedq stays out) and runs from outside the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import venv
import zipfile
from pathlib import Path

import pytest

from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("producer_sdk", "gateway", "worker", "pagedq_kernels")


def _data_files() -> set[str]:
    """Every file of the packages in the checkout that is not Python source: what the code reads at run
    time (kernel sources and headers, Lua, chat templates)."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts:
                found.add(path.relative_to(ROOT).as_posix())
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (the build leaves nothing behind in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (built,) = (tmp / "dist").glob("pagedq-*.whl")
    return built


def test_the_wheel_carries_every_file_the_code_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_data_files() - names)
    assert not missing, f"left out of the wheel: {missing}"
    assert {"pagedq_kernels/csrc/cpu_vec.h", "producer_sdk/contract/pagedq.lua"} <= names


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed non-editable; its python."""
    env_dir = tmp_path_factory.mktemp("installed") / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    # The checkout venv's packages, appended after the fresh venv's own: torch, transformers, redis ...
    Path(site, "zz_checkout_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    out = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return py


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_the_installed_wheel_serves_a_request(installed, llama_dir, redis_url, tmp_path):
    env = _clean_env()
    where = subprocess.run(
        [str(installed), "-c", "import pagedq_kernels, producer_sdk, worker; print(pagedq_kernels.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed.parent.parent), where.stdout  # not the checkout
    log_path = tmp_path / "worker.log"
    cmd = [str(installed.parent / "pagedq"), "worker", "--model", str(llama_dir), "--redis-url", redis_url]
    cmd += ["--consumer", "wheel", "--dtype", "float32", "--device", "cpu", "--log-json"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    try:
        r = connect(redis_url, asyncio=False, socket_timeout=10)
        deadline = time.monotonic() + 120
        while not r.exists(keys.worker_state("default", "wheel")):
            assert proc.poll() is None, f"the installed worker exited with {proc.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"the installed worker did not start:\n{log_path.read_text()}"
            time.sleep(0.1)
        r.close()
        ask = (
            "import json, sys; from producer_sdk import Client\n"
            "with Client(sys.argv[1], 'default') as c:\n"
            "    done = c.generate('Hello there', max_tokens=8, temperature=0.0, ignore_eos=True, timeout=120)\n"
            "print(json.dumps({'n': done.usage.completion_tokens, 'reason': done.finish_reason}))\n"
        )
        answer = subprocess.run(
            [str(installed), "-c", ask, redis_url], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=180
        )
        assert answer.returncode == 0, answer.stderr + log_path.read_text()
        assert answer.stdout.strip() == '{"n": 8, "reason": "length"}'
    finally:
        proc.terminate()
        proc.wait(60)
    text = log_path.read_text()
    assert "C++ CPU kernels in use" in text, text  # the kernels built from the wheel's own sources
    assert "unavailable" not in text and "Traceback" not in text, text
