// Prefill attention over the paged KV cache on the CPU (AVX-512): the chunks that follow a step's
// decodes, causal inside each chunk, full over its cached context (minus a sliding window).
//
// torch's scaled_dot_product_attention, called once per request on K and V gathered from the cache,
// ran SmolLM2's 146-token bf16 prompts at about 25 GFLOP/s on a 2-core EPYC. Here the cache is read
// in place and multiplied like the GEMM (cpu_gemm.cpp, with the same panels and tiles):
//   - a task is one KV head of one request over up to 96 query rows: each token's G query heads of
//     that KV head are consecutive rows of one matrix, so every K and V line serves all of them;
//   - keys come in blocks of 64. K is packed into 4 panels of 16 keys (a 16 x 16 transpose of 32-bit
//     words: one fp32 dim, or a pair of bf16 dims), V into panels of 16 dims (bf16: pairs of keys);
//   - scores S = Q K^T in tiles of 6 rows x 64 keys with the sums in registers, then an online softmax
//     in fp32 (a running max and sum per row, as flash attention), then O += P V, with O in fp32 until
//     the end. P is rounded to the dtype before that product, as torch's flash attention does in bf16;
//   - a row tile stops at the last key its last token sees; masked keys get P = 0.
// Threads take contiguous runs of tasks of about equal cost (rows x keys seen).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_avx512.h"
#include "cpu_parallel.h"

namespace {

constexpr int64_t kMaxHeadDim = 256;

#ifdef PAGEDQ_GEMM_FP32
using pagedq_simd::Dot;
using pagedq_simd::dot_tile;

constexpr int64_t kKeys = 64;      // keys per block: four panels of 16
constexpr int kTileRows = 6;
constexpr int64_t kTaskRows = 96;  // query rows per task (tokens x the KV head's query heads), at least G

template <typename T>
struct Args {
  const T* q;
  int64_t q_t, q_h;
  const T* k;
  const T* v;
  int64_t c_blk, c_pos, c_head;  // cache strides, K's and V's alike
  const int32_t* tables;
  int64_t bt;  // a block table's row stride
  const int32_t* starts;  // query_start_loc of these requests, [n + 1]
  const int32_t* lens;    // seq_lens, [n]
  T* o;
  int64_t o_t, o_h;
  int64_t G, D, BS, window;
  float scale;
  const T* zero;  // D zeros: the row of a key past the block's end
};

struct Task {
  int64_t req, head, t0, t1;  // tokens t0 .. t1 - 1 of the request's chunk
  int64_t lo, hi;             // the keys they see, positions lo .. hi - 1
};

// A 16 x 16 matrix of 32-bit words transposed in registers: unpack pairs, then quads, then 128-bit lanes.
inline void transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // b[4g + c], lane L: column 4L + c of rows 4g .. 4g + 3
    b[4 * g] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
    b[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
    b[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
    b[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i e1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i e2 = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i e3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
    r[c] = _mm512_shuffle_i32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + c] = _mm512_shuffle_i32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + c] = _mm512_shuffle_i32x4(e2, e3, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + c] = _mm512_shuffle_i32x4(e2, e3, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// K rows of 64 keys -> 4 panels [words][16 keys] of 32-bit words (`words` = D / Dot<T>::kPerStep).
template <typename T>
void pack_k(const T* const* rows, int64_t words, T* out) {
  auto* dst = reinterpret_cast<int32_t*>(out);
  for (int p = 0; p < 4; ++p)
    for (int64_t w0 = 0; w0 < words; w0 += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(reinterpret_cast<const int32_t*>(rows[16 * p + j]) + w0);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (p * words + w0 + i) * 16, r[i]);
    }
}

// V rows of 64 keys -> D / 16 panels of 16 dims, kKeys / kPerStep steps each (bf16: two keys per step).
inline void pack_v(const float* const* rows, int64_t D, float* out) {
  for (int64_t c = 0; c < D / 16; ++c)
    for (int64_t j = 0; j < kKeys; ++j) _mm512_storeu_ps(out + (c * kKeys + j) * 16, _mm512_loadu_ps(rows[j] + 16 * c));
}

#ifdef PAGEDQ_GEMM_BF16
inline void pack_v(const at::BFloat16* const* rows, int64_t D, at::BFloat16* out) {
  alignas(64) static constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kInterleave);
  for (int64_t c = 0; c < D / 16; ++c)
    for (int64_t s = 0; s < kKeys / 2; ++s) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * s] + 16 * c));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * s + 1] + 16 * c));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_storeu_si512(out + (c * kKeys + 2 * s) * 16, _mm512_permutexvar_epi16(idx, both));
    }
}
#endif

