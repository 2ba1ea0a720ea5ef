"""latest/summary.md: the machine, the goals table and one section per benchmark, with the plots."""

from __future__ import annotations

from pathlib import Path

from ops.bench.formatting import fmt, ms, num, pct, table
from ops.bench.goals import goals
from ops.bench.plots import PLOTS
from ops.bench.results import load_latest, results_dir


def _dist_cells(d: dict | None, fn=ms) -> list[str]:
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
        each = ", ".join(fmt(r.get("out_tok_s"), 1) for r in v.get("runs", []))
        rows.append(
            [
                f"{s}{sub}",
                fmt(v.get("out_tok_s"), 1),
                each,
                fmt(v.get("total_tok_s"), 1),
                fmt(v.get("peak_rss_mb"), 0),
                *([fmt(v.get("peak_gpu_mb"), 0)] if gpu else []),
                fmt(v.get("cpu_share"), 2),
                "-" if s == "pagedq" else fmt(off.get("ratios", {}).get(s), 2, "x"),
                "-" if s == "pagedq" else pct(ag.get("identical"), 0),
                "-" if s == "pagedq" else pct(ag.get("mean_common_prefix_frac"), 0),
                "FAILED" if v.get("error") and not v.get("runs") else "",
            ]
        )
    head = ["system", "output tok/s", "per repeat", "total tok/s", "peak RSS MB", *(["peak GPU MB"] if gpu else [])]
    head += ["CPU share", "pagedq speed-up (paired)", "identical outputs", "common prefix", ""]
    lines += table(head, rows)
    lines.append(
        "\nCPU share: CPU time over (wall time x threads) while timed; well below the others' on a busy "
        "machine. Speed-ups are medians of per-repeat ratios. Outputs are compared with pagedq's token for "
        "token (bf16 drifts after a while; fp32 must agree fully); common prefix: mean share of each output."
    )
    c = off.get("ceiling", {})
    lines += [
        "",
        f"Hardware ceiling: a {c.get('matmul_size')}^3 matmul runs at {fmt(num(c.get('matmul_flops')) / 1e9, 1)} "
        f"GFLOP/s ({off.get('dtype')}, {off.get('threads')} threads, {c.get('matmul_path') or 'F.linear'}). "
        "pagedq does "
        f"{fmt(num(c.get('achieved_flops')) / 1e9, 1)} GFLOP/s of useful model work = **{pct(c.get('fraction'))}** "
        f"of it (FLOPs per token {fmt(num(c.get('flops_per_token')) / 1e6, 1)} M at mean context "
        f"{fmt(c.get('mean_context'), 0)}; the per-token formula x total tokens/s gives "
        f"{pct(c.get('fraction_brief_formula'))}).",
    ]
    if r := c.get("roofline"):
        lines.append(
            f"Memory streams at {fmt(num(c.get('bandwidth')) / 1e9, 1)} GB/s here. The least time this workload takes "
            f"(ops/bench/roofline.py) is {fmt(r['bound_s'], 2)} s, bound by {r['bound_by']} (arithmetic at the matmul "
            f"rate {fmt(r['compute_s'], 2)} s; {fmt(r['bytes'] / 1e9, 1)} GB of weights and KV cache "
            f"{fmt(r['memory_s'], 2)} s): pagedq runs at **{pct(r['share'])}** of that bound."
        )
    cb = off.get("hf_cb", {})
    if cb.get("sweep"):
        tried = ", ".join(
            f"{e['preset']}: {fmt(e.get('out_tok_s'), 1)} tok/s" + (" (failed)" if e.get("error") else "")
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
        f"fractions of pagedq's saturation rate ({fmt(srv.get('saturation_rate_req_s'), 3)} req/s). "
        f"Goodput SLO: TTFT <= {slo.get('ttft_s')} s and TPOT <= {slo.get('tpot_s')} s. Latencies in ms."
    )
    ref = srv.get("offline_ref", {})
    rows = []
    for s, v in srv.get("systems", {}).items():
        sat = v.get("saturation", {})
        vs = pct(ref.get("ratio")) if s == "pagedq" and ref.get("available") else "-"
        note = v.get("error") or (f"unavailable: {v['unavailable']}" if v.get("unavailable") else "")
        rows.append([s, fmt(sat.get("out_tok_s"), 1), fmt(sat.get("req_s"), 3), vs, note[:80]])
    lines += ["", *table(["system", "output tok/s at saturation", "req/s", "vs pagedq offline", ""], rows), ""]
    if ref.get("method") == "pairs":
        shown = ", ".join(
            f"{pct(p['ratio'])} ({fmt(p['serve_out_tok_s'], 1)} / {fmt(p['offline_out_tok_s'], 1)})"
            for p in ref["pairs"]
        )
        lines += [f"pagedq vs offline, median of runs paired with an offline run just before: {shown}.", ""]
    elif ref.get("available"):
        lines += [f"pagedq vs offline: against {ref['method']} ({fmt(ref['offline_out_tok_s'], 1)} tok/s).", ""]
    llama = srv.get("systems", {}).get("llama-server", {})
    if llama.get("server_cmd"):
        lines += [
            "llama-server: llama.cpp's HTTP server on a GGUF of the same weights in the same dtype (its KV "
            "cache: llama.cpp's default f16), the same requests streamed over HTTP (SSE), not through Redis; "
            "prompt caching off. Command: "
            f"`{' '.join(llama['server_cmd'][1:])}`.",
            "",
        ]
    rows = []
    for s, v in srv.get("systems", {}).items():
        for r in v.get("sweep", []):
            rows.append(
                [
                    s,
                    f"{r['fraction']:g}x ({r['rate_req_s']:.2f}/s)",
                    fmt(r.get("out_tok_s"), 1),
                    *_dist_cells(r.get("ttft_s")),
                    *_dist_cells(r.get("itl_s")),
                    *_dist_cells(r.get("e2e_s")),
                    fmt(r.get("goodput_req_s"), 3),
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
    lines += table(head, rows)
    rows = []
    for s, v in srv.get("systems", {}).items():
        lp = v.get("long_prompt")
        if lp:
            rows.append(
                [
                    s,
                    ms(lp["itl_alone_s"].get("p99")),
                    ms(lp["itl_during_long_s"].get("p99")),
                    fmt(lp.get("p99_ratio_during"), 2, "x"),
                    ms(lp["itl_with_long_s"].get("p99")),
                    ms(lp["long_ttft_s"].get("p50")),
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
            "prefill. Chunked worker: "
            + (
                f"a prompt takes at most {srv['chunk_cap']} tokens of a step."
                if srv.get("chunk_cap")
                else "the engine's chunking defaults (long-prompt threshold and attention-cost budget)."
            ),
            "",
        ]
        lines += table(
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
        f"mean {pct(s.get('waste', {}).get('mean'), 2)}, max {pct(s.get('waste', {}).get('max'), 2)} "
        f"({s.get('samples')} /metrics samples, {s.get('waste_updates')} waste-gauge updates); KV usage mean "
        f"{pct(s.get('kv_usage', {}).get('mean'))}."
    )
    if fit:
        lines.append(
            f"\nFixed budget of {mem.get('budget_tokens')} tokens ({mem.get('budget_tokens', 0) // 16} blocks = "
            f"{mem.get('max_model_len') and mem['budget_tokens'] // mem['max_model_len']} x max-model-len "
            f"{mem.get('max_model_len')}): contiguous preallocation holds **{fit.get('contiguous')}** requests; "
            f"paged allocation ran **{fmt(fit.get('paged_mean'), 1)}** at once on average while requests waited "
            f"for memory (peak {fit.get('paged_peak')}, {eng.get('preemptions')} preemptions) = "
            f"**{fmt(fit.get('ratio'), 1)}x**; per-step waste mean {pct(eng.get('waste', {}).get('mean'), 2)}. "
            f"(Reserving only each request's own prompt + max_tokens would hold {fit.get('contiguous_workload_max')}.)"
        )
    if sim:
        lines.append(
            f"\nBlock-manager simulation ({sim.get('requests')} requests, lengths 1..{sim.get('max_len')}, "
            f"{sim.get('concurrency')} at once): paged waste {pct(sim.get('paged_waste_mean'), 2)} vs contiguous "
            f"{pct(sim.get('contiguous_waste_mean'), 1)}; the same budget holds {sim.get('fit_paged')} vs "
            f"{sim.get('fit_contiguous')} requests."
        )
    return lines


def _prefix_section(pre: dict) -> list[str]:
    wl = pre.get("workload", {})
    lines = ["## Prefix caching", ""]
    lines.append(
        f"`shared-prefix`: {wl.get('requests')} requests sharing a 512-token system prompt. TTFT at Poisson "
        f"{fmt(pre.get('rate_req_s'), 3)} req/s ({pre.get('load_fraction')}x the uncached saturation), median "
        f"of {pre.get('repeats')}; throughput with all requests at once."
    )
    rows = []
    for name, v in pre.get("settings", {}).items():
        p = (v.get("poisson") or [{}])[0]
        rows.append(
            [
                name,
                ms(v.get("ttft_p50_s")),
                ms(p.get("ttft_s", {}).get("p90")),
                fmt(v.get("out_tok_s"), 1),
                pct(v.get("prefix_cache", {}).get("hit_rate")),
                v.get("error", "")[:80],
            ]
        )
    lines += ["", *table(["setting", "TTFT p50 ms", "TTFT p90 ms", "output tok/s", "prefix hit rate", ""], rows)]
    lines.append(
        f"\nTTFT p50 with / without caching: **{fmt(pre.get('ttft_p50_ratio'), 2, 'x')}**; throughput "
        f"{fmt(pre.get('throughput_ratio'), 2, 'x')}."
    )
    return lines


def write_summary(out_dir: str | Path | None = None, command: str | None = None) -> str:
    """Rebuild latest/summary.md and the plots from latest/*.json; returns the Markdown."""
    latest = results_dir(out_dir) / "latest"
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
        f"{'' if m.get('cpu_bf16') is None else (', native bf16' if m['cpu_bf16'] else ', no native bf16')}"
        f"{' (' + ', '.join(m['cpu_features']) + ')' if m.get('cpu_features') else ''}; "
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
    lines += table(
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
