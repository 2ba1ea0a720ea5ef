"""`make demo` as a new user runs it (`python -m worker.demo`), on the tiny model: `pagedq up`, three
streamed answers through Redis, the summary, one answer through the gateway, and a clean stop."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from worker.demo import QUESTIONS


@pytest.mark.slow
def test_demo_streams_three_answers_and_one_through_the_gateway(llama_dir, tmp_path):
    env = {**os.environ, "PAGEDQ_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "worker.demo", "--model", str(llama_dir), "--max-tokens", "12", "--dtype", "float32"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    for question in QUESTIONS:
        assert question in out

    row = re.compile(r"^(#\d)\s+([\d.]+)s\s+([\d.]+)s\s+(\d+)\s+[\d.]+\s+(\d+)\s+(\d+)$", re.M)
    rows = {m[0]: m[1:] for m in row.findall(out)}
    assert sorted(rows) == ["#1", "#2", "#3"], out
    for _sent, _ttft, tokens, prompt, cached in rows.values():
        assert 1 <= int(tokens) <= 12 and int(prompt) > 0 and int(cached) <= int(prompt)
    assert int(rows["#3"][4]) > 0  # the third shares the first one's system prompt: served from the prefix cache
    # the worker's count comes from its heartbeat, read once it has counted all three answers
    assert re.search(r"^worker \S+: 3 requests done, KV cache in use", out, re.M), out

    assert "the same through the OpenAI-compatible gateway" in out and "did not answer" not in out
    gateway = re.search(r"\(finish_reason (\w+); (\d+) prompt \+ (\d+) completion tokens", out)
    assert gateway and gateway[1] in ("length", "stop") and 1 <= int(gateway[3]) <= 12, out
    assert "pagedq up stopped (exit code 0)" in out


def test_the_demo_asks_for_a_repetition_penalty_only_where_the_model_sets_none(llama_dir, tmp_path):
    from worker.demo import DEMO_REPETITION_PENALTY, demo_sampling

    assert demo_sampling(str(llama_dir)) == {"temperature": 0.0, "repetition_penalty": DEMO_REPETITION_PENALTY}
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.3, "eos_token_id": 2}))
    assert demo_sampling(str(tmp_path)) == {"temperature": 0.0}  # the worker applies the model's 1.3
