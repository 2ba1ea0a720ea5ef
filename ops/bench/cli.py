"""`pagedq bench` / `python -m ops.bench`: offline throughput, serving through Redis, KV memory, prefix
cache; JSON, plots, summary.

    python -m ops.bench all --quick             # a few minutes, tiny model: smoke
    python -m ops.bench all                     # SmolLM2-135M, the fastest dtype here, 2 threads, 64 requests
    python -m ops.bench offline --dtype float32 --requests 16
    python -m ops.bench serve --rates 0.5,1,1.5
    python -m ops.bench report                  # rebuild summary.md + plots from latest/*.json

`pagedq bench ARGS` runs `python -m ops.bench ARGS` from the source checkout. The default dtype is
the fastest one the hardware has: bf16 on a GPU or a CPU with native bf16, else fp32 (the recorded
run in RESULTS.md: fp32, on a CPU without native bf16).

Every subcommand writes ops/bench/results/<name>-<timestamp>.json and latest/<name>.json, then
rebuilds latest/summary.md (printed at the end) and the PNG plots from whatever latest/ holds.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from ops.bench.common import kv_options as _kv
from ops.bench.machine import machine_info
from ops.bench.progress import Progress
from ops.bench.results import save_result
from ops.bench.summary import write_summary

COMMANDS = ("offline", "serve", "memory", "prefix", "all", "report")


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in _csv(text)]


def add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("common")
    g.add_argument("--quick", action="store_true", help="small and fast (tiny model unless --model): smoke")
    g.add_argument("--model", default=None, help="model folder, 'smollm2' or 'tiny' (default: smollm2; quick: tiny)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="auto: bf16 on a GPU or a CPU with native bf16, else fp32 (the fastest dtype here)",
    )
    g.add_argument("--threads", type=int, default=2, help="torch threads of every measured process")
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.add_argument("--requests", type=int, default=None, help="requests of the main workload (64; quick 8)")
    g.add_argument("--repeats", type=int, default=None, help="repeats, median quoted (3; quick 1)")
    g.add_argument("--seed", type=int, default=0, help="workload seed")
    g.add_argument("--out", default=None, help="results folder (default ops/bench/results)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--child-timeout", type=float, default=None, help="seconds per measured process (3600; quick 600)")

    o = p.add_argument_group("offline")
    o.add_argument("--workload", default="random", help="workload of the offline and serving comparisons")
    o.add_argument(
        "--systems",
        type=_csv,
        default=None,
        help="offline: pagedq,hf-single,hf-static,hf-cb; serve: pagedq,pagedq-nochunk,hf-static "
        "(default), llama-server (opt-in: named here, or --llama-cpp-dir without --systems)",
    )
    o.add_argument(
        "--single-requests",
        type=int,
        default=None,
        help="hf-single runs this many requests spread over the workload (8; quick all)",
    )
    o.add_argument("--static-batch", type=int, default=16, help="batch size of transformers static batching")
    o.add_argument("--hf-cb", default=None, help="transformers continuous batching preset (hf_baselines.CB_PRESETS)")
    o.add_argument(
        "--hf-cb-sweep",
        type=_csv,
        default=None,
        help="presets to try in repeat 1, fastest kept ('none' to skip; default quick: all but auto)",
    )
    o.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="K=V",
        help="extra pagedq EngineConfig option for the offline LLM and the workers",
    )

    s = p.add_argument_group("serve")
    s.add_argument("--rates", type=_floats, default=None, help="Poisson rates as fractions of saturation (0.5,1,1.5)")
    s.add_argument("--serve-requests", type=int, default=None, help="requests per Poisson load point (24; quick 8)")
    s.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: time to first token, seconds")
    s.add_argument("--slo-tpot", type=float, default=0.2, help="goodput SLO: mean inter-token latency, seconds")
    s.add_argument(
        "--chunk-cap",
        type=int,
        default=None,
        help="chunked pagedq worker: --long-prefill-token-threshold (default: the engine's); "
        "other engine options go through --engine-arg",
    )
    s.add_argument(
        "--long-requests", type=int, default=None, help="requests of the long-prompt run (32; quick 16; 0: no such run)"
    )
    s.add_argument(
        "--long-prompt-only",
        action="store_true",
        help="only the long-prompt run of the pagedq systems (no saturation, no Poisson sweep): "
        "tuning the chunking options; write it to its own --out",
    )
    s.add_argument(
        "--no-offline-pairs",
        action="store_true",
        help="no offline run before each pagedq saturation run: the serving ratio then compares against "
        "the offline benchmark's result (this run's, else the latest matching one)",
    )
    s.add_argument(
        "--llama-cpp-dir",
        type=Path,
        default=None,
        help="serve's llama-server system: a llama.cpp checkout (binary in build/bin, else PATH; its "
        "convert_hf_to_gguf.py makes the GGUF once); without --systems it adds llama-server to the default list",
    )
    s.add_argument("--gguf", default=None, help="llama-server's model (default: the pagedq cache's GGUF of --dtype)")
    s.add_argument("--via", choices=("sdk", "gateway"), default="sdk", help="gateway: the HTTP gateway vs the SDK")
    s.add_argument("--gateway-streams", type=int, default=1000, help="--via gateway: SSE streams held at once")

    m = p.add_argument_group("memory")
    m.add_argument("--max-model-len", type=int, default=2048, help="what contiguous allocation reserves per request")
    m.add_argument(
        "--fit-contiguous", type=int, default=4, help="KV budget of the memory test, in max-model-len requests"
    )

    x = p.add_argument_group("prefix")
    x.add_argument("--prefix-requests", type=int, default=None, help="shared-prefix requests (16; quick 8)")
    x.add_argument(
        "--prefix-load",
        type=float,
        default=0.5,
        help="Poisson rate of the TTFT runs, as a fraction of saturation without prefix caching",
    )


def finalize(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --quick."""
    q = args.quick

    def pick(name: str, full, quick) -> None:
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)

    pick("requests", 64, 8)
    pick("repeats", 3, 1)
    pick("child_timeout", 3600.0, 600.0)
    pick("single_requests", 8, 0)
    pick("serve_requests", 24, 8)
    pick("long_requests", 32, 16)
    pick("prefix_requests", 16, 8)
    pick("rates", [0.5, 1.0, 1.5], [0.5, 1.0])
    pick("hf_cb", "p32-t1024", "p32-t1024")
    if args.hf_cb_sweep is None:
        args.hf_cb_sweep = ["p32-t1024", "p32-t512", "p64-t2048"] if q else []
    elif args.hf_cb_sweep == ["none"]:
        args.hf_cb_sweep = []
    args.engine = _kv(args.engine_arg)
    if args.dtype == "auto":
        args.dtype = fastest_dtype(args.device)
    return args


