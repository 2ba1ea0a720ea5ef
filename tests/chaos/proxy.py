"""A TCP proxy between a worker and redis-server that can lose a reply on purpose.

Armed with `drop_next_reply_to(sha)`, it lets the next command that runs that script (EVALSHA <sha>)
reach Redis and run, waits for Redis to answer, and then cuts the client's connection instead of
passing the answer on: the write happened, the client sees a ConnectionError and tries again. That
is the fault that used to write events twice. Everything else passes through untouched.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class ReplyDroppingProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._armed: bytes | None = None
        self._lock = threading.Lock()
        self.dropped = 0  # replies lost on purpose
        self.fired = threading.Event()  # set each time a reply was dropped
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def drop_next_reply_to(self, script_sha: str) -> None:
        with self._lock:
            self._armed = script_sha.encode()
            self.fired.clear()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            doomed = threading.Event()
            threading.Thread(target=self._up, args=(client, server, doomed), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, doomed), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, doomed: threading.Event) -> None:
        """Client to Redis: note when an armed script call goes through."""
        try:
            while data := client.recv(65536):
                with self._lock:
                    if self._armed is not None and self._armed in data:
                        self._armed = None
                        doomed.set()
                server.sendall(data)
        except OSError:
            pass
        _close(client, server)

    def _down(self, server: socket.socket, client: socket.socket, doomed: threading.Event) -> None:
        """Redis to client: the reply to a doomed call is swallowed and the connection cut."""
        try:
            while data := server.recv(65536):
                if doomed.is_set():
                    self.dropped += 1
                    self.fired.set()
                    break
                client.sendall(data)
        except OSError:
            pass
        _close(client, server)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
