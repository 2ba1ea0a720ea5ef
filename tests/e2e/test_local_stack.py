"""`pagedq up` / `submit` / `stats` as a user runs them: real processes, Ctrl-C at the end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.service.worker_proc import WorkerProc
from worker.service.redis_proc import free_port


def _children(pid: int) -> set[int]:
    """Every descendant process of `pid`, from /proc (no extra dependency)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cli(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.mark.slow
def test_up_submit_stats_and_ctrl_c(llama_dir, tmp_path):
    port, gateway_port = free_port(), free_port()
    env = {**os.environ, "PAGEDQ_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker.cli",
            "up",
            "--model",
            str(llama_dir),
            "--redis-port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--gateway-port",
            str(gateway_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line and up.poll() is not None:
                pytest.fail("pagedq up exited:\n" + "".join(lines))
            lines.append(line)
            if "point producers at" in line:
                break
        assert f"redis://127.0.0.1:{port}/0" in "".join(lines)
        assert "KV cache" in "".join(lines) and "model loaded" in "".join(lines)  # progress was shown
        while "OpenAI-compatible gateway on" not in lines[-1]:
            lines.append(up.stdout.readline())
        assert f"http://127.0.0.1:{gateway_port}/v1" in lines[-1]
        state = json.loads((tmp_path / "cache" / "up.json").read_text())
        assert state["redis_url"] == f"redis://127.0.0.1:{port}/0"

        # submit finds the running stack by itself (no --redis-url) and streams text to stdout
        done = _cli("submit", "Hello there", "--max-tokens", "12", "--json", env=env)
        assert done.returncode == 0, done.stderr
        records = [json.loads(x) for x in done.stdout.splitlines()]
        final = records[-1]
        assert final["finish_reason"] in ("length", "stop") and len(final["token_ids"]) <= 12
        assert "".join(r["text"] for r in records[:-1]) == final["text"]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(llama_dir)
        assert final["text"] == tok.decode(final["token_ids"], skip_special_tokens=True)

        plain = _cli("submit", "Hi", "--chat", "--max-tokens", "5", env=env)
        assert plain.returncode == 0 and "tokens; ttft" in plain.stderr

        typo = _cli("submit", "Hi", "--model-name", "defualt", "--timeout", "300", env=env)
        assert typo.returncode == 1 and "ModelNotFound" in typo.stderr and "served: default" in typo.stderr

        # the gateway answers OpenAI's way
        body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        ask = urllib.request.Request(
            f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(ask, timeout=60) as resp:
            answer = json.loads(resp.read())
        assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] <= 4
        assert state["gateway_url"] == f"http://127.0.0.1:{gateway_port}/v1"

        stats = _cli("stats", "--json", env=env)
        assert stats.returncode == 0, stats.stderr
        info = json.loads(stats.stdout)
        assert len(info["workers"]) == 1 and info["lanes"]["normal"] == 0

        # a second model on the same Redis: served side by side, listed by stats --all-models
        other = WorkerProc(llama_dir, f"redis://127.0.0.1:{port}/0", name="w-other", model="other", metrics=False)
        other.start()
        try:
            done = _cli("submit", "Hi", "--model-name", "other", "--max-tokens", "3", "--json", env=env)
            assert done.returncode == 0, done.stderr
            every = _cli("stats", "--all-models", "--json", env=env)
            assert every.returncode == 0, every.stderr
            models = {m["model"]: m for m in map(json.loads, every.stdout.splitlines())}
            assert set(models) == {"default", "other"}
            assert all(len(m["workers"]) == 1 for m in models.values())
            text = _cli("stats", "--all-models", env=env).stdout
            assert "model default:" in text and "model other:" in text
        finally:
            other.stop()

        procs = _children(up.pid)
        assert len(procs) >= 2, "pagedq up should have a redis-server and a gateway child"
    finally:
        up.send_signal(signal.SIGINT)
        rc = up.wait(60)
    assert rc == 0
    time.sleep(0.2)
    assert not [p for p in procs if _alive(p)], "processes left behind after Ctrl-C"
    assert not (tmp_path / "cache" / "up.json").exists()
    data_dir = next(x for x in lines if "data in" in x).split("data in ", 1)[1].rstrip(")\n")
    assert not os.path.exists(data_dir), "the private redis data folder was left behind"


def test_cli_help_and_errors():
    env = {**os.environ}
    out = _cli("--help", env=env)
    assert out.returncode == 0 and "worker" in out.stdout and "up" in out.stdout
    bad = _cli("worker", "--redis-url", "redis://127.0.0.1:1/0", env=env)
    assert bad.returncode == 2 and "--model is required" in bad.stderr
    missing = _cli("worker", "--model", "/nonexistent/model", "--redis-url", "redis://127.0.0.1:1/0", env=env)
    assert missing.returncode != 0 and "does not exist" in missing.stderr


def _held_port() -> socket.socket:
    """A port another process listens on (this test's socket)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_up_names_a_taken_redis_port_and_its_flag(tmp_path):
    env = {**os.environ, "PAGEDQ_CACHE": str(tmp_path / "cache")}
    with _held_port() as held:
        port = held.getsockname()[1]
        done = _cli("up", "--redis-port", str(port), "--no-gateway", "--model", "/unused", env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"port {port} is taken" in done.stderr and "--redis-port" in done.stderr
    assert not (tmp_path / "cache" / "up.json").exists()


@pytest.mark.slow
def test_up_names_a_taken_gateway_port_and_its_flag_and_serves_without_a_gateway(llama_dir, tmp_path):
    env = {**os.environ, "PAGEDQ_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    with _held_port() as held:
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "worker.cli", "up", "--model", str(llama_dir), "--dtype", "float32"]
        cmd += ["--max-model-len", "256", "--gateway-port", str(port)]
        up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines: list[str] = []
        try:
            deadline = time.monotonic() + 120
            while not lines or "point producers at" not in lines[-1]:
                line = up.stdout.readline()
                if (not line and up.poll() is not None) or time.monotonic() > deadline:
                    pytest.fail("pagedq up did not start:\n" + "".join(lines))
                lines.append(line)
        finally:
            up.send_signal(signal.SIGINT)
            rc = up.wait(60)
            up.stdout.close()
    text = "".join(lines)
    assert f"port {port} is taken" in text and "--gateway-port" in text and "PAGEDQ_GATEWAY_PORT" in text, text
    assert "OpenAI-compatible gateway on" not in text and rc == 0
