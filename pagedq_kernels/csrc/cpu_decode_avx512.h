// The AVX-512 path of the CPU decode attention (cpu_decode.cpp), for head sizes that are a multiple of 16.
//
// The AVX2 path stages eight widened K (or V) rows in a buffer and sums each score with a horizontal
// add: on a bf16 cache most of its instructions are conversions and shuffles, and it runs far below the
// memory's bandwidth. Here, per query head:
//   - scores: 16 positions at a time, one fp32 accumulator of 16 lanes each, the partial sums of the
//     16 folded into one vector of 16 scores by a transpose-and-add tree (sum16). bf16 caches multiply
//     in hardware where the CPU has avx512_bf16 (vdpbf16ps: bf16 products, fp32 sums); other dtypes
//     widen to fp32 in registers;
//   - the softmax: 16 lanes at a time (the max, e^x, the sum and the scaling);
//   - the weighted sum of V: up to 4 x 16 lanes of the output of every query head that shares the KV
//     head at once (at most 32 sums in registers), each V line widened once and used by all of them.
// Rows are found through a per-request table of row pointers, built once per block (no division per
// position). Sums run in fp32 in a different order than the AVX2 path: same values to rounding.
#pragma once

#include "cpu_avx512.h"
#include "cpu_vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(PAGEDQ_AVX2)
#define PAGEDQ_AVX512 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace pagedq_avx512 {

constexpr int64_t kMaxHeadDim = 256;

using pagedq_simd::load16;

