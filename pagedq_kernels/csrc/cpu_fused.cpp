// Fused layer ops on the CPU: RMSNorm (+ residual add), SiLU-and-mul, rotary embedding (+ KV-cache
// write). A decode step of a small model runs thousands of tiny torch ops, each costing a dispatch
// and a pass over memory; these do each group in one call and one pass.
//
// Each one replays the torch reference of pagedq_kernels/fused.py op by op in the tensor's dtype, rounding
// to it where torch does (`rnd`), so bf16 and fp16 results match it except where a sum is taken in
// another order (the RMSNorm mean) or a transcendental differs in its last bit (exp in SiLU). The
// library is built with -ffp-contract=off: a multiply-add is never fused into an FMA that torch's
// separate multiply and add would not do.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_avx512.h"
#include "cpu_vec.h"

namespace {

#ifdef PAGEDQ_AVX2
using namespace pagedq_vec;
#endif
#ifdef PAGEDQ_SIMD512
using pagedq_simd::exp512;
using pagedq_simd::load16;
using pagedq_simd::round16;
using pagedq_simd::store16;
#endif

template <typename T>
inline float rnd(float x) {  // x rounded to T, as torch stores an op's result in T
  return static_cast<float>(static_cast<T>(x));
}

// Rows per task: small steps stay on one thread (a parallel region costs more than their work).
inline int64_t grain(int64_t elems_per_row) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, elems_per_row)); }

template <typename T>
void rms_norm_rows(const torch::Tensor& x, const torch::Tensor* residual, const torch::Tensor& weight, double eps,
                   torch::Tensor& out, torch::Tensor* summed) {
  const int64_t rows = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = summed ? summed->data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0, os = out.stride(0);
  const int64_t ss = summed ? summed->stride(0) : 0;
  const float inv_h = 1.f / static_cast<float>(H), feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(H), [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t t = begin; t < end; ++t) {
      float acc = 0.f;
      int64_t i = 0;
#ifdef PAGEDQ_SIMD512
      __m512 vacc16 = _mm512_setzero_ps();
      for (; i + 16 <= H; i += 16) {
        __m512 v = load16(xp + t * xs + i);
        if (rp) {
          v = round16<T>(_mm512_add_ps(v, load16(rp + t * rs + i)));
          store16(sp + t * ss + i, v);
        }
        _mm512_storeu_ps(&row[i], v);
        vacc16 = _mm512_add_ps(vacc16, _mm512_mul_ps(v, v));
      }
      acc = _mm512_reduce_add_ps(vacc16);
#endif
#ifdef PAGEDQ_AVX2
      __m256 vacc = _mm256_setzero_ps();
      for (; i + 8 <= H; i += 8) {
        __m256 v = load8(xp + t * xs + i);
        if (rp) {
          v = round8<T>(_mm256_add_ps(v, load8(rp + t * rs + i)));
          store8(sp + t * ss + i, v);
        }
        _mm256_storeu_ps(&row[i], v);
        vacc = _mm256_add_ps(vacc, _mm256_mul_ps(v, v));
      }
      acc += hsum(vacc);
#endif
      for (; i < H; ++i) {
        float v = static_cast<float>(xp[t * xs + i]);
        if (rp) {
          v = rnd<T>(v + static_cast<float>(rp[t * rs + i]));  // x + residual, in T
          sp[t * ss + i] = static_cast<T>(v);
        }
        row[i] = v;
        acc += v * v;
      }
      const float inv = 1.f / std::sqrt(acc * inv_h + feps);  // rsqrt(mean(x^2) + eps), in fp32
      i = 0;
#ifdef PAGEDQ_SIMD512
      for (const __m512 vinv = _mm512_set1_ps(inv); i + 16 <= H; i += 16)
        store16(op + t * os + i, _mm512_mul_ps(load16(wp + i), round16<T>(_mm512_mul_ps(_mm512_loadu_ps(&row[i]), vinv))));
#endif
#ifdef PAGEDQ_AVX2
      const __m256 vinv = _mm256_set1_ps(inv);
      for (; i + 8 <= H; i += 8)
        store8(op + t * os + i, _mm256_mul_ps(load8(wp + i), round8<T>(_mm256_mul_ps(_mm256_loadu_ps(&row[i]), vinv))));
#endif
      for (; i < H; ++i) op[t * os + i] = static_cast<T>(static_cast<float>(wp[i]) * rnd<T>(row[i] * inv));
    }
  });
}

template <typename T>
void silu_mul_rows(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), N = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain(2 * N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = xp + t * xs;
      const T* up = gate + N;
      int64_t i = 0;
#ifdef PAGEDQ_SIMD512
      for (const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps(); i + 16 <= N; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 silu = round16<T>(_mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(zero, g)))));
        store16(op + t * os + i, _mm512_mul_ps(silu, load16(up + i)));
      }
