"""The worker's HTTP endpoints on the metrics port: /metrics, /health and /ready.

- `/health` (liveness): 200 while the engine thread is alive and has passed through its loop within
  `stall_s` (it beats on every step and every idle wait, so only a wedged forward or a dead thread
  goes stale); 503 otherwise. A container healthcheck restarts a worker that fails it.
- `/ready` (readiness): 200 once the model is loaded and serving, Redis took the last heartbeat in
  time, and the worker is not draining; 503 with the reason otherwise.
Both answer JSON. The server runs on its own thread, so a busy event loop cannot delay the answer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

Check = Callable[[], tuple[bool, dict]]


class HealthServer:
    def __init__(self, render_metrics: Callable[[], bytes], health: Check, ready: Check) -> None:
        self.routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, render_metrics()),
            "/health": lambda: _json(*health()),
            "/ready": lambda: _json(*ready()),
        }
        self._server: ThreadingHTTPServer | None = None

    def start(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve on `port` (0 picks a free one); returns the bound port."""
        routes = self.routes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                status, ctype, body = route() if route else (404, "text/plain", b"not found\n")
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes every few seconds: not worth a log line
                pass

        self._server = ThreadingHTTPServer((addr, port), Handler)
        self._server.daemon_threads = True
        # A short poll: `stop` waits for one (serve_forever checks for shutdown between polls).
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="http", daemon=True
        ).start()
        return self._server.server_address[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _json(ok: bool, detail: dict) -> tuple[int, str, bytes]:
    body = json.dumps({"status": "ok" if ok else "unavailable", **detail}).encode() + b"\n"
    return (200 if ok else 503), "application/json", body