// The lane sums of a[0..15], in order, as one vector: pairs, then quads, then 128-bit halves, then lanes.
inline __m512 sum16(const __m512* a) {
  __m512 s2[8], s4[4], s8[2];
  for (int j = 0; j < 8; ++j)
    s2[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(s2[2 * j]), y = _mm512_castps_pd(s2[2 * j + 1]);
    s4[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int j = 0; j < 2; ++j)
    s8[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * j], s4[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s4[2 * j], s4[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s8[0], s8[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s8[0], s8[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __mmask16 first_lanes(int64_t m) { return static_cast<__mmask16>((1u << m) - 1u); }

// q . k for 16 positions (fewer at the end: m), k rows at rows[j] + off; q as fp32 chunks of 16.
template <typename T>
inline __m512 dots16(const T* const* rows, int64_t off, int64_t m, const __m512* q, int64_t chunks) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
    if (j < m)
      for (int64_t c = 0; c < chunks; ++c) acc[j] = _mm512_fmadd_ps(q[c], load16(rows[j] + off + 16 * c), acc[j]);
  }
  return sum16(acc);
}

#ifdef __AVX512BF16__
// The same for bf16 rows and a bf16 query, in hardware: 32 products per instruction, summed in fp32.
// A head size of 16 mod 32 ends in a half chunk, zero-extended on both sides.
inline __m512bh bf16x32(const at::BFloat16* p, bool half) {
  const __m512i v = half ? _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
                         : _mm512_loadu_si512(p);
  return reinterpret_cast<const __m512bh&>(v);
}

inline __m512 dots16_bf16(const at::BFloat16* const* rows, int64_t off, int64_t m, const __m512bh* q, int64_t D) {
  const int64_t full = D / 32;
  const bool tail = D % 32 != 0;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
    if (j < m) {
      const at::BFloat16* k = rows[j] + off;
      for (int64_t c = 0; c < full; ++c) acc[j] = _mm512_dpbf16_ps(acc[j], q[c], bf16x32(k + 32 * c, false));
      if (tail) acc[j] = _mm512_dpbf16_ps(acc[j], q[full], bf16x32(k + 32 * full, true));
    }
  }
  return sum16(acc);
}
#endif

// acc[g * stride + 16 c ..] += sum_i p[g * n + i] * v_i[col + 16 c ..] over the m positions of a tile, for
// the H query heads that share one KV head and C 16-lane columns (V rows at rows[i] + col): H x C sums
// in registers, each V line widened once and used by every head. H x C independent chains keep the FMA
// units busy (with one column at a time, each head's sum waited on its previous FMA).
template <typename T, int H, int C>
inline void weighted16(const T* const* rows, int64_t col, int64_t m, const float* p, int64_t n, float* acc,
                       int64_t stride) {
  __m512 a[H][C];
  for (int g = 0; g < H; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * stride + 16 * c);
  for (int64_t i = 0; i < m; ++i) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(rows[i] + col + 16 * c);
    for (int g = 0; g < H; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * n + i]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pg, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < H; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * stride + 16 * c, a[g][c]);
}

// All `chunks` 16-lane columns from col on: four at a time for up to 4 heads, two for more (at most 8).
template <typename T, int H>
inline void weighted16_columns(const T* const* rows, int64_t col, int64_t chunks, int64_t m, const float* p,
                               int64_t n, float* acc, int64_t stride) {
  constexpr int C = H <= 4 ? 4 : 2;
  int64_t c = 0;
  for (; c + C <= chunks; c += C) weighted16<T, H, C>(rows, col + 16 * c, m, p, n, acc + 16 * c, stride);
  for (; c < chunks; ++c) weighted16<T, H, 1>(rows, col + 16 * c, m, p, n, acc + 16 * c, stride);
}

// f(std::integral_constant<int, H>) for H = heads, 1 to 8 (more are taken 8 at a time by the caller).
template <typename F>
inline void with_heads(int heads, F&& f) {
  switch (heads) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

#ifdef __AVX512BF16__
// The same sums for a bf16 cache in hardware: two positions per vdpbf16ps. Each 16-lane column of V
// rows i and i + 1 is interleaved into (v_i, v_i+1) pairs and multiplied by the pair (p_i, p_i+1),
// rounded to bf16 (`pairs`: each head's weights as bf16, `n2` apart, zero past the last position; the
// row after an odd tile's last is `zero`). About half the instructions of widening V to fp32.
template <int H, int C>
inline void weighted_pairs(const at::BFloat16* const* rows, int64_t col, int64_t m, const at::BFloat16* pairs,
                           int64_t n2, float* acc, int64_t stride, const at::BFloat16* zero) {
  alignas(64) static constexpr int16_t kInterleave[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                          8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i idx = _mm512_load_si512(kInterleave);
  __m512 a[H][C];
  for (int g = 0; g < H; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * stride + 16 * c);
  for (int64_t i = 0; i < m; i += 2) {
    const at::BFloat16* r0 = rows[i] + col;
    const at::BFloat16* r1 = i + 1 < m ? rows[i + 1] + col : zero;
    __m512i v[C];
    for (int c = 0; c < C; ++c)
      v[c] = _mm512_permutex2var_epi16(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 16 * c))), idx,
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 16 * c))));
    for (int g = 0; g < H; ++g) {
      int32_t pair;
      std::memcpy(&pair, pairs + g * n2 + i, sizeof(pair));
      const __m512bh pg = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], pg, (__m512bh)v[c]);
    }
  }
  for (int g = 0; g < H; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * stride + 16 * c, a[g][c]);
}

template <int H>
inline void weighted_pairs_columns(const at::BFloat16* const* rows, int64_t col, int64_t chunks, int64_t m,
                                   const at::BFloat16* pairs, int64_t n2, float* acc, int64_t stride,
                                   const at::BFloat16* zero) {
  constexpr int C = H <= 4 ? 4 : 2;
  int64_t c = 0;
  for (; c + C <= chunks; c += C) weighted_pairs<H, C>(rows, col + 16 * c, m, pairs, n2, acc + 16 * c, stride, zero);
  for (; c < chunks; ++c) weighted_pairs<H, 1>(rows, col + 16 * c, m, pairs, n2, acc + 16 * c, stride, zero);
}
#endif

// s[i] = exp(s[i] - max) / sum over n scores, in place, 16 lanes at a time.
inline void softmax16(float* s, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16)
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, first_lanes(std::min<int64_t>(16, n - i)), s + i));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = first_lanes(std::min<int64_t>(16, n - i));
    const __m512 e = _mm512_maskz_mov_ps(k, pagedq_simd::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), m)));
    _mm512_mask_storeu_ps(s + i, k, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = first_lanes(std::min<int64_t>(16, n - i));
    _mm512_mask_storeu_ps(s + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + i), inv));
  }
}

