// Weight-only int8 GEMM for the CPU's projections on AVX-512: y[M, N] = (x[M, K] @ Q[N, K]^T) * scale[N]
// (+ bias), Q symmetric int8 per output channel (scale = max|W[n, :]| / 127, fp32), x in bf16 or fp32,
// fp32 sums, y in x's dtype. Reached through gemm_linear (cpu_gemm.cpp) when the packed weight is int8, so
// the one-call layer (cpu_layer.cpp) and cpu_linear.py take int8 weights unchanged.
//
// Why weight-only: a decode step reads every weight once, so halving the weight bytes is what speeds it
// up; quantizing the activations as well (for VNNI's int8 dot products) cost SmolLM2 1.2-4% perplexity in
// a simulation, against 0.7% for the weights alone (measured: ops/bench/quant_quality.py). So the int8 weights are widened in registers and
// multiplied against the activations as they are: in bf16 with `vdpbf16ps` where the CPU has avx512_bf16,
// else (and for fp32 activations) in fp32 with FMA. The per-channel scale multiplies the fp32 sums once at
// the end, so the sums are exact products of the int8 values (small integers, exact in bf16) and x.
//
// Layout (pack_gemm_weight_int8): panels of 16 output columns, as in cpu_gemm.cpp, each a contiguous run
// of 64-byte lines, one per 4 steps of K: a line holds k = 4s..4s+3, each as the 16 columns' int8 values
// side by side ([N/16][K/4][4][16]). `vpmovsxbd` widens each 16-byte quarter to 16 int32 lanes (one per
// column) and `vcvtdq2ps` makes them fp32, which is what the FMA path takes; for `vdpbf16ps` two such
// quarters (k and k+1) are merged into 16 lanes of bf16 pairs with a shift and a word blend (the values
// are exact, so bf16 is fp32's high half). After the K lines, each panel ends with one more line: its 16
// fp32 scales, so a packed weight is one tensor ([N/16][K/4 + 1][4][16] int8), as the layer passes it.
// K is padded with zero weights to a multiple of 4 (x is then copied into a zero-padded buffer).
//
// Up to kDirectMaxRows rows (decode steps) one tile widens each line as it streams it from memory and uses
// it for every row; with more rows (prompt chunks, big decode batches) the first tile of 4 rows over a group
// of 4 panels also keeps the widened lines in a per-thread buffer in the compute type's panel layout
// (cpu_avx512.h's), and 6-row x 4-panel dot tiles run over it for the other rows, prefetching the next
// group's int8 lines into L2 meanwhile: the widening is paid once per 240 rows. Threads split the output columns in
// groups of 4 panels, as cpu_gemm.cpp does (cpu_parallel.h).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "cpu_avx512.h"
#include "cpu_ops.h"
#include "cpu_parallel.h"

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kLine = 64;   // bytes per line: 4 steps of K x 16 columns
constexpr int64_t kKPerLine = 4;

#ifdef PAGEDQ_GEMM_FP32
constexpr int kMaxPanels = 4;         // panels per tile
constexpr int kDirectRows = 4;        // rows up to which a direct tile takes 4 panels (2 above)
constexpr int64_t kDirectMaxRows = 8;  // more rows: panels widened once into a buffer (prompt chunks)
constexpr int64_t kAhead = 512;       // bytes of a panel prefetched ahead of a direct tile
constexpr int64_t kBlockRows = 240;   // rows of x per pass over a thread's panels (kept in L2)
constexpr int kBufferRows = 6;        // rows per dot tile over the widened panels

using pagedq_simd::Dot;

// 16 int8 (one column each) as fp32.
inline __m512 widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Two widened steps of K (a: k, b: k + 1) as 16 lanes of bf16 pairs (k in the low word), the operand of
// vdpbf16ps. The values are small integers, exact in bf16: the pair is the high halves of a and b.
inline __m512i pair(__m512 a, __m512 b) {
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(_mm512_castps_si512(a), 16), _mm512_castps_si512(b));
}

// 16 fp32 lanes stored to the valid columns of y in its dtype (bf16: rounded to nearest even, as
// cpu_gemm.cpp stores them).
inline void store(float* y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }
inline void store(at::BFloat16* y, __mmask16 mask, __m512 v) {
  const __m512i bits = _mm512_srli_epi32(pagedq_simd::bf16_bits16(v), 16);
  _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(bits));
}