#endif
#ifdef PAGEDQ_AVX2
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; i + 8 <= N; i += 8) {
        const __m256 g = load8(gate + i);
        const __m256 silu = round8<T>(_mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, g)))));
        store8(op + t * os + i, _mm256_mul_ps(silu, load8(up + i)));
      }
#endif
      for (; i < N; ++i) {
        const float g = static_cast<float>(gate[i]);
        op[t * os + i] = static_cast<T>(rnd<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
      }
    }
  });
}

// x[0:D] of one head rotated in place: transformers' x * cos + rotate_half(x) * sin, each product and
// the sum rounded to T; c and s are this position's tables, already rounded to T.
template <typename T>
inline void rotate_head(T* x, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  int64_t d = 0;
#ifdef PAGEDQ_SIMD512
  for (const __m512 zero = _mm512_setzero_ps(); d + 16 <= half; d += 16) {
    const __m512 x1 = load16(x + d), x2 = load16(x + d + half);
    const __m512 lo = _mm512_add_ps(round16<T>(_mm512_mul_ps(x1, _mm512_loadu_ps(c + d))),
                                    round16<T>(_mm512_mul_ps(_mm512_sub_ps(zero, x2), _mm512_loadu_ps(s + d))));
    const __m512 hi = _mm512_add_ps(round16<T>(_mm512_mul_ps(x2, _mm512_loadu_ps(c + d + half))),
                                    round16<T>(_mm512_mul_ps(x1, _mm512_loadu_ps(s + d + half))));
    store16(x + d, lo);
    store16(x + d + half, hi);
  }
#endif
#ifdef PAGEDQ_AVX2
  const __m256 zero = _mm256_setzero_ps();
  for (; d + 8 <= half; d += 8) {
    const __m256 x1 = load8(x + d), x2 = load8(x + d + half);
    const __m256 lo = _mm256_add_ps(round8<T>(_mm256_mul_ps(x1, _mm256_loadu_ps(c + d))),
                                    round8<T>(_mm256_mul_ps(_mm256_sub_ps(zero, x2), _mm256_loadu_ps(s + d))));
    const __m256 hi = _mm256_add_ps(round8<T>(_mm256_mul_ps(x2, _mm256_loadu_ps(c + d + half))),
                                    round8<T>(_mm256_mul_ps(x1, _mm256_loadu_ps(s + d + half))));
    store8(x + d, lo);
    store8(x + d + half, hi);
  }
#endif
  for (; d < half; ++d) {
    const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + half]);
    const float lo = rnd<T>(rnd<T>(x1 * c[d]) + rnd<T>(-x2 * s[d]));
    const float hi = rnd<T>(rnd<T>(x2 * c[d + half]) + rnd<T>(x1 * s[d + half]));
    x[d] = static_cast<T>(lo);
    x[d + half] = static_cast<T>(hi);
  }
}

template <typename T>
void rotary_rows(const torch::Tensor& positions, torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos,
                 const torch::Tensor& sin, const torch::Tensor* v, torch::Tensor* k_cache, torch::Tensor* v_cache,
                 const torch::Tensor* slots) {
  const int64_t tokens = q.size(0), Hq = q.size(1), Hkv = k.size(1), D = q.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* vp = v ? v->data_ptr<T>() : nullptr;
  const int64_t* slot = slots ? slots->data_ptr<int64_t>() : nullptr;
  T* kc = k_cache ? k_cache->data_ptr<T>() : nullptr;
  T* vc = v_cache ? v_cache->data_ptr<T>() : nullptr;
  const int64_t BS = k_cache ? k_cache->size(1) : 0;
  const int64_t cb = k_cache ? k_cache->stride(0) : 0, cs = k_cache ? k_cache->stride(1) : 0;
  const int64_t ch = k_cache ? k_cache->stride(2) : 0;
  const int64_t db = v_cache ? v_cache->stride(0) : 0, ds = v_cache ? v_cache->stride(1) : 0;
  const int64_t dh = v_cache ? v_cache->stride(2) : 0;
  const int64_t q_t = q.stride(0), q_h = q.stride(1), k_t = k.stride(0), k_h = k.stride(1);
  const int64_t v_t = v ? v->stride(0) : 0, v_h = v ? v->stride(1) : 0;
  const int64_t table_row = cos.stride(0);
  for (int64_t t = 0; t < tokens; ++t) {  // what indexing would refuse, refused before any write
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_write_kv: position ", pos[t], " outside the tables");
    TORCH_CHECK(!slot || slot[t] < k_cache->size(0) * BS, "rotary_write_kv: slot ", slot[t], " outside the cache");
  }
  at::parallel_for(0, tokens, grain((Hq + 2 * Hkv) * D), [&](int64_t begin, int64_t end) {
    std::vector<float> c(D), s(D);
    for (int64_t t = begin; t < end; ++t) {
      int64_t d = 0;
#ifdef PAGEDQ_AVX2
      for (; d + 8 <= D; d += 8) {  // cos[positions].to(T), sin[positions].to(T)
        _mm256_storeu_ps(&c[d], round8<T>(_mm256_loadu_ps(cp + pos[t] * table_row + d)));
        _mm256_storeu_ps(&s[d], round8<T>(_mm256_loadu_ps(sp + pos[t] * table_row + d)));
      }
#endif
      for (; d < D; ++d) {
        c[d] = rnd<T>(cp[pos[t] * table_row + d]);
        s[d] = rnd<T>(sp[pos[t] * table_row + d]);
      }
      for (int64_t h = 0; h < Hq; ++h) rotate_head(qp + t * q_t + h * q_h, c.data(), s.data(), D);
      for (int64_t h = 0; h < Hkv; ++h) rotate_head(kp + t * k_t + h * k_h, c.data(), s.data(), D);
      if (!kc || slot[t] < 0) continue;
      const int64_t block = slot[t] / BS, offset = slot[t] % BS;
      for (int64_t h = 0; h < Hkv; ++h) {
        std::copy_n(kp + t * k_t + h * k_h, D, kc + block * cb + offset * cs + h * ch);
        std::copy_n(vp + t * v_t + h * v_h, D, vc + block * db + offset * ds + h * dh);
      }
    }
  });
}

