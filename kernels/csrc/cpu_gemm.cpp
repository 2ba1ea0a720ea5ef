// bf16 GEMM for the CPU's projections: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 accumulation,
// one rounding to bf16, built only where the CPU has avx512_bf16 (`vdpbf16ps`).
//
// Why not oneDNN alone: a decode step multiplies a few to 64 rows by every weight of the model, once.
// On a 2-core AMD EPYC, oneDNN's packed GEMM read SmolLM2's weights at 22-34 GB/s at 1-4 rows (a plain
// streaming read did 48 GB/s) and reached about 57% of its own 2048^3 rate at 64 rows, with the
// weights coming from memory rather than cache. This kernel is shaped for that case: the weight is packed once at load
// into panels of 16 output columns, each a contiguous run of K/2 pairs ([N/16][K/2][16][2]), so a
// tile of up to 6 rows x 64 columns streams four panels front to back, one 64-byte load per panel per
// pair of K, and every load feeds 6 dot-product instructions. The row pairs of x are broadcast from
// L1. Threads split the output columns, so each weight byte is read from memory once per call. The
// first row tile of a group of panels reads them from memory; the later ones find them in L2 and
// prefetch the next group's lines there, one per pair of K (4-12% faster at 24 to 64 rows in an A/B).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDQ_BF16_GEMM 1
#endif

namespace {

constexpr int64_t kPanel = 16;   // output columns per packed panel (one zmm of fp32 sums)
constexpr int kMaxPanels = 4;    // panels per tile: 4 x 6 accumulators + 4 weights + 1 broadcast registers
constexpr int kTileRows = 6;
constexpr int64_t kBlockRows = 240;  // rows of x per pass over a thread's panels (kept in L2)

#ifdef PAGEDQ_BF16_GEMM
struct Gemm {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;  // packed
  int64_t K2;         // pairs of K
  const float* bias;  // fp32, padded to the packed width, or null
  uint16_t* y;
  int64_t ldy;
  int64_t N;  // valid output columns
};

// Cache lines to bring into L2 while a tile runs, one per pair of K: the next group of panels.
struct Prefetch {
  const char* at = nullptr;
  const char* end = nullptr;
};

// Rows [m, m + R) x panels [p, p + P) over all of K; the sums stay in registers.
template <int R, int P>
inline void tile(const Gemm& g, int64_t m, int64_t p, Prefetch& pf) {
  const int64_t stride = g.K2 * 2 * kPanel;  // elements per panel
  const uint16_t* w = g.w + p * stride;
  const uint16_t* x = g.x + m * g.ldx;
  __m512 acc[R][P];
  for (int j = 0; j < P; ++j) {
    const __m512 b = g.bias ? _mm512_loadu_ps(g.bias + (p + j) * kPanel) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][j] = b;
  }
  for (int64_t kk = 0; kk < g.K2; ++kk) {
    __m512i wv[P];
    for (int j = 0; j < P; ++j) wv[j] = _mm512_loadu_si512(w + j * stride + kk * 2 * kPanel);
    if (pf.at < pf.end) {
      _mm_prefetch(pf.at, _MM_HINT_T1);
      pf.at += 64;
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // x[m + r, 2kk], x[m + r, 2kk + 1]
      std::memcpy(&pair, x + r * g.ldx + 2 * kk, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < P; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, (__m512bh)wv[j]);
    }
  }
  for (int j = 0; j < P; ++j) {
    const int64_t col = (p + j) * kPanel;
    const int64_t valid = g.N - col < kPanel ? g.N - col : kPanel;
    const __mmask16 mask = valid == kPanel ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int r = 0; r < R; ++r) {
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(acc[r][j]);
      _mm256_mask_storeu_epi16(g.y + (m + r) * g.ldy + col, mask, v);
    }
  }
}

// Rows [m0, m1) of panels [p, p + P); the tiles after the first prefetch `next`.
template <int P>
inline void rows(const Gemm& g, int64_t m0, int64_t m1, int64_t p, Prefetch next) {
  Prefetch none;
  Prefetch* pf = &none;  // the first tile streams its panels from memory: no prefetch beside it
  int64_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows, pf = &next) tile<kTileRows, P>(g, m, p, *pf);
  switch (m1 - m) {
    case 1: tile<1, P>(g, m, p, *pf); break;
    case 2: tile<2, P>(g, m, p, *pf); break;
    case 3: tile<3, P>(g, m, p, *pf); break;
    case 4: tile<4, P>(g, m, p, *pf); break;
    case 5: tile<5, P>(g, m, p, *pf); break;
    default: break;
  }
}

// Panels [p0, p1) for rows [m0, m1), four panels (64 columns) at a time.
inline void panels(const Gemm& g, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  const int64_t bytes = g.K2 * 2 * kPanel * sizeof(uint16_t);  // per panel
  const char* base = reinterpret_cast<const char*>(g.w);
  auto group_after = [&](int64_t p) {  // the panels a tile group at p should prefetch
    const int64_t a = std::min(p + kMaxPanels, p1), b = std::min(p + 2 * kMaxPanels, p1);
    return Prefetch{base + a * bytes, base + b * bytes};
  };
  int64_t p = p0;
  for (; p + kMaxPanels <= p1; p += kMaxPanels) rows<kMaxPanels>(g, m0, m1, p, group_after(p));
  switch (p1 - p) {
    case 1: rows<1>(g, m0, m1, p, Prefetch{}); break;
    case 2: rows<2>(g, m0, m1, p, Prefetch{}); break;
    case 3: rows<3>(g, m0, m1, p, Prefetch{}); break;
    default: break;
  }
}
#endif

}  // namespace

bool bf16_gemm_available() {
#ifdef PAGEDQ_BF16_GEMM
  return true;
#else
  return false;
#endif
}

// W [N, K] bf16 -> [ceil(N/16), K/2, 16, 2], zero columns past N. K must be even.
torch::Tensor pack_bf16_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_bf16_weight: a 2-D bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_bf16_weight: K must be even");
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto padded = weight.new_zeros({panels * kPanel, K});
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// y = x @ W^T + bias for x [M, K] bf16 (rows contiguous), `packed` from pack_bf16_weight, `bias` fp32
// padded to the packed width; `out` [M, N] bf16, rows contiguous.
void bf16_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "bf16_linear: x [M, K] bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(1) && packed.is_contiguous(), "bf16_linear: packed weight");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 && out.scalar_type() == at::kBFloat16,
              "bf16_linear: out [M, N] bf16");
  const int64_t N = out.size(1), panel_count = packed.size(0);
  TORCH_CHECK(N <= panel_count * kPanel && N > (panel_count - 1) * kPanel, "bf16_linear: out width != weight");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == panel_count * kPanel,
                "bf16_linear: bias fp32, padded");
  }
#ifdef PAGEDQ_BF16_GEMM
  const Gemm g{reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
               reinterpret_cast<const uint16_t*>(packed.data_ptr()), packed.size(1),
               bias ? bias->data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr()), out.stride(0), N};
  const int64_t M = x.size(0);
  at::parallel_for(0, panel_count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t m = 0; m < M; m += kBlockRows) panels(g, m, std::min(m + kBlockRows, M), p0, p1);
  });
#else
  TORCH_CHECK(false, "bf16_linear: built without avx512_bf16");
#endif
}