// C: the compute type (what x holds, padded to the weight's K); O: the output's dtype.
template <typename C, typename O>
struct Int8Gemm {
  const C* x;
  int64_t ldx;
  const int8_t* w;       // packed
  int64_t lines;         // of K per panel (the scale line not counted)
  const float* bias;     // fp32, padded to the packed width, or null
  O* y;
  int64_t ldy;
  int64_t N;  // valid output columns

  int64_t panel_bytes() const { return (lines + 1) * kLine; }
  const int8_t* panel(int64_t p) const { return w + p * panel_bytes(); }
  const float* scales(int64_t p) const { return reinterpret_cast<const float*>(panel(p) + lines * kLine); }
};

// y rows [m, m + R) x panels [p, p + P) = acc * scale + bias.
template <typename C, typename O, int R, int P>
inline void finish(const Int8Gemm<C, O>& g, int64_t m, int64_t p, __m512 (&acc)[R][P]) {
  for (int j = 0; j < P; ++j) {
    const int64_t col = (p + j) * kPanel;
    const int64_t valid = std::min(kPanel, g.N - col);
    const __mmask16 mask = valid == kPanel ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    const __m512 scale = _mm512_loadu_ps(g.scales(p + j));
    const __m512 bias = g.bias ? _mm512_loadu_ps(g.bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) store(g.y + (m + r) * g.ldy + col, mask, _mm512_fmadd_ps(acc[r][j], scale, bias));
  }
}

// One line of K (4 steps) of one panel into R rows' sums: the FMA path (fp32 x). `keep` (where not null)
// receives the widened line, 4 x 16 fp32, for the next tiles over the same panels.
template <int R>
inline void direct_line(const float* const* x, int64_t s, const int8_t* line, __m512* acc, int stride, float* keep) {
  const __m512 w0 = widen(line), w1 = widen(line + 16), w2 = widen(line + 32), w3 = widen(line + 48);
  if (keep) {
    _mm512_storeu_ps(keep, w0);
    _mm512_storeu_ps(keep + 16, w1);
    _mm512_storeu_ps(keep + 32, w2);
    _mm512_storeu_ps(keep + 48, w3);
  }
  for (int r = 0; r < R; ++r) {
    const float* xr = x[r] + s * kKPerLine;
    __m512 a = acc[r * stride];
    a = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), w0, a);
    a = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), w1, a);
    a = _mm512_fmadd_ps(_mm512_set1_ps(xr[2]), w2, a);
    acc[r * stride] = _mm512_fmadd_ps(_mm512_set1_ps(xr[3]), w3, a);
  }
}

#ifdef PAGEDQ_GEMM_BF16
// The same with bf16 x: two vdpbf16ps per row and line (`keep`: 2 x 16 pairs of bf16).
template <int R>
inline void direct_line(const at::BFloat16* const* x, int64_t s, const int8_t* line, __m512* acc, int stride,
                        at::BFloat16* keep) {
  const __m512i p01 = pair(widen(line), widen(line + 16)), p23 = pair(widen(line + 32), widen(line + 48));
  if (keep) {
    _mm512_storeu_si512(keep, p01);
    _mm512_storeu_si512(keep + 32, p23);
  }
  for (int r = 0; r < R; ++r) {
    const at::BFloat16* xr = x[r] + s * kKPerLine;
    int32_t x01, x23;
    std::memcpy(&x01, xr, 4);
    std::memcpy(&x23, xr + 2, 4);
    __m512 a = acc[r * stride];
    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi32(x01), (__m512bh)p01);
    acc[r * stride] = _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi32(x23), (__m512bh)p23);
  }
}
#endif

// Rows [m, m + R) x panels [p, p + P), widening each line as it streams in, kAhead bytes of each panel
// requested ahead (one row streamed 3-12% faster with it in a microbenchmark on a 2-core EPYC).
template <typename C, typename O, int R, int P>
inline void direct_tile(const Int8Gemm<C, O>& g, int64_t m, int64_t p, C* keep = nullptr) {
  const int64_t kept = g.lines * kKPerLine * kPanel;  // elements per widened panel in `keep`
  const C* x[R];
  for (int r = 0; r < R; ++r) x[r] = g.x + (m + r) * g.ldx;
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t pb = g.panel_bytes();
  const int8_t* w = g.panel(p);
  for (int64_t s = 0; s < g.lines; ++s)
    for (int j = 0; j < P; ++j) {
      const int8_t* line = w + j * pb + s * kLine;
      _mm_prefetch(reinterpret_cast<const char*>(line) + kAhead, _MM_HINT_T0);
      direct_line<R>(x, s, line, &acc[0][j], P, keep ? keep + j * kept + s * kKPerLine * kPanel : nullptr);
    }
  finish<C, O, R, P>(g, m, p, acc);
}

