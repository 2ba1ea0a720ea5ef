// GEMM for the CPU's projections on AVX-512: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 sums, in
// fp32 (FMA, built wherever the CPU has AVX-512) and in bf16 (`vdpbf16ps`, where it has avx512_bf16;
// one rounding to bf16 at the end).
//
// Why not oneDNN alone: a decode step multiplies a few to 64 rows by every weight of the model, once.
// On a 2-core AMD EPYC, oneDNN's packed GEMM read SmolLM2's bf16 weights at 22-34 GB/s at 1-4 rows (a
// plain streaming read did 48 GB/s) and reached about 57% of its own 2048^3 rate at 64 rows, with the
// weights coming from memory rather than cache. This kernel is shaped for that case: the weight is
// packed once at load into panels of 16 output columns, each a contiguous run over K (fp32:
// [N/16][K][16][1]; bf16, K in pairs: [N/16][K/2][16][2]). A tile of up to 6 rows x 64 columns
// streams four panels front to back, one 64-byte load per panel per step of K, and every load feeds
// 6 FMA or dot-product instructions. The rows of x are broadcast from L1. Threads split the output
// columns, so each weight byte is read from memory once per block of 240 rows (once per call in a
// decode step). The first row tile of a group of panels reads them from memory; the later ones find
// them in L2 and prefetch the next group's lines there, one per step of K (4-12% faster at 24 to 64
// rows in an A/B).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_avx512.h"
#include "cpu_ops.h"
#include "cpu_parallel.h"

namespace {

constexpr int64_t kPanel = 16;   // output columns per packed panel (one zmm of fp32 sums)
constexpr int kMaxPanels = 4;    // panels per tile: 4 x 6 accumulators + 4 weights + 1 broadcast registers
constexpr int kTileRows = 6;
constexpr int64_t kBlockRows = 240;  // rows of x per pass over a thread's panels (kept in L2)

using pagedq_simd::built_for;

// K elements per step: one 64-byte line of a panel (16 fp32, or 16 pairs of bf16).
int64_t per_step(at::ScalarType t) { return t == at::kBFloat16 ? 2 : 1; }

#ifdef PAGEDQ_GEMM_FP32
template <typename T>
struct Gemm {
  const T* x;
  int64_t ldx;
  const T* w;         // packed
  int64_t steps;      // of K
  const float* bias;  // fp32, padded to the packed width, or null
  T* y;
  int64_t ldy;
  int64_t N;  // valid output columns
};

using pagedq_simd::Dot;

// Cache lines to bring into L2 while a tile runs, one per step of K: the next group of panels.
struct Prefetch {
  const char* at = nullptr;
  const char* end = nullptr;
};

// Rows [m, m + R) x panels [p, p + P) over all of K; the sums stay in registers.
template <typename T, int R, int P>
inline void tile(const Gemm<T>& g, int64_t m, int64_t p, Prefetch& pf) {
  constexpr int64_t line = 64 / sizeof(T);  // elements per panel per step
  const int64_t stride = g.steps * line;   // elements per panel
  const T* w = g.w + p * stride;
  const T* x = g.x + m * g.ldx;
  __m512 acc[R][P];
  for (int j = 0; j < P; ++j) {
    const __m512 b = g.bias ? _mm512_loadu_ps(g.bias + (p + j) * kPanel) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][j] = b;
  }
  for (int64_t s = 0; s < g.steps; ++s) {
    __m512i wv[P];
    for (int j = 0; j < P; ++j) wv[j] = _mm512_loadu_si512(w + j * stride + s * line);
    if (pf.at < pf.end) {
      _mm_prefetch(pf.at, _MM_HINT_T1);
      pf.at += 64;
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xb = Dot<T>::broadcast(x + r * g.ldx, s);
      for (int j = 0; j < P; ++j) acc[r][j] = Dot<T>::madd(acc[r][j], xb, wv[j]);
    }
  }
  for (int j = 0; j < P; ++j) {
    const int64_t col = (p + j) * kPanel;
    const int64_t valid = std::min(kPanel, g.N - col);
    const __mmask16 mask = valid == kPanel ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int r = 0; r < R; ++r) Dot<T>::store(g.y + (m + r) * g.ldy + col, mask, acc[r][j]);
  }
}

// Rows [m0, m1) of panels [p, p + P); the tiles after the first prefetch `next`.
template <typename T, int P>
inline void rows(const Gemm<T>& g, int64_t m0, int64_t m1, int64_t p, Prefetch next) {
  Prefetch none;
  Prefetch* pf = &none;  // the first tile streams its panels from memory: no prefetch beside it
  int64_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows, pf = &next) tile<T, kTileRows, P>(g, m, p, *pf);
  switch (m1 - m) {
    case 1: tile<T, 1, P>(g, m, p, *pf); break;
    case 2: tile<T, 2, P>(g, m, p, *pf); break;
    case 3: tile<T, 3, P>(g, m, p, *pf); break;
    case 4: tile<T, 4, P>(g, m, p, *pf); break;
    case 5: tile<T, 5, P>(g, m, p, *pf); break;
    default: break;
  }
}

