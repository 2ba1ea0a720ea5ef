"""Sections a (kernels), b (fp32 tokens) and c (bf16 logits) of ops/bench/gpu_check.py: correctness."""

from __future__ import annotations

from pathlib import Path

from ops.bench.gpu_check_common import (
    Report,
    Sizes,
    check_model,
    engine_imports,
    graphs_active,
    hf_greedy,
    hf_margin,
    random_prompts,
    rel_err,
    run_steps,
)

# --- a: kernels ---------------------------------------------------------------------------------


def section_kernels(sz: Sizes, work: Path, rep: Report) -> bool:
    import torch

    from ops.bench.kernels import check_correctness

    rows = check_correctness(sz.device, small=sz.dry)
    rep.results["attention_and_write_kv"] = rows
    rep.save()
    dtypes = [torch.float32, torch.float16] if sz.dry else [torch.bfloat16, torch.float16]
    fused = [row for dtype in dtypes for row in _fused_checks(sz, dtype)]
    rep.results["fused"] = fused
    rep.save()
    ok = all(r["ok"] for r in rows + fused)
    if not sz.dry:
        rec = recompile_check(sz)
        rep.results["recompiles"] = rec
        ok = ok and rec["ok"]
    return ok


def _fused_checks(sz: Sizes, dtype) -> list[dict]:
    """Each fused kernel vs its torch reference on the same device, 1B-shaped rows."""
    import torch

    from pagedq_kernels import use_backend
    from pagedq_kernels.fused import add_rms_norm, rms_norm, rotary_write_kv, silu_and_mul

    dev, name = sz.device, str(dtype).removeprefix("torch.")
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]  # ~2 units of roundoff
    gen = torch.Generator(device=dev).manual_seed(7)
    t, hq, hkv, d = 37, sz.heads, sz.kv_heads, sz.head_dim
    x = torch.randn(t, sz.hidden, generator=gen, device=dev).to(dtype)
    res = torch.randn(t, sz.hidden, generator=gen, device=dev).to(dtype)
    w = (1 + 0.1 * torch.randn(sz.hidden, generator=gen, device=dev)).to(dtype)
    gate_up = (3 * torch.randn(t, 2 * sz.intermediate, generator=gen, device=dev)).to(dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, device=dev).to(dtype)
    positions = torch.randint(0, 4096, (t,), generator=gen, device=dev)
    angles = torch.arange(4096.0, device=dev)[:, None] * torch.rand(d // 2, generator=gen, device=dev)[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    slots = torch.randperm(64 * 16, generator=gen, device=dev)[:t]
    slots[::5] = -1

    def run(backend: str) -> dict:
        out = {}
        with use_backend(backend):
            out["rms_norm"] = rms_norm(x, w, 1e-5)
            out["add_rms_norm"], out["residual_sum"] = add_rms_norm(x, res, w, 1e-5)
            out["silu_and_mul"] = silu_and_mul(gate_up)
            fused_qkv = qkv.clone()
            q, k, v = fused_qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            kc = torch.zeros(64, 16, hkv, d, device=dev, dtype=dtype)
            vc = torch.zeros_like(kc)
            rotary_write_kv(positions, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), cos, sin, kc, vc, slots)
            out["rotary_qkv"], out["rotary_k_cache"], out["rotary_v_cache"] = fused_qkv, kc, vc
        return out

    got, want = run("triton"), run("torch")
    rows = []
    for key in want:
        err = rel_err(got[key], want[key])
        finite = bool(torch.isfinite(got[key]).all())
        ok = finite and err <= tol
        if key == "residual_sum" or key == "rotary_v_cache":
            ok = finite and torch.equal(got[key], want[key])  # a single rounding / a copy: bit-identical
        rows.append({"check": key, "dtype": name, "rel_err": err, "ok": ok})
    return rows


