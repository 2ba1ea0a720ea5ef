"""The README's examples run against a real worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.worker_proc import WorkerProc

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_examples_run_against_a_real_worker(llama_dir, redis_url):
    w = WorkerProc(llama_dir, redis_url, metrics=False).start()
    try:
        for script in ("agent_backend.py", "sync_client.py"):
            out = subprocess.run(
                [sys.executable, str(ROOT / "examples" / script), "--redis-url", redis_url],
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert out.returncode == 0, f"{script}:\n{out.stdout}\n{out.stderr}"
            if script == "agent_backend.py":
                assert out.stdout.count("(case ") == 20  # every fanned-out call answered
                assert "cancelled after" in out.stdout
    finally:
        w.stop()
