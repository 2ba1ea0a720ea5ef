// Decode attention over the paged KV cache on the CPU: one query token per request.
//
// One request at a time per thread: its K and V rows are read straight from the cache blocks,
// once, all KV heads of a position together (one contiguous row of Hkv x D), scored against every
// query head, and the softmax-weighted V rows are accumulated, in fp32. There is no gather copy:
// each K and V row is read from the cache once.
// AVX-512 where the compiler targets it and the head size is a multiple of 16 (cpu_decode_avx512.h);
// else AVX2 + FMA + F16C when the compiler targets them (cpu_vec.h); plain C++ otherwise.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_decode_avx512.h"
#include "cpu_parallel.h"
#include "cpu_ops.h"
#include "cpu_vec.h"

using pagedq_vec::softmax;

namespace {

inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDQ_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void widen(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDQ_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDQ_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += p * x[i];
}

#ifdef PAGEDQ_AVX2
// The horizontal sums of a[0..7], in order, as one vector.
inline __m256 hsum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

template <typename T>
struct Request {
  const T* k;  // the caches
  const T* v;
  const int32_t* table;  // its block table
  int64_t first, n;      // positions first .. first + n - 1 are visible
  int64_t block_size, c_blk, c_pos;
  const T* row(const T* base, int64_t pos) const {
    return base + table[pos / block_size] * c_blk + (pos % block_size) * c_pos;
  }
};

// scores[hq * n + i] = q[hq] . k[i, hq / G] for every query head hq and visible position i.
template <typename T>
void scores_of(const Request<T>& r, const float* qf, int64_t Hq, int64_t Hkv, int64_t D, float* scores,
               float* kbuf) {
  const int64_t G = Hq / Hkv, W = Hkv * D;
  int64_t i = 0;
#ifdef PAGEDQ_AVX2
  if (D % 8 == 0) {
    for (; i + 8 <= r.n; i += 8) {
      for (int64_t j = 0; j < 8; ++j) widen(r.row(r.k, r.first + i + j), kbuf + j * W, W);
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const float* q = qf + hq * D;
        const float* kh = kbuf + (hq / G) * D;
        __m256 acc[8];
        for (int64_t j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + d);
          for (int64_t j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kh + j * W + d), acc[j]);
        }
        _mm256_storeu_ps(scores + hq * r.n + i, hsum8(acc));
      }
    }
  }
#endif
  for (; i < r.n; ++i) {
    widen(r.row(r.k, r.first + i), kbuf, W);
    for (int64_t hq = 0; hq < Hq; ++hq) scores[hq * r.n + i] = dot(qf + hq * D, kbuf + (hq / G) * D, D);
  }
}

// acc[hq] = sum_i p[hq * n + i] * v[i, hq / G] for every query head hq.
template <typename T>
void weighted_sum(const Request<T>& r, const float* p, int64_t Hq, int64_t Hkv, int64_t D, float* acc, float* vbuf) {
  const int64_t G = Hq / Hkv, W = Hkv * D;
  int64_t i = 0;
#ifdef PAGEDQ_AVX2
  if (D % 8 == 0) {
    for (; i + 8 <= r.n; i += 8) {
      for (int64_t j = 0; j < 8; ++j) widen(r.row(r.v, r.first + i + j), vbuf + j * W, W);
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const float* vh = vbuf + (hq / G) * D;
        const float* ph = p + hq * r.n + i;
        __m256 pj[8];
        for (int64_t j = 0; j < 8; ++j) pj[j] = _mm256_set1_ps(ph[j]);
        for (int64_t d = 0; d < D; d += 8) {
          __m256 a = _mm256_loadu_ps(acc + hq * D + d);
          for (int64_t j = 0; j < 8; ++j) a = _mm256_fmadd_ps(pj[j], _mm256_loadu_ps(vh + j * W + d), a);
          _mm256_storeu_ps(acc + hq * D + d, a);
        }
      }
    }
  }
#endif
  for (; i < r.n; ++i) {
    widen(r.row(r.v, r.first + i), vbuf, W);
    for (int64_t hq = 0; hq < Hq; ++hq) axpy(p[hq * r.n + i], vbuf + (hq / G) * D, acc + hq * D, D);
  }
}

template <typename T>
void decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out, double scale,
            int64_t window) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv, W = Hkv * D;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int64_t q_b = q.stride(0), q_h = q.stride(1), o_b = out.stride(0), o_h = out.stride(1);
  const float fscale = static_cast<float>(scale);
  const auto request = [&](int64_t b) {  // request b's visible positions (the last `window`, if any)
    const int64_t len = sl[b], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    return Request<T>{k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), bt + b * block_tables.stride(0), first,
                      len - first, BS, k_cache.stride(0), k_cache.stride(1)};
  };

#ifdef PAGEDQ_AVX512
  const bool wide = D % 16 == 0 && D <= pagedq_avx512::kMaxHeadDim;
  if (wide && B < at::get_num_threads() && Hkv > 1) {
    // Fewer requests than threads: one task per (request, KV head), so a lone long request uses them all.
    pagedq_parallel::run_shares(
        pagedq_parallel::equal_bounds(B * Hkv), [] { return pagedq_avx512::Scratch<T>(); },
        [&](pagedq_avx512::Scratch<T>& scratch, int64_t t, int64_t) {
          const int64_t b = t / Hkv, h = t % Hkv;
          pagedq_avx512::decode_one(request(b), qp + b * q_b, q_h, fscale, Hq, Hkv, D, op + b * o_b, o_h, scratch,
                                    h, h + 1);
        });
    return;
  }