// Per-thread buffers, reused from request to request.
template <typename T>
struct Scratch {
  std::vector<const T*> k_rows, v_rows;
  std::vector<float> scores, acc;
  std::vector<at::BFloat16> pairs;  // the weights in bf16, for a bf16 cache's V sum in hardware
  std::vector<at::BFloat16> zero = std::vector<at::BFloat16>(kMaxHeadDim);
};

// Pointers to the K and V rows of positions first .. first + n - 1, one block at a time.
template <typename R, typename T>
void find_rows(const R& r, Scratch<T>& s) {
  s.k_rows.resize(r.n);
  s.v_rows.resize(r.n);
  for (int64_t i = 0, pos = r.first; i < r.n;) {
    const int64_t off = pos % r.block_size, m = std::min(r.block_size - off, r.n - i);
    const int64_t base = r.table[pos / r.block_size] * r.c_blk + off * r.c_pos;
    for (int64_t t = 0; t < m; ++t) {
      s.k_rows[i + t] = r.k + base + t * r.c_pos;
      s.v_rows[i + t] = r.v + base + t * r.c_pos;
    }
    i += m;
    pos += m;
  }
}

// Positions are taken a tile at a time, every head over one tile before the next: the tile's rows are
// read from memory once, whole, and the passes of the heads and 16-lane columns over them hit the cache.
// While a tile is scored, the next tile's K rows and this tile's V rows are prefetched; while V is summed,
// the next request's K rows (and its first V rows).
constexpr int64_t kTile = 64;

// Asks for the rows of positions i0 .. i0 + m - 1 to be brought into the cache: a tile ahead, so that
// the memory reads of the next tile overlap the arithmetic of this one (the rows of a request are spread
// over blocks, which the hardware prefetcher does not follow).
template <int Hint, typename T>
inline void prefetch_line_run(const T* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, static_cast<_mm_hint>(Hint));
}

// V rows of the next request to prefetch with all of its K (the rest would crowd L2 for long requests).
// An A/B on SmolLM2's heads, bf16, rows from memory: K alone gave 1.18-1.20x over its first tile at 64
// requests of 165 and 300 positions; adding V up to 512 positions gave another 1.08-1.09x at 16 and 64 x 165.
constexpr int64_t kNextV = 512;

template <int Hint = _MM_HINT_T0, typename T>
inline void prefetch_rows(const T* const* rows, int64_t i0, int64_t m, int64_t col, int64_t bytes) {
  for (int64_t i = i0; i < i0 + m; ++i) prefetch_line_run<Hint>(rows[i] + col, bytes);
}

// The scaled scores of query head hq over the positions i0 .. i0 + m - 1.
template <typename T>
inline void score_tile(const Scratch<T>& s, const T* qh, int64_t off, float scale, int64_t D, int64_t i0, int64_t m,
                       float* sc) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    __m512bh qv[kMaxHeadDim / 32];
    for (int64_t c = 0; c * 32 < D; ++c) qv[c] = bf16x32(qh + 32 * c, D - 32 * c < 32);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t i = i0; i < i0 + m; i += 16) {
      const int64_t k = std::min<int64_t>(16, i0 + m - i);
      const __m512 d = dots16_bf16(s.k_rows.data() + i, off, k, qv, D);
      _mm512_mask_storeu_ps(sc + i, first_lanes(k), _mm512_mul_ps(d, vscale));
    }
    return;
  }
#endif
  __m512 qv[kMaxHeadDim / 16];
  for (int64_t c = 0; c < D / 16; ++c) qv[c] = _mm512_mul_ps(load16(qh + 16 * c), _mm512_set1_ps(scale));
  for (int64_t i = i0; i < i0 + m; i += 16) {
    const int64_t k = std::min<int64_t>(16, i0 + m - i);
    _mm512_mask_storeu_ps(sc + i, first_lanes(k), dots16(s.k_rows.data() + i, off, k, qv, D / 16));
  }
}

