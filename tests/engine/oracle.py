"""Hugging Face transformers as the oracle: greedy `generate`, one prompt at a time, fp32."""

from __future__ import annotations

import random

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the key value cache in fixed size blocks.",
    "大型语言模型的推理服务需要高效地管理显存。",
    "连续批处理让新的请求在每一次迭代时加入正在运行的批次。",
    "Emoji 🚀🔥😀 and accents: café, naïve.",
    "def main():\n    print('hello world')\n",
    "Redis streams carry requests to workers.",
]


def mixed_prompts(tokenizer, count: int = 24, seed: int = 0) -> list[list[int]]:
    """Prompts of 1 to 300+ tokens: text (English, Chinese, emoji) and raw token ids."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    lengths = [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 48, 64, 90, 128, 150, 200, 256, 301, 333]
    prompts: list[list[int]] = []
    for i in range(count):
        if i % 3 == 0:
            text = " ".join(rng.choice(CORPUS) for _ in range(1 + i // 3))
            prompts.append(tokenizer(text).input_ids)
        else:
            n = lengths[i % len(lengths)]
            prompts.append([rng.randrange(vocab) for _ in range(n)])
    return prompts


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: list[int] | int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    outs = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_new_tokens, strict=True):
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
            outs.append(y[0, len(ids) :].tolist())
    return outs
