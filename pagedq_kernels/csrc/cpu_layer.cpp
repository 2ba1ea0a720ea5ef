// One decoder layer of the Llama family in one call: the same kernels, in the same order, as the fused
// Python path of worker/models/llama.py (`DecoderLayer.forward_fused`), so the result is the same bit for
// bit. A step of a small model calls about ten kernels per layer; from Python each call cost a few
// microseconds of dispatch (attribute lookups, backend checks, slicing the step's tables), about 85 us per
// layer in all, or 4-5% of a SmolLM2 decode step on 2 cores. Here the glue is C++.
//
// Taken only where every part runs in this extension (worker/models/cpu_layer.py checks): projections
// packed for its GEMM, no q/k norm, the prompt chunks' attention in its prefill kernel.
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "cpu_ops.h"

namespace {

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t n) {
  auto out = torch::empty({x.size(0), n}, x.options());
  gemm_linear(x, packed, bias, out);
  return out;
}

}  // namespace

// (the layer's MLP output, the residual stream before it), as forward_fused returns them. `residual`
// None: the first layer (x is the embedding). First this layer's cache and the step's tables (as in
// AttentionMetadata), then the layer's constants: norms, packed projections and biases, sizes.
std::vector<torch::Tensor> decoder_layer(
    torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor k_cache, torch::Tensor v_cache,
    torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
    torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens, int64_t num_decodes,
    torch::Tensor ln1, torch::Tensor ln2, double eps, torch::Tensor qkv, c10::optional<torch::Tensor> qkv_bias,
    torch::Tensor o, c10::optional<torch::Tensor> o_bias, torch::Tensor gate_up, torch::Tensor down,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double scale,
    int64_t window) {
  TORCH_CHECK(x.dim() == 2, "decoder_layer: x must be [tokens, hidden]");
  const int64_t T = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  torch::Tensor h, res;
  if (residual.has_value()) {
    auto normed = add_rms_norm(x, *residual, ln1, eps);
    h = normed[0];
    res = normed[1];
  } else {
    res = x;
    h = rms_norm(x, ln1, eps);
  }
  // attention
  const auto qkv_out = linear(h, qkv, qkv_bias, q_size + 2 * kv_size);
  auto q = qkv_out.narrow(1, 0, q_size).view({T, num_heads, head_dim});
  auto k = qkv_out.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
  auto v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
  rotary_write_kv(positions.to(at::kLong), q, k, v, cos, sin, k_cache, v_cache, slot_mapping.to(at::kLong));
  auto attn = torch::empty({T, num_heads, head_dim}, x.options());
  const int64_t num_seqs = seq_lens.size(0);
  if (num_decodes > 0)
    paged_decode(q.narrow(0, 0, num_decodes), k_cache, v_cache, block_tables.narrow(0, 0, num_decodes),
                 seq_lens.narrow(0, 0, num_decodes), attn.narrow(0, 0, num_decodes), scale, window);
  if (num_decodes < num_seqs) {
    const int64_t rest = num_seqs - num_decodes;
    paged_prefill(q, k_cache, v_cache, block_tables.narrow(0, num_decodes, rest),
                  query_start_loc.narrow(0, num_decodes, rest + 1), seq_lens.narrow(0, num_decodes, rest), attn, scale,
                  window);
  }
  const auto a = linear(attn.view({T, q_size}), o, o_bias, hidden);
  // MLP
  auto normed = add_rms_norm(a, res, ln2, eps);
  const auto up = linear(normed[0], gate_up, c10::nullopt, 2 * intermediate);
  return {linear(silu_and_mul(up), down, c10::nullopt, hidden), normed[1]};
}
