"""The Llama family on the paged KV cache: Llama 2/3, Mistral, Qwen2 (QKV bias), Qwen3 (q/k norm),
SmolLM2. One flattened token axis, fused QKV and gate/up projections, attention through `pagedq_kernels`.

On CUDA, and on the CPU where the C++ extension is built, the elementwise work between the matmuls
goes through fused kernels (`pagedq_kernels.add_rms_norm`, `.silu_and_mul`, `.rotary_write_kv`:
rotary embedding folded into the KV-cache write), about 10 calls per layer instead of about 37.
Elsewhere the plain torch code below runs, operation for operation what transformers computes.
`LlamaForCausalLM.use_fused_ops` forces either path. Where the extension runs every part of a layer, the
fused path's layers are called from C++ (worker/models/cpu_layer.py), the same kernels in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

import pagedq_kernels
from pagedq_kernels import AttentionMetadata
from pagedq_kernels.fused import cpu_extension_for, rms_norm_ref, rotate_ref
from worker.models.cpu_layer import LayerConstants, layer_plan, run_layers
from worker.models.cpu_linear import linear, pack, packing_enabled
from worker.models.quantization import check_method, quantize_linear, quantize_lm_head


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


class Rotary(nn.Module):
    """cos/sin tables `[max_positions, head_dim]` for every position, built once in fp32 on the CPU (as
    transformers computes them there), then moved to the device the model is being built on."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        target = torch.empty(0).device  # the device of the enclosing `with torch.device(...)`, if any
        # transformers' RoPE init functions mix devices under a device context (they return CPU
        # tensors): build everything inside an explicit CPU context, move the result once.
        with torch.device("cpu"):
            cos, sin = _rope_tables(config, head_dim, max_positions)
        self.register_buffer("cos", cos.to(target), persistent=False)
        self.register_buffer("sin", sin.to(target), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def _rope_tables(config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    return emb.cos() * scaling, emb.sin() * scaling


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
        cos_sin: tuple[torch.Tensor, torch.Tensor] | Rotary,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`cos_sin`: this step's per-token tables (unfused), or the Rotary module itself with
        `positions` (fused)."""
        t = x.shape[0]
        qkv = linear(x, self.qkv_proj)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv_cache
        if isinstance(cos_sin, Rotary):  # fused: rotate q and k in place, k and v straight into the cache
            rope = cos_sin
            pagedq_kernels.rotary_write_kv(positions, q, k, v, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping)
        else:
            q, k = rotate_ref(q, *cos_sin), rotate_ref(k, *cos_sin)
            pagedq_kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = pagedq_kernels.paged_attention(
            q, k_cache, v_cache, meta, scale=self.scale, sliding_window=self.sliding_window
        )
        return linear(o.reshape(t, self.q_size), self.o_proj)


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

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj)
        if fused:
            return linear(pagedq_kernels.silu_and_mul(gate_up), self.down_proj)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)


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

    def forward_fused(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary, positions, kv_cache, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the caller adds the two, fused
        into the next norm. The same sums in the same dtype as `forward`."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, h = x, pagedq_kernels.rms_norm(x, ln1.weight, ln1.eps)
        else:
            h, residual = pagedq_kernels.add_rms_norm(x, residual, ln1.weight, ln1.eps)
        a = self.self_attn(h, rotary, kv_cache, meta, positions)
        h, residual = pagedq_kernels.add_rms_norm(a, residual, ln2.weight, ln2.eps)
        return self.mlp(h, fused=True), residual


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
        # None: fused kernels on CUDA tensors and where the CPU extension is built, the plain torch
        # path elsewhere; True/False forces one.
        self.use_fused_ops: bool | None = None
        # Every layer's constant arguments for the CPU's one-call layer (worker/models/cpu_layer.py), set
        # by pack_linears where the extension runs the whole layer; None: the Python layers.
        self.cpu_layer_plan: list[LayerConstants] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = F.embedding(input_ids, self.embed_tokens.weight)
        fused = self.use_fused_ops
        if fused is None:  # fused where a kernel does it: CUDA, or the C++ extension on the CPU
            fused = x.is_cuda or cpu_extension_for(x) is not None
        if fused:
            ran = run_layers(self, self.cpu_layer_plan, x, positions, kv_caches, meta) if self.cpu_layer_plan else None
            if ran is not None:
                x, residual = ran
            else:
                residual = None
                for layer, cache in zip(self.layers, kv_caches, strict=True):
                    x, residual = layer.forward_fused(x, residual, self.rotary, positions, cache, meta)
            return pagedq_kernels.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]
        cos_sin = self.rotary.tables(positions, x.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head)

    def pack_linears(self, quantization: str | None = None) -> None:
        """Pack every projection for the CPU GEMM (`worker.models.cpu_linear`); call once, after `load_weights`.
        `quantization="int8"`: quantize them to int8 instead (`worker.models.quantization`), the LM head too
        unless PAGEDQ_INT8_LM_HEAD=0."""
        check_method(quantization)
        prepare = quantize_linear if quantization else pack
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                prepare(module)
        if quantization and quantize_lm_head():
            quantize_linear(self.lm_head, keep_weight=self.tie_word_embeddings)
        elif not quantization or packing_enabled(self.embed_tokens.weight.device, self.dtype):
            pack(self.lm_head, keep_weight=self.tie_word_embeddings)
        self.cpu_layer_plan = layer_plan(self)

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
