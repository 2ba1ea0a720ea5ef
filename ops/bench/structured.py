"""Structured outputs: throughput with a JSON-schema constraint vs the same requests unconstrained,
grammar compile time, and the bitmask's cost per step.

    python -m ops.bench.structured                       # SmolLM2, 32 concurrent requests, 3 repeats
    python -m ops.bench.structured --model tiny --repeats 1
    python -m ops.bench.structured --device cuda --dtype bfloat16

Throughput: `--requests` requests (32) run at once through the offline `LLMEngine`, sampled at
temperature 1.0 (seeded) under a nested JSON schema (objects in arrays, enums, integer ranges, bounded
strings), written as `response_format` writes it. The same prompts then run unconstrained with each
request's `max_tokens` set to the length its constrained answer had (and EOS ignored), so both runs
generate exactly the same number of tokens in the same batch shapes: the ratio of generated tokens
per second is the constraint's whole cost (mask fill on the host, mask apply on the device, matcher
updates). The grammar is compiled before the timed runs (its compile time is measured on its own).
Each repeat runs constrained, unconstrained, constrained again (seeded: the same tokens), and compares
the unconstrained time with the mean of the two around it, so a shared machine's drift cancels; prefix
caching is off so every run computes its prompts. The median ratio over repeats is quoted.

Compile time: `--schemas` (50) distinct schemas (the workload schema with renamed properties, other
enums and bounds), each compiled once cold through the engine's compiler; p50 and p99.

Mask time per step: the engine's own count of the host time spent filling bitmasks, over the steps of
the constrained runs, per step and per row; and the apply kernel's time on a [requests, vocab] batch.
With the matcher updates, the host's share of the run is the constraint's cost on a CPU whatever else
the machine is doing (the throughput ratio needs a quiet machine).

The result goes to ops/bench/results/structured-<timestamp>.json (and latest/structured.json).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

GOAL_RATIO = 0.85

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "status": {"enum": ["open", "closed", "pending"]},
        "title": {"type": "string", "minLength": 1, "maxLength": 16},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 8},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 10},
                    "kind": {"enum": ["a", "b"]},
                },
                "required": ["sku", "qty", "kind"],
            },
        },
    },
    "required": ["id", "status", "title", "items"],
}


def schema_variant(i: int) -> dict:
    """A distinct schema of the same shape (new property names, enum values and bounds)."""
    s = copy.deepcopy(SCHEMA)
    props = s["properties"]
    props[f"note{i}"] = {"type": "string", "maxLength": 4 + i % 7}
    props["status"]["enum"] = [f"s{i}_{k}" for k in range(2 + i % 4)]
    props["id"]["maximum"] = 100 + 37 * i
    props["items"]["items"]["properties"]["qty"]["maximum"] = 2 + i % 9
    s["required"] = [*s["required"], f"note{i}"]
    return s


def make_engine(args: argparse.Namespace):
    from ops.bench.common import resolve_model
    from worker import LLMEngine

    model = resolve_model(args.model, quick=args.model == "tiny")
    engine = LLMEngine(
        model=str(model),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(args.requests, 8),
        max_model_len=1024,
        num_kv_blocks=args.requests * (1024 // 16) + 64,
        enable_prefix_caching=False,  # every run computes its prompts: runs compare like for like
    )
    return engine, model


def run_batch(engine, prompts: list[str], params: list) -> tuple[list[list[int]], float, int]:
    """All requests at once, to the end: per request its tokens, the wall time, the steps taken."""
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params, strict=True)]
    steps0 = engine.snapshot().steps
    done: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids], time.perf_counter() - start, engine.snapshot().steps - steps0


def throughput(engine, args: argparse.Namespace) -> dict:
    from worker import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    prompts = [f"Order {i}: write it as JSON." for i in range(args.requests)]

    def constrained(rep: int) -> list:
        return [
            SamplingParams(temperature=1.0, seed=1000 * rep + i, max_tokens=args.max_tokens, structured_outputs=so)
            for i in range(args.requests)
        ]

    run_batch(engine, prompts[:2], constrained(99)[:2])  # compile (cached from here on) and warm up
    ratios, runs = [], []
    for rep in range(args.repeats):
        stats = engine.structured.mask_stats
        fill0, steps0, rows0, acc0 = stats.seconds, stats.steps, stats.rows, stats.accept_seconds
        tokens, t_con, steps = run_batch(engine, prompts, constrained(rep))
        fill, fill_steps, rows = stats.seconds - fill0, stats.steps - steps0, stats.rows - rows0
        accept = stats.accept_seconds - acc0
        t_first = t_con
        free = [
            SamplingParams(temperature=1.0, seed=1000 * rep + i, max_tokens=len(t), ignore_eos=True)
            for i, t in enumerate(tokens)
        ]
        free_tokens, t_free, free_steps = run_batch(engine, prompts, free)
        again, t_con2, _ = run_batch(engine, prompts, constrained(rep))  # the same tokens (seeded): drift cancels
        n = sum(len(t) for t in tokens)
        assert n == sum(len(t) for t in free_tokens) and again == tokens
        t_con = (t_con + t_con2) / 2
        run = {
            "generated_tokens": n,
            "constrained_s": t_con,
            "unconstrained_s": t_free,
            "constrained_tok_s": n / t_con,
            "unconstrained_tok_s": n / t_free,
            "ratio": t_free / t_con,
            "steps": steps,
            "unconstrained_steps": free_steps,
            "mask_fill_ms_per_step": 1000 * fill / max(fill_steps, 1),
            "mask_fill_us_per_row": 1e6 * fill / max(rows, 1),
            "mask_fill_share": fill / t_first,
            "accept_us_per_row": 1e6 * accept / max(rows, 1),
            "host_grammar_share": (fill + accept) / t_first,  # fill + matcher updates, of the first run
        }
        runs.append(run)
        ratios.append(run["ratio"])
    return {"runs": runs, "ratio_median": statistics.median(ratios)}


def compile_times(engine, count: int) -> dict:
    from worker.engine.structured.spec import GrammarSpec, canonical_json, fix_bounded_strings

    compiler = engine.structured.compiler
    before = len(compiler.compile_seconds)
    for i in range(count):
        spec = GrammarSpec("json", canonical_json(fix_bounded_strings(schema_variant(i))), False)
        compiler.get(spec).result()
    seconds = sorted(list(compiler.compile_seconds)[before:])
    return {
        "schemas": len(seconds),
        "p50_ms": 1000 * _quantile(seconds, 0.5),
        "p99_ms": 1000 * _quantile(seconds, 0.99),
        "max_ms": 1000 * seconds[-1],
    }


def apply_time(engine, rows: int, repeats: int = 50) -> dict:
    import torch

    from worker.engine.structured.bitmask import apply_bitmask

    lim = engine.limits
    vocab = lim.vocab_size
    logits = torch.randn(rows, vocab, device=lim.device, dtype=getattr(torch, lim.dtype))
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32, device=logits.device)
    sync = torch.cuda.synchronize if logits.device.type == "cuda" else (lambda: None)
    apply_bitmask(logits, mask, None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        apply_bitmask(logits, mask, None)
    sync()
    return {"rows": rows, "vocab": vocab, "us_per_step": 1e6 * (time.perf_counter() - start) / repeats}


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.bench.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model folder, 'smollm2' or 'tiny'")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--requests", type=int, default=32, help="concurrent requests")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--schemas", type=int, default=50, help="distinct schemas compiled for the compile times")
    p.add_argument("--out", default=None, help="results folder (default ops/bench/results)")
    args = p.parse_args(argv)

    import torch

    from ops.bench.machine import machine_info
    from ops.bench.results import save_result

    torch.set_num_threads(args.threads)
    engine, model = make_engine(args)
    result = {
        "benchmark": "structured",
        "command": "python -m ops.bench.structured "
        + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "machine": machine_info(args.threads, args.device),
        "model": str(model),
        "dtype": args.dtype,
        "requests": args.requests,
        "goal_ratio": GOAL_RATIO,
        "throughput": throughput(engine, args),
        "compile": compile_times(engine, args.schemas),
        "mask_apply": apply_time(engine, args.requests),
    }
    path = save_result("structured", result, args.out)
    t, c, a = result["throughput"], result["compile"], result["mask_apply"]
    last = t["runs"][-1]
    print(f"model {model.name}, {args.dtype} on {args.device}, {args.requests} concurrent requests")
    print(
        f"structured / unconstrained throughput: {t['ratio_median']:.1%} (goal >= {GOAL_RATIO:.0%}); "
        f"last run {last['constrained_tok_s']:.1f} vs {last['unconstrained_tok_s']:.1f} tok/s"
    )
    print(f"grammar compile over {c['schemas']} schemas: p50 {c['p50_ms']:.2f} ms, p99 {c['p99_ms']:.2f} ms")
    print(
        f"mask fill {last['mask_fill_ms_per_step']:.3f} ms/step ({last['mask_fill_us_per_row']:.1f} us/row, "
        f"{last['mask_fill_share']:.1%} of the run); apply {a['us_per_step']:.1f} us/step "
        f"on [{a['rows']}, {a['vocab']}]"
    )
    print(f"host time on grammars (fill + matcher updates): {last['host_grammar_share']:.1%} of the run")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