def _compiled_variants(kernel) -> int:
    """How many specializations of a Triton kernel have been compiled in this process (0: unknown here).
    Triton 3.2+ keeps, per device, a tuple whose first item is the dict of compiled kernels."""
    caches = getattr(kernel, "device_caches", None) or {}
    return sum(len(entry[0]) for entry in caches.values() if isinstance(entry, tuple) and isinstance(entry[0], dict))


def compiled_counts() -> dict[str, int]:
    """Compiled variants of each of pagedq's Triton kernels in this process (all 0: not measurable here)."""
    import pagedq_kernels.cache_ops as cache_ops
    import pagedq_kernels.decode as decode
    import pagedq_kernels.fused_triton as fused
    import pagedq_kernels.prefill as prefill

    watched = {
        "prefill": prefill._prefill_kernel,
        "decode": decode._decode_kernel,
        "combine": decode._combine_kernel,
        "rms_norm": fused._rms_norm_kernel,
        "silu_and_mul": fused._silu_and_mul_kernel,
        "rotary": fused._rotary_kernel,
        "write_kv": cache_ops._write_kv_kernel,
    }
    return {name: _compiled_variants(k) for name, k in watched.items()}


def recompile_check(sz: Sizes) -> dict:
    """Serving-like steps whose per-step values change (decode count, hence the prefill's first request;
    block-table width; split) compile nothing new once each kernel has run once."""
    import torch

    import pagedq_kernels.cache_ops as cache_ops
    from ops.bench.attention_problems import build_problem
    from pagedq_kernels import use_backend
    from pagedq_kernels.fused import add_rms_norm, rotary_write_kv, silu_and_mul
    from pagedq_kernels.paged_attention import paged_attention_triton

    heads = (sz.heads, sz.kv_heads, sz.head_dim)
    dtype = torch.bfloat16
    cos = sin = torch.randn(8192, sz.head_dim, device="cuda")

    def step(decode_lens: list[int], prefill_lens: list[int], parts: int | None = None) -> None:
        seq = decode_lens + [c + 40 for c in prefill_lens]
        q, kc, vc, meta = build_problem(seq, [1] * len(decode_lens) + prefill_lens, heads, dtype, "cuda")
        t = q.shape[0]
        meta.slot_mapping = torch.arange(t, device="cuda")
        with use_backend("triton"):
            x = torch.randn(t, sz.hidden, device="cuda", dtype=dtype)
            add_rms_norm(x, x, x[0], 1e-5)
            silu_and_mul(torch.randn(t, 2 * sz.intermediate, device="cuda", dtype=dtype))
            k = torch.randn(t, sz.kv_heads, sz.head_dim, device="cuda", dtype=dtype)
            rotary_write_kv(torch.arange(t, device="cuda"), q, k, k, cos, sin, kc, vc, meta.slot_mapping)
            cache_ops.write_kv_triton(k, k, kc, vc, meta.slot_mapping)
        paged_attention_triton(q, kc, vc, meta, scale=0.125, num_partitions=parts)

    step([5], [10])  # warm: every kernel once (decode unsplit, then split with the combine)
    step([3000], [], parts=4)
    torch.cuda.synchronize()
    before = compiled_counts()
    step([1] * 16 + [17], [33, 7])  # 17 decodes: the prefill's first request is 17
    step([700], [1])  # block-table width 44 and 1, a one-token "prefill"
    step([16] * 37, [64])
    step([5000, 20], [], parts=3)
    step([4000] * 2, [], parts=16)
    step([100], [], parts=1)
    torch.cuda.synchronize()
    after = compiled_counts()
    if not any(before.values()):  # this Triton keeps its caches elsewhere: nothing to compare
        return {"ok": True, "measured": False, "before": before, "after": after}
    return {"ok": before == after, "measured": True, "before": before, "after": after}


# --- b: fp32 greedy tokens ----------------------------------------------------------------------


