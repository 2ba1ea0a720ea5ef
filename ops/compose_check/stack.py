"""The running compose stack as the check sees it: its containers and their health, the gateway over HTTP
(JSON and server-sent events), the workers' logs and metrics."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
import urllib.request

from ops.compose_check.shell import COMPOSE, FACTS, ROOT, CheckFailed, check, compose, fact, run, say

KERNELS_UNAVAILABLE = "C++ CPU kernels unavailable"

# --- HTTP ------------------------------------------------------------------------------------------


def http_json(url: str, body: dict | None = None, timeout: float = 300):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def sse(url: str, body: dict, on_event=None, timeout: float = 600) -> list[dict]:
    """POST a streaming request; returns the decoded `data:` events (until [DONE])."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().rstrip("\n")
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            events.append(json.loads(payload))
            if on_event:
                on_event(events[-1])
    return events


def stream_text(events: list[dict]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))


# --- the stack ----------------------------------------------------------------------------------


class Stack:
    def __init__(self, env: dict, services: list[str]):
        self.env, self.services = env, services
        self.gateway = f"http://127.0.0.1:{env['GATEWAY_PORT']}"
        self.redis_url = f"redis://127.0.0.1:{env['REDIS_PORT']}/0"

    def compose(self, args: list[str], **kw):
        return compose(args, self.env, **kw)

    def up(self, workers: int = 1) -> None:
        self.compose(["up", "-d", "--scale", f"worker={workers}", *self.services], timeout=1200)

    def containers(self, service: str, all_: bool = False) -> list[str]:
        p = self.compose(["ps", "-q", *(["-a"] if all_ else []), service], quiet=True)
        return p.stdout.split()

    def health(self, cid: str) -> str:
        fmt = "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}"
        p = run(["docker", "inspect", "-f", fmt, cid], quiet=True)
        return p.stdout.strip()

    def wait_ready(self, workers: int, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            states = [self.health(c) for c in self.containers("worker")]
            state = f"workers: {states}"
            ok = len(states) == workers and all(s == "running healthy" for s in states)
            if ok:
                try:
                    ready = urllib.request.urlopen(self.gateway + "/ready", timeout=5).status == 200
                    models = [m["id"] for m in http_json(self.gateway + "/v1/models", timeout=10)["data"]]
                    state += f", gateway ready: {ready}, models: {models}"
                    if ready and "default" in models:
                        say(state)
                        return
                except (OSError, ValueError) as e:
                    state += f", gateway: {e}"
            if state != last:
                say(state)
                last = state
            for c in self.containers("worker", all_=True):
                if self.health(c).startswith(("exited", "restarting")):
                    raise CheckFailed(f"worker container {c[:12]} is {self.health(c)}")
            time.sleep(3)
        raise CheckFailed(f"not ready within {timeout:.0f}s ({last})")

    def worker_logs_clean(self) -> None:
        logs = self.compose(["logs", "--no-color", "worker"], quiet=True)
        text = logs.stdout + logs.stderr
        check(KERNELS_UNAVAILABLE not in text, f"a worker logged {KERNELS_UNAVAILABLE!r}")
        in_use = re.search(r"C\+\+ CPU kernels in use \([^)]*\)", text)
        check(in_use is not None, "no worker logged its C++ CPU kernels in use")
        if in_use.group(0) not in FACTS:
            fact(in_use.group(0))
        check("Traceback" not in text, "a worker logged a traceback:\n" + text[-3000:])

    def running_requests(self, cid: str) -> float:
        code = (
            "import urllib.request\n"
            "text = urllib.request.urlopen('http://127.0.0.1:9400/metrics', timeout=5).read().decode()\n"
            "for line in text.splitlines():\n"
            "    if line.startswith('pagedq_num_requests_running'):\n"
            "        print(line.split()[-1])\n"
        )
        p = run(["docker", "exec", cid, "python", "-c", code], quiet=True)
        return sum(float(v) for v in p.stdout.split())

    def dump_logs(self) -> None:
        with contextlib.suppress(Exception):
            p = subprocess.run(
                [*COMPOSE, "logs", "--no-color", "--tail", "40"],
                cwd=ROOT,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            print(p.stdout[-8000:] + p.stderr[-2000:], flush=True)


def chat_body(content: str, **extra) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": content}], **extra}