// One request: q [Hq, D] (row stride q_h) against its visible positions, into o [Hq, D] (row stride o_h),
// for the query heads of KV heads h0 .. h1 - 1 (all of them, or one when a few requests share the threads).
template <typename R, typename T>
void decode_one(const R& r, const T* q, int64_t q_h, float scale, int64_t Hq, int64_t Hkv, int64_t D, T* o,
                int64_t o_h, Scratch<T>& s, int64_t h0, int64_t h1, const R* next = nullptr) {
  const int64_t G = Hq / Hkv, n = r.n;
  find_rows(r, s);
  s.scores.resize(Hq * n);
  const int64_t col = h0 * D, bytes = (h1 - h0) * D * static_cast<int64_t>(sizeof(T));
  prefetch_rows(s.k_rows.data(), 0, std::min(kTile, n), col, bytes);
  for (int64_t i0 = 0; i0 < n; i0 += kTile) {
    prefetch_rows(s.k_rows.data(), i0 + kTile, std::min(kTile, n - i0 - kTile), col, bytes);
    prefetch_rows<_MM_HINT_T1>(s.v_rows.data(), i0, std::min(kTile, n - i0), col, bytes);
    for (int64_t hq = h0 * G; hq < h1 * G; ++hq)
      score_tile(s, q + hq * q_h, (hq / G) * D, scale, D, i0, std::min(kTile, n - i0), s.scores.data() + hq * n);
  }
  for (int64_t hq = h0 * G; hq < h1 * G; ++hq) softmax16(s.scores.data() + hq * n, n);
  s.acc.assign(Hq * D, 0.f);
  if (next != nullptr)  // the next request's K rows, and its first kNextV V rows, come into L2 meanwhile
    for (int64_t i = 0; i < next->n; ++i) {
      prefetch_line_run<_MM_HINT_T1>(next->row(next->k, next->first + i) + col, bytes);
      if (i < kNextV) prefetch_line_run<_MM_HINT_T1>(next->row(next->v, next->first + i) + col, bytes);
    }
#ifdef __AVX512BF16__
  constexpr bool in_pairs = std::is_same_v<T, at::BFloat16>;
  const int64_t n2 = (n + 1) / 2 * 2;
  if constexpr (in_pairs) {
    s.pairs.resize(Hq * n2);
    for (int64_t hq = h0 * G; hq < h1 * G; ++hq) {
      const float* p = s.scores.data() + hq * n;
      at::BFloat16* out = s.pairs.data() + hq * n2;
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = first_lanes(std::min<int64_t>(16, n - i));
        _mm256_mask_storeu_epi16(out + i, k, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, p + i)));
      }
      out[n2 - 1] = n2 > n ? at::BFloat16(0.f) : out[n2 - 1];
    }
  }
#endif
  prefetch_rows(s.v_rows.data(), 0, std::min(kTile, n), col, bytes);
  for (int64_t i0 = 0; i0 < n; i0 += kTile) {
    const int64_t m = std::min(kTile, n - i0);
    prefetch_rows(s.v_rows.data(), i0 + kTile, std::min(kTile, n - i0 - kTile), col, bytes);
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t g0 = 0; g0 < G; g0 += 8) {
        const int64_t hq0 = h * G + g0;
        with_heads(static_cast<int>(std::min<int64_t>(8, G - g0)), [&](auto heads) {
          constexpr int H = decltype(heads)::value;
#ifdef __AVX512BF16__
          if constexpr (in_pairs) {
            weighted_pairs_columns<H>(s.v_rows.data() + i0, h * D, D / 16, m, s.pairs.data() + hq0 * n2 + i0, n2,
                                      s.acc.data() + hq0 * D, D, s.zero.data());
            return;
          }
#endif
          weighted16_columns<T, H>(s.v_rows.data() + i0, h * D, D / 16, m, s.scores.data() + hq0 * n + i0, n,
                                   s.acc.data() + hq0 * D, D);
        });
      }
  }
  for (int64_t hq = h0 * G; hq < h1 * G; ++hq)
    for (int64_t d = 0; d < D; ++d) o[hq * o_h + d] = static_cast<T>(s.acc[hq * D + d]);
}

}  // namespace pagedq_avx512
#endif