// Rows [m0, m1) (at most kDirectMaxRows) of panels [p, p + P) in one pass over the weight: up to 4 rows
// with 4 panels per tile, 5 to 8 rows with 2 (the accumulators stay in registers; one pass of 8 rows ran
// 1.2x as fast as two of 4, which widen every line twice).
template <typename C, typename O, int R, int P>
inline void direct_split(const Int8Gemm<C, O>& g, int64_t m, int64_t p) {
  if constexpr (R <= kDirectRows || P <= 2) {
    direct_tile<C, O, R, P>(g, m, p);
  } else {
    direct_tile<C, O, R, 2>(g, m, p);
    direct_tile<C, O, R, P - 2>(g, m, p + 2);
  }
}

template <typename C, typename O, int P>
inline void direct_rows(const Int8Gemm<C, O>& g, int64_t m0, int64_t m1, int64_t p) {
  switch (m1 - m0) {
    case 1: direct_split<C, O, 1, P>(g, m0, p); break;
    case 2: direct_split<C, O, 2, P>(g, m0, p); break;
    case 3: direct_split<C, O, 3, P>(g, m0, p); break;
    case 4: direct_split<C, O, 4, P>(g, m0, p); break;
    case 5: direct_split<C, O, 5, P>(g, m0, p); break;
    case 6: direct_split<C, O, 6, P>(g, m0, p); break;
    case 7: direct_split<C, O, 7, P>(g, m0, p); break;
    case 8: direct_split<C, O, 8, P>(g, m0, p); break;
    default: break;
  }
}

// Cache lines of the next group of panels to bring into L2 while the tiles over the buffer run, one per step
// of K, so that widening the next group does not wait on memory.
struct Prefetch {
  const char* at = nullptr;
  const char* end = nullptr;
};

// Rows [m, m + R) x panels [p, p + P) over the widened panels in `buf` (cpu_avx512.h's dot step).
template <typename C, typename O, int R, int P>
inline void buffer_tile(const Int8Gemm<C, O>& g, int64_t m, int64_t p, const C* buf, Prefetch& pf) {
  constexpr int64_t line = 64 / sizeof(C);  // elements per widened panel per step
  const int64_t stride = g.lines * kKPerLine * kPanel, steps = g.lines * kKPerLine / Dot<C>::kPerStep;
  const C* x[R];
  for (int r = 0; r < R; ++r) x[r] = g.x + (m + r) * g.ldx;
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    __m512i wv[P];
    for (int j = 0; j < P; ++j) wv[j] = _mm512_loadu_si512(buf + j * stride + s * line);
    if (pf.at < pf.end) {
      _mm_prefetch(pf.at, _MM_HINT_T1);
      pf.at += 64;
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xb = Dot<C>::broadcast(x[r], s);
      for (int j = 0; j < P; ++j) acc[r][j] = Dot<C>::madd(acc[r][j], xb, wv[j]);
    }
  }
  finish<C, O, R, P>(g, m, p, acc);
}

template <typename C, typename O, int P>
inline void buffer_rows(const Int8Gemm<C, O>& g, int64_t m0, int64_t m1, int64_t p, const C* buf, Prefetch pf) {
  int64_t m = m0;
  for (; m + kBufferRows <= m1; m += kBufferRows) buffer_tile<C, O, kBufferRows, P>(g, m, p, buf, pf);
  switch (m1 - m) {
    case 1: buffer_tile<C, O, 1, P>(g, m, p, buf, pf); break;
    case 2: buffer_tile<C, O, 2, P>(g, m, p, buf, pf); break;
    case 3: buffer_tile<C, O, 3, P>(g, m, p, buf, pf); break;
    case 4: buffer_tile<C, O, 4, P>(g, m, p, buf, pf); break;
    case 5: buffer_tile<C, O, 5, P>(g, m, p, buf, pf); break;
    default: break;
  }
}

