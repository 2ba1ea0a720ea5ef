"""Run real `pagedq worker` processes for the service, e2e and chaos tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.contract.keys import EVENT_FIELD
from producer_sdk.protocol import decode_event
from worker.service.redis_proc import free_port


class WorkerProc:
    """One worker process; `start()` returns once it heartbeats (model loaded, serving)."""

    def __init__(
        self,
        model_dir,
        redis_url: str,
        *args: str,
        name: str = "w1",
        model: str = "default",
        metrics: bool = True,
        env: dict | None = None,
    ) -> None:
        self.name, self.redis_url, self.model = name, redis_url, model
        self.metrics_port = free_port() if metrics else None
        self.cmd = [
            sys.executable,
            "-m",
            "worker.cli",
            "worker",
            "--model",
            str(model_dir),
            "--redis-url",
            redis_url,
            "--model-name",
            model,
            "--consumer",
            name,
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--log-json",
        ]
        if self.metrics_port:
            self.cmd += ["--metrics-port", str(self.metrics_port)]
        self.cmd += list(args)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.log_path = Path(tempfile.mkstemp(prefix=f"pagedq-{name}-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> WorkerProc:
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        r = connect(self.redis_url, asyncio=False, socket_timeout=10)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log()}")
                if r.exists(keys.worker_state(self.model, self.name)):
                    return self
                time.sleep(0.05)
        finally:
            r.close()
        raise RuntimeError(f"worker {self.name} did not start within {timeout}s:\n{self.log()}")

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc:
            self.proc.wait(10)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "_log"):
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def log_events(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def metrics_text(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, value = line.rsplit(" ", 1)
            metric = head.split("{", 1)[0]
            if metric != name:
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


def response_events(redis_url: str, request_id: str) -> list:
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    try:
        return [decode_event(f[EVENT_FIELD.encode()]) for _, f in r.xrange(keys.response_stream(request_id))]
    finally:
        r.close()


def wait_until(cond, timeout: float = 30.0, what: str = "condition", interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_acked(redis_url: str, model: str = "default", timeout: float = 30.0) -> None:
    """Until every entry of the model's lanes is acked and deleted. A reader sees a request's final
    event one round trip before the worker acks its entry (the ack follows the final event)."""
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    group = keys.group(model)

    def acked() -> bool:
        lanes = [keys.lane_stream(model, lane) for lane in keys.LANES]
        return all(r.xlen(s) == 0 and (not r.exists(s) or r.xpending(s, group)["pending"] == 0) for s in lanes)

    try:
        wait_until(acked, timeout, f"every entry of {model} acked")
    finally:
        r.close()
