"""The goals of the benchmarks (targets from the project brief and the performance issue), checked against the
latest results."""

from __future__ import annotations

import math

from ops.bench.formatting import fmt, num, pct


def _goal(name: str, target: str, value: float, ok: bool | None, shown: str) -> dict:
    status = "n/a" if ok is None or math.isnan(value) else ("PASS" if ok else "MISS")
    return {"goal": name, "target": target, "measured": shown, "value": value, "status": status}


def goals(res: dict[str, dict]) -> list[dict]:
    out = []
    off = res.get("offline", {})
    ratios = off.get("ratios", {})
    for system, target, label in (
        ("hf-cb", 5.0, "transformers continuous batching"),
        ("hf-static", 3.0, "transformers static batching"),
        ("hf-single", 8.0, "transformers one request at a time"),
    ):
        v = num(ratios.get(system))
        out.append(_goal(f"offline: pagedq vs {label}", f">= {target:g}x", v, v >= target, fmt(v, 2, "x")))
    frac = num(off.get("ceiling", {}).get("fraction"))
    out.append(_goal("offline: share of the hardware ceiling (matmul FLOP/s)", ">= 60%", frac, frac >= 0.6, pct(frac)))
    v = num(off.get("ceiling", {}).get("roofline", {}).get("share"))
    out.append(
        _goal("offline: share of the roofline bound, matmul rate and memory (reported)", "report", v, None, pct(v))
    )
    if off.get("dtype") == "float32":
        agree = [num(a.get("identical")) for a in off.get("agreement", {}).values()]
        v = min(agree) if agree else math.nan
        out.append(_goal("offline fp32: greedy outputs identical to transformers", "100%", v, v >= 1.0, pct(v)))
    srv = res.get("serve", {})
    ref = srv.get("offline_ref", {})
    v = num(ref.get("ratio"))
    out.append(_goal("serve: saturation throughput through Redis vs offline", ">= 90%", v, v >= 0.9, pct(v)))
    systems = srv.get("systems", {})
    lp = systems.get("pagedq", {}).get("long_prompt", {})
    v = num(lp.get("p99_ratio_during"))
    out.append(
        _goal(
            "serve, chunked prefill: ITL p99 while long prompts arrive vs without",
            "<= 2x",
            v,
            v <= 2.0,
            fmt(v, 2, "x"),
        )
    )
    lp = systems.get("pagedq-nochunk", {}).get("long_prompt", {})
    v = num(lp.get("p99_ratio_during"))
    out.append(_goal("serve, no chunking: the same ratio (reported)", "report", v, None, fmt(v, 2, "x")))
    mem = res.get("memory", {})
    v = num(mem.get("waste_mean"))
    src = f" ({mem['waste_source']})" if mem.get("waste_source") else ""
    out.append(
        _goal(
            f"memory: allocated KV slots without a live token{src}",
            "< 4%",
            v,
            v < 0.04,
            pct(v, 2),
        )
    )
    v = num(mem.get("fit", {}).get("ratio"))
    out.append(
        _goal(
            "memory: concurrent requests in a fixed KV budget, paged vs contiguous",
            ">= 3x",
            v,
            v >= 3.0,
            fmt(v, 1, "x"),
        )
    )
    pre = res.get("prefix", {})
    v = num(pre.get("ttft_p50_ratio"))
    out.append(_goal("prefix cache: TTFT p50 with caching vs without", "<= 0.5x", v, v <= 0.5, fmt(v, 2, "x")))
    return out