def fastest_dtype(device: str) -> str:
    """Every system is measured in the same dtype: the fastest one this hardware has."""
    import torch

    from worker.models.loader import bf16_is_fast

    return "bfloat16" if bf16_is_fast(torch.device(device)) else "float32"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedq bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="bench", metavar="COMMAND", required=True)
    helps = {
        "offline": "throughput: pagedq LLM vs transformers (one at a time, static, continuous batching)",
        "serve": "latency and throughput through Redis: pagedq (chunked prefill on/off) vs a static-batching "
        "worker (and llama.cpp's llama-server over HTTP, opt-in)",
        "memory": "KV slots holding live tokens; requests that fit a KV budget, paged vs contiguous",
        "prefix": "shared-prefix workload with prefix caching on and off",
        "all": "offline, serve, memory, prefix, then the summary",
        "report": "rebuild summary.md and the plots from latest/*.json",
    }
    for name in COMMANDS:
        add_options(sub.add_parser(name, help=helps[name]))
    for name in DELEGATED:
        # Benchmarks with options of their own: `pagedq bench NAME ...` runs `python -m ops.bench.NAME ...`
        sub.add_parser(name, help=f"{DELEGATED_HELP[name]} (options: pagedq bench {name} --help)", add_help=False)
    return parser


DELEGATED = {
    "structured": "ops.bench.structured",
    "tenants": "ops.bench.tenants",
    "uniform": "ops.bench.uniform",
    "batch": "ops.bench.batch_mix",
    "hostile": "ops.bench.hostile",
    "host": "ops.bench.host",
}
DELEGATED_HELP = {
    "structured": "constrained decoding: throughput vs unconstrained, grammar compile and mask times",
    "tenants": "tenant isolation: a calm tenant's TTFT alone and beside one bursting 10x its quota",
    "uniform": "uniform batch (B prompts of P tokens, G decode steps): prefill and decode tok/s, llama.cpp beside",
    "batch": "Batch API beside interactive chat: TTFT with a low-lane batch running, batch tok/s busy vs idle",
    "hostile": "hostile clients against the gateway: stalled streams, slowloris, hang-ups; RSS, others' TTFT",
    "host": "the engine's host work per step: step time vs forward time at batch 1/64/256 (tiny model)",
}


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw and raw[0] in DELEGATED:
        import importlib

        return importlib.import_module(DELEGATED[raw[0]]).main(raw[1:])
    args = finalize(build_parser().parse_args(raw))
    command = "pagedq bench " + " ".join(shlex.quote(a) for a in raw)
    if args.bench == "report":
        print(write_summary(args.out, command=None))
        return 0

    from ops.bench import memory, offline, prefix, serve
    from ops.bench.common import resolve_model

    args.model_dir = resolve_model(args.model, args.quick)
    if args.systems is None:
        args.offline_systems = list(offline.SYSTEMS)
    else:
        args.offline_systems = [s for s in args.systems if s in offline.SYSTEMS]
    args.serve_systems = serve_systems(args.systems, args.llama_cpp_dir)
    todo = ["offline", "serve", "memory", "prefix"] if args.bench == "all" else [args.bench]
    modules = {"offline": offline, "serve": serve, "memory": memory, "prefix": prefix}
    units = sum(modules[n].plan_units(_view(args, n)) for n in todo)
    progress = Progress(units, enabled=not args.no_progress)
    machine = machine_info(args.threads, args.device)
    done: dict[str, dict] = {}
    t_all = time.monotonic()
    try:
        for name in todo:
            t0 = time.monotonic()
            result = modules[name].run(_view(args, name), progress, **({"context": done} if name != "offline" else {}))
            result.update(
                machine=machine,
                command=command,
                quick=args.quick,
                seconds=round(time.monotonic() - t0, 1),
            )
            done[name] = result
            path = save_result("serve-gateway" if result.get("kind") == "serve-gateway" else name, result, args.out)
            progress.write(f"[{name}] wrote {path} ({result['seconds']:.0f}s)")
    finally:
        progress.close()
    print(write_summary(args.out, command=command))
    print(f"\n(total {time.monotonic() - t_all:.0f}s)", file=sys.stderr)
    return 0


def serve_systems(listed: list[str] | None, llama_cpp_dir: Path | None) -> list[str]:
    """The serving benchmark's systems: those --systems lists, in its order, else the default ones, plus
    the opt-in llama-server when --llama-cpp-dir is given (never merely because a binary is on PATH)."""
    from ops.bench.serve import OPTIONAL, SYSTEMS

    if listed is not None:
        return [s for s in listed if s in SYSTEMS + OPTIONAL]
    return list(SYSTEMS) + (list(OPTIONAL) if llama_cpp_dir is not None else [])


def _view(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """The options as one benchmark sees them (its own --systems list)."""
    view = argparse.Namespace(**vars(args))
    if name == "offline":
        view.systems = args.offline_systems
    elif name == "serve":
        view.systems = args.serve_systems
    return view


if __name__ == "__main__":
    sys.exit(main())
