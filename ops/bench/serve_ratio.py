"""The serving goal's ratio: pagedq's saturation throughput through Redis against offline, pair by pair.

Right before each of pagedq's saturation runs, the offline benchmark's pagedq (`LLM.generate`, a fresh
process, the same engine options) runs the same workload, so the two halves of a pair get the same
minutes of the machine; the ratio quoted is the median of the pairs' ratios. Quoting the offline
benchmark's median against the serving one's compared runs 10 to 25 minutes apart, and the machine's
drift over that time moved the ratio by several points (ops/bench/RESULTS.md, 2026-12-04).

The served worker is up and idle during its pair's offline run (the whole child process, model loading
included); the CPU it used meanwhile is recorded with the pair (`idle_worker_cpu_s`). Without pairs
(`--no-offline-pairs`), the ratio falls back to the offline benchmark's result of this run, or its latest
matching one.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from ops.bench.common import kv_blocks_for, run_child
from ops.bench.offline import child_base, pagedq_engine
from ops.bench.results import load_latest
from ops.bench.stats import median
from ops.bench.workloads import Workload


def process_cpu_s(pid: int | None) -> float:
    """utime + stime seconds of process `pid` (all its threads); NaN when unreadable."""
    if pid is None:
        return math.nan
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class OfflinePairs:
    """Runs the offline half of each pair: the offline benchmark's pagedq on the serving workload."""

    def __init__(self, args: argparse.Namespace, wl: Workload, info: dict) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="pagedq-bench-pairs-")
        tmp = Path(self._tmp.name)
        self.tmp, self.timeout = tmp, args.child_timeout
        self.spec = {
            **child_base(args, info),
            "system": "pagedq",
            "workload": str(wl.save(tmp / "workload.json")),
            "engine": pagedq_engine(args, kv_blocks_for(wl, info["max_model_len"])),
        }

    def run(self, idle_worker_pid: int | None) -> dict:
        """One offline run; its output tok/s (or its error), and the idle worker's CPU meanwhile."""
        before = process_cpu_s(idle_worker_pid)
        res = run_child(self.spec, self.tmp, self.timeout, "ops.bench.offline")
        if "error" in res:
            return {"error": res["error"]}
        return {
            "out_tok_s": res["out_tok_s"],
            "output_tokens": res["output_tokens"],
            "elapsed_s": res["elapsed_s"],
            "cpu_share": res.get("cpu_share"),
            "idle_worker_cpu_s": process_cpu_s(idle_worker_pid) - before,
        }

    def close(self) -> None:
        self._tmp.cleanup()


def offline_ref(out: dict, args: argparse.Namespace, context: dict) -> dict:
    """pagedq's served saturation throughput against offline: the median of this run's pairs, else the
    offline benchmark's throughput on the same workload (this run's, else the latest matching one)."""
    pq = out["systems"].get("pagedq", {}).get("saturation")
    if not pq:
        return {"available": False}
    pairs = [
        {
            "offline_out_tok_s": off["out_tok_s"],
            "serve_out_tok_s": run["out_tok_s"],
            "ratio": run["out_tok_s"] / off["out_tok_s"],
        }
        for off, run in zip(pq.get("offline_pairs", []), pq["runs"])
        if off.get("out_tok_s", 0) > 0
    ]
    if pairs:
        return {
            "available": True,
            "method": "pairs",
            "pairs": pairs,
            "offline_out_tok_s": median(p["offline_out_tok_s"] for p in pairs),
            "serve_out_tok_s": median(p["serve_out_tok_s"] for p in pairs),
            "ratio": median(p["ratio"] for p in pairs),
        }
    off = context.get("offline") or load_latest(args.out).get("offline")
    same = (
        off
        and off.get("workload") == out["workload"]
        and off.get("dtype") == args.dtype
        and off.get("threads") == args.threads
        and off.get("model", {}).get("folder") == out["model"]["folder"]
    )
    if not same:
        return {"available": False}
    offline_rate = off["systems"].get("pagedq", {}).get("out_tok_s")
    return {
        "available": bool(offline_rate),
        "method": "this run's offline benchmark" if "offline" in context else "the latest offline benchmark",
        "offline_out_tok_s": offline_rate,
        "serve_out_tok_s": pq["out_tok_s"],
        "ratio": pq["out_tok_s"] / offline_rate if offline_rate else math.nan,
    }
