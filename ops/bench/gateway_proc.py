"""The pieces of `pagedq bench serve --via gateway` that are no measurement: the gateway process and a
small asyncio HTTP/1.1 + SSE client (so no client library's overhead lands in the numbers)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from ops.bench.common import REPO, child_env, stop_process

# --- the gateway process -----------------------------------------------------------------------------


class GatewayProcess:
    def __init__(self, redis_url: str, *args: str) -> None:
        from worker.service.redis_proc import free_port

        self.port = free_port()
        self.cmd = [sys.executable, "-m", "gateway", "--redis-url", redis_url, "--port", str(self.port)]
        self.cmd += list(args)
        self.log_path = Path(tempfile.mkstemp(prefix="pagedq-bench-gateway-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> GatewayProcess:
        self._log = self.log_path.open("wb")
        env = {**child_env(1), "PAGEDQ_LOG_LEVEL": "warning"}
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"gateway not ready within {timeout:.0f}s:\n{self.log()}")

    def rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.split("{", 1)[0].split(" ", 1)[0] == name:
                    return float(line.rsplit(" ", 1)[1])
        return math.nan

    def stop(self) -> None:
        stop_process(self.proc, getattr(self, "_log", None))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


# --- a minimal HTTP/1.1 + SSE client ------------------------------------------------------------------


class SSEStream:
    """One streamed POST on its own connection; `events()` yields the `data:` payloads."""

    def __init__(self, port: int, path: str, body: dict, headers: dict[str, str] | None = None) -> None:
        self.port, self.path, self.body = port, path, json.dumps(body).encode()
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(self.body)}\r\n{self.headers}Connection: close\r\n\r\n"
        )
        self.writer.write(head.encode() + self.body)
        status = await self.reader.readline()
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP {status.decode().strip()}: {(await self.reader.read(2000)).decode()}")
        self.chunked = headers.get("transfer-encoding") == "chunked"

    async def _bytes(self):
        while True:
            if not self.chunked:
                data = await self.reader.read(65536)
                if not data:
                    return
                yield data
                continue
            size = int((await self.reader.readline()).strip() or b"0", 16)
            if size == 0:
                return
            yield await self.reader.readexactly(size + 2)

    async def events(self):
        buf = b""
        async for data in self._bytes():
            buf += data.removesuffix(b"\r\n") if self.chunked else data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# --- what a running gateway reports --------------------------------------------------------------------

LIMITS = "pagedq_gateway_limit_closes_total"


def wait_for_model(port: int, model: str, timeout: float = 30.0, key: str | None = None) -> None:
    """Until the gateway's registry lists the worker's model (it rereads it every second)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=headers)
        with urllib.request.urlopen(req, timeout=5) as resp:
            if any(m["id"] == model for m in json.loads(resp.read())["data"]):
                return
        time.sleep(0.2)
    raise TimeoutError(f"the gateway did not list {model} within {timeout:.0f}s")


def gateway_metrics(port: int) -> dict[str, float]:
    """Every sample of the gateway's /metrics, by its full name (labels included)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def closes(port: int) -> dict[str, float]:
    """pagedq_gateway_limit_closes_total by reason."""
    m = gateway_metrics(port)
    return {k.split('reason="')[1].rstrip('"}'): v for k, v in m.items() if k.startswith(LIMITS + "{")}


def gauge(port: int, name: str) -> float:
    return gateway_metrics(port).get(name, math.nan)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks (100 a second)


class RssSampler:
    """The gateway's RSS every 0.2 s on a thread: the peak of a phase."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self.gateway, self.peak = gateway, gateway.rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self.gateway.rss_bytes())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
