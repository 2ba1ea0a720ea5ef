// The extension's entry points, one declaration each: the module definition (cpu_decode.cpp) binds them
// and the one-call layer (cpu_layer.cpp) calls them.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

// cpu_decode.cpp
void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                  torch::Tensor seq_lens, torch::Tensor out, double scale, int64_t window);

// cpu_fused.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void rotary_write_kv(torch::Tensor positions, torch::Tensor q, torch::Tensor k, c10::optional<torch::Tensor> v,
                     torch::Tensor cos, torch::Tensor sin, c10::optional<torch::Tensor> k_cache,
                     c10::optional<torch::Tensor> v_cache, c10::optional<torch::Tensor> slot_mapping);
// cpu_gemm.cpp
std::vector<std::string> gemm_dtypes();
torch::Tensor pack_gemm_weight(torch::Tensor weight);
void gemm_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, torch::Tensor out);

// cpu_gemm_int8.cpp: weight-only int8 (gemm_linear dispatches on the packed weight's dtype)
bool gemm_int8_available();
torch::Tensor pack_gemm_weight_int8(torch::Tensor q, torch::Tensor scales);
void gemm_linear_int8(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, torch::Tensor out);

// cpu_gemm_amx.cpp: bf16 on AMX tiles (false: not taken, the caller's vector kernel runs instead)
bool gemm_amx_available();
bool gemm_amx(const torch::Tensor& x, const torch::Tensor& packed, const float* bias, torch::Tensor& out);

// cpu_sample.cpp
bool greedy_argmax_fast();
torch::Tensor greedy_argmax(torch::Tensor x);

// cpu_layer.cpp
std::vector<torch::Tensor> decoder_layer(
    torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor k_cache, torch::Tensor v_cache,
    torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
    torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens, int64_t num_decodes,
    torch::Tensor ln1, torch::Tensor ln2, double eps, torch::Tensor qkv, c10::optional<torch::Tensor> qkv_bias,
    torch::Tensor o, c10::optional<torch::Tensor> o_bias, torch::Tensor gate_up, torch::Tensor down,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double scale,
    int64_t window);

// cpu_parallel.cpp
torch::Tensor shares_trace(int64_t n, bool hold_caller);

// cpu_prefill.cpp
bool prefill_supported(at::ScalarType dtype, int64_t head_dim);
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                   torch::Tensor starts, torch::Tensor seq_lens, torch::Tensor out, double scale, int64_t window);
