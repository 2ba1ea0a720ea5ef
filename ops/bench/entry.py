"""The common end of a benchmark with options of its own (`pagedq bench batch`, `pagedq bench hostile`): resolve
the dtype and the model, run under a progress bar, save the result, print its report."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from ops.bench.common import resolve_model
from ops.bench.machine import machine_info
from ops.bench.progress import Progress
from ops.bench.results import save_result


def run_and_save(
    name: str,
    argv: list[str],
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace, Progress], dict],
    report_lines: Callable[[dict], list[str]],
    units: int,
) -> int:
    """`run(args, progress)` with `--dtype auto` and `--model` resolved; the result, with the command and the
    machine, goes to ops/bench/results/<name>-<timestamp>.json (and latest/). 1 when the run failed."""
    if args.dtype == "auto":
        from ops.bench.cli import fastest_dtype

        args.dtype = fastest_dtype(args.device)
    args.model_dir = resolve_model(args.model, args.quick)
    started = time.monotonic()
    progress = Progress(units, enabled=not args.no_progress)
    try:
        result = {
            "benchmark": name,
            "command": " ".join([f"pagedq bench {name}", *argv]),
            "quick": args.quick,
            "machine": machine_info(args.threads, args.device),
            **run(args, progress),
        }
    finally:
        progress.close()
    result["wall_s"] = time.monotonic() - started
    path = save_result(name, result, args.out)
    for line in report_lines(result):
        print(line)
    print(f"saved {path}")
    return 1 if "error" in result else 0
