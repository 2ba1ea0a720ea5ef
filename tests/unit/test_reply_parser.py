"""How redis-py parses Redis's replies: hiredis (in C) where the worker's or gateway's extra is installed,
redis-py's own Python parser where hiredis is missing, and `reply_parser` says which."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from producer_sdk.contract.connection import reply_parser

ROOT = Path(__file__).resolve().parents[2]
# What each client's connections parse replies with, next to what `reply_parser` says of it.
PROBE = """
import sys
if sys.argv[1] == "hidden":
    sys.modules["hiredis"] = None  # as if it were not installed: `import hiredis` raises ImportError
import redis.asyncio.connection, redis.connection
from producer_sdk.contract.connection import reply_parser
print(reply_parser(), redis.connection.DefaultParser.__name__, redis.asyncio.connection.DefaultParser.__name__)
"""


def _probe(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_the_worker_and_gateway_extras_bring_hiredis():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("worker", "gateway", "hiredis"):
        specs = {re.split(r"[<>=;\[ ]", spec, maxsplit=1)[0].lower() for spec in extras[name]}
        assert "hiredis" in specs, name
    assert "hiredis" not in " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def test_installed_here_the_replies_are_parsed_in_c():
    # `make setup` installs the worker extra, so hiredis is here, new enough for this redis-py
    assert reply_parser() == "hiredis"
    said, sync_parser, async_parser = _probe("installed")
    assert said == "hiredis" and "Hiredis" in sync_parser and "Hiredis" in async_parser


def test_without_hiredis_redis_py_parses_in_python_and_says_so():
    said, sync_parser, async_parser = _probe("hidden")
    assert said == "python"
    assert "Hiredis" not in sync_parser and "Hiredis" not in async_parser
