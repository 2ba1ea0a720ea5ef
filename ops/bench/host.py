"""The engine's host work per step (issue 45): time per `engine.step()` against the time in the model's forward.

    pagedq bench host                         # tiny Llama, fp32, 2 threads, batches 1, 64, 256
    pagedq bench host --batch 256 --steps 80  # one batch, more steps

The workload of the issue: the tiny random Llama (`worker.models.tiny`), B requests of 32 prompt tokens
and 64 greedy tokens (`ignore_eos`), `max_num_seqs=256`. Once every sequence decodes, each of `--steps`
steps is timed three ways: the whole `engine.step()`, the time inside `runner.execute` (inputs, forward,
sampling), and the time inside the model's forward (the kernels). "Host" is the step less the forward:
scheduling, input building, sampling set-up, appending tokens, stops, outputs. Medians over the steps;
each batch runs `--rounds` times in one process and the median round is quoted.

Also counted: device-to-host syncs per step (`worker.engine.transfer.HOST_READS`), which must be one.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time

from ops.bench.machine import machine_info
from ops.bench.results import save_result

GOALS = {256: 2.0, 64: 0.6}  # ms per step (issue 45, CPU)
HOST_SHARE_GOAL = 0.25  # of the step at batch 256


class _Timer:
    """Wraps a callable; sums the seconds spent in it while `on`."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


def measure(engine, batch: int, steps: int, seed: int) -> dict:
    """One round: `batch` requests in, prefill until all decode, then `steps` timed decode steps."""
    from worker.engine import transfer
    from worker.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(5, 400) for _ in range(32)]
        engine.add_request(f"b{batch}-{seed}-{i}", None, params, prompt_token_ids=prompt)
    while engine.get_num_unfinished_requests() and any(
        s.num_computed_tokens < s.num_prompt_tokens for r in engine.requests.values() for s in r.seqs
    ):
        engine.step()
    engine.step()  # the first step with every sequence decoding
    execute, forward = engine.runner.execute, engine.runner.model.forward
    step_s, exec_s, fwd_s, syncs = [], [], [], []
    for _ in range(min(steps, 60)):
        execute.seconds = forward.seconds = 0.0
        reads = transfer.HOST_READS.count
        t = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t)
        exec_s.append(execute.seconds)
        fwd_s.append(forward.seconds)
        syncs.append(transfer.HOST_READS.count - reads)
    while engine.has_unfinished_requests():
        engine.step()
    step, ex, fw = (statistics.median(x) * 1e3 for x in (step_s, exec_s, fwd_s))
    return {
        "batch": batch,
        "step_ms": round(step, 3),
        "execute_ms": round(ex, 3),
        "forward_ms": round(fw, 3),
        "host_ms": round(step - fw, 3),
        "host_share": round((step - fw) / step, 3),
        "syncs_per_step": max(syncs),
    }


def run(args: argparse.Namespace) -> dict:
    import torch

    from worker.engine.engine import LLMEngine
    from worker.models.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="pagedq-host-") as tmp:
        model = build_tiny_model("llama", tmp, seed=0)
        engine = LLMEngine(model=str(model), dtype=args.dtype, device="cpu", max_num_seqs=max(args.batch), seed=0)
    engine.runner.execute = _Timer(engine.runner.execute)
    engine.runner.model.forward = _Timer(engine.runner.model.forward)
    rows = []
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(args.batch) * args.rounds, unit="round", file=sys.stderr, desc="bench host")
    for b in args.batch:
        rounds = []
        for k in range(args.rounds):
            rounds.append(measure(engine, b, args.steps, seed=k))
            if bar is not None:
                bar.set_postfix_str(f"batch {b}: {rounds[-1]['step_ms']:.2f} ms/step", refresh=False)
                bar.update(1)
        rounds.sort(key=lambda r: r["step_ms"])
        row = dict(rounds[len(rounds) // 2])
        row["rounds_step_ms"] = [r["step_ms"] for r in rounds]
        rows.append(row)
    if bar is not None:
        bar.close()
    return {
        "kind": "host",
        "model": "tiny-llama",
        "dtype": args.dtype,
        "threads": args.threads,
        "rows": rows,
        "goals_ms": GOALS,
        "host_share_goal": HOST_SHARE_GOAL,
        "machine": machine_info(args.threads),
    }


def table(result: dict) -> str:
    lines = [
        "| batch | step ms | execute ms | forward ms | host ms | host share | syncs/step | goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        goal = GOALS.get(r["batch"])
        verdict = "" if goal is None else f"<= {goal} ms: {'met' if r['step_ms'] <= goal else 'not met'}"
        lines.append(
            f"| {r['batch']} | {r['step_ms']:.2f} | {r['execute_ms']:.2f} | {r['forward_ms']:.2f} | "
            f"{r['host_ms']:.2f} | {r['host_share']:.0%} | {r['syncs_per_step']} | {verdict} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedq bench host", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per round (at most 60)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per batch; the median round is quoted")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="results folder (default ops/bench/results)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    result["command"] = "pagedq bench host " + " ".join(argv if argv is not None else sys.argv[1:])
    path = save_result("host", result, args.out)
    print(table(result))
    print(f"(wrote {path})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
