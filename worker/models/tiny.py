"""Tiny random-weight models for tests, demos in CI and benchmarks of the machinery.

Everything is built locally: a byte-level BPE tokenizer trained on a small fixed corpus (so multi-byte
characters are split across tokens, the hard case for detokenizers) and transformers models of the
Llama family with random weights, saved as ordinary Hugging Face folders (safetensors).
"""

from __future__ import annotations

import json
from pathlib import Path

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores the key value cache in fixed size blocks, like virtual memory pages.",
    "Continuous batching lets new requests join a running batch at every iteration of the engine.",
    "Redis streams carry requests to workers; consumer groups share the work between them.",
    "def main():\n    print('hello world')\n    return 0\n",
    "大型语言模型的推理服务需要高效地管理显存。分页注意力机制把键值缓存分成固定大小的块。",
    "连续批处理让新的请求在每一次迭代时加入正在运行的批次。你好，世界！",
    "Emoji: 🚀🔥😀👍🎉 and accents: café, naïve, résumé, Ångström, Straße.",
    "Numbers 0123456789 and symbols: !@#$%^&*()[]{}<>?/\\|~`'\";:,.-_=+",
]


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE tokenizer on the fixed corpus, save it to `out_dir`; return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out_dir)
    return len(fast)


def _config(family: str, vocab_size: int, eos_id: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        # Wider than the usual 0.02 so greedy choices are decisive, not near-ties of random logits.
        initializer_range=0.1,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    if family == "llama":
        cfg = LlamaConfig(**{**common, "tie_word_embeddings": False, "head_dim": 32, **overrides})
    elif family == "qwen2":  # QKV bias, tied embeddings, GQA 4:1 (MQA-like)
        cfg = Qwen2Config(
            **{
                **common,
                "num_key_value_heads": 1,
                "tie_word_embeddings": True,
                "rope_theta": 1e6,
                **overrides,
            }
        )
    elif family == "qwen3":  # q/k RMSNorm, head_dim not hidden/heads
        cfg = Qwen3Config(**{**common, "head_dim": 48, "tie_word_embeddings": False, **overrides})
    elif family == "mistral":
        cfg = MistralConfig(**{**common, "sliding_window": None, "tie_word_embeddings": False, **overrides})
    else:
        raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES}")
    return cfg


def build_tiny_model(family: str, out_dir: str | Path, *, seed: int = 0, **config_overrides) -> Path:
    """Write a random-weight `family` model plus tokenizer to `out_dir` (a complete HF folder)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    eos_id = SPECIAL_TOKENS.index("<|endoftext|>")
    cfg = _config(family, vocab, eos_id, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Norm weights start at exactly 1 and biases at 0; perturb them so their loading is really tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(out)
    (out / "pagedq_tiny.json").write_text(json.dumps({"family": family, "seed": seed}))
    return out
