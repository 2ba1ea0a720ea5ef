"""Uniform batch: B sequences of P prompt tokens, then G decode steps; prefill and decode tokens/s.

    pagedq bench uniform                                  # SmolLM2, B=32, P=144, G=128, each dtype here
    pagedq bench uniform --dtypes float32 --batch 32,64
    pagedq bench uniform --llama-cpp-dir ~/llama.cpp      # llama.cpp rows too (converts the model once)

The shape of llama.cpp's `llama-batched-bench` (same B, P and G, separate prompts), so the two can be
read side by side. llama.cpp prefills every prompt, then runs G decode steps; its S_PP is B*P over
the prefill time, S_TG is B*G over the decode time. pagedq interleaves the two (chunked prefill), so
its prefill time is measured by a run with one output token per sequence (every prompt computed, one
token sampled), and its decode time is the full run's time (G+1 tokens per sequence) minus that.
Prefix caching is off (every prompt is distinct anyway); each dtype runs in a fresh process, after a
warm-up run of the same shape.

llama.cpp rows appear when `llama-batched-bench` is on PATH or in --llama-cpp-dir (its build/bin),
with a GGUF of the same weights in the same dtype: `--gguf f32=PATH`, or converted once into the
pagedq cache by llama.cpp's `convert_hf_to_gguf.py` from --llama-cpp-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ops.bench.common import child_entry, child_env, kv_options, resolve_model, run_child
from ops.bench.machine import machine_info
from ops.bench.results import save_result

MODULE = "ops.bench.uniform"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


# --- pagedq (child process) ------------------------------------------------------------------------


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(min(1000, vocab // 2), vocab - 1) for _ in range(prompt_len)] for _ in range(batch)]


def _timed_run(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from worker.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != len(prompts) * max_tokens:
        raise RuntimeError(f"expected {len(prompts) * max_tokens} output tokens, got {produced}")
    return seconds, produced


def _child(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from worker.engine.llm import LLM

    b, p, g = spec["batch"], spec["prompt_len"], spec["gen_len"]
    llm = LLM(
        spec["model_dir"],
        dtype=spec["dtype"],
        device="cpu",
        enable_prefix_caching=False,
        max_num_seqs=max(b, 1),
        max_model_len=p + g + 16,
        **spec.get("engine", {}),
    )
    vocab = json.loads((Path(spec["model_dir"]) / "config.json").read_text())["vocab_size"]
    _timed_run(llm, _prompts(b, p, vocab, seed=999), g + 1)  # warm-up: same shapes, other prompts
    t_pp, _ = _timed_run(llm, _prompts(b, p, vocab, seed=spec["seed"]), 1)
    t_all, _ = _timed_run(llm, _prompts(b, p, vocab, seed=spec["seed"] + 1), g + 1)
    t_tg = max(t_all - t_pp, 1e-9)
    result = {
        "system": "pagedq",
        "dtype": spec["dtype"],
        "quantization": spec.get("engine", {}).get("quantization"),  # int8 weights (--engine-arg), or None
        "batch": b,
        "prompt_len": p,
        "gen_len": g,
        "t_pp": t_pp,
        "t_tg": t_tg,
        "s_pp": b * p / t_pp,
        "s_tg": b * g / t_tg,
        "s_total": b * (p + g) / (t_pp + t_tg),
    }
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


# --- llama.cpp ---------------------------------------------------------------------------------------


def find_binary(name: str, llama_dir: Path | None) -> str | None:
    if llama_dir is not None:
        for sub in ("build/bin", "bin", ""):
            path = llama_dir / sub / name
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return shutil.which(name)


def cached_gguf(model_dir: Path, dtype: str) -> Path:
    """Where `convert_gguf` puts the model as a GGUF of `dtype` (it may not exist yet)."""
    from worker.models.prepare import cache_root

    return cache_root().parent / "gguf" / f"{model_dir.name}-{GGUF_TYPES[dtype]}.gguf"


def convert_gguf(model_dir: Path, dtype: str, llama_dir: Path) -> Path:
    """The model as a GGUF of `dtype`, converted once by llama.cpp's own script into the pagedq cache."""
    out = cached_gguf(model_dir, dtype)
    if out.exists():
        return out
    script = llama_dir / "convert_hf_to_gguf.py"
    if not script.exists():
        raise SystemExit(f"--llama-cpp-dir {llama_dir}: no convert_hf_to_gguf.py there; give --gguf {dtype}=PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(llama_dir / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(script), str(model_dir), "--outtype", GGUF_TYPES[dtype], "--outfile", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return out


_ROW = re.compile(r"^\|\s*\d+\s*\|")


def parse_batched_bench(text: str) -> list[dict]:
    """The table rows `llama-batched-bench` prints: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s |
    S_TG t/s | T s | S t/s |."""
    rows = []
    for line in text.splitlines():
        if not _ROW.match(line.strip()):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 10:
            continue
        pp, tg, b, _nkv, t_pp, s_pp, t_tg, s_tg, _t, s = cells[:10]
        rows.append(
            {
                "prompt_len": int(pp),
                "gen_len": int(tg),
                "batch": int(b),
                "t_pp": float(t_pp),
                "s_pp": float(s_pp),
                "t_tg": float(t_tg),
                "s_tg": float(s_tg),
                "s_total": float(s),
            }
        )
    return rows


def run_llama_cpp(binary: str, gguf: Path, dtype: str, batch: int, p: int, g: int, threads: int) -> dict:
    ctx = batch * (p + g) + 64
    cmd = [binary, "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-t", str(threads)]
    cmd += ["-npp", str(p), "-ntg", str(g), "-npl", str(batch)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(threads))
    rows = parse_batched_bench(done.stdout + "\n" + done.stderr)
    if done.returncode != 0 or not rows:
        return {"system": "llama.cpp", "dtype": dtype, "batch": batch, "error": (done.stderr or done.stdout)[-2000:]}
    return {**rows[-1], "system": "llama.cpp", "dtype": dtype, "command": " ".join(cmd)}


# --- driver -----------------------------------------------------------------------------------------


def _table(rows: list[dict]) -> str:
    head = "| system | dtype | B | P | G | prefill tok/s | decode tok/s | overall tok/s | prefill s | decode s |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['dtype']} | {r.get('batch', '')} | error: {r['error'][:120]!r} |")
            continue
        dtype = r["dtype"] + (f" ({r['quantization']} weights)" if r.get("quantization") else "")
        lines.append(
            f"| {r['system']} | {dtype} | {r['batch']} | {r['prompt_len']} | {r['gen_len']} | "
            f"{r['s_pp']:,.0f} | {r['s_tg']:,.0f} | {r['s_total']:,.0f} | {r['t_pp']:.2f} | {r['t_tg']:.2f} |"
        )
    return "\n".join(lines)


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedq bench uniform", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="model folder, 'smollm2' or 'tiny'")
    p.add_argument("--dtypes", default=None, help="comma list (default: float32, plus bfloat16 where native)")
    p.add_argument("--batch", type=_csv_ints, default=[32], help="sequences in the batch (comma list)")
    p.add_argument("--prompt-len", type=int, default=144)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-cpp-dir", type=Path, default=None, help="a llama.cpp checkout with build/bin")
    p.add_argument("--gguf", action="append", default=[], metavar="DTYPE=PATH", help="llama.cpp model per dtype")
    p.add_argument("--no-llama-cpp", action="store_true", help="pagedq rows only")
    p.add_argument("--engine-arg", action="append", default=[], metavar="K=V", help="extra EngineConfig option")
    p.add_argument("--out", default=None, help="results folder (default ops/bench/results)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per measured process")
    return p


