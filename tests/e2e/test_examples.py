"""The README's examples run against a real worker."""

from __future__ import annotations

import importlib.util
import re
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
                answers = re.findall(r"^.*\(case \d\): (\S+)", out.stdout, re.M)
                tools = {*_agent_backend().TOOLS, "no", "deadline"}  # "no tool named", "deadline hit"
                assert len(answers) == 20 and set(answers) <= tools, out.stdout
                assert "cancelled after" in out.stdout
    finally:
        w.stop()


def _agent_backend():
    spec = importlib.util.spec_from_file_location("agent_backend", ROOT / "examples" / "agent_backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_agent_backend_reads_the_tool_the_model_names():
    chosen = _agent_backend().chosen_tool
    assert chosen("order_status") == "order_status"
    assert chosen("I would use Search Docs, then escalate_to_human.") == "search_docs"  # the first one named
    assert chosen("Sure! Let me think.") is None