// Per-thread buffers, reused from task to task.
template <typename T>
struct Work {
  std::vector<T> kp, vp, p;  // packed K and V of a block; P of a row tile (kTileRows x kKeys)
  std::vector<T> qc;         // on AMX tiles: the task's query rows, contiguous (cpu_prefill_amx.h)
  std::vector<float> o, m, l;
  std::vector<const T*> qrows, krows, vrows;
  std::vector<int64_t> qpos;
  Work(int64_t D, int64_t rows)
      : kp(kKeys * D), vp(kKeys * D), p(kTileRows * kKeys), o(rows * D), m(rows), l(rows), qrows(rows), krows(kKeys),
        vrows(kKeys), qpos(rows) {}
};

// o[r][0 .. 16 P) = alpha[r] o[r] + P[r] V for R rows (o's rows `ld` apart), over `steps` of V's panels.
template <typename T, int R, int P>
inline void add_pv(const T* const* prow, const T* vp, int64_t steps, float* o, int64_t ld, const float* alpha) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ld + 16 * j), _mm512_set1_ps(alpha[r]));
  dot_tile<T, R, P>(prow, vp, kKeys * 16, steps, acc);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) _mm512_storeu_ps(o + r * ld + 16 * j, acc[r][j]);
}

// Rows r0 .. r0 + R - 1 of a task against the packed block of keys k0 .. k0 + 63: scores, the online
// softmax, and O += P V.
template <typename T, int R>
void row_tile(const Args<T>& a, Work<T>& w, int64_t r0, int64_t k0, int64_t nk) {
  constexpr int64_t step = Dot<T>::kPerStep;
  const int64_t D = a.D, words = D / step;
  __m512 s[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_ps();
  dot_tile<T, R, 4>(w.qrows.data() + r0, w.kp.data(), words * 16 * step, words, s);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 scale = _mm512_set1_ps(a.scale), neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    const int64_t qp = w.qpos[r0 + r];
    __mmask16 seen[4];
    __m512 row_max = neg_inf;
    for (int j = 0; j < 4; ++j) {
      const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(k0 + 16 * j)));
      seen[j] = _mm512_cmple_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(qp)));
      if (a.window > 0)
        seen[j] &= _mm512_cmpgt_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(qp - a.window)));
      s[r][j] = _mm512_mask_mov_ps(neg_inf, seen[j], _mm512_mul_ps(s[r][j], scale));
      row_max = _mm512_max_ps(row_max, s[r][j]);
    }
    const float old_max = w.m[r0 + r], new_max = std::max(old_max, _mm512_reduce_max_ps(row_max));
    T* p = w.p.data() + r * kKeys;
    if (new_max == -std::numeric_limits<float>::infinity()) {  // sees no key of this block
      alpha[r] = 1.f;
      for (int j = 0; j < 4; ++j) Dot<T>::store(p + 16 * j, 0xFFFF, _mm512_setzero_ps());
      continue;
    }
    alpha[r] = std::exp(old_max - new_max);  // 0 on the first block the row sees
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const __m512 e = _mm512_maskz_mov_ps(seen[j], pagedq_simd::exp512(_mm512_sub_ps(s[r][j], _mm512_set1_ps(new_max))));
      sum = _mm512_add_ps(sum, e);
      Dot<T>::store(p + 16 * j, 0xFFFF, e);
    }
    w.m[r0 + r] = new_max;
    w.l[r0 + r] = w.l[r0 + r] * alpha[r] + _mm512_reduce_add_ps(sum);
  }
  // O += P V over the keys this tile's last row sees, four panels of 16 dims at a time.
  const int64_t steps = (std::min<int64_t>(nk, w.qpos[r0 + R - 1] - k0 + 1) + step - 1) / step;
  const T* prow[R];
  for (int r = 0; r < R; ++r) prow[r] = w.p.data() + r * kKeys;
  float* o = w.o.data() + r0 * D;
  for (int64_t c = 0; c < D / 16; c += 4) {
    const T* vp = w.vp.data() + c * kKeys * 16;
    switch (std::min<int64_t>(4, D / 16 - c)) {
      case 1: add_pv<T, R, 1>(prow, vp, steps, o + 16 * c, D, alpha); break;
      case 2: add_pv<T, R, 2>(prow, vp, steps, o + 16 * c, D, alpha); break;
      case 3: add_pv<T, R, 3>(prow, vp, steps, o + 16 * c, D, alpha); break;
      default: add_pv<T, R, 4>(prow, vp, steps, o + 16 * c, D, alpha); break;
    }
  }
}