def _dtypes(arg: str | None) -> list[str]:
    if arg:
        return [d.strip() for d in arg.split(",") if d.strip()]
    from pagedq_kernels.cpu import native_bf16

    return ["float32", "bfloat16"] if native_bf16() else ["float32"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_dir = resolve_model(args.model)
    dtypes = _dtypes(args.dtypes)
    ggufs = {k: Path(v) for k, _, v in (g.partition("=") for g in args.gguf)}
    ggufs = {next((d for d, t in GGUF_TYPES.items() if t == k), k): v for k, v in ggufs.items()}
    binary = None if args.no_llama_cpp else find_binary("llama-batched-bench", args.llama_cpp_dir)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="pagedq-uniform-") as tmp:
        for dtype in dtypes:
            for b in args.batch:
                spec = {
                    "system": f"pagedq-{dtype}-{b}",
                    "model_dir": str(model_dir),
                    "dtype": dtype,
                    "batch": b,
                    "prompt_len": args.prompt_len,
                    "gen_len": args.gen_len,
                    "threads": args.threads,
                    "seed": args.seed,
                    "engine": kv_options(args.engine_arg),
                }
                rows.append(run_child(spec, Path(tmp), args.timeout, MODULE))
                print(_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
                if binary is None:
                    continue
                gguf = ggufs.get(dtype) or (
                    convert_gguf(model_dir, dtype, args.llama_cpp_dir) if args.llama_cpp_dir else None
                )
                if gguf is None:
                    continue
                rows.append(run_llama_cpp(binary, gguf, dtype, b, args.prompt_len, args.gen_len, args.threads))
                print(_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    result = {
        "kind": "uniform",
        "rows": rows,
        "machine": machine_info(args.threads),
        "model": model_dir.name,
        "llama_cpp": binary,
        "command": "pagedq bench uniform " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    path = save_result("uniform", result, args.out)
    print(_table(rows))
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        raise SystemExit(child_entry(_child))
    raise SystemExit(main())