def section_fp32_tokens(sz: Sizes, work: Path, rep: Report) -> bool:
    import torch
    from transformers import AutoModelForCausalLM

    LLM, SamplingParams = engine_imports()
    folder = check_model(sz, work)
    prompts = random_prompts(sz, sz.prompt_lens, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(sz.device).eval()
    want = [hf_greedy(hf, p, sz.new_tokens, sz.device) for p in prompts]
    rep.results["transformers_done"] = True
    rep.save()
    llm = LLM(
        model=str(folder),
        dtype="float32",
        device=sz.device,
        max_model_len=sz.max_model_len,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=sz.chunk_budget,
        enable_chunked_prefill=True,
        kv_cache_memory=1 << 30 if not sz.dry else 64 << 20,
    )
    params = SamplingParams(temperature=0.0, max_tokens=sz.new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    rows = []
    for p, g, w in zip(prompts, got, want, strict=True):
        row = {"prompt_len": len(p), "equal": g == w}
        if g != w:
            first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            row.update(first_difference=first, got=g, want=w, margin=hf_margin(hf, p + w[:first], sz.device))
        rows.append(row)
    rep.results.update(
        prompts=rows,
        equal=sum(r["equal"] for r in rows),
        total=len(rows),
        cuda_graphs=graphs_active(llm),
        chunked_prefill_budget=sz.chunk_budget,
    )
    return all(r["equal"] for r in rows)


# --- c: bf16 logits -----------------------------------------------------------------------------


def section_bf16_logits(sz: Sizes, work: Path, rep: Report) -> bool:
    """Teacher-forced logits in bf16 against transformers in bf16 and in fp32. Pass: ours is no further
    from the fp32 logits than transformers' own bf16 is (x1.5 + 1e-3), and within 5% of transformers bf16."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    from worker.models.loader import load_model

    folder = check_model(sz, work)
    prompt_lens = list(sz.prompt_lens)
    seqs = random_prompts(sz, [n + sz.new_tokens for n in prompt_lens], seed=2)
    dev = sz.device

    def hf_logits(dtype) -> list:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(dev).eval()
        with torch.inference_mode():
            out = [hf(torch.tensor([s], device=dev)).logits[0].float() for s in seqs]
        del hf
        gc.collect()
        return out

    ref32 = hf_logits(torch.float32)
    ref16 = hf_logits(torch.bfloat16)
    ours = load_model(folder, dtype="bfloat16", device=dev).model
    got = run_steps(ours, seqs, prompt_lens, dev, chunk=128 if not sz.dry else 16, keep_on_device=True)
    rows = []
    for n, g, r16, r32 in zip(prompt_lens, got, ref16, ref32, strict=True):
        rows.append(
            {
                "prompt_len": n,
                "rel_err_vs_hf_bf16": rel_err(g, r16),
                "max_abs_err_vs_hf_bf16": float((g - r16).abs().max()),
                "rel_err_vs_hf_fp32": rel_err(g, r32),
                "hf_bf16_rel_err_vs_hf_fp32": rel_err(r16, r32),
                "decode_rel_err_vs_hf_bf16": rel_err(g[n:], r16[n:]),
                "top1_agreement_vs_hf_fp32": float((g.argmax(-1) == r32.argmax(-1)).float().mean()),
                "hf_bf16_top1_agreement_vs_hf_fp32": float((r16.argmax(-1) == r32.argmax(-1)).float().mean()),
            }
        )
    ours_err = max(r["rel_err_vs_hf_fp32"] for r in rows)
    hf_err = max(r["hf_bf16_rel_err_vs_hf_fp32"] for r in rows)
    worst = max(r["rel_err_vs_hf_bf16"] for r in rows)
    rep.results.update(
        sequences=rows,
        max_rel_err_vs_hf_bf16=worst,
        max_abs_err_vs_hf_bf16=max(r["max_abs_err_vs_hf_bf16"] for r in rows),
        max_rel_err_vs_hf_fp32=ours_err,
        hf_bf16_max_rel_err_vs_hf_fp32=hf_err,
        tolerance="ours vs fp32 <= 1.5 x (HF bf16 vs fp32) + 1e-3, and ours vs HF bf16 < 0.05",
    )
    return ours_err <= 1.5 * hf_err + 1e-3 and worst < 0.05
