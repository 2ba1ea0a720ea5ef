"""Sections d (engine throughput, CUDA graphs off and on) and e (decode attention bandwidth) of
ops/bench/gpu_check.py: speed."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from ops.bench.gpu_check_common import (
    Report,
    Sizes,
    build_model,
    engine_imports,
    graphs_active,
    random_prompts,
    sync_device,
    time_once,
)

# --- d: engine throughput -----------------------------------------------------------------------


def section_throughput(sz: Sizes, work: Path, rep: Report) -> bool:
    import gc

    import torch

    from ops.bench.attention_problems import copy_bandwidth, timer
    from pagedq_kernels import use_backend

    dtype = "bfloat16" if not sz.dry else "float32"
    folder = build_model(sz, work / f"llama-1b-shape-bench-{sz.bench_layers}l", sz.bench_layers, dtype)
    # Bytes a decode step must move: every weight once (the tied embedding as the LM head), plus the KV
    # cache of the batch; the checkpoint is stored in the dtype it runs in.
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    elem = 2 if dtype == "bfloat16" else 4
    kv_per_token = 2 * sz.bench_layers * sz.kv_heads * sz.head_dim * elem
    copy_bw = copy_bandwidth(sz.device, sz.copy_bytes, timer(sz.device) if not sz.dry else time_once)
    rep.results.update(copy_bandwidth_GBps=copy_bw / 1e9, weight_bytes=weight_bytes, rows=[], engine_build=[])
    rep.results["note"] = (
        "decode step: mean engine step once every request has its first token; "
        "bound: (weight bytes + KV bytes at the mean context) / copy bandwidth"
    )
    mean_context = sz.bench_in + sz.bench_out / 2
    bound = {b: (weight_bytes + b * mean_context * kv_per_token) / copy_bw for b in sz.bench_batches}
    eager_tokens: dict[int, list] = {}
    for enforce_eager in (True, False):
        # A dry run cannot capture graphs: it runs the graph path's static buffers eagerly instead, through
        # the (interpreted) Triton kernels, so that this flow is exercised on CPU too.
        emulate = sz.dry and not enforce_eager
        with use_backend("triton") if emulate else contextlib.nullcontext():
            _bench_engine(sz, folder, enforce_eager, emulate, bound, eager_tokens, rep)
        gc.collect()
        if sz.device == "cuda":
            torch.cuda.empty_cache()
    rows = rep.results["rows"]
    rep.results["cuda_graphs_available"] = any(r["cuda_graphs"] for r in rows)
    # Without --enforce-eager every timed decode step went through the graph path: captured graphs on a
    # GPU, their static buffers run eagerly in a dry run; with it, never.
    graph_rows = [r for r in rows if not r["enforce_eager"]]
    replayed = all(r["graph_replays"] >= r["decode_steps_timed"] for r in graph_rows)
    eager_only = not any(r["graph_replays"] or r["cuda_graphs"] for r in rows if r["enforce_eager"])
    return replayed and eager_only and all(r["cuda_graphs"] == (sz.device == "cuda") for r in graph_rows)


def _bench_engine(
    sz: Sizes, folder: Path, enforce_eager: bool, emulate: bool, bound: dict, eager_tokens: dict, rep: Report
) -> None:
    """One engine (graphs off or on): its build time, then each batch size's decode rate (section d)."""
    LLM, SamplingParams = engine_imports()
    max_batch = max(sz.bench_batches)
    t0 = time.perf_counter()
    llm = LLM(
        model=str(folder),
        dtype="bfloat16" if not sz.dry else "float32",
        device=sz.device,
        max_model_len=sz.bench_in + sz.bench_out + 16,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max_batch * sz.bench_in,
        kv_cache_memory=(6 << 30) if not sz.dry else (32 << 20),
        enable_prefix_caching=False,
        enforce_eager=enforce_eager,
    )
    if emulate:
        llm.engine.runner.capture_decode_graphs(capture=False)
    graphs = llm.engine.runner.decode_graphs
    rep.results["engine_build"].append(
        {
            "enforce_eager": enforce_eager,
            "cuda_graphs": graphs_active(llm),
            "seconds": time.perf_counter() - t0,  # load, warm-up and graph capture
            "capture_seconds": graphs.capture_seconds if graphs else None,
            "graph_buckets": graphs.sizes if graphs else [],
        }
    )
    rep.save()
    warm = random_prompts(sz, [sz.bench_in] * 4, seed=3)
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    rows = rep.results["rows"]
    for batch in sz.bench_batches:
        prompts = random_prompts(sz, [sz.bench_in] * batch, seed=10 + batch)
        _timed_generate(llm, prompts, 2, SamplingParams, sz)  # this batch shape once, untimed
        replays = graphs.replays if graphs else 0
        total_s, step_s, steps, tokens = _timed_decode(llm, prompts, sz.bench_out, SamplingParams, sz)
        row = {
            "batch": batch,
            "enforce_eager": enforce_eager,
            "cuda_graphs": graphs_active(llm),
            "graph_replays": graphs.replays - replays if graphs else 0,
            "total_s": total_s,
            "decode_steps_timed": steps,
            "decode_step_ms": step_s * 1e3,
            "decode_tokens_per_s": batch / step_s,
            "bound_step_ms": bound[batch] * 1e3,
            "share_of_bandwidth_bound": bound[batch] / step_s,
        }
        if enforce_eager:
            eager_tokens[batch] = tokens
        elif batch in eager_tokens:
            # bf16: differing tokens are legitimate (a padded batch picks other GEMM kernels): for the record.
            eager_row = next(r for r in rows if r["batch"] == batch and r["enforce_eager"])
            row["speedup_vs_eager"] = eager_row["decode_step_ms"] / row["decode_step_ms"]
            row["requests_with_eager_tokens"] = sum(a == b for a, b in zip(tokens, eager_tokens[batch])) / batch
        rows.append(row)
        rep.save()
    del llm, graphs


