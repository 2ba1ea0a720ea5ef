"""Building the C++ CPU kernels: a failed build never crashes (one warning, the torch reference serves),
and `python -m pagedq_kernels.build` prebuilds into TORCH_EXTENSIONS_DIR what a worker then loads
without compiling. Each case runs in its own process: the built module is cached per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedq_kernels import build as kernel_build
from pagedq_kernels import cpu

ROOT = Path(__file__).resolve().parents[2]

# Two calls to extension(): one build attempt, one answer, whatever the build did.
PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from pagedq_kernels import cpu
{setup}
first, second = cpu.extension(), cpu.extension()
print("loaded" if first is not None else "none", "same" if first is second else "differs")
"""


def _probe(tmp_path: Path, setup: str = "", **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", PROBE.format(setup=setup)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=full,
        timeout=300,
    )


def test_no_compiler_falls_back_with_one_warning(tmp_path):
    out = _probe(tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["none", "same"]
    assert out.stderr.count("C++ CPU kernels unavailable") == 1, out.stderr


def test_a_missing_header_falls_back_with_one_warning(tmp_path):
    setup = "from pathlib import Path; cpu.HEADERS.append(Path('/nonexistent/cpu_gone.h'))"
    out = _probe(tmp_path, setup)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["none", "same"]
    assert out.stderr.count("C++ CPU kernels unavailable") == 1 and "cpu_gone.h" in out.stderr, out.stderr


def test_every_x86_variant_selects_its_own_flags():
    flags = {label: tuple(f) for label, f in kernel_build.variants(all_isas=True).items()}
    if set(flags) == {"native"}:
        pytest.skip("not an x86 machine: only the native build exists")
    assert len(set(flags.values())) == len(kernel_build.X86_VARIANTS)  # five different builds
    assert "-mamx-tile" in flags["amx"] and "-mavx2" not in flags["generic"]
    # This CPU's own flags are one of them: a prebuilt image covers the machine it runs on.
    assert tuple(cpu._compile_flags()) in set(flags.values())


def test_prebuilt_kernels_load_without_compiling(tmp_path):
    """`make setup` prebuilt this CPU's kernels into torch's default extension folder (as an image build
    does into its own): the build command finds them, and a process with no compiler loads them.
    (Compiling anew takes minutes on two cores; `make setup` and the wheel test compile for real.)"""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    built = subprocess.run(
        [sys.executable, "-m", "pagedq_kernels.build"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900
    )
    assert built.returncode == 0, built.stderr
    assert "native: " in built.stdout, built.stdout
    again = subprocess.run(
        [sys.executable, "-m", "pagedq_kernels.build"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900
    )
    assert "native: already built" in again.stdout, again.stdout
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(setup="")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "CXX": str(tmp_path / "no-such-c++"), "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert out.stdout.split() == ["loaded", "same"], out.stderr
    assert "prebuilt" in out.stderr and "unavailable" not in out.stderr, out.stderr
