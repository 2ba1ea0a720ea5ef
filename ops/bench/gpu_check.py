#!/usr/bin/env python3
"""pagedq's GPU path in one run: correctness first, then speed, sized for a few minutes on one GPU.

    python3 ops/bench/gpu_check.py --out DIR              # on a CUDA machine (never past --budget, 350 s)
    python3 ops/bench/gpu_check.py --dry-run --out DIR    # the same flow on CPU: Triton interpreter, tiny shapes
    python3 ops/bench/gpu_check.py --sections a,c ...     # some sections only

Sections, each in its own process with its own time limit (a crash, a CUDA error or a hang costs that
section only), each writing DIR/<name>.json as soon as it has a result (and again as it goes):

  a kernels      Triton vs the torch reference in bf16 and fp16: mixed prefill + decode batches, GQA,
                 sliding window, forced and automatic split-K, a fixed grid with padded requests,
                 write_kv, the fused RMSNorm / SiLU-mul / rotary + KV-write kernels; and no kernel
                 compiles again when the per-step values (decode count, block-table width, split) change.
  b fp32_tokens  greedy tokens of `worker.LLM` equal transformers' on 16 prompts of 5-700 tokens, fp32,
                 a random-weight model with Llama-3.2-1B's shapes and llama3 RoPE scaling, 4 layers,
                 chunked prefill on.
  c bf16_logits  the same model in bf16, teacher-forced (chunked prefill, then decodes): logits vs
                 transformers bf16 and fp32 within a tolerance (tokens are not compared in bf16: ties
                 and kernel choices make them differ legitimately).
  d throughput   the engine at batch 1, 64 and 256 (128 tokens in, 128 out, 16 layers, 1B shapes, bf16)
                 with CUDA graphs off (--enforce-eager) and on, as a share of the bandwidth bound: (weight +
                 KV bytes) per decode step over the device copy bandwidth measured in the same run; also
                 the engine's build and graph-capture time. Fails unless every timed decode step of the
                 run with graphs replayed one (a dry run replays the graph path's buffers eagerly).
  e attention    decode attention bandwidth vs copy bandwidth and vs SDPA on contiguous KV.

DIR/summary.json lists each section's status and time; the exit code is 0 iff every section passed.
Needs torch, triton, transformers, numpy and this repository's worker/ and pagedq_kernels/ packages (plus msgspec,
which the engine's sampling parameters import: sections b and d say so when it is missing): no Redis, no
network, no model files (models are random-weight and built here, under --work). The sections live in
gpu_check_correctness.py (a-c) and gpu_check_speed.py (d, e), what they share in gpu_check_common.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # as a script: ops/bench (which has a kernels.py) must not shadow
    # the `kernels` distribution that transformers imports
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(REPO))

# `run_steps` and `Sizes` are imported from here by tests too.
from ops.bench.gpu_check_common import Report, Sizes, environment, run_steps  # noqa: E402

__all__ = ["Sizes", "main", "run_steps"]

# name, time limit on a GPU (seconds); the limits add up to under 6 minutes with the start-up costs.
SECTIONS = {
    "a": ("kernels", 90),  # most of it is compiling about 35 kernel variants on a fresh machine
    "b": ("fp32_tokens", 70),
    "c": ("bf16_logits", 50),
    "d": ("throughput", 95),
    "e": ("attention", 40),
}
DRY_LIMIT = 300  # all sections of a dry run, in one process (they share its ~8 s of imports)


def runners() -> dict:
    from ops.bench.gpu_check_correctness import section_bf16_logits, section_fp32_tokens, section_kernels
    from ops.bench.gpu_check_speed import section_attention, section_throughput

    return {
        "kernels": section_kernels,
        "fp32_tokens": section_fp32_tokens,
        "bf16_logits": section_bf16_logits,
        "throughput": section_throughput,
        "attention": section_attention,
    }


# --- driver -------------------------------------------------------------------------------------


def run_sections(keys: str, out: Path, work: Path, dry: bool) -> int:
    """Child process: run sections one after another, each writing its JSON (status ok / fail / error)."""
    failed = 0
    for key in keys:
        name = SECTIONS[key][0]
        sz = Sizes.for_run(dry)
        rep = Report(out / f"{key}_{name}.json", name)
        try:
            import torch

            torch.manual_seed(0)
            if dry:
                torch.set_num_threads(min(2, os.cpu_count() or 1))
            rep.env = environment(sz)
            rep.save()
            ok = runners()[name](sz, work, rep)
            rep.status, rep.ok = ("ok" if ok else "fail"), bool(ok)
        except Exception as e:  # reported in the JSON; the next section still runs
            rep.status, rep.ok = "error", False
            rep.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        rep.save()
        failed += not rep.ok
        print(f"[{key} {name}] {rep.status} in {rep.seconds:.1f}s", flush=True)
    return 1 if failed else 0


def _child_env(dry: bool) -> dict:
    env = dict(os.environ)
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if dry:
        env.update(TRITON_INTERPRET="1", PAGEDQ_CPU_KERNEL="0", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
    else:
        env["TRITON_INTERPRET"] = "0"
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, help="folder for the JSON files (default: ops/bench/results/gpu-check-<time>)"
    )
    parser.add_argument("--work", type=Path, help="folder for the random models (default: a temp folder, reused)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--sections", default="abcde", help="which sections, e.g. a,b or abe (default: all)")
    parser.add_argument("--budget", type=float, default=350.0, help="seconds for everything (default 350)")
    parser.add_argument("--run-section", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import tempfile

    out = args.out or REPO / "ops" / "bench" / "results" / time.strftime("gpu-check-%Y%m%d-%H%M%S")
    work = args.work or Path(tempfile.gettempdir()) / ("pagedq-gpu-check" + ("-dry" if args.dry_run else ""))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if args.run_section:
        return run_sections(args.run_section, out, work, args.dry_run)

    keys = [k for k in args.sections.replace(",", "") if k in SECTIONS]
    if not keys:
        parser.error(f"--sections: choose from {''.join(SECTIONS)}")
    t0 = time.perf_counter()
    summary = {"dry_run": args.dry_run, "out": str(out), "sections": {}}
    print(
        f"pagedq gpu_check{' (dry run)' if args.dry_run else ''}: sections {''.join(keys)}, JSON in {out}", flush=True
    )
    # On a GPU each section gets a fresh process (a CUDA error poisons its context); a dry run shares one.
    groups = [keys] if args.dry_run else [[k] for k in keys]
    for group in groups:
        left = args.budget - (time.perf_counter() - t0)
        limit = min(DRY_LIMIT if args.dry_run else SECTIONS[group[0]][1], left)
        if limit < 10:
            for key in group:
                name = SECTIONS[key][0]
                data = {"section": name, "status": "skipped", "ok": False, "error": "out of time"}
                (out / f"{key}_{name}.json").write_text(json.dumps(data) + "\n")
                summary["sections"][key] = {"name": name, "status": "skipped", "seconds": 0.0}
            continue
        summary["sections"].update(_run_child(group, out, work, args.dry_run, limit))
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["ok"] = all(s["status"] == "ok" for s in summary["sections"].values())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{'section':<14} {'status':<8} {'seconds':>8}")
    for key, s in summary["sections"].items():
        print(f"{key} {s['name']:<12} {s['status']:<8} {s['seconds']:>8.1f}")
    print(f"total {summary['seconds']:.1f}s: {'all passed' if summary['ok'] else 'NOT all passed'}; JSON in {out}")
    return 0 if summary["ok"] else 1


def _run_child(keys: list[str], out: Path, work: Path, dry: bool, limit: float) -> dict:
    """Run `keys` in one child process with a time limit; fill in the JSON of any section it left unfinished."""
    me = str(Path(__file__).resolve())
    cmd = [sys.executable, me, "--run-section", "".join(keys), "--out", str(out), "--work", str(work)]
    if dry:
        cmd.append("--dry-run")
    log = out / ("dry_run.log" if dry else f"{keys[0]}_{SECTIONS[keys[0]][0]}.log")
    start = time.perf_counter()
    timed_out = False
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_child_env(dry), start_new_session=True)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
    results = {}
    for key in keys:
        name = SECTIONS[key][0]
        path = out / f"{key}_{name}.json"
        data = json.loads(path.read_text()) if path.exists() else {"section": name}
        if data.get("status") in (None, "running"):
            data.update(status="timeout" if timed_out else "error", ok=False)
            data["error"] = f"killed after {limit:.0f}s" if timed_out else f"the process exited {proc.returncode} first"
            data["log_tail"] = log.read_text()[-4000:]
            path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        seconds = data.get("seconds") or round(time.perf_counter() - start, 1)
        if data["status"] == "ok":
            print(f"--- {key} {name}: ok in {seconds:.1f}s", flush=True)
        else:
            tail = data.get("error") or log.read_text()[-2000:]
            print(f"--- {key} {name}: {data['status']}\n{str(tail)[-2000:]}", flush=True)
        results[key] = {"name": name, "status": data["status"], "seconds": seconds}
    return results


if __name__ == "__main__":
    sys.exit(main())