// Rows [m0, m1) of group `group` of panels (kMaxPanels of them, fewer in the last group); the buffered
// path prefetches group `next` (-1: none) into L2.
template <typename C, typename O>
void group_rows(const Int8Gemm<C, O>& g, int64_t m0, int64_t m1, int64_t group, int64_t next, int64_t panel_count,
                C* buf) {
  const int64_t p = group * kMaxPanels;
  const int P = static_cast<int>(std::min<int64_t>(kMaxPanels, panel_count - p));
  if (m1 - m0 <= kDirectMaxRows) {
    switch (P) {
      case 1: direct_rows<C, O, 1>(g, m0, m1, p); break;
      case 2: direct_rows<C, O, 2>(g, m0, m1, p); break;
      case 3: direct_rows<C, O, 3>(g, m0, m1, p); break;
      case 4: direct_rows<C, O, 4>(g, m0, m1, p); break;
      default: break;
    }
    return;
  }
  // The first 4 rows stream the panels from memory as a direct tile does, keeping the widened lines in
  // `buf` (in cpu_avx512.h's panel layout for C: fp32 [K][16], bf16 [K/2][16][2]) for the other rows' tiles,
  // so the widening overlaps the memory stream rather than waiting on it in a pass of its own.
  switch (P) {
    case 1: direct_tile<C, O, kDirectRows, 1>(g, m0, p, buf); break;
    case 2: direct_tile<C, O, kDirectRows, 2>(g, m0, p, buf); break;
    case 3: direct_tile<C, O, kDirectRows, 3>(g, m0, p, buf); break;
    case 4: direct_tile<C, O, kDirectRows, 4>(g, m0, p, buf); break;
    default: break;
  }
  m0 += kDirectRows;
  Prefetch pf;
  if (next >= 0) {
    const int64_t a = next * kMaxPanels, b = std::min(a + kMaxPanels, panel_count);
    pf = Prefetch{reinterpret_cast<const char*>(g.panel(a)), reinterpret_cast<const char*>(g.panel(b))};
  }
  switch (P) {
    case 1: buffer_rows<C, O, 1>(g, m0, m1, p, buf, pf); break;
    case 2: buffer_rows<C, O, 2>(g, m0, m1, p, buf, pf); break;
    case 3: buffer_rows<C, O, 3>(g, m0, m1, p, buf, pf); break;
    case 4: buffer_rows<C, O, 4>(g, m0, m1, p, buf, pf); break;
    default: break;
  }
}

// This thread's buffer for a group of widened panels of `lines` lines, kept between calls (a buffer
// allocated and zeroed per call made SmolLM2's 16-row products 1.2x slower).
template <typename C>
C* scratch(int64_t lines) {
  thread_local std::unique_ptr<char[]> bytes;
  thread_local int64_t size = 0;
  const int64_t need = kMaxPanels * lines * kKPerLine * kPanel * static_cast<int64_t>(sizeof(float));
  if (need > size) {
    bytes.reset(new char[need]);
    size = need;
  }
  return reinterpret_cast<C*>(bytes.get());
}

template <typename C, typename O>
void run(const torch::Tensor& x, const torch::Tensor& packed, const float* bias, torch::Tensor& out) {
  const int64_t M = x.size(0), panel_count = packed.size(0);
  const Int8Gemm<C, O> g{x.data_ptr<C>(), x.stride(0), packed.data_ptr<int8_t>(), packed.size(1) - 1, bias,
                         out.data_ptr<O>(), out.stride(0), out.size(1)};
  const int64_t groups = (panel_count + kMaxPanels - 1) / kMaxPanels;
  for (int64_t m = 0; m < M; m += kBlockRows) {
    const int64_t m1 = std::min(m + kBlockRows, M);
    pagedq_parallel::run_shares(
        pagedq_parallel::equal_bounds(groups), [&] { return M > kDirectMaxRows ? scratch<C>(g.lines) : nullptr; },
        [&](C* buf, int64_t group, int64_t next) { group_rows(g, m, m1, group, next, panel_count, buf); });
  }
}
#endif

bool env_is_zero(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") == 0;
}

}  // namespace

// Whether gemm_linear takes int8 weights here (AVX-512), for bf16 and fp32 x.
bool gemm_int8_available() {
#ifdef PAGEDQ_GEMM_FP32
  return true;
#else
  return false;
#endif
}

