"""The Llama family on the paged KV cache: Llama 2/3, Mistral, Qwen2 (QKV bias), Qwen3 (q/k norm),
SmolLM2. One flattened token axis, fused QKV and gate/up projections, attention through `kernels`."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import AttentionMetadata


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same operation order as transformers: normalise in fp32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for every position, built once (fp32, as transformers computes them)."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:  # llama3, linear, yarn, ...: transformers' own definitions of the frequencies
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
                raise NotImplementedError(f"RoPE type {rope_type!r} is not supported")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Module()
        self.qkv_proj.weight = _param(self.q_size + 2 * self.kv_size, hidden, dtype=dtype)
        self.qkv_proj.bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype) if bias else None
        self.o_proj = nn.Module()
        self.o_proj.weight = _param(hidden, self.q_size, dtype=dtype)
        self.o_proj.bias = _param(hidden, dtype=dtype) if getattr(config, "attention_bias", False) else None
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.sliding_window = _sliding_window(config, layer_idx)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = F.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, *cos_sin), _rotate(k, *cos_sin)
        k_cache, v_cache = kv_cache
        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = kernels.paged_attention(q, k_cache, v_cache, meta, scale=self.scale, sliding_window=self.sliding_window)
        return F.linear(o.reshape(t, self.q_size), self.o_proj.weight, self.o_proj.bias)


def _sliding_window(config, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return int(window)


class MLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"activation {config.hidden_act!r} is not supported (only silu)")
        if getattr(config, "mlp_bias", False):
            raise NotImplementedError("MLP biases (mlp_bias=true) are not supported")
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Module()
        self.gate_up_proj.weight = _param(2 * self.intermediate, config.hidden_size, dtype=dtype)
        self.down_proj = nn.Module()
        self.down_proj.weight = _param(config.hidden_size, self.intermediate, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj.weight).split(self.intermediate, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x, cos_sin, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# HF checkpoint names that land in a slice of one of our fused parameters: (part, fused, shard index).
_FUSED = (
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, dtype: torch.dtype, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Module()
            self.lm_head.weight = _param(config.vocab_size, config.hidden_size, dtype=dtype)
        attn = self.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.rotary = Rotary(config, attn.head_dim, max_positions or config.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = F.embedding(input_ids, self.embed_tokens.weight)
        cos_sin = self.rotary.tables(positions, x.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight)

    # --- weights -----------------------------------------------------------------------------

    def _shard(self, fused_name: str, shard: int) -> tuple[int, int]:
        """(offset, size) along dim 0 of a fused parameter's shard."""
        if ".qkv_proj." in fused_name:
            attn = self.layers[0].self_attn
            sizes = (attn.q_size, attn.kv_size, attn.kv_size)
        else:
            sizes = (self.config.intermediate_size,) * 2
        return sum(sizes[:shard]), sizes[shard]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into our parameters; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target_name, rows = name, None
            for part, fused, shard in _FUSED:
                if part in name:
                    target_name = name.replace(part, fused)
                    rows = self._shard(target_name, shard)
                    break
            param = params.get(target_name)
            if param is None:
                raise WeightsError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}")
            dst = param.data if rows is None else param.data[rows[0] : rows[0] + rows[1]]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise WeightsError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(dst.shape)} (config.json does not match the weights)"
                )
            dst.copy_(tensor)
            filled[target_name] = filled.get(target_name, 0) + dst.shape[0]
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise WeightsError(f"checkpoint is missing {len(missing)} tensors: {shown}")


class WeightsError(ValueError):
    """The checkpoint does not fit the model definition."""
