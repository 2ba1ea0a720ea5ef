"""Results of the benchmarks: JSON files, the machine they ran on, statistics, the Markdown summary and plots.

Layout under the results folder (default ops/bench/results):
    <name>-<timestamp>.json     every run, kept
    latest/<name>.json          the last run of each benchmark (offline, serve, memory, prefix)
    latest/*.png, summary.md    rebuilt from latest/*.json by `write_summary`
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
BENCHMARKS = ("offline", "serve", "memory", "prefix")

# --- statistics ------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), as numpy's default."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dist(values: Iterable[float]) -> dict[str, float]:
    """mean, p50, p90, p99, max and count of a sample (NaN when empty)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan, "max": math.nan}
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": max(xs),
    }


def median(values: Iterable[float]) -> float:
    xs = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(xs) if xs else math.nan


def clean(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become None (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


# --- the machine ---------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _native_bf16() -> bool | None:
    try:
        from kernels.cpu import native_bf16
    except ImportError:
        return None
    return native_bf16()


def machine_info(threads: int | None = None, device: str = "cpu") -> dict:
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_bf16": _native_bf16(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if device.startswith("cuda") and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        info["torch"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


# --- files ---------------------------------------------------------------------------------------


def timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def save_result(name: str, data: dict, out_dir: str | Path | None = None) -> Path:
    """Write `<out>/<name>-<timestamp>.json` and `<out>/latest/<name>.json`; returns the first."""
    out = Path(out_dir) if out_dir else RESULTS
    (out / "latest").mkdir(parents=True, exist_ok=True)
    text = json.dumps(clean(data), indent=1) + "\n"
    path = out / f"{name}-{timestamp()}.json"
    path.write_text(text)
    (out / "latest" / f"{name}.json").write_text(text)
    return path


def load_latest(out_dir: str | Path | None = None) -> dict[str, dict]:
    latest = (Path(out_dir) if out_dir else RESULTS) / "latest"
    found = {}
    for name in BENCHMARKS:
        p = latest / f"{name}.json"
        if p.exists():
            found[name] = json.loads(p.read_text())
    return found


# --- progress --------------------------------------------------------------------------------------


class Progress:
    """One progress bar over the planned units of work (a subprocess run, a serving load point)."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr, desc="bench")

    def start(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(what[:60])
            self.bar.refresh()

    def done(self, n: int = 1, note: str | None = None) -> None:
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note[:50], refresh=False)
            self.bar.update(n)

    def add(self, n: int) -> None:
        if self.bar is not None:
            self.bar.total += n
            self.bar.refresh()

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --- goals -----------------------------------------------------------------------------------------


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and x is not None and math.isfinite(x) else math.nan


def _fmt(x: Any, digits: int = 2, unit: str = "") -> str:
    v = _num(x)
    return "n/a" if math.isnan(v) else f"{v:,.{digits}f}{unit}"


def _pct(x: Any, digits: int = 1) -> str:
    v = _num(x)
    return "n/a" if math.isnan(v) else f"{100 * v:.{digits}f}%"


def _ms(x: Any) -> str:
    v = _num(x)
    return "n/a" if math.isnan(v) else f"{1000 * v:,.0f}"


def _goal(name: str, target: str, value: float, ok: bool | None, shown: str) -> dict:
    status = "n/a" if ok is None or math.isnan(value) else ("PASS" if ok else "MISS")
    return {"goal": name, "target": target, "measured": shown, "value": value, "status": status}


def goals(res: dict[str, dict]) -> list[dict]:
    out = []
    off = res.get("offline", {})
    ratios = off.get("ratios", {})
    for system, target, label in (
        ("hf-cb", 3.0, "transformers continuous batching"),
        ("hf-static", 2.5, "transformers static batching"),
        ("hf-single", 8.0, "transformers one request at a time"),
    ):
        v = _num(ratios.get(system))
        out.append(_goal(f"offline: pagedq vs {label}", f">= {target:g}x", v, v >= target, _fmt(v, 2, "x")))
    frac = _num(off.get("ceiling", {}).get("fraction"))
    out.append(_goal("offline: share of the hardware ceiling (matmul FLOP/s)", ">= 60%", frac, frac >= 0.6, _pct(frac)))
    if off.get("dtype") == "float32":
        agree = [_num(a.get("identical")) for a in off.get("agreement", {}).values()]
        v = min(agree) if agree else math.nan
        out.append(_goal("offline fp32: greedy outputs identical to transformers", "100%", v, v >= 1.0, _pct(v)))
    srv = res.get("serve", {})
    ref = srv.get("offline_ref", {})
    v = _num(ref.get("ratio"))
    out.append(_goal("serve: saturation throughput through Redis vs offline", ">= 90%", v, v >= 0.9, _pct(v)))
    systems = srv.get("systems", {})
    lp = systems.get("pagedq", {}).get("long_prompt", {})
    v = _num(lp.get("p99_ratio_during"))
    out.append(
        _goal(
            "serve, chunked prefill: ITL p99 while long prompts arrive vs without",
            "<= 2x",
            v,
            v <= 2.0,
            _fmt(v, 2, "x"),
        )
    )
    lp = systems.get("pagedq-nochunk", {}).get("long_prompt", {})
    v = _num(lp.get("p99_ratio_during"))
    out.append(_goal("serve, no chunking: the same ratio (reported)", "report", v, None, _fmt(v, 2, "x")))
    mem = res.get("memory", {})
    v = _num(mem.get("waste_mean"))
    src = f" ({mem['waste_source']})" if mem.get("waste_source") else ""
    out.append(
        _goal(
            f"memory: allocated KV slots without a live token{src}",
            "< 4%",
            v,
            v < 0.04,
            _pct(v, 2),
        )
    )
    v = _num(mem.get("fit", {}).get("ratio"))
    out.append(
        _goal(
            "memory: concurrent requests in a fixed KV budget, paged vs contiguous",
            ">= 3x",
            v,
            v >= 3.0,
            _fmt(v, 1, "x"),
        )
    )
    pre = res.get("prefix", {})
    v = _num(pre.get("ttft_p50_ratio"))
    out.append(_goal("prefix cache: TTFT p50 with caching vs without", "<= 0.5x", v, v <= 0.5, _fmt(v, 2, "x")))
    return out


# --- plots -----------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(res: dict[str, dict], path: Path) -> bool:
    off, srv = res.get("offline", {}), res.get("serve", {})
    bars = [(s, _num(v.get("out_tok_s"))) for s, v in off.get("systems", {}).items()]
    serve_bars = [(s, _num(v.get("saturation", {}).get("out_tok_s"))) for s, v in srv.get("systems", {}).items()]
    if not bars and not serve_bars:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, data, title in ((axes[0], bars, "offline"), (axes[1], serve_bars, "through Redis, all at once")):
        names = [n for n, _ in data]
        vals = [0 if math.isnan(v) else v for _, v in data]
        colors = ["#2b7bba" if n.startswith("pagedq") else "#999999" for n in names]
        ax.bar(names, vals, color=colors)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=9)
        ax.set_title(title)
        ax.set_ylabel("output tokens/s")
        ax.tick_params(axis="x", labelrotation=15)
    fig.suptitle(f"{off.get('model', srv.get('model', {})).get('folder', '')} {off.get('dtype', srv.get('dtype', ''))}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _cdf(ax, values: list[float], label: str, scale: float = 1.0) -> None:
    xs = sorted(v * scale for v in values if v is not None)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def plot_latency_cdfs(res: dict[str, dict], path: Path) -> bool:
    srv = res.get("serve", {})
    runs = []
    for s, v in srv.get("systems", {}).items():
        sweep = v.get("sweep") or []
        if sweep:  # the load closest to saturation from below, else the lowest
            below = [r for r in sweep if r["fraction"] <= 1.0] or sweep
            runs.append((s, max(below, key=lambda r: r["fraction"])))
    if not runs:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for s, r in runs:
        label = f"{s} @ {r['fraction']:g}x"
        _cdf(axes[0], r.get("samples", {}).get("ttft", []), label)
        _cdf(axes[1], r.get("samples", {}).get("itl", []), label, 1000)
    axes[0].set_xlabel("time to first token (s)")
    axes[1].set_xlabel("inter-token latency (ms)")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"latency CDFs, Poisson arrivals ({srv.get('saturation_rate_req_s', 0) or 0:.2f} req/s = 1x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_itl_long_prompts(res: dict[str, dict], path: Path) -> bool:
    systems = [(s, v["long_prompt"]) for s, v in res.get("serve", {}).get("systems", {}).items() if "long_prompt" in v]
    if not systems:
        return False
    plt = _plt()
    fig, axes = plt.subplots(len(systems), 1, figsize=(11, 3.2 * len(systems)), sharex=True, squeeze=False)
    for ax, (s, lp) in zip(axes[:, 0], systems):
        tl = lp.get("timeline", {})
        for a, b in tl.get("long_windows", []):
            ax.axvspan(a, b, color="#f4a261", alpha=0.3)
        if tl.get("alone"):
            t, g = zip(*tl["alone"])
            ax.scatter(t, [1000 * x for x in g], s=4, color="#999999", label="short chats alone")
        if tl.get("with_long"):
            t, g = zip(*tl["with_long"])
            ax.scatter(
                t, [1000 * x for x in g], s=4, color="#2b7bba", label="with long prompts (shaded: their prefill)"
            )
        ax.set_yscale("log")
        ax.set_ylabel("ITL (ms)")
        ratio = lp.get("p99_ratio_during")
        ax.set_title(f"{s}: ITL of running short requests; p99 during long prefill / alone = {_fmt(ratio, 2, 'x')}")
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the first arrival")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_prefix(res: dict[str, dict], path: Path) -> bool:
    settings = res.get("prefix", {}).get("settings", {})
    if not any(v.get("poisson") for v in settings.values()):
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, v in settings.items():
        if v.get("poisson"):
            _cdf(ax, v["poisson"][0].get("samples", {}).get("ttft", []), name)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("shared-prefix workload: TTFT")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


PLOTS = {
    "throughput.png": plot_throughput,
    "latency_cdf.png": plot_latency_cdfs,
    "itl_long_prompt.png": plot_itl_long_prompts,
    "prefix_ttft.png": plot_prefix,
}


# --- the Markdown summary ----------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _dist_cells(d: dict | None, fn=_ms) -> list[str]:
    d = d or {}
    return [fn(d.get("mean")), fn(d.get("p50")), fn(d.get("p90")), fn(d.get("p99"))]


def _offline_section(off: dict) -> list[str]:
    lines = ["## Offline throughput", ""]
    wl = off.get("workload", {})
    lines.append(
        f"Workload `{wl.get('name')}`: {wl.get('requests')} requests, {wl.get('prompt_tokens')} prompt + "
        f"{wl.get('output_tokens')} output tokens (EOS ignored), seed {wl.get('seed')}. "
        f"Median of {off.get('repeats')} repeat(s), each system in a fresh process, warm-up excluded."
    )
    lines.append("")
    rows = []
    gpu = any("peak_gpu_mb" in v for v in off.get("systems", {}).values())
    for s, v in off.get("systems", {}).items():
        ag = off.get("agreement", {}).get(s, {})
        sub = f" ({v.get('requests')} req subset)" if v.get("subset") else ""
        each = ", ".join(_fmt(r.get("out_tok_s"), 1) for r in v.get("runs", []))
        rows.append(
            [
                f"{s}{sub}",
                _fmt(v.get("out_tok_s"), 1),
                each,
                _fmt(v.get("total_tok_s"), 1),
                _fmt(v.get("peak_rss_mb"), 0),
                *([_fmt(v.get("peak_gpu_mb"), 0)] if gpu else []),
                _fmt(v.get("cpu_share"), 2),
                "-" if s == "pagedq" else _fmt(off.get("ratios", {}).get(s), 2, "x"),
                "-" if s == "pagedq" else _pct(ag.get("identical"), 0),
                "-" if s == "pagedq" else _pct(ag.get("mean_common_prefix_frac"), 0),
                "FAILED" if v.get("error") and not v.get("runs") else "",
            ]
        )
    head = ["system", "output tok/s", "per repeat", "total tok/s", "peak RSS MB", *(["peak GPU MB"] if gpu else [])]
    head += ["CPU share", "pagedq speed-up (paired)", "identical outputs", "common prefix", ""]
    lines += _table(head, rows)
    lines.append(
        "\nCPU share: CPU time over (wall time x threads) while timed; well below the others' on a busy "
        "machine. Speed-ups are medians of per-repeat ratios. Outputs are compared with pagedq's token for "
        "token (bf16 drifts after a while; fp32 must agree fully); common prefix: mean share of each output."
    )
    c = off.get("ceiling", {})
    lines += [
        "",
        f"Hardware ceiling: a {c.get('matmul_size')}^3 matmul runs at {_fmt(_num(c.get('matmul_flops')) / 1e9, 1)} "
        f"GFLOP/s ({off.get('dtype')}, {off.get('threads')} threads). pagedq does "
        f"{_fmt(_num(c.get('achieved_flops')) / 1e9, 1)} GFLOP/s of useful model work = **{_pct(c.get('fraction'))}** "
        f"of it (FLOPs per token {_fmt(_num(c.get('flops_per_token')) / 1e6, 1)} M at mean context "
        f"{_fmt(c.get('mean_context'), 0)}; the per-token formula x total tokens/s gives "
        f"{_pct(c.get('fraction_brief_formula'))}).",
    ]
    cb = off.get("hf_cb", {})
    if cb.get("sweep"):
        tried = ", ".join(
            f"{e['preset']}: {_fmt(e.get('out_tok_s'), 1)} tok/s" + (" (failed)" if e.get("error") else "")
            for e in cb["sweep"]
        )
        lines.append(f"transformers continuous batching presets tried: {tried}; kept `{cb.get('preset')}`.")
    elif cb.get("preset"):
        lines.append(f"transformers continuous batching preset: `{cb.get('preset')}` (ops/bench/hf_baselines.py).")
    for s, err in off.get("errors", {}).items():
        lines.append(f"\n**{s} failed**: `{err.strip().splitlines()[-1][:300] if err.strip() else err}`")
    return lines


def _serve_section(srv: dict) -> list[str]:
    lines = ["## Serving through Redis", ""]
    slo = srv.get("slo", {})
    lines.append(
        f"A real redis-server and worker process; the client streams with the SDK. Saturation: the "
        f"{srv.get('workload', {}).get('requests')}-request workload submitted at once (pagedq: median of "
        f"{srv.get('repeats')}). Poisson loads: {srv.get('poisson_workload', {}).get('requests')} requests at "
        f"fractions of pagedq's saturation rate ({_fmt(srv.get('saturation_rate_req_s'), 3)} req/s). "
        f"Goodput SLO: TTFT <= {slo.get('ttft_s')} s and TPOT <= {slo.get('tpot_s')} s. Latencies in ms."
    )
    ref = srv.get("offline_ref", {})
    rows = []
    for s, v in srv.get("systems", {}).items():
        sat = v.get("saturation", {})
        vs = _pct(ref.get("ratio")) if s == "pagedq" and ref.get("available") else "-"
        rows.append([s, _fmt(sat.get("out_tok_s"), 1), _fmt(sat.get("req_s"), 3), vs, v.get("error", "")[:80]])
    lines += ["", *_table(["system", "output tok/s at saturation", "req/s", "vs pagedq offline", ""], rows), ""]
    rows = []
    for s, v in srv.get("systems", {}).items():
        for r in v.get("sweep", []):
            rows.append(
                [
                    s,
                    f"{r['fraction']:g}x ({r['rate_req_s']:.2f}/s)",
                    _fmt(r.get("out_tok_s"), 1),
                    *_dist_cells(r.get("ttft_s")),
                    *_dist_cells(r.get("itl_s")),
                    *_dist_cells(r.get("e2e_s")),
                    _fmt(r.get("goodput_req_s"), 3),
                ]
            )
    head = [
        "system",
        "load",
        "out tok/s",
        "TTFT mean",
        "p50",
        "p90",
        "p99",
        "ITL mean",
        "p50",
        "p90",
        "p99",
        "e2e mean",
        "p50",
        "p90",
        "p99",
        "goodput req/s",
    ]
    lines += _table(head, rows)
    rows = []
    for s, v in srv.get("systems", {}).items():
        lp = v.get("long_prompt")
        if lp:
            rows.append(
                [
                    s,
                    _ms(lp["itl_alone_s"].get("p99")),
                    _ms(lp["itl_during_long_s"].get("p99")),
                    _fmt(lp.get("p99_ratio_during"), 2, "x"),
                    _ms(lp["itl_with_long_s"].get("p99")),
                    _ms(lp["long_ttft_s"].get("p50")),
                ]
            )
    if rows:
        lw = srv.get("long_prompt_workload", {})
        lines += [
            "",
            f"Long prompts: {lw.get('requests', 0) - lw.get('long_prompts', 0)} short chats submitted at "
            f"once; while they decode, {lw.get('long_prompts')} prompt(s) of up to "
            f"{lw.get('prompt_len_min_mean_max', [0])[-1]} tokens arrive. Inter-token latency of the running "
            f"short requests (ms): steady state without long prompts vs gaps overlapping a long prompt's "
            f"prefill. Chunked worker: a prompt takes at most {srv.get('chunk_cap')} tokens of a step.",
            "",
        ]
        lines += _table(
            [
                "system",
                "ITL p99 without long prompts",
                "ITL p99 during long prefill",
                "ratio",
                "ITL p99 whole run",
                "long prompt TTFT p50",
            ],
            rows,
        )
    return lines


def _memory_section(mem: dict) -> list[str]:
    s, fit, sim = mem.get("serving", {}), mem.get("fit", {}), mem.get("simulation", {})
    eng = mem.get("engine_run", {})
    lines = ["## KV cache memory", ""]
    lines.append(
        f"Serving run ({mem.get('serving_source')}): allocated KV slots without a live token "
        f"mean {_pct(s.get('waste', {}).get('mean'), 2)}, max {_pct(s.get('waste', {}).get('max'), 2)} "
        f"({s.get('samples')} /metrics samples, {s.get('waste_updates')} waste-gauge updates); KV usage mean "
        f"{_pct(s.get('kv_usage', {}).get('mean'))}."
    )
    if fit:
        lines.append(
            f"\nFixed budget of {mem.get('budget_tokens')} tokens ({mem.get('budget_tokens', 0) // 16} blocks = "
            f"{mem.get('max_model_len') and mem['budget_tokens'] // mem['max_model_len']} x max-model-len "
            f"{mem.get('max_model_len')}): contiguous preallocation holds **{fit.get('contiguous')}** requests; "
            f"paged allocation ran **{_fmt(fit.get('paged_mean'), 1)}** at once on average while requests waited "
            f"for memory (peak {fit.get('paged_peak')}, {eng.get('preemptions')} preemptions) = "
            f"**{_fmt(fit.get('ratio'), 1)}x**; per-step waste mean {_pct(eng.get('waste', {}).get('mean'), 2)}. "
            f"(Reserving only each request's own prompt + max_tokens would hold {fit.get('contiguous_workload_max')}.)"
        )
    if sim:
        lines.append(
            f"\nBlock-manager simulation ({sim.get('requests')} requests, lengths 1..{sim.get('max_len')}, "
            f"{sim.get('concurrency')} at once): paged waste {_pct(sim.get('paged_waste_mean'), 2)} vs contiguous "
            f"{_pct(sim.get('contiguous_waste_mean'), 1)}; the same budget holds {sim.get('fit_paged')} vs "
            f"{sim.get('fit_contiguous')} requests."
        )
    return lines


def _prefix_section(pre: dict) -> list[str]:
    wl = pre.get("workload", {})
    lines = ["## Prefix caching", ""]
    lines.append(
        f"`shared-prefix`: {wl.get('requests')} requests sharing a 512-token system prompt. TTFT at Poisson "
        f"{_fmt(pre.get('rate_req_s'), 3)} req/s ({pre.get('load_fraction')}x the uncached saturation), median "
        f"of {pre.get('repeats')}; throughput with all requests at once."
    )
    rows = []
    for name, v in pre.get("settings", {}).items():
        p = (v.get("poisson") or [{}])[0]
        rows.append(
            [
                name,
                _ms(v.get("ttft_p50_s")),
                _ms(p.get("ttft_s", {}).get("p90")),
                _fmt(v.get("out_tok_s"), 1),
                _pct(v.get("prefix_cache", {}).get("hit_rate")),
                v.get("error", "")[:80],
            ]
        )
    lines += ["", *_table(["setting", "TTFT p50 ms", "TTFT p90 ms", "output tok/s", "prefix hit rate", ""], rows)]
    lines.append(
        f"\nTTFT p50 with / without caching: **{_fmt(pre.get('ttft_p50_ratio'), 2, 'x')}**; throughput "
        f"{_fmt(pre.get('throughput_ratio'), 2, 'x')}."
    )
    return lines


def write_summary(out_dir: str | Path | None = None, command: str | None = None) -> str:
    """Rebuild latest/summary.md and the plots from latest/*.json; returns the Markdown."""
    latest = (Path(out_dir) if out_dir else RESULTS) / "latest"
    res = load_latest(out_dir)
    if not res:
        return f"no results under {latest}"
    first = next(iter(res.values()))
    m = first.get("machine", {})
    model = first.get("model", {})
    commands = sorted({r.get("command") for r in res.values() if r.get("command")})
    dates = sorted({r.get("machine", {}).get("date") for r in res.values() if r.get("machine")})
    lines = [
        "# pagedq benchmarks",
        "",
        f"- Machine: {m.get('cpu')}, {m.get('cores')} cores{', GPU ' + m['gpu'] if m.get('gpu') else ''}"
        f"{'' if m.get('cpu_bf16') is None else (', native bf16' if m['cpu_bf16'] else ', no native bf16')}; "
        f"torch {m.get('torch')}, transformers {m.get('transformers')}, Python {m.get('python')}",
        f"- Date: {', '.join(d for d in dates if d)}",
        f"- Command: {'; '.join(f'`{c}`' for c in commands) or '`' + (command or '?') + '`'}",
        f"- Model: {model.get('folder')} ({model.get('model_type')}), {first.get('dtype')}, "
        f"{first.get('threads')} threads, device {first.get('device', 'cpu')}",
        f"- Load average at start: {m.get('load_avg_1m')} (numbers on a shared machine are noisy: compare ratios "
        "measured in the same run)",
    ]
    if any(r.get("quick") for r in res.values()):
        lines.append("- **Quick run**: small workloads, one repeat; not the configuration the goals are set for.")
    lines += ["", "## Goals", ""]
    lines += _table(
        ["goal", "target", "measured", ""], [[g["goal"], g["target"], g["measured"], g["status"]] for g in goals(res)]
    )
    sections = (
        ("offline", _offline_section),
        ("serve", _serve_section),
        ("memory", _memory_section),
        ("prefix", _prefix_section),
    )
    for name, fn in sections:
        if name in res:
            lines += ["", *fn(res[name])]
    made = []
    for fname, fn in PLOTS.items():
        try:
            if fn(res, latest / fname):
                made.append(fname)
        except Exception as e:  # a plot never sinks the summary
            lines.append(f"\n(plot {fname} failed: {type(e).__name__}: {e})")
    if made:
        lines += ["", "## Plots", "", *(f"![{f}]({f})" for f in made)]
    text = "\n".join(lines) + "\n"
    (latest / "summary.md").write_text(text)
    return text