#define PAGEDQ_DISPATCH(dtype, name, ...)                                          \
  switch (dtype) {                                                                \
    case at::kFloat: { using T = float; __VA_ARGS__; break; }                      \
    case at::kBFloat16: { using T = at::BFloat16; __VA_ARGS__; break; }            \
    case at::kHalf: { using T = at::Half; __VA_ARGS__; break; }                    \
    default: TORCH_CHECK(false, name ": float32, bfloat16 or float16 only");      \
  }

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": expects a [rows, n] tensor with unit stride on n");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "rms_norm: weight of x's dtype");
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  PAGEDQ_DISPATCH(x.scalar_type(), "rms_norm", rms_norm_rows<T>(x, nullptr, weight, eps, out, nullptr));
  return out;
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual of x's shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "add_rms_norm: weight of x's dtype");
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  auto summed = torch::empty_like(x, at::MemoryFormat::Contiguous);
  PAGEDQ_DISPATCH(x.scalar_type(), "add_rms_norm", rms_norm_rows<T>(x, &residual, weight, eps, out, &summed));
  return {out, summed};
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dim holds [gate | up]");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  PAGEDQ_DISPATCH(x.scalar_type(), "silu_and_mul", silu_mul_rows<T>(x, out));
  return out;
}

void rotary_write_kv(torch::Tensor positions, torch::Tensor q, torch::Tensor k, c10::optional<torch::Tensor> v,
                     torch::Tensor cos, torch::Tensor sin, c10::optional<torch::Tensor> k_cache,
                     c10::optional<torch::Tensor> v_cache, c10::optional<torch::Tensor> slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) == k.size(2) &&
                  q.size(2) % 2 == 0 && k.scalar_type() == q.scalar_type(),
              "rotary_write_kv: q [T, Hq, D] and k [T, Hkv, D] of one dtype, unit stride on an even D");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rotary_write_kv: int64 positions");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.strides() == cos.strides() && cos.stride(1) == 1 &&
                  cos.size(1) == q.size(2),
              "rotary_write_kv: fp32 cos/sin tables [positions, D]");
  const bool write = k_cache.has_value();
  if (write) {
    TORCH_CHECK(v.has_value() && v_cache.has_value() && slot_mapping.has_value(), "rotary_write_kv: v, caches, slots");
    TORCH_CHECK(k_cache->scalar_type() == q.scalar_type() && v_cache->scalar_type() == q.scalar_type() &&
                    v->scalar_type() == q.scalar_type() && k_cache->stride(3) == 1 && v_cache->stride(3) == 1 &&
                    v->stride(2) == 1,
                "rotary_write_kv: caches [blocks, block_size, Hkv, D] of q's dtype");
    TORCH_CHECK(slot_mapping->scalar_type() == at::kLong && slot_mapping->is_contiguous(),
                "rotary_write_kv: int64 slot_mapping");
  }
  PAGEDQ_DISPATCH(q.scalar_type(), "rotary_write_kv",
                  rotary_rows<T>(positions, q, k, cos, sin, write ? &*v : nullptr, write ? &*k_cache : nullptr,
                                 write ? &*v_cache : nullptr, write ? &*slot_mapping : nullptr));
}