// Q [N, K] int8 and its per-row fp32 scales [N] -> [ceil(N/16), ceil(K/4) + 1, 4, 16] int8: panels of 16
// output columns, 4 steps of K per 64-byte line, zero-padded; each panel's last line its 16 fp32 scales.
torch::Tensor pack_gemm_weight_int8(torch::Tensor q, torch::Tensor scales) {
  TORCH_CHECK(q.dim() == 2 && q.is_cpu() && q.scalar_type() == at::kChar, "pack_gemm_weight_int8: a 2-D CPU int8 weight");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(scales.dim() == 1 && scales.numel() == N && scales.is_cpu() && scales.scalar_type() == at::kFloat,
              "pack_gemm_weight_int8: fp32 scales, one per row");
  const int64_t panels = (N + kPanel - 1) / kPanel, lines = (K + kKPerLine - 1) / kKPerLine;
  auto padded = q.new_zeros({panels * kPanel, lines * kKPerLine});
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(q);
  auto body = padded.view({panels, kPanel, lines, kKPerLine}).permute({0, 2, 3, 1});
  auto s = torch::zeros({panels * kPanel}, scales.options());
  s.narrow(0, 0, N).copy_(scales);
  auto tail = s.view(at::kChar).view({panels, 1, kKPerLine, kPanel});
  return torch::cat({body, tail}, 1).contiguous();
}

// gemm_linear for an int8 packed weight (cpu_gemm.cpp dispatches here on the weight's dtype).
void gemm_linear_int8(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, torch::Tensor out) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "gemm_linear: x [M, K] on the CPU, float32 or bfloat16, for an int8 weight");
  TORCH_CHECK(packed.dim() == 4 && packed.is_cpu() && packed.is_contiguous() && packed.size(1) >= 1 &&
                  packed.size(2) == kKPerLine && packed.size(3) == kPanel,
              "gemm_linear: packed is not a weight from pack_gemm_weight_int8");
  const int64_t K = x.size(1), Kp = (packed.size(1) - 1) * kKPerLine, panel_count = packed.size(0);
  TORCH_CHECK(K <= Kp && K > Kp - kKPerLine, "gemm_linear: the weight's K differs from x's");
  TORCH_CHECK(out.dim() == 2 && out.is_cpu() && out.size(0) == x.size(0) && out.scalar_type() == dtype &&
                  (out.stride(1) == 1 || out.size(1) <= 1) && (out.size(0) <= 1 || out.stride(0) >= out.size(1)),
              "gemm_linear: out [M, N] on the CPU, in x's dtype, rows contiguous");
  TORCH_CHECK(out.size(1) <= panel_count * kPanel && out.size(1) > (panel_count - 1) * kPanel,
              "gemm_linear: out width != weight");
  TORCH_CHECK(!bias || (bias->is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->numel() == panel_count * kPanel),
              "gemm_linear: bias fp32, padded");
  TORCH_CHECK(gemm_int8_available(), "gemm_linear: int8 weights need the AVX-512 build");
#ifdef PAGEDQ_GEMM_FP32
  if (x.size(0) == 0 || out.size(1) == 0) return;
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
#ifdef PAGEDQ_GEMM_BF16
  constexpr bool bf16_dots = true;
#else
  constexpr bool bf16_dots = false;
#endif
  // The compute type: x's own where it can be used as it is; bf16 x without vdpbf16ps goes through fp32
  // (PAGEDQ_CPU_INT8_BF16_DOTS=0 takes that route here too: what an AVX-512 CPU without avx512_bf16 runs).
  static const bool use_dots = bf16_dots && !env_is_zero("PAGEDQ_CPU_INT8_BF16_DOTS");
  const auto compute = (dtype == at::kBFloat16 && use_dots) ? at::kBFloat16 : at::kFloat;
  torch::Tensor xc = x;
  if (compute != dtype || K != Kp || x.stride(1) != 1) {
    xc = torch::zeros({x.size(0), Kp}, x.options().dtype(compute));
    xc.narrow(1, 0, K).copy_(x);
  }
  if (dtype == at::kFloat) return run<float, float>(xc, packed, b, out);
#ifdef PAGEDQ_GEMM_BF16
  if (compute == at::kBFloat16) return run<at::BFloat16, at::BFloat16>(xc, packed, b, out);
#endif
  return run<float, at::BFloat16>(xc, packed, b, out);
#endif
}
