"""A private redis-server child process: `pagedq up` runs one, and so do the tests."""

from __future__ import annotations

import errno
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether another process listens on `host:port` (a server's old connections in TIME_WAIT do not
    count: SO_REUSEADDR, as redis-server and uvicorn bind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


class PortInUse(RuntimeError):
    """A server could not listen: another process holds its port (`port`)."""

    def __init__(self, port: int, what: str = "redis-server") -> None:
        super().__init__(f"{what} cannot listen on 127.0.0.1:{port}: the port is taken by another process")
        self.port = port


class RedisProcess:
    """Start, stop and restart a redis-server on 127.0.0.1.

    `appendonly=True` turns on AOF with `appendfsync always`, so a restart keeps every acknowledged
    write (what `pagedq up` and the chaos tests want); without it the server keeps nothing on disk.
    A restart reuses the same port and data folder.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        appendonly: bool = False,
        data_dir: str | Path | None = None,
        extra_args: list[str] | None = None,
        binary: str = "redis-server",
    ) -> None:
        path = shutil.which(binary)
        if path is None:
            raise RuntimeError(f"{binary} not found on PATH: install it (apt-get install redis-server)")
        self.binary = path
        self.port = port or free_port()
        self.appendonly = appendonly
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="pagedq-redis-"))
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        return args + self.extra_args

    def start(self, timeout: float = 10.0) -> RedisProcess:
        """Start the server and wait until it answers; `PortInUse` when another process holds the port
        (checked first: a PING would otherwise reach that process and pass for this server's)."""
        if port_in_use(self.port):
            raise PortInUse(self.port)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                log = self.data_dir / "redis.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                if "Address already in use" in err + tail:  # taken between the check and the bind
                    raise PortInUse(self.port)
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}{tail}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (clean shutdown) or SIGKILL (crash) the server and wait for it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self, *, kill: bool = True) -> None:
        self.stop(kill=kill)
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
