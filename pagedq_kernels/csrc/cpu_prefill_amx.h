// The bf16 prefill attention's block of 64 keys on AMX tiles (cpu_amx.h), for head sizes that are a multiple
// of 64. Included by cpu_prefill.cpp inside its namespace, after Args, Work, pack_k and pack_v.
//
// A prompt's attention is most of its prefill time at a few thousand tokens: with the vector kernel, a
// 3,000-token SmolLM2 prompt took 2.7 s, about 0.35 s of it in the projections. The packed blocks of
// cpu_prefill.cpp are already the tiles' right operands: pack_k's panels of 16 keys hold pairs of dims
// (S = Q K^T, 32 dims a step), pack_v's panels of 16 dims hold pairs of keys (O += P V, 32 keys a step). The
// task's query rows are copied once into a contiguous buffer (tiles load rows at one stride), 16 rows make
// a group: 4 tiles of scores (64 keys), the online softmax of cpu_prefill.cpp's row_tile in fp32 on them,
// P rounded to bf16, then P V for 64 dims at a time into 4 fresh tiles, added to O after O's rescaling.
// On a 2-core Xeon the 3,000-token prompt's prefill went from 2.7 s to 1.5 s; most of what is left is the
// softmax's e^x (one per query row and key), not the products. Longer tasks (192, 384 rows against 96),
// which pack each block of keys for more rows, changed nothing.
#pragma once

#ifdef PAGEDQ_AMX

constexpr int64_t kAmxGroup = 16;  // query rows per tile

inline bool prefill_amx(int64_t D) { return D % 64 == 0 && pagedq_amx::tiles_permitted(); }

// The task's query rows into w.qc, `rows` of them then zero rows up to a multiple of 16.
inline void gather_queries(Work<at::BFloat16>& w, int64_t rows, int64_t D) {
  const int64_t padded = (rows + kAmxGroup - 1) / kAmxGroup * kAmxGroup;
  if (static_cast<int64_t>(w.qc.size()) < padded * D) w.qc.resize(padded * D);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(w.qrows[r], D, w.qc.data() + r * D);
  std::fill(w.qc.begin() + rows * D, w.qc.begin() + padded * D, at::BFloat16(0));
}

// out [16][64] fp32 = A x B for 16 rows of A (lda_bytes apart) and 4 packed panels of B (`panel` elements
// apart), over `steps` steps of 32 along the sum: A's step s at a + 32 s, each panel's at + 512 s (16 rows of
// 64 bytes: pairs of the summed dimension, 16 columns).
inline void amx_four_panels(const at::BFloat16* a, int64_t lda_bytes, const at::BFloat16* b, int64_t panel,
                            int64_t steps, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const at::BFloat16* bs = b + 512 * s;
    _tile_loadd(4, a + 32 * s, lda_bytes);
    _tile_loadd(5, bs, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, bs + panel, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, bs + 2 * panel, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, bs + 3 * panel, 64);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, out, 256);
  _tile_stored(1, out + 16, 256);
  _tile_stored(2, out + 32, 256);
  _tile_stored(3, out + 48, 256);
}

// Scores of 16 query rows (from q, D apart) against the packed block: s [16][64]. pack_k's panels of 16 keys
// hold D / 2 rows of dim pairs each.
inline void amx_scores(const at::BFloat16* q, const at::BFloat16* kp, int64_t D, float* s) {
  amx_four_panels(q, D * 2, kp, D * 16, D / 32, s);
}

// P [16][64] bf16 times dims [c0, c0 + 64) of the packed V block: pv [16][64]. pack_v's panels of 16 dims hold
// kKeys / 2 rows of key pairs each.
inline void amx_pv(const at::BFloat16* p, const at::BFloat16* vp, int64_t c0, float* pv) {
  amx_four_panels(p, kKeys * 2, vp + c0 / 16 * kKeys * 16, kKeys * 16, kKeys / 32, pv);
}

// Rows [0, rows) of a task against the packed block of keys k0 .. k0 + nk - 1, 16 rows at a time.
inline void amx_block(const Args<at::BFloat16>& a, Work<at::BFloat16>& w, int64_t rows, int64_t k0, int64_t nk) {
  using T = at::BFloat16;
  const int64_t D = a.D;
  alignas(64) float s[kAmxGroup * kKeys];
  alignas(64) float pv[kAmxGroup * kKeys];
  alignas(64) T p[kAmxGroup * kKeys];
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 scale = _mm512_set1_ps(a.scale), neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  pagedq_amx::load_tile_config();
  for (int64_t g0 = 0; g0 < rows; g0 += kAmxGroup) {
    const int64_t n = std::min(kAmxGroup, rows - g0);
    if (w.qpos[g0 + n - 1] < k0) continue;  // sees none of these keys
    if (a.window > 0 && w.qpos[g0] - a.window >= k0 + nk - 1) continue;  // all of them left the window
    amx_scores(w.qc.data() + g0 * D, w.kp.data(), D, s);
    float alpha[kAmxGroup];
    for (int64_t r = 0; r < kAmxGroup; ++r) {  // the online softmax of row_tile, row by row
      T* pr = p + r * kKeys;
      if (r >= n) {
        std::fill_n(pr, kKeys, T(0));
        continue;
      }
      const int64_t qp = w.qpos[g0 + r];
      __mmask16 seen[4];
      __m512 sv[4], row_max = neg_inf;
      for (int j = 0; j < 4; ++j) {
        const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(k0 + 16 * j)));
        seen[j] = _mm512_cmple_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(qp)));
        if (a.window > 0)
          seen[j] &= _mm512_cmpgt_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(qp - a.window)));
        sv[j] = _mm512_mask_mov_ps(neg_inf, seen[j], _mm512_mul_ps(_mm512_load_ps(s + r * kKeys + 16 * j), scale));
        row_max = _mm512_max_ps(row_max, sv[j]);
      }
      const float old_max = w.m[g0 + r], new_max = std::max(old_max, _mm512_reduce_max_ps(row_max));
      if (new_max == -std::numeric_limits<float>::infinity()) {
        alpha[r] = 1.f;
        std::fill_n(pr, kKeys, T(0));
        continue;
      }
      alpha[r] = std::exp(old_max - new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        const __m512 e = _mm512_maskz_mov_ps(seen[j], pagedq_simd::exp512(_mm512_sub_ps(sv[j], _mm512_set1_ps(new_max))));
        sum = _mm512_add_ps(sum, e);
        Dot<T>::store(pr + 16 * j, 0xFFFF, e);
      }
      w.m[g0 + r] = new_max;
      w.l[g0 + r] = w.l[g0 + r] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
      amx_pv(p, w.vp.data(), c0, pv);
      for (int64_t r = 0; r < n; ++r) {
        float* o = w.o.data() + (g0 + r) * D + c0;
        const __m512 al = _mm512_set1_ps(alpha[r]);
        for (int j = 0; j < 4; ++j)
          _mm512_storeu_ps(o + 16 * j, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(o + 16 * j), al),
                                                     _mm512_load_ps(pv + r * kKeys + 16 * j)));
      }
    }
  }
}

#endif
