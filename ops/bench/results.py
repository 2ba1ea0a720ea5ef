"""The results folder (default ops/bench/results):

<name>-<timestamp>.json     every run, kept
latest/<name>.json          the last run of each benchmark (offline, serve, memory, prefix)
latest/*.png, summary.md    rebuilt from latest/*.json (ops/bench/summary.py)
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from ops.bench.stats import clean

RESULTS = Path(__file__).resolve().parent / "results"
BENCHMARKS = ("offline", "serve", "memory", "prefix")


def results_dir(out_dir: str | Path | None = None) -> Path:
    return Path(out_dir) if out_dir else RESULTS


def timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def save_result(name: str, data: dict, out_dir: str | Path | None = None) -> Path:
    """Write `<out>/<name>-<timestamp>.json` and `<out>/latest/<name>.json`; returns the first."""
    out = results_dir(out_dir)
    (out / "latest").mkdir(parents=True, exist_ok=True)
    text = json.dumps(clean(data), indent=1) + "\n"
    path = out / f"{name}-{timestamp()}.json"
    path.write_text(text)
    (out / "latest" / f"{name}.json").write_text(text)
    return path


def load_latest(out_dir: str | Path | None = None) -> dict[str, dict]:
    latest = results_dir(out_dir) / "latest"
    found = {}
    for name in BENCHMARKS:
        p = latest / f"{name}.json"
        if p.exists():
            found[name] = json.loads(p.read_text())
    return found
