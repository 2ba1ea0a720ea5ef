"""What the sections of ops/bench/gpu_check.py share: the sizes of a run, the JSON report, random-weight
Llama folders, a step driver that feeds a model the way the engine does, and transformers' greedy."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


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


def environment(sz: Sizes) -> dict:
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


def rel_err(a, b) -> float:
    """‖a - b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def sync_device(sz: Sizes) -> None:
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


def random_prompts(sz: Sizes, lens, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, sz.vocab, (n,), generator=gen).tolist() for n in lens]


def run_steps(model, seqs, prompt_lens, device, *, block_size: int = 16, chunk: int = 64, keep_on_device=False):
    """Feed each sequence through `model` the way the engine does: its first `prompt_lens[i]` tokens in
    chunks of at most `chunk`, the rest one per step (teacher forcing), one-token requests first in each
    batch, blocks handed out out of order. Returns each sequence's logits `[len, V]` in fp32."""
    import torch

    from pagedq_kernels import AttentionMetadata

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


def engine_imports() -> tuple:
    """`worker.LLM` and `worker.SamplingParams`, or a clear error naming what the image lacks."""
    try:
        from worker import LLM, SamplingParams

        return LLM, SamplingParams
    except ModuleNotFoundError as e:
        raise RuntimeError(
            f"the engine's import chain needs {e.name!r}, which this image lacks (carry its wheel and "
            f"`pip install` it first): {e}"
        ) from e


def graphs_active(llm) -> bool:
    """Whether the engine's runner replays CUDA graphs (the runner's `cuda_graphs` flag, when it has one)."""
    runner = getattr(llm.engine, "runner", None)
    return bool(getattr(runner, "cuda_graphs", False))


def hf_greedy(hf, prompt: list[int], n: int, device: str) -> list[int]:
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


def hf_margin(hf, ids: list[int], device: str) -> float:
    """transformers' top-1 minus top-2 logit after `ids`: how near a tie a differing token was."""
    import torch

    with torch.inference_mode():
        top = hf(torch.tensor([ids], device=device)).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def time_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return max(time.perf_counter() - t0, 1e-9)
