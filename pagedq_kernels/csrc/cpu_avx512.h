// AVX-512 pieces shared by the CPU GEMM (cpu_gemm.cpp) and the prefill attention (cpu_prefill.cpp):
// one step of a dot product into 16 fp32 sums (FMA for fp32; vdpbf16ps for a pair of bf16, where the
// CPU has avx512_bf16), a tile of such steps over packed panels, and e^x on 16 lanes.
//
// Also 16 lanes of float / bfloat16 / float16 loaded as fp32, rounded to the type (nearest even) and
// stored back, for the fused layer ops (cpu_fused.cpp) and the decode attention.
//
// A "panel" is 16 output columns laid out as one 64-byte line per step: 16 fp32 values, or 16 pairs of
// bf16 (the two elements of the sum's step side by side, as vdpbf16ps takes them).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDQ_GEMM_FP32 1
#define PAGEDQ_SIMD512 1
#if defined(__AVX512BF16__)
#define PAGEDQ_GEMM_BF16 1
#endif
#endif

namespace pagedq_simd {
// Whether the GEMM's dot step (and so the GEMM and the prefill attention) was built for this dtype here.
inline bool built_for(at::ScalarType t) {
#ifdef PAGEDQ_GEMM_BF16
  if (t == at::kBFloat16) return true;
#endif
#ifdef PAGEDQ_GEMM_FP32
  if (t == at::kFloat) return true;
#endif
  return false;
}
}  // namespace pagedq_simd

#ifdef PAGEDQ_GEMM_FP32
namespace pagedq_simd {

template <typename T>
struct Dot;

template <>
struct Dot<float> {
  static constexpr int64_t kPerStep = 1;  // elements of x per step
  static __m512 broadcast(const float* x, int64_t step) { return _mm512_set1_ps(x[step]); }
  static __m512 madd(__m512 acc, __m512 xb, __m512i w) { return _mm512_fmadd_ps(xb, _mm512_castsi512_ps(w), acc); }
  static void store(float* y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }
};

#ifdef PAGEDQ_GEMM_BF16
template <>
struct Dot<at::BFloat16> {
  static constexpr int64_t kPerStep = 2;
  static __m512 broadcast(const at::BFloat16* x, int64_t step) {
    int32_t pair;  // x[2 step], x[2 step + 1]
    std::memcpy(&pair, x + 2 * step, sizeof(pair));
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static __m512 madd(__m512 acc, __m512 xb, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(xb), (__m512bh)w);
  }
  static void store(at::BFloat16* y, __mmask16 mask, __m512 v) {  // rounded to nearest even
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
};
#endif

// acc[r][j] += sum over `steps` of row r of x times panel j, for R rows (x[r]: each row's first
// element) and P panels (`panel_stride` elements apart in w).
template <typename T, int R, int P>
inline void dot_tile(const T* const* x, const T* w, int64_t panel_stride, int64_t steps, __m512 (&acc)[R][P]) {
  constexpr int64_t line = 64 / sizeof(T);
  for (int64_t s = 0; s < steps; ++s) {
    __m512i wv[P];
    for (int j = 0; j < P; ++j) wv[j] = _mm512_loadu_si512(w + j * panel_stride + s * line);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = Dot<T>::broadcast(x[r], s);
      for (int j = 0; j < P; ++j) acc[r][j] = Dot<T>::madd(acc[r][j], xb, wv[j]);
    }
  }
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// fp32 lanes rounded to bfloat16 (nearest even; NaN payloads are not preserved), as fp32 bit patterns
// with the low 16 bits still to be cleared or shifted out.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits16(v), 16)));
}
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// v rounded to T and widened again: what torch holds after an op whose result is stored in T.
template <typename T>
inline __m512 round16(__m512 v);
template <>
inline __m512 round16<float>(__m512 v) { return v; }
template <>
inline __m512 round16<at::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits16(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
template <>
inline __m512 round16<at::Half>(__m512 v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }

// e^x on 16 lanes, clamped to [-87, 88] (e^-inf gives e^-87, about 1.6e-38: mask such lanes out):
// the Cephes polynomial of cpu_vec.h's exp256, ~1e-7 relative error.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

}  // namespace pagedq_simd
#endif
