#!/usr/bin/env python3
"""pagedq's GPU path in one run: correctness first, then speed, sized for a few minutes on one GPU.

    python3 ops/bench/gpu_check.py --out DIR              # on a CUDA machine (never past --budget, 350 s)
    python3 ops/bench/gpu_check.py --dry-run --out DIR    # the same flow on CPU: Triton interpreter, tiny shapes
    python3 ops/bench/gpu_check.py --sections a,c ...     # some sections only

Sections, each in its own process with its own time limit (a crash, a CUDA error or a hang costs that
section only), each writing DIR/<name>.json as soon as it has a result (and again as it goes):

  a kernels      Triton vs the torch reference in bf16 and fp16: mixed prefill + decode batches, GQA,
                 sliding window, forced and automatic split-K, a fixed grid with padded requests,
                 write_kv, the fused RMSNorm / SiLU-mul / rotary + KV-write kernels; and no kernel
                 compiles again when the per-step values (decode count, block-table width, split) change.
  b fp32_tokens  greedy tokens of `worker.LLM` equal transformers' on 16 prompts of 5-700 tokens, fp32,
                 a random-weight model with Llama-3.2-1B's shapes and llama3 RoPE scaling, 4 layers,
                 chunked prefill on.
  c bf16_logits  the same model in bf16, teacher-forced (chunked prefill, then decodes): logits vs
                 transformers bf16 and fp32 within a tolerance (tokens are not compared in bf16: ties
                 and kernel choices make them differ legitimately).
  d throughput   the engine at batch 1, 64 and 256 (128 tokens in, 128 out, 16 layers, 1B shapes, bf16)
                 with CUDA graphs off (--enforce-eager) and on, as a share of the bandwidth bound: (weight +
                 KV bytes) per decode step over the device copy bandwidth measured in the same run; also
                 the engine's build and graph-capture time. Fails unless every timed decode step of the
                 run with graphs replayed one (a dry run replays the graph path's buffers eagerly).
  e attention    decode attention bandwidth vs copy bandwidth and vs SDPA on contiguous KV.

DIR/summary.json lists each section's status and time; the exit code is 0 iff every section passed.
Needs torch, triton, transformers, numpy and this repository's worker/ and kernels/ packages: no
Redis, no msgspec, no network, no model files (models are random-weight and built here, under --work).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # as a script: ops/bench (which has a kernels.py) must not shadow the package
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(REPO))

# name, time limit on a GPU (seconds); the limits add up to under 6 minutes with the start-up costs.
SECTIONS = {
    "a": ("kernels", 90),  # most of it is compiling about 35 kernel variants on a fresh machine
    "b": ("fp32_tokens", 70),
    "c": ("bf16_logits", 50),
    "d": ("throughput", 95),
    "e": ("attention", 40),
}
DRY_LIMIT = 300  # all sections of a dry run, in one process (they share its ~8 s of imports)


@dataclass(frozen=True)
class Sizes:
    """Everything the sections size by: Llama-3.2-1B's shapes on a GPU, tiny ones in a dry run."""

    dry: bool
    device: str
    vocab: int = 128256
    hidden: int = 2048
    intermediate: int = 8192
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    max_positions: int = 131072
    rope_original: int = 8192
    check_layers: int = 4
    bench_layers: int = 16
    prompt_lens: tuple[int, ...] = (5, 9, 17, 33, 64, 100, 128, 200, 256, 300, 384, 450, 512, 600, 650, 700)
    new_tokens: int = 16
    chunk_budget: int = 256  # max_num_batched_tokens of the equality runs: long prompts are chunked
    max_model_len: int = 1024
    bench_batches: tuple[int, ...] = (1, 64, 256)
    bench_in: int = 128
    bench_out: int = 128
    attn_models: tuple[str, ...] = ("llama1b", "llama8b")
    attn_batches: tuple[int, ...] = (1, 16, 64)
    attn_contexts: tuple[int, ...] = (1024, 4096, 16384)
    copy_bytes: int = 2 << 30

    @classmethod
    def for_run(cls, dry: bool) -> Sizes:
        if not dry:
            return cls(dry=False, device="cuda")
        return cls(
            dry=True,
            device="cpu",
            vocab=512,
            hidden=64,
            intermediate=128,
            heads=4,
            kv_heads=2,
            head_dim=16,
            max_positions=512,
            rope_original=64,
            check_layers=2,
            bench_layers=2,
            prompt_lens=(5, 9, 40, 70),
            new_tokens=4,
            chunk_budget=32,
            max_model_len=128,
            bench_batches=(1, 2),
            bench_in=8,
            bench_out=4,
            attn_models=("tiny",),
            attn_batches=(1, 2),
            attn_contexts=(64, 200),
            copy_bytes=16 << 20,
        )


