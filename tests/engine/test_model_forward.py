"""The engine's model on the paged cache computes the same logits as transformers (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedq_kernels import AttentionMetadata
from worker.models.loader import ModelLoadError, load_model
from worker.models.registry import UnsupportedArchitecture


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def hf_models(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    return {
        fam: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for fam, path in tiny_model_dirs.items()
    }


class PagedHarness:
    """Runs the model over sequences chunk by chunk, each sequence on shuffled, scattered blocks."""

    def __init__(self, model, block_size: int, num_blocks: int, seed: int) -> None:
        self.model, self.bs = model, block_size
        layers = len(model.layers)
        self.cache = torch.zeros(layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.caches = [(self.cache[i, 0], self.cache[i, 1]) for i in range(layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.done: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """chunks: seq -> new token ids. Returns each chunk's logits [len, V]."""
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for sid, toks in chunks.items():
            start = self.done.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.bs < start + len(toks):
                table.append(self.free.pop())
            for j, t in enumerate(toks):
                p = start + j
                ids.append(t)
                pos.append(p)
                slots.append(table[p // self.bs] * self.bs + p % self.bs)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(start + len(toks))
            self.done[sid] = start + len(toks)
        width = max(len(self.tables[s]) for s in chunks)
        bt = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, s in enumerate(chunks):
            bt[i, : len(self.tables[s])] = torch.tensor(self.tables[s])
        qlens = [len(t) for t in chunks.values()]
        leading_decodes = next((i for i, q in enumerate(qlens) if q != 1), len(qlens))
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=bt,
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            num_decodes=leading_decodes,
            query_lens_host=qlens,
            seq_lens_host=seq_lens,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(qlens))


@pytest.mark.parametrize("block_size", [16, 32])
def test_logits_match_transformers(tiny_model_dirs, hf_models, block_size):
    gen = torch.Generator().manual_seed(block_size)
    for fam, path in tiny_model_dirs.items():
        model = load_model(path, dtype="float32", device="cpu").model
        hf = hf_models[fam]
        vocab = hf.config.vocab_size
        lengths = [1, 7, 40, 75]
        seqs = {i: torch.randint(0, vocab, (n + 3,), generator=gen).tolist() for i, n in enumerate(lengths)}
        with torch.inference_mode():
            want = {i: hf(torch.tensor([s])).logits[0] for i, s in seqs.items()}
        h = PagedHarness(model, block_size, num_blocks=64, seed=block_size)
        got: dict[int, list[torch.Tensor]] = {i: [] for i in seqs}
        # Step 1: whole prompts of seq 0 and 1, the first chunk of seqs 2 and 3 (chunked prefill).
        first = {0: seqs[0][:1], 1: seqs[1][:7], 2: seqs[2][:17], 3: seqs[3][:33]}
        for i, lg in zip(first, h.step(first), strict=True):
            got[i].append(lg)
        # Step 2: decodes of 0 and 1 mixed with the rest of 2 and 3's prompts.
        second = {0: seqs[0][1:2], 1: seqs[1][7:8], 2: seqs[2][17:40], 3: seqs[3][33:75]}
        for i, lg in zip(second, h.step(second), strict=True):
            got[i].append(lg)
        # Steps 3+: decode one token at a time until every sequence is consumed.
        while any(h.done[i] < len(s) for i, s in seqs.items()):
            batch = {i: [s[h.done[i]]] for i, s in seqs.items() if h.done[i] < len(s)}
            for i, lg in zip(batch, h.step(batch), strict=True):
                got[i].append(lg)
        for i, s in seqs.items():
            err = rel_err(torch.cat(got[i]), want[i])
            assert err < 1e-4, f"{fam} seq {i} (len {len(s)}, block {block_size}): rel err {err:.2e}"


def test_missing_folder_is_a_readable_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path)


def test_unsupported_architecture_names_the_supported_ones(tmp_path, llama_dir):
    import json
    import shutil

    folder = tmp_path / "gpt2ish"
    shutil.copytree(llama_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="LlamaForCausalLM"):
        load_model(folder)


def test_mismatched_shapes_are_named(tmp_path, llama_dir):
    import json
    import shutil

    folder = tmp_path / "wrong"
    shutil.copytree(llama_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 320
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight.*shape"):
        load_model(folder)


def test_missing_tensors_are_named(tmp_path, llama_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    shutil.copytree(llama_dir, folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensors: norm\.weight"):
        load_model(folder)


def test_sharded_checkpoint_loads(tmp_path, llama_dir):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "sharded"
    shutil.copytree(llama_dir, folder)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, folder / file)
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(folder, dtype="float32", device="cpu").model
    assert torch.equal(model.norm.weight, weights["model.norm.weight"])


@pytest.mark.slow
def test_gguf_file_loads_and_matches_transformers():
    """The GGUF path: the engine's model from the GGUF file computes transformers' logits."""
    from transformers import AutoModelForCausalLM

    from worker.models.prepare import PrepareError, find_gguf

    try:
        gguf = find_gguf("smollm2")
    except PrepareError as e:
        pytest.fail(str(e))
    loaded = load_model(gguf, dtype="float32", device="cpu")
    ours = loaded.model
    # transformers' own reading of the file's config (AutoConfig), passed on so it is not parsed again
    hf = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, config=loaded.config, dtype=torch.float32
    ).eval()
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    h = PagedHarness(ours, 16, num_blocks=8, seed=0)
    (got,) = h.step({0: ids})
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    assert rel_err(got, want) < 1e-4


@pytest.mark.parametrize("declared", ["bfloat16", "float16", "float32", None])
def test_auto_dtype_on_cpu_is_never_an_emulated_half(declared):
    """A bf16 checkpoint on a CPU without native bf16 (AVX2 only) runs in fp32: emulated bf16
    matmuls are tens of times slower. fp16 is never chosen on a CPU."""
    from types import SimpleNamespace

    from pagedq_kernels.cpu import native_bf16
    from worker.models.loader import resolve_dtype

    got = resolve_dtype("auto", SimpleNamespace(dtype=declared), torch.device("cpu"))
    if declared in ("bfloat16", "float16"):
        assert got == (torch.bfloat16 if native_bf16() else torch.float32)
    else:
        assert got == torch.float32
    assert resolve_dtype("bfloat16", SimpleNamespace(dtype=None), torch.device("cpu")) == torch.bfloat16