#include "cpu_prefill_amx.h"

template <typename T>
void run_task(const Args<T>& a, const Task& t, Work<T>& w) {
  const int64_t G = a.G, D = a.D, rows = (t.t1 - t.t0) * G;
  const int64_t start = a.starts[t.req], ctx = a.lens[t.req] - (a.starts[t.req + 1] - start);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = t.t0 + r / G, hq = t.head * G + r % G;
    w.qrows[r] = a.q + (start + tok) * a.q_t + hq * a.q_h;
    w.qpos[r] = ctx + tok;
  }
  std::fill_n(w.o.begin(), rows * D, 0.f);
  std::fill_n(w.m.begin(), rows, -std::numeric_limits<float>::infinity());
  std::fill_n(w.l.begin(), rows, 0.f);
  const int32_t* table = a.tables + t.req * a.bt;
  [[maybe_unused]] bool amx = false;
#ifdef PAGEDQ_AMX
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    amx = prefill_amx(D);
    if (amx) gather_queries(w, rows, D);
  }
#endif
  for (int64_t k0 = t.lo; k0 < t.hi; k0 += kKeys) {
    const int64_t nk = std::min(kKeys, t.hi - k0);
    for (int64_t j = 0; j < kKeys; ++j) {
      if (j < nk) {
        const int64_t pos = k0 + j, off = table[pos / a.BS] * a.c_blk + (pos % a.BS) * a.c_pos + t.head * a.c_head;
        w.krows[j] = a.k + off;
        w.vrows[j] = a.v + off;
      } else {
        w.krows[j] = w.vrows[j] = a.zero;
      }
    }
    pack_k(w.krows.data(), D / Dot<T>::kPerStep, w.kp.data());
    pack_v(w.vrows.data(), D, w.vp.data());
#ifdef PAGEDQ_AMX
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (amx) {
        amx_block(a, w, rows, k0, nk);
        continue;
      }
    }
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      if (w.qpos[std::min(r0 + kTileRows, rows) - 1] < k0) continue;  // sees none of these keys
      if (a.window > 0 && w.qpos[r0] - a.window >= k0 + nk - 1) continue;  // all of them left the window
      switch (std::min<int64_t>(kTileRows, rows - r0)) {
        case 1: row_tile<T, 1>(a, w, r0, k0, nk); break;
        case 2: row_tile<T, 2>(a, w, r0, k0, nk); break;
        case 3: row_tile<T, 3>(a, w, r0, k0, nk); break;
        case 4: row_tile<T, 4>(a, w, r0, k0, nk); break;
        case 5: row_tile<T, 5>(a, w, r0, k0, nk); break;
        default: row_tile<T, kTileRows>(a, w, r0, k0, nk); break;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = t.t0 + r / G, hq = t.head * G + r % G;
    const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);
    T* out = a.o + (start + tok) * a.o_t + hq * a.o_h;
    for (int64_t c = 0; c < D / 16; ++c)
      Dot<T>::store(out + 16 * c, 0xFFFF, _mm512_mul_ps(_mm512_loadu_ps(&w.o[r * D + 16 * c]), inv));
  }
}

