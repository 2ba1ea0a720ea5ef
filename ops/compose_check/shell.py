"""The compose check's output, timings and commands: every phase reports through here, and every command
that can fail the check raises CheckFailed."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "pagedq-compose-check"
COMPOSE = ["docker", "compose", "-p", PROJECT, "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml"]


class CheckFailed(Exception):
    pass


# --- output and timing ---------------------------------------------------------------------------

TIMINGS: list[tuple[str, float]] = []
FACTS: list[str] = []


def say(text: str) -> None:
    print(f"[compose-check] {text}", flush=True)


def fact(text: str) -> None:
    FACTS.append(text)
    say(text)


@contextlib.contextmanager
def phase(name: str):
    say(f"--- {name}")
    t0 = time.monotonic()
    try:
        yield
    finally:
        TIMINGS.append((name, time.monotonic() - t0))
        say(f"    {name}: {time.monotonic() - t0:.1f}s")


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


# --- processes -----------------------------------------------------------------------------------


def run(cmd: list[str], *, env: dict | None = None, timeout: float = 600, quiet: bool = False, **kw):
    """Run a command; its output is shown unless quiet (and returned). Non-zero exit: CheckFailed."""
    if not quiet:
        say("$ " + " ".join(cmd))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if not quiet and (p.stdout or p.stderr):
        print((p.stdout + p.stderr).rstrip(), flush=True)
    if p.returncode != 0:
        tail = (p.stdout + p.stderr)[-3000:]
        raise CheckFailed(f"{' '.join(cmd[:6])} ... exited {p.returncode}:\n{tail}")
    return p


def probe(cmd: list[str], timeout: float = 120) -> bool:
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def compose(args: list[str], env: dict, **kw):
    return run([*COMPOSE, *args], env=env, **kw)


def build(env: dict, timeout: float = 7200) -> str:
    """`docker compose build`, showing its steps as they start (the C++ kernels take most of the time);
    returns the whole output."""
    cmd = [*COMPOSE, "--progress", "plain", "build"]
    say("$ " + " ".join(cmd))
    lines: list[str] = []
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    for line in p.stdout:
        lines.append(line)
        if re.match(r"#\d+ \[[^\]]*\d+/\d+\]", line) or re.search(r"\bBuilt\b|ERROR|\[\d+/\d+\] \w+:", line):
            print("    " + line.rstrip()[:160], flush=True)
        if time.monotonic() > deadline:
            p.kill()
    if p.wait() != 0:
        raise CheckFailed("docker compose build failed:\n" + "".join(lines[-60:]))
    return "".join(lines)
