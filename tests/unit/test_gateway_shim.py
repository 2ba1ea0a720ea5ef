"""The gateway's old home, `producer_sdk.gateway`, still works for one release and says where it went."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_old_import_warns_and_gives_the_same_gateway():
    sys.modules.pop("producer_sdk.gateway", None)
    with pytest.warns(DeprecationWarning, match="moved to the package `gateway`"):
        old = importlib.import_module("producer_sdk.gateway")
    from gateway.app import create_app

    assert old.create_app is create_app


def test_the_old_module_command_runs_the_gateway():
    out = subprocess.run(
        [sys.executable, "-m", "producer_sdk.gateway", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "--redis-url" in out.stdout and "moved to the package `gateway`: run `python -m gateway`" in out.stderr
