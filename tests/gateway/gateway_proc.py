"""Real `python -m gateway` processes, and a raw HTTP client for what the openai package
does not do (SSE ids, Last-Event-ID, status codes and headers)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from worker.service.redis_proc import free_port

ROOT = Path(__file__).resolve().parents[2]


class GatewayProc:
    """One gateway process; `start()` returns once it answers /health."""

    def __init__(self, redis_url: str, *args: str) -> None:
        self.port = free_port()
        self.cmd = [
            sys.executable,
            "-m",
            "gateway",
            "--redis-url",
            redis_url,
            "--port",
            str(self.port),
            *args,
        ]
        self.log_path = Path(tempfile.mkstemp(prefix="pagedq-gateway-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> GatewayProc:
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if request(self.port, "GET", "/health", timeout=1)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"gateway did not start within {timeout}s:\n{self.log()}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "_log"):
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in request(self.port, "GET", "/metrics")[2].decode().splitlines():
            if line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            if head.split("{", 1)[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


def request(
    port: int,
    method: str,
    path: str,
    body: dict | bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


class SSE:
    """A streamed POST or GET, read event by event: `(id, data)` pairs; `close()` hangs up."""

    def __init__(
        self,
        port: int,
        method: str,
        path: str,
        body: dict | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        data = json.dumps(body).encode() if body is not None else None
        self.conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.headers = {k.lower(): v for k, v in self.resp.getheaders()}

    def events(self) -> Iterator[tuple[str | None, str]]:
        event_id, data = None, []
        while True:
            raw = self.resp.readline()
            if not raw:
                return
            line = raw.decode().rstrip("\r\n")
            if not line:
                if data:
                    yield event_id, "\n".join(data)
                event_id, data = None, []
            elif line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())

    def close(self) -> None:
        self.conn.sock.close() if self.conn.sock else None
        self.conn.close()


def chunk_text(data: str) -> str:
    """The text a chat or completion chunk adds (choice 0)."""
    obj = json.loads(data)
    out = []
    for choice in obj.get("choices", []):
        if "delta" in choice:
            out.append(choice["delta"].get("content") or "")
        else:
            out.append(choice.get("text") or "")
    return "".join(out)