def _timed_decode(llm, prompts, n: int, sampling_params_cls, sz: Sizes) -> tuple[float, float, int, list]:
    """(total seconds, mean seconds of a decode step, decode steps timed, each prompt's tokens) for n
    greedy tokens per prompt, stepping the engine the way `LLM.generate` does; a decode step is one
    taken once every request has its first token (the prefill is done)."""
    engine = llm.engine
    params = sampling_params_cls(temperature=0.0, max_tokens=n, ignore_eos=True)
    sync_device(sz)
    start = time.perf_counter()
    tokens = {engine.add_request(None, p, params): [] for p in prompts}
    decode_times = []
    while engine.has_unfinished_requests():
        decoding = all(tokens.values())
        t0 = time.perf_counter()
        outs = engine.step()  # returns after the sampled ids reach the host: no extra sync needed
        dt = time.perf_counter() - t0
        for o in outs:
            tokens[o.request_id] = list(o.outputs[0].token_ids)
        if decoding:
            decode_times.append(dt)
    total = time.perf_counter() - start
    if any(len(t) != n for t in tokens.values()) or not decode_times:
        raise RuntimeError(f"asked for {n} tokens per prompt, got {sorted({len(t) for t in tokens.values()})}")
    return total, sum(decode_times) / len(decode_times), len(decode_times), list(tokens.values())


def _timed_generate(llm, prompts, n: int, sampling_params_cls, sz: Sizes) -> float:
    """Seconds for `llm` to generate exactly n tokens for every prompt (greedy, EOS ignored)."""
    sync_device(sz)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sampling_params_cls(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    sync_device(sz)
    if any(len(o.outputs[0].token_ids) != n for o in outs):
        raise RuntimeError(f"asked for {n} tokens per prompt, got {[len(o.outputs[0].token_ids) for o in outs]}")
    return time.perf_counter() - t0


# --- e: decode attention bandwidth --------------------------------------------------------------


def section_attention(sz: Sizes, work: Path, rep: Report) -> bool:
    from ops.bench.attention_problems import copy_bandwidth, timer
    from ops.bench.kernels import time_decode

    bench = timer(sz.device) if not sz.dry else time_once
    copy_bw = copy_bandwidth(sz.device, sz.copy_bytes, bench)
    rep.results["copy_bandwidth_GBps"] = copy_bw / 1e9
    rep.save()
    rows = time_decode(sz.device, list(sz.attn_models), list(sz.attn_batches), list(sz.attn_contexts), copy_bw, bench)
    rep.results["decode"] = rows
    return all("triton_us" in r or "skipped" in r for r in rows)
