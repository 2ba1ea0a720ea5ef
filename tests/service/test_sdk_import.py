"""The SDK installs and imports without the worker's heavy dependencies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
import producer_sdk
from producer_sdk import AsyncClient, Client, Completion, QueueFull
import producer_sdk.protocol, producer_sdk.errors
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "transformers", "numpy", "worker", "arq"})
assert not heavy, heavy
"""


def run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_import_is_light():
    run("import producer_sdk, sys; assert 'torch' not in sys.modules")
    run(CHECK)


def test_protocol_import_does_not_load_the_clients():
    run(
        "import sys, producer_sdk.protocol; "
        "assert 'producer_sdk.client' not in sys.modules and 'redis.asyncio' not in sys.modules, "
        "sorted(m for m in sys.modules if m.startswith(('producer_sdk', 'redis')))"
    )


def test_sdk_sources_never_import_the_worker():
    for path in (ROOT / "producer_sdk").glob("*.py"):
        text = path.read_text()
        for banned in ("import torch", "import transformers", "from worker", "import worker"):
            assert banned not in text, f"{path.name}: {banned}"
