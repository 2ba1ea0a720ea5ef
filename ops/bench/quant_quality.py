"""What `--quantization int8` costs in quality (issue 46): perplexity of a fixed English text
(ops/bench/texts/ppl.txt, about 2,000 tokens) from teacher-forced logits of the engine's model, and
agreement with the unquantized model: its argmax at each position of that text, and its greedy
continuations (--gen tokens) of 16 held-out prompts of 64 tokens (windows of ops/bench/texts/heldout.txt).

    .venv/bin/python -m ops.bench.quant_quality                       # SmolLM2, bf16 vs int8
    .venv/bin/python -m ops.bench.quant_quality --dtype float32 --model FOLDER

Each variant loads through `worker.models.loader.load_model` (as the engine does) and runs its forward on a
paged cache of its own: the text in chunks of --chunk tokens, then the prompts one token at a time, greedy.
`PAGEDQ_INT8_LM_HEAD=0` keeps the LM head unquantized (an A/B switch of worker/models/quantization.py).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from pagedq_kernels import AttentionMetadata

TEXTS = Path(__file__).with_name("texts")


class Sequence:
    """One sequence on a private paged cache: `feed` runs the model over its next tokens and returns their
    logits (fp32)."""

    def __init__(self, model, capacity: int, block_size: int = 16) -> None:
        layers, blocks = len(model.layers), (capacity + block_size - 1) // block_size
        dtype = model.embed_tokens.weight.dtype
        shape = (blocks, block_size, model.num_kv_heads, model.head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(layers)]
        self.model, self.block_size, self.done = model, block_size, 0
        self.table = torch.arange(blocks, dtype=torch.int32)[None]

    def feed(self, tokens: list[int]) -> torch.Tensor:
        n, start = len(tokens), self.done
        self.done += n
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([self.done], dtype=torch.int32),
            block_tables=self.table,
            slot_mapping=torch.arange(start, self.done, dtype=torch.long),
            max_query_len=n,
            max_seq_len=self.done,
            num_decodes=1 if n == 1 else 0,
            query_lens_host=[n],
            seq_lens_host=[self.done],
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(tokens), torch.arange(start, self.done), self.caches, meta)
            return self.model.compute_logits(hidden).float()


def perplexity(model, ids: list[int], chunk: int) -> tuple[float, torch.Tensor]:
    """(perplexity of ids[1:] given the tokens before each, the argmax at each position)."""
    seq = Sequence(model, len(ids))
    nll, top = 0.0, []
    for i in range(0, len(ids) - 1, chunk):
        part = ids[i : min(i + chunk, len(ids) - 1)]
        logits = seq.feed(part)
        targets = torch.tensor(ids[i + 1 : i + 1 + len(part)])
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        top.append(logits.argmax(dim=-1))
    return math.exp(nll / (len(ids) - 1)), torch.cat(top)


def greedy(model, prompt: list[int], gen: int) -> list[int]:
    seq = Sequence(model, len(prompt) + gen)
    logits = seq.feed(prompt)[-1]
    out = []
    for _ in range(gen):
        out.append(int(logits.argmax()))
        logits = seq.feed(out[-1:])[-1]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 or a model folder")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk", type=int, default=512, help="tokens per forward of the perplexity text")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen", type=int, default=32, help="greedy tokens per prompt")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from worker.models.loader import load_model

    folder = args.model
    if folder == "smollm2":
        from worker.models.prepare import prepare

        folder = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok((TEXTS / "ppl.txt").read_text())["input_ids"]
    held = tok((TEXTS / "heldout.txt").read_text())["input_ids"]
    stride = max(1, (len(held) - args.prompt_len) // max(1, args.prompts - 1))
    prompts = [held[i * stride : i * stride + args.prompt_len] for i in range(args.prompts)]

    results, outputs, tops = {}, {}, {}
    for method in (None, "int8"):
        model = load_model(folder, dtype=args.dtype, device="cpu", quantization=method).model
        name = method or args.dtype
        ppl, tops[name] = perplexity(model, text, args.chunk)
        results[name] = {"perplexity": ppl}
        outputs[name] = [greedy(model, prompt, args.gen) for prompt in prompts]
        print(f"{name}: perplexity {results[name]['perplexity']:.4f} over {len(text)} tokens", flush=True)
    base, quant = outputs[args.dtype], outputs["int8"]
    pairs = list(zip(base, quant, strict=True))
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), args.gen) for x, y in pairs]
    summary = {
        "model": folder,
        "dtype": args.dtype,
        "text_tokens": len(text),
        **{f"ppl_{k}": round(v["perplexity"], 4) for k, v in results.items()},
        "ppl_change_pct": round(100 * (results["int8"]["perplexity"] / results[args.dtype]["perplexity"] - 1), 3),
        "prompts": len(prompts),
        "teacher_forced_top1_agreement": round((tops["int8"] == tops[args.dtype]).float().mean().item(), 4),
        "identical_continuations": sum(x == y for x, y in pairs),
        "greedy_tokens_each": args.gen,
        "mean_tokens_before_first_difference": round(sum(first_diff) / len(first_diff), 2),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