# --- results ------------------------------------------------------------------------------------


@dataclass
class Report:
    """One section's JSON, rewritten on every `save()` so a timeout still leaves what was measured."""

    path: Path
    section: str
    status: str = "running"
    ok: bool | None = None
    seconds: float = 0.0
    env: dict = field(default_factory=dict)
    results: dict = field(default_factory=dict)
    error: str | None = None
    _t0: float = field(default_factory=time.perf_counter)

    def save(self) -> None:
        self.seconds = round(time.perf_counter() - self._t0, 2)
        data = {k: v for k, v in asdict(self).items() if not k.startswith("_") and k != "path"}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def _env(sz: Sizes) -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0], "dry_run": sz.dry}
    for name in ("triton", "transformers", "numpy"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = "absent"
    if sz.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "")
    return info


def _rel(a, b) -> float:
    """‖a - b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _sync(sz: Sizes) -> None:
    import torch

    if sz.device == "cuda":
        torch.cuda.synchronize()


# --- models -------------------------------------------------------------------------------------


def _llama_config(sz: Sizes, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=sz.vocab,
        hidden_size=sz.hidden,
        intermediate_size=sz.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=sz.heads,
        num_key_value_heads=sz.kv_heads,
        head_dim=sz.head_dim,
        max_position_embeddings=sz.max_positions,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": sz.rope_original,
        },
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )


def _tokenizer(vocab: int):
    """A word-level tokenizer with one token per model id ("t0" .. "t<V-1>"): every sampled id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", pad_token="t1", unk_token="t0")


