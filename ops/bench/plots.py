"""PNG plots from the latest results: throughput bars, latency CDFs, ITL around long prompts, prefix TTFT."""

from __future__ import annotations

import math
from pathlib import Path

from ops.bench.formatting import fmt, num


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(res: dict[str, dict], path: Path) -> bool:
    off, srv = res.get("offline", {}), res.get("serve", {})
    bars = [(s, num(v.get("out_tok_s"))) for s, v in off.get("systems", {}).items()]
    serve_bars = [
        (s, num(v.get("saturation", {}).get("out_tok_s")))
        for s, v in srv.get("systems", {}).items()
        if not v.get("unavailable")  # a system not run gets no bar, not a zero
    ]
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
        ax.set_title(f"{s}: ITL of running short requests; p99 during long prefill / alone = {fmt(ratio, 2, 'x')}")
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
