"""Smoke tests of the benchmark harness (ops/bench): workloads, a tiny offline run, the baseline worker,
and `pagedq bench` running the harness of the source checkout in a child process.

No timing assertions: only that the machinery runs, is deterministic, and agrees with transformers.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import redis

from ops.bench import cli
from ops.bench.common import REPO, child_env
from ops.bench.machine import SIMD_FLAGS
from ops.bench.offline import agreement
from ops.bench.workloads import (
    SYSTEM_PROMPT_TOKENS,
    WORKLOADS,
    Workload,
    make_workload,
    mean_context,
    poisson_arrivals,
)
from pagedq_kernels.cpu import cpu_flags
from producer_sdk import Client
from producer_sdk.contract import keys
from producer_sdk.contract.keys import EVENT_FIELD
from producer_sdk.protocol import Finished, Started, Tokens, decode_event
from tests.service.worker_proc import wait_acked

VOCAB = 49152


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_deterministic_and_in_range(name, tmp_path):
    a = make_workload(name, 64, seed=3, vocab_size=VOCAB)
    b = make_workload(name, 64, seed=3, vocab_size=VOCAB)
    c = make_workload(name, 64, seed=4, vocab_size=VOCAB)
    assert a.requests == b.requests
    assert a.requests != c.requests
    assert len(a) == 64
    assert Workload.load(a.save(tmp_path / "w.json")).requests == a.requests
    for r in a.requests:
        assert all(1000 <= t < VOCAB for t in r.prompt)  # above the special tokens
        assert r.total_tokens <= 8192
    prompts = [len(r.prompt) for r in a.requests]
    outputs = [r.max_tokens for r in a.requests]
    if name == "random":
        assert all(32 <= p <= 256 for p in prompts) and all(16 <= o <= 256 for o in outputs)
    elif name == "sharegpt-like":
        assert max(prompts) > 4 * sorted(prompts)[32]  # a long tail
    elif name == "long-prompt":
        longs = [r for r in a.requests if r.kind == "long"]
        assert len(longs) == 4 and all(2048 <= len(r.prompt) <= 4096 for r in longs)
        assert all(32 <= len(r.prompt) <= 128 for r in a.requests if r.kind != "long")
    else:
        system = a.requests[0].prompt[:SYSTEM_PROMPT_TOKENS]
        assert all(r.prompt[:SYSTEM_PROMPT_TOKENS] == system for r in a.requests)
        assert all(16 <= len(r.prompt) - SYSTEM_PROMPT_TOKENS <= 64 for r in a.requests)


def test_workloads_fit_a_short_model_and_arrivals_are_poisson():
    wl = make_workload("long-prompt", 16, seed=0, vocab_size=512, max_model_len=2048)
    assert all(r.total_tokens <= 2048 and all(128 <= t < 512 for t in r.prompt) for r in wl.requests)
    arr = poisson_arrivals(2000, 4.0, seed=1)
    assert arr == poisson_arrivals(2000, 4.0, seed=1)
    assert arr[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(arr))
    assert 3.6 < len(arr) / arr[-1] < 4.4  # the rate
    assert poisson_arrivals(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
    assert mean_context(Workload("x", 0, [])) == 0.0


def test_agreement_counts_identical_outputs_and_common_prefixes():
    a = agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert a["identical"] == 0.5 and a["mean_common_prefix"] == 2.0


def test_offline_tiny_fp32_agrees_with_transformers(llama_dir, tmp_path, capsys):
    out = tmp_path / "results"
    rc = cli.main(
        [
            "offline",
            "--model",
            str(llama_dir),
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--requests",
            "4",
            "--repeats",
            "1",
            "--systems",
            "pagedq,hf-single",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    res = json.loads((out / "latest" / "offline.json").read_text())
    assert not res["errors"]
    assert res["agreement"]["hf-single"]["identical"] == 1.0
    assert res["systems"]["pagedq"]["runs"][0]["output_tokens"] == res["workload"]["output_tokens"]
    assert res["systems"]["pagedq"]["out_tok_s"] > 0 and res["ceiling"]["matmul_flops"] > 0
    assert res["ceiling"]["bandwidth"] > 0 and res["ceiling"]["roofline"]["share"] > 0
    assert list(out.glob("offline-*.json"))
    summary = (out / "latest" / "summary.md").read_text()
    assert "## Offline throughput" in summary and "fp32: greedy outputs identical" in summary
    assert "Memory streams at" in summary and "share of the roofline bound" in summary
    assert res["machine"]["cpu_features"] == [f for f in SIMD_FLAGS if f in cpu_flags()]
    assert (out / "latest" / "throughput.png").exists()
    assert "# pagedq benchmarks" in capsys.readouterr().out


def test_baseline_worker_speaks_the_protocol(llama_dir, redis_url):
    """Two greedy requests through the static-batching worker: contiguous events, the same tokens as
    transformers, entries acked and deleted; an unsupported option is refused with an Error event."""
    from ops.bench.hf_baselines import load_hf_model, run_single
    from ops.bench.workloads import BenchRequest

    model_name = f"baseline-{uuid.uuid4().hex[:8]}"  # registered by this worker alone
    cmd = [
        sys.executable,
        "-m",
        "ops.bench.baseline_worker",
        "--model",
        str(llama_dir),
        "--redis-url",
        redis_url,
        "--consumer",
        "b1",
        "--model-name",
        model_name,
        "--dtype",
        "float32",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    r = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 60
        while not r.exists(keys.worker_state(model_name, "b1")):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "baseline worker did not start"
            time.sleep(0.05)
        prompts = [[130, 200, 300, 400, 150], [140, 141, 142]]
        assert r.zscore(keys.models(), model_name)  # in the registry the SDK checks submits against
        with Client(redis_url, model=model_name) as client:
            handles = [
                client.submit(prompt_token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True)
                for p, n in zip(prompts, (12, 5))
            ]
            done = [h.result(timeout=60) for h in handles]
            bad = client.submit(prompt_token_ids=[130, 131], max_tokens=3, temperature=0.7)
            with pytest.raises(Exception, match=r"unsupported|temperature"):
                bad.result(timeout=60)
        model = load_hf_model(str(llama_dir), "float32")
        expected = run_single(model, [BenchRequest(p, n) for p, n in zip(prompts, (12, 5))])
        assert [c.token_ids for c in done] == expected
        assert [c.finish_reason for c in done] == ["length", "length"]
        events = [decode_event(f[EVENT_FIELD.encode()]) for _, f in r.xrange(keys.response_stream(done[0].request_id))]
        assert [e.seq for e in events] == list(range(len(events)))
        assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
        assert sum(len(e.token_ids) for e in events if isinstance(e, Tokens)) == 12
        wait_acked(redis_url, model_name)  # acked and deleted
    finally:
        proc.terminate()
        proc.wait(30)
        r.close()


def _pagedq(args: list[str], cwd, pythonpath) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    cmd = [sys.executable, "-m", "worker.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_pagedq_bench_runs_the_checkout_harness_with_every_option(tmp_path):
    """`pagedq bench` hands its arguments to `python -m ops.bench` of the checkout: options, exit code,
    relative paths (resolved in the caller's directory) and --help all come through."""
    res = _pagedq(["bench", "report", "--out", "results"], cwd=tmp_path, pythonpath=REPO)
    assert res.returncode == 0, res.stderr
    assert f"no results under {os.path.join('results', 'latest')}" in res.stdout

    latest = tmp_path / "results" / "latest"
    latest.mkdir(parents=True)
    (latest / "memory.json").write_text(json.dumps({"kind": "memory", "waste_mean": 0.01, "fit": {"ratio": 5.0}}))
    res = _pagedq(["bench", "report", "--out", "results", "--no-progress"], cwd=tmp_path, pythonpath=REPO)
    assert res.returncode == 0, res.stderr
    assert "# pagedq benchmarks" in res.stdout and "## KV cache memory" in res.stdout
    assert (latest / "summary.md").read_text() == res.stdout.rstrip("\n") + "\n"

    res = _pagedq(["bench", "offline", "--no-such-option"], cwd=tmp_path, pythonpath=REPO)
    assert res.returncode == 2 and "--no-such-option" in res.stderr
    res = _pagedq(["bench", "--help"], cwd=tmp_path, pythonpath=REPO)
    assert res.returncode == 0 and "usage: pagedq bench" in res.stdout
    for name in cli.COMMANDS:
        assert name in res.stdout


def test_pagedq_bench_without_a_checkout_says_so(tmp_path):
    """Installed without ops/ (a wheel), `pagedq bench` fails with a clear error and a non-zero exit."""
    shutil.copytree(REPO / "worker", tmp_path / "worker", ignore=shutil.ignore_patterns("__pycache__"))
    res = _pagedq(["bench", "all", "--quick"], cwd=tmp_path, pythonpath=tmp_path)
    assert res.returncode == 2
    assert "source checkout" in res.stderr and "Traceback" not in res.stderr


def test_python_m_ops_bench_is_the_bench_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-m", "ops.bench", "report", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and "no results under" in res.stdout, res.stderr
    # A module's child side is internal: run without --child, it points at the real entry point.
    res = subprocess.run(
        [sys.executable, "-m", "ops.bench.offline", "--requests", "4"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "python -m ops.bench" in res.stderr


def test_pagedq_bench_hands_its_own_benchmarks_their_arguments(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["structured", "--help"])
    assert done.value.code == 0 and "python -m ops.bench.structured" in capsys.readouterr().out