def build_model(sz: Sizes, folder: Path, layers: int, dtype_name: str) -> Path:
    """A random-weight Llama folder (config, safetensors, tokenizer), built once per spec and reused."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = {"dtype": dtype_name, "config": _llama_config(sz, layers).to_dict(), "device": sz.device}
    marker = folder / "gpu_check_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return folder
    tmp = folder.with_name(folder.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    torch.manual_seed(1234 + layers)
    with torch.device(sz.device):
        model = AutoModelForCausalLM.from_config(_llama_config(sz, layers), dtype=getattr(torch, dtype_name))
    model.save_pretrained(tmp)
    del model
    _tokenizer(sz.vocab).save_pretrained(tmp)
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1).save_pretrained(tmp)
    (tmp / "gpu_check_spec.json").write_text(json.dumps(spec))
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def check_model(sz: Sizes, work: Path) -> Path:
    """Sections b and c: 4 layers, stored in bf16 (loaded as fp32 for b: the same values)."""
    return build_model(sz, work / f"llama-1b-shape-check-{sz.check_layers}l", sz.check_layers, "bfloat16")


def _prompts(sz: Sizes, lens, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, sz.vocab, (n,), generator=gen).tolist() for n in lens]


def run_steps(model, seqs, prompt_lens, device, *, block_size: int = 16, chunk: int = 64, keep_on_device=False):
    """Feed each sequence through `model` the way the engine does: its first `prompt_lens[i]` tokens in
    chunks of at most `chunk`, the rest one per step (teacher forcing), one-token requests first in each
    batch, blocks handed out out of order. Returns each sequence's logits `[len, V]` in fp32."""
    import torch

    from kernels import AttentionMetadata

    layers = len(model.layers)
    num_blocks = sum(-(-len(s) // block_size) for s in seqs) + 2
    shape = (layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    cache = torch.zeros(shape, dtype=model.dtype, device=device)
    caches = [(cache[i, 0], cache[i, 1]) for i in range(layers)]
    free = list(range(num_blocks))[::-1]
    free = free[1::2] + free[::2]
    tables: list[list[int]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    logits: list[list] = [[] for _ in seqs]
    while True:
        sizes = {}
        for i, s in enumerate(seqs):
            if done[i] < len(s):
                sizes[i] = min(chunk, prompt_lens[i] - done[i]) if done[i] < prompt_lens[i] else 1
        if not sizes:
            break
        order = sorted(sizes, key=lambda i: sizes[i] != 1)  # decodes first
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for i in order:
            n = sizes[i]
            while len(tables[i]) * block_size < done[i] + n:
                tables[i].append(free.pop())
            for p in range(done[i], done[i] + n):
                ids.append(seqs[i][p])
                pos.append(p)
                slots.append(tables[i][p // block_size] * block_size + p % block_size)
            qsl.append(qsl[-1] + n)
            seq_lens.append(done[i] + n)
        qlens = [sizes[i] for i in order]
        bt = torch.zeros(len(order), max(len(tables[i]) for i in order), dtype=torch.int32)
        for row, i in enumerate(order):
            bt[row, : len(tables[i])] = torch.tensor(tables[i])
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=bt.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            num_decodes=next((j for j, q in enumerate(qlens) if q != 1), len(qlens)),
            query_lens_host=qlens,
            seq_lens_host=seq_lens,
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), caches, meta)
            out = model.compute_logits(hidden).float()
        if not keep_on_device:
            out = out.cpu()
        for i, part in zip(order, out.split(qlens), strict=True):
            logits[i].append(part)
            done[i] += sizes[i]
    return [torch.cat(parts) for parts in logits]


def _engine_imports() -> tuple:
    """`worker.LLM` and `worker.SamplingParams`, or a clear error naming what the image lacks."""
    try:
        from worker import LLM, SamplingParams

        return LLM, SamplingParams
    except ModuleNotFoundError as e:
        raise RuntimeError(
            f"the engine's import chain needs {e.name!r}, which this image lacks (carry its wheel and "
            f"`pip install` it first): {e}"
        ) from e


def _graphs_active(llm) -> bool:
    """Whether the engine's runner replays CUDA graphs (the runner's `cuda_graphs` flag, when it has one)."""
    runner = getattr(llm.engine, "runner", None)
    return bool(getattr(runner, "cuda_graphs", False))


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
        rec = _recompile_check(sz)
        rep.results["recompiles"] = rec
        ok = ok and rec["ok"]
    return ok


def _fused_checks(sz: Sizes, dtype) -> list[dict]:
    """Each fused kernel vs its torch reference on the same device, 1B-shaped rows."""
    import torch

    from kernels import use_backend
    from kernels.fused import add_rms_norm, rms_norm, rotary_write_kv, silu_and_mul

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
        err = _rel(got[key], want[key])
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
    import kernels.cache_ops as cache_ops
    import kernels.decode as decode
    import kernels.fused_triton as fused
    import kernels.prefill as prefill

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


def _recompile_check(sz: Sizes) -> dict:
    """Serving-like steps whose per-step values change (decode count, hence the prefill's first request;
    block-table width; split) compile nothing new once each kernel has run once."""
    import torch

    import kernels.cache_ops as cache_ops
    from kernels import use_backend
    from kernels.fused import add_rms_norm, rotary_write_kv, silu_and_mul
    from kernels.paged_attention import paged_attention_triton
    from ops.bench.kernels import build_problem

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

    LLM, SamplingParams = _engine_imports()
    folder = check_model(sz, work)
    prompts = _prompts(sz, sz.prompt_lens, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(sz.device).eval()
    want = [_hf_greedy(hf, p, sz.new_tokens, sz.device) for p in prompts]
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
            row.update(first_difference=first, got=g, want=w, margin=_hf_margin(hf, p + w[:first], sz.device))
        rows.append(row)
    rep.results.update(
        prompts=rows,
        equal=sum(r["equal"] for r in rows),
        total=len(rows),
        cuda_graphs=_graphs_active(llm),
        chunked_prefill_budget=sz.chunk_budget,
    )
    return all(r["equal"] for r in rows)


def _hf_greedy(hf, prompt: list[int], n: int, device: str) -> list[int]:
    """transformers' own greedy decoding with its KV cache (EOS does not stop it)."""
    import torch

    out = []
    with torch.inference_mode():
        res = hf(torch.tensor([prompt], device=device), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = hf(torch.tensor([[tok]], device=device), past_key_values=res.past_key_values, use_cache=True)
    return out


def _hf_margin(hf, ids: list[int], device: str) -> float:
    """transformers' top-1 minus top-2 logit after `ids`: how near a tie a differing token was."""
    import torch

    with torch.inference_mode():
        top = hf(torch.tensor([ids], device=device)).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


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
    seqs = _prompts(sz, [n + sz.new_tokens for n in prompt_lens], seed=2)
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
                "rel_err_vs_hf_bf16": _rel(g, r16),
                "max_abs_err_vs_hf_bf16": float((g - r16).abs().max()),
                "rel_err_vs_hf_fp32": _rel(g, r32),
                "hf_bf16_rel_err_vs_hf_fp32": _rel(r16, r32),
                "decode_rel_err_vs_hf_bf16": _rel(g[n:], r16[n:]),
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


# --- d: engine throughput -----------------------------------------------------------------------


def section_throughput(sz: Sizes, work: Path, rep: Report) -> bool:
    import gc

    import torch

    from kernels import use_backend
    from ops.bench.kernels import copy_bandwidth, timer

    dtype = "bfloat16" if not sz.dry else "float32"
    folder = build_model(sz, work / f"llama-1b-shape-bench-{sz.bench_layers}l", sz.bench_layers, dtype)
    # Bytes a decode step must move: every weight once (the tied embedding as the LM head), plus the KV
    # cache of the batch; the checkpoint is stored in the dtype it runs in.
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    elem = 2 if dtype == "bfloat16" else 4
    kv_per_token = 2 * sz.bench_layers * sz.kv_heads * sz.head_dim * elem
    copy_bw = copy_bandwidth(sz.device, sz.copy_bytes, timer(sz.device) if not sz.dry else _once)
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
    LLM, SamplingParams = _engine_imports()
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
            "cuda_graphs": _graphs_active(llm),
            "seconds": time.perf_counter() - t0,  # load, warm-up and graph capture
            "capture_seconds": graphs.capture_seconds if graphs else None,
            "graph_buckets": graphs.sizes if graphs else [],
        }
    )
    rep.save()
    warm = _prompts(sz, [sz.bench_in] * 4, seed=3)
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    rows = rep.results["rows"]
    for batch in sz.bench_batches:
        prompts = _prompts(sz, [sz.bench_in] * batch, seed=10 + batch)
        _timed_generate(llm, prompts, 2, SamplingParams, sz)  # this batch shape once, untimed
        replays = graphs.replays if graphs else 0
        total_s, step_s, steps, tokens = _timed_decode(llm, prompts, sz.bench_out, SamplingParams, sz)
        row = {
            "batch": batch,
            "enforce_eager": enforce_eager,
            "cuda_graphs": _graphs_active(llm),
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
    _sync(sz)
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
    _sync(sz)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sampling_params_cls(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    _sync(sz)
    if any(len(o.outputs[0].token_ids) != n for o in outs):
        raise RuntimeError(f"asked for {n} tokens per prompt, got {[len(o.outputs[0].token_ids) for o in outs]}")
    return time.perf_counter() - t0


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return max(time.perf_counter() - t0, 1e-9)


# --- e: decode attention bandwidth --------------------------------------------------------------


def section_attention(sz: Sizes, work: Path, rep: Report) -> bool:
    from ops.bench.kernels import copy_bandwidth, time_decode, timer

    bench = timer(sz.device) if not sz.dry else _once
    copy_bw = copy_bandwidth(sz.device, sz.copy_bytes, bench)
    rep.results["copy_bandwidth_GBps"] = copy_bw / 1e9
    rep.save()
    rows = time_decode(sz.device, list(sz.attn_models), list(sz.attn_batches), list(sz.attn_contexts), copy_bw, bench)
    rep.results["decode"] = rows
    return all("triton_us" in r or "skipped" in r for r in rows)


RUNNERS = {
    "kernels": section_kernels,
    "fp32_tokens": section_fp32_tokens,
    "bf16_logits": section_bf16_logits,
    "throughput": section_throughput,
    "attention": section_attention,
}


# --- driver -------------------------------------------------------------------------------------


def run_sections(keys: str, out: Path, work: Path, dry: bool) -> int:
    """Child process: run sections one after another, each writing its JSON (status ok / fail / error)."""
    failed = 0
    for key in keys:
        name = SECTIONS[key][0]
        sz = Sizes.for_run(dry)
        rep = Report(out / f"{key}_{name}.json", name)
        try:
            import torch

            torch.manual_seed(0)
            if dry:
                torch.set_num_threads(min(2, os.cpu_count() or 1))
            rep.env = _env(sz)
            rep.save()
            ok = RUNNERS[name](sz, work, rep)
            rep.status, rep.ok = ("ok" if ok else "fail"), bool(ok)
        except Exception as e:  # reported in the JSON; the next section still runs
            rep.status, rep.ok = "error", False
            rep.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        rep.save()
        failed += not rep.ok
        print(f"[{key} {name}] {rep.status} in {rep.seconds:.1f}s", flush=True)
    return 1 if failed else 0


def _child_env(dry: bool) -> dict:
    env = dict(os.environ)
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if dry:
        env.update(TRITON_INTERPRET="1", PAGEDQ_CPU_KERNEL="0", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
    else:
        env["TRITON_INTERPRET"] = "0"
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, help="folder for the JSON files (default: ops/bench/results/gpu-check-<time>)"
    )
    parser.add_argument("--work", type=Path, help="folder for the random models (default: a temp folder, reused)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--sections", default="abcde", help="which sections, e.g. a,b or abe (default: all)")
    parser.add_argument("--budget", type=float, default=350.0, help="seconds for everything (default 350)")
    parser.add_argument("--run-section", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import tempfile

    out = args.out or REPO / "ops" / "bench" / "results" / time.strftime("gpu-check-%Y%m%d-%H%M%S")
    work = args.work or Path(tempfile.gettempdir()) / ("pagedq-gpu-check" + ("-dry" if args.dry_run else ""))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if args.run_section:
        return run_sections(args.run_section, out, work, args.dry_run)

    keys = [k for k in args.sections.replace(",", "") if k in SECTIONS]
    if not keys:
        parser.error(f"--sections: choose from {''.join(SECTIONS)}")
    t0 = time.perf_counter()
    summary = {"dry_run": args.dry_run, "out": str(out), "sections": {}}
    print(
        f"pagedq gpu_check{' (dry run)' if args.dry_run else ''}: sections {''.join(keys)}, JSON in {out}", flush=True
    )
    # On a GPU each section gets a fresh process (a CUDA error poisons its context); a dry run shares one.
    groups = [keys] if args.dry_run else [[k] for k in keys]
    for group in groups:
        left = args.budget - (time.perf_counter() - t0)
        limit = min(DRY_LIMIT if args.dry_run else SECTIONS[group[0]][1], left)
        if limit < 10:
            for key in group:
                name = SECTIONS[key][0]
                data = {"section": name, "status": "skipped", "ok": False, "error": "out of time"}
                (out / f"{key}_{name}.json").write_text(json.dumps(data) + "\n")
                summary["sections"][key] = {"name": name, "status": "skipped", "seconds": 0.0}
            continue
        summary["sections"].update(_run_child(group, out, work, args.dry_run, limit))
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["ok"] = all(s["status"] == "ok" for s in summary["sections"].values())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{'section':<14} {'status':<8} {'seconds':>8}")
    for key, s in summary["sections"].items():
        print(f"{key} {s['name']:<12} {s['status']:<8} {s['seconds']:>8.1f}")
    print(f"total {summary['seconds']:.1f}s: {'all passed' if summary['ok'] else 'NOT all passed'}; JSON in {out}")
    return 0 if summary["ok"] else 1


def _run_child(keys: list[str], out: Path, work: Path, dry: bool, limit: float) -> dict:
    """Run `keys` in one child process with a time limit; fill in the JSON of any section it left unfinished."""
    me = str(Path(__file__).resolve())
    cmd = [sys.executable, me, "--run-section", "".join(keys), "--out", str(out), "--work", str(work)]
    if dry:
        cmd.append("--dry-run")
    log = out / ("dry_run.log" if dry else f"{keys[0]}_{SECTIONS[keys[0]][0]}.log")
    start = time.perf_counter()
    timed_out = False
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_child_env(dry), start_new_session=True)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
    results = {}
    for key in keys:
        name = SECTIONS[key][0]
        path = out / f"{key}_{name}.json"
        data = json.loads(path.read_text()) if path.exists() else {"section": name}
        if data.get("status") in (None, "running"):
            data.update(status="timeout" if timed_out else "error", ok=False)
            data["error"] = f"killed after {limit:.0f}s" if timed_out else f"the process exited {proc.returncode} first"
            data["log_tail"] = log.read_text()[-4000:]
            path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        seconds = data.get("seconds") or round(time.perf_counter() - start, 1)
        if data["status"] == "ok":
            print(f"--- {key} {name}: ok in {seconds:.1f}s", flush=True)
        else:
            tail = data.get("error") or log.read_text()[-2000:]
            print(f"--- {key} {name}: {data['status']}\n{str(tail)[-2000:]}", flush=True)
        results[key] = {"name": name, "status": data["status"], "seconds": seconds}
    return results


if __name__ == "__main__":
    sys.exit(main())