// Rows [m0, m1) of group `group` of panels (kMaxPanels of them, fewer in the last group); its tiles after
// the first prefetch group `next` (-1: none) into L2.
template <typename T>
inline void group_rows(const Gemm<T>& g, int64_t m0, int64_t m1, int64_t group, int64_t next, int64_t panel_count) {
  const int64_t bytes = g.steps * 64;  // per panel
  const char* base = reinterpret_cast<const char*>(g.w);
  Prefetch pf;
  if (next >= 0) {
    const int64_t a = next * kMaxPanels, b = std::min(a + kMaxPanels, panel_count);
    pf = Prefetch{base + a * bytes, base + b * bytes};
  }
  const int64_t p = group * kMaxPanels;
  switch (std::min<int64_t>(kMaxPanels, panel_count - p)) {
    case 1: rows<T, 1>(g, m0, m1, p, pf); break;
    case 2: rows<T, 2>(g, m0, m1, p, pf); break;
    case 3: rows<T, 3>(g, m0, m1, p, pf); break;
    case 4: rows<T, 4>(g, m0, m1, p, pf); break;
    default: break;
  }
}

// Each thread takes a contiguous share of the groups of panels and walks it front to back, prefetching
// its next group; a thread done with its share takes groups from the back of the others'
// (cpu_parallel.h).
template <typename T>
void run(const torch::Tensor& x, const torch::Tensor& packed, const float* bias, torch::Tensor& out) {
  const int64_t M = x.size(0), panel_count = packed.size(0);
  const Gemm<T> g{x.data_ptr<T>(), x.stride(0), packed.data_ptr<T>(), packed.size(1), bias,
                  out.data_ptr<T>(), out.stride(0), out.size(1)};
  const int64_t groups = (panel_count + kMaxPanels - 1) / kMaxPanels;
  for (int64_t m = 0; m < M; m += kBlockRows) {
    const int64_t m1 = std::min(m + kBlockRows, M);
    pagedq_parallel::run_items(groups, [&](int64_t group, int64_t next) {
      group_rows(g, m, m1, group, next, panel_count);
    });
  }
}
#endif

// Whether the memory spans of two 2-D tensors (first to last element) overlap.
bool spans_overlap(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  auto span = [](const torch::Tensor& t) {
    const char* first = static_cast<const char*>(t.data_ptr());
    const int64_t last = (t.size(0) - 1) * t.stride(0) + (t.size(1) - 1) * t.stride(1);
    return std::make_pair(first, first + (last + 1) * t.element_size());
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

}  // namespace

// The dtypes gemm_linear was built for on this CPU: float32 with AVX-512, bfloat16 with avx512_bf16.
std::vector<std::string> gemm_dtypes() {
  std::vector<std::string> out;
  if (built_for(at::kFloat)) out.emplace_back("float32");
  if (built_for(at::kBFloat16)) out.emplace_back("bfloat16");
  return out;
}

// W [N, K] -> panels of 16 output columns, zero columns past N: fp32 [ceil(N/16), K, 16, 1], bf16
// [ceil(N/16), K/2, 16, 2] (K must be even).
torch::Tensor pack_gemm_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_cpu() && built_for(weight.scalar_type()),
              "pack_gemm_weight: a 2-D CPU weight of a built dtype");
  const int64_t N = weight.size(0), K = weight.size(1), step = per_step(weight.scalar_type());
  TORCH_CHECK(K % step == 0, "pack_gemm_weight: K must be even for bf16");
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto padded = weight.new_zeros({panels * kPanel, K});
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K / step, step}).permute({0, 2, 1, 3}).contiguous();
}

// out = x @ W^T + bias for x [M, K] (rows contiguous), `packed` from pack_gemm_weight, `bias` fp32
// padded to the packed width; `out` [M, N] in x's dtype, rows contiguous and not overlapping.
// An int8 `packed` (pack_gemm_weight_int8) goes to the int8 kernel (cpu_gemm_int8.cpp).
void gemm_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, torch::Tensor out) {
  if (packed.scalar_type() == at::kChar) return gemm_linear_int8(x, packed, bias, out);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_cpu() && (x.stride(1) == 1 || x.size(1) <= 1) && built_for(dtype),
              "gemm_linear: x [M, K] on the CPU, of a built dtype");
  TORCH_CHECK(packed.dim() == 4 && packed.is_cpu() && packed.is_contiguous() && packed.size(2) == kPanel &&
                  packed.size(3) == per_step(packed.scalar_type()),
              "gemm_linear: packed is not a weight from pack_gemm_weight");
  TORCH_CHECK(packed.scalar_type() == dtype && packed.size(1) * packed.size(3) == x.size(1),
              "gemm_linear: the weight's dtype and K differ from x's");
  TORCH_CHECK(out.dim() == 2 && out.is_cpu() && out.size(0) == x.size(0) && out.scalar_type() == dtype &&
                  (out.stride(1) == 1 || out.size(1) <= 1) && (out.size(0) <= 1 || out.stride(0) >= out.size(1)),
              "gemm_linear: out [M, N] on the CPU, in x's dtype, rows contiguous");
  TORCH_CHECK(!spans_overlap(out, x), "gemm_linear: out must not overlap x");
  const int64_t panel_count = packed.size(0);
  TORCH_CHECK(out.size(1) <= panel_count * kPanel && out.size(1) > (panel_count - 1) * kPanel,
              "gemm_linear: out width != weight");
  TORCH_CHECK(!bias || (bias->is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->numel() == panel_count * kPanel),
              "gemm_linear: bias fp32, padded");
#ifdef PAGEDQ_GEMM_FP32
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
#ifdef PAGEDQ_GEMM_BF16
  if (dtype == at::kBFloat16) {
    if (gemm_amx(x, packed, b, out)) return;  // AMX tiles where the CPU has them, from 4 rows up
    return run<at::BFloat16>(x, packed, b, out);
  }
#endif
  run<float>(x, packed, b, out);
#endif
}