template <typename T>
void run(const Args<T>& a, int64_t n, int64_t Hkv) {
  std::vector<Task> tasks;
  std::vector<double> cost;
  const int64_t tokens_per_task = std::max<int64_t>(1, kTaskRows / a.G);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t q_len = a.starts[i + 1] - a.starts[i], ctx = a.lens[i] - q_len;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t t0 = 0; t0 < q_len; t0 += tokens_per_task) {
        const int64_t t1 = std::min(q_len, t0 + tokens_per_task), hi = ctx + t1;
        const int64_t lo = a.window > 0 ? std::max<int64_t>(0, ctx + t0 - a.window + 1) : 0;
        tasks.push_back(Task{i, h, t0, t1, lo, hi});
        cost.push_back(static_cast<double>((t1 - t0) * (hi - lo) + kKeys));
      }
  }
  double total = 0;
  for (double c : cost) total += c;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<int64_t> first(threads + 1, static_cast<int64_t>(tasks.size()));
  first[0] = 0;
  double before = 0;  // a task goes to the thread whose share of the total holds its midpoint
  for (int64_t i = 0, th = 1; i < static_cast<int64_t>(tasks.size()); before += cost[i++])
    while (th < threads && before + cost[i] / 2 >= total * th / threads) first[th++] = i;
  pagedq_parallel::run_shares(
      first, [&] { return Work<T>(a.D, tokens_per_task * a.G); },
      [&](Work<T>& w, int64_t i, int64_t) { run_task(a, tasks[i], w); });
}
#endif

using pagedq_simd::built_for;

}  // namespace

// Whether paged_prefill takes this dtype and head size here (else the caller keeps its reference path).
bool prefill_supported(at::ScalarType dtype, int64_t head_dim) {
  return built_for(dtype) && head_dim > 0 && head_dim <= kMaxHeadDim &&
         head_dim * static_cast<int64_t>(c10::elementSize(dtype)) % 64 == 0;
}

// Attention of the chunks of n requests: query rows starts[i] .. starts[i + 1] - 1 of q [T, Hq, D] sit
// at positions lens[i] - (their count) onwards and see the cache's keys up to their own position
// (and, with window w > 0, above their own position - w); the result goes to the same rows of out.
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                   torch::Tensor starts, torch::Tensor seq_lens, torch::Tensor out, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1 && q.is_cpu() &&
                  out.is_cpu(),
              "paged_prefill: q and out [T, Hq, D] on the CPU, unit stride on D");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && k_cache.strides() == v_cache.strides() &&
                  k_cache.sizes() == v_cache.sizes(),
              "paged_prefill: caches [blocks, block_size, Hkv, D] alike, unit stride on D");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_prefill: q, caches and out of one dtype");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), BS = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "paged_prefill: head sizes differ or Hq % Hkv != 0");
  TORCH_CHECK(prefill_supported(dtype, D), "paged_prefill: dtype or head size not built here");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && starts.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && block_tables.dim() == 2,
              "paged_prefill: int32 block_tables [n, max_blocks], starts [n + 1], seq_lens [n]");
  const int64_t n = seq_lens.numel();
  TORCH_CHECK(starts.numel() == n + 1 && block_tables.size(0) == n, "paged_prefill: n requests in each index");
  const auto tables = block_tables.contiguous();
  const auto st = starts.contiguous();
  const auto lens = seq_lens.contiguous();
  const int32_t* sp = st.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {  // what would read outside a tensor, refused before any work
    const int64_t q_len = sp[i + 1] - sp[i];
    TORCH_CHECK(sp[i] >= 0 && q_len >= 0 && sp[i + 1] <= q.size(0), "paged_prefill: query rows of request ", i,
                " outside q");
    TORCH_CHECK(lp[i] >= q_len, "paged_prefill: request ", i, " has fewer keys than query rows");
    const int64_t blocks = (lp[i] + BS - 1) / BS;
    TORCH_CHECK(blocks <= tables.size(1), "paged_prefill: request ", i, " needs more blocks than its table has");
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK(tp[i * tables.size(1) + b] >= 0 && tp[i * tables.size(1) + b] < k_cache.size(0),
                  "paged_prefill: block table of request ", i, " points outside the cache");
  }
#ifdef PAGEDQ_GEMM_FP32
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    const std::vector<T> zero(D, T(0));
    const Args<T> a{q.data_ptr<T>(), q.stride(0), q.stride(1), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                    k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tp, tables.size(1), sp, lp,
                    out.data_ptr<T>(), out.stride(0), out.stride(1), Hq / Hkv, D, BS, window > 0 ? window : 0,
                    static_cast<float>(scale), zero.data()};
    run(a, n, Hkv);
  };
#ifdef PAGEDQ_GEMM_BF16
  if (dtype == at::kBFloat16) return launch(at::BFloat16(0));
#endif
  launch(float(0));
#endif
}