#endif
#ifdef PAGEDQ_AVX512
  if (wide) {
    pagedq_parallel::run_shares(
        pagedq_parallel::equal_bounds(B), [] { return pagedq_avx512::Scratch<T>(); },
        [&](pagedq_avx512::Scratch<T>& scratch, int64_t b, int64_t after) {
          const Request<T> next = request(after >= 0 ? after : b);  // its first rows are prefetched
          pagedq_avx512::decode_one(request(b), qp + b * q_b, q_h, fscale, Hq, Hkv, D, op + b * o_b, o_h, scratch,
                                    0, Hkv, after >= 0 ? &next : nullptr);
        });
    return;
  }
#endif
  struct Buffers {
    std::vector<float> qf, acc, kbuf, scores;
  };
  pagedq_parallel::run_shares(
      pagedq_parallel::equal_bounds(B),
      [&] { return Buffers{std::vector<float>(Hq * D), std::vector<float>(Hq * D), std::vector<float>(8 * W), {}}; },
      [&](Buffers& w, int64_t b, int64_t) {
        const Request<T> r = request(b);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          widen(qp + b * q_b + hq * q_h, &w.qf[hq * D], D);
          for (int64_t d = 0; d < D; ++d) w.qf[hq * D + d] *= fscale;
        }
        w.scores.resize(Hq * r.n);
        scores_of(r, w.qf.data(), Hq, Hkv, D, w.scores.data(), w.kbuf.data());
        for (int64_t hq = 0; hq < Hq; ++hq) softmax(&w.scores[hq * r.n], r.n);
        std::fill(w.acc.begin(), w.acc.end(), 0.f);
        weighted_sum(r, w.scores.data(), Hq, Hkv, D, w.acc.data(), w.kbuf.data());
        for (int64_t hq = 0; hq < Hq; ++hq) {
          T* o = op + b * o_b + hq * o_h;
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(w.acc[hq * D + d]);
        }
      });
}

}  // namespace

void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                  torch::Tensor seq_lens, torch::Tensor out, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.stride(2) == 1 && out.stride(2) == 1,
              "paged_decode: query/out must be [B, Hq, D] with unit stride on D");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) && k_cache.strides() == v_cache.strides(),
              "paged_decode: caches must be [blocks, block_size, Hkv, D] with contiguous rows");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode: block_tables and seq_lens must be int32");
  const auto bt = block_tables.contiguous();
  const auto sl = seq_lens.contiguous();
  switch (q.scalar_type()) {
    case at::kFloat: decode<float>(q, k_cache, v_cache, bt, sl, out, scale, window); break;
    case at::kBFloat16: decode<at::BFloat16>(q, k_cache, v_cache, bt, sl, out, scale, window); break;
    case at::kHalf: decode<at::Half>(q, k_cache, v_cache, bt, sl, out, scale, window); break;
    default: TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16 only");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL, as torch's own ops do: the worker's event loop (publishing, intake)
  // keeps running while the engine thread is inside a step's kernels.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV cache (one query token per request)", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm over the rows of a [rows, n] tensor", nogil);
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(x + residual), x + residual)", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for rows [gate | up]", nogil);
  m.def("rotary_write_kv", &rotary_write_kv, "rotate q and k in place; with caches, store k and v at their slots", nogil);
  m.def("paged_prefill", &paged_prefill, "prefill attention over the paged KV cache (the chunks after the decodes)", nogil);
  m.def(
      "prefill_supported", [](torch::Tensor t) { return prefill_supported(t.scalar_type(), t.size(-1)); },
      "whether paged_prefill takes a query of this dtype and head size here");
  m.def("gemm_dtypes", &gemm_dtypes, "the dtypes gemm_linear was built for (AVX-512: float32; avx512_bf16: bfloat16)");
  m.def("pack_gemm_weight", &pack_gemm_weight, "a [N, K] weight in gemm_linear's panel layout", nogil);
  m.def("gemm_int8_available", &gemm_int8_available, "whether gemm_linear takes int8 weights here (AVX-512)");
  m.def("pack_gemm_weight_int8", &pack_gemm_weight_int8, "int8 [N, K] and fp32 scales [N] in the int8 panel layout",
        nogil);
  m.def("greedy_argmax", &greedy_argmax, "each row's first maximum, as torch's max(dim=-1).indices", nogil);
  m.def("greedy_argmax_fast", &greedy_argmax_fast, "whether greedy_argmax has its vector path here (AVX-512)");
  m.def("decoder_layer", &decoder_layer, "one Llama-family decoder layer, the fused path's kernels called from C++", nogil);
  m.def("gemm_amx_available", &gemm_amx_available, "whether bf16 gemm_linear runs on AMX tiles from 4 rows up here");
  m.def("gemm_linear", &gemm_linear, "out = x @ W^T (+ bias) through a packed weight", nogil);
  m.def("shares_trace", &shares_trace, "how often, and on which thread, each item of the kernels' scheduler ran", nogil);
}
