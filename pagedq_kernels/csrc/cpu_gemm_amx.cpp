// The bf16 GEMM on Intel's AMX tiles, from the same packed weight as cpu_gemm.cpp's AVX-512 path.
//
// On a 2-core Xeon with AMX, oneDNN's bf16 GEMM (which uses the tiles) ran 1.3x to 4.5x faster than the
// AVX-512 `vdpbf16ps` kernel at 8 to 64 rows with the weights coming from memory; the vector kernel still won
// at 1 and 2 rows. The weight's panel layout, [N/16][K/2][16][2], is already what a tile multiply takes as
// its right operand: 32 steps of K of one panel are 16 rows of 64 bytes, contiguous. So where K is a
// multiple of 32, calls of kAmxMinRows rows or more go through the tiles here (padded to 16 rows), fewer
// through the vector kernel, and the model keeps one packed copy of each weight. PAGEDQ_CPU_AMX=0 turns
// the tiles off (an A/B switch).
//
// A thread takes two panels (32 output columns) at a time and walks the rows of x 32 at a time: 2 x 2
// fp32 sum tiles, 2 tiles of x and 2 of the weight, over all of K; the sums go through a small buffer to
// add the bias, round to bf16 and store the valid columns, as the vector kernel stores them.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "cpu_amx.h"
#include "cpu_avx512.h"
#include "cpu_ops.h"
#include "cpu_parallel.h"

namespace {

#ifdef PAGEDQ_AMX
constexpr int64_t kTile = 16;       // rows of a tile; output columns of a panel
constexpr int64_t kDepth = 32;      // K per tile step: 64 bytes of x's row, 16 pairs of the weight
constexpr int64_t kBlockRows = 256;  // rows of x per pass over a thread's panels (kept in L2)
// Fewer rows go through the vector kernel, which won at 1 and 2 rows (python -m ops.bench.gemm_paths).
constexpr int64_t kAmxMinRows = 4;

// Tiles 0-3: sums (x tile i, panel j) at 2 i + j; 4-5: x; 6-7: the weight (cpu_amx.h's shapes).
using pagedq_amx::tiles_permitted;

// Sums of x rows [0, 16 I) times panels [0, J) over K, into c [16 I][32] (fp32).
template <int I, int J>
void tile_block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t panel_stride, int64_t steps,
                float* c) {
  _tile_zero(0);
  if constexpr (J > 1) _tile_zero(1);
  if constexpr (I > 1) _tile_zero(2);
  if constexpr (I > 1 && J > 1) _tile_zero(3);
  const int64_t x_bytes = ldx * 2;
  for (int64_t s = 0; s < steps; ++s) {
    const at::BFloat16* ws = w + s * kDepth * kTile;
    _tile_loadd(4, x + s * kDepth, x_bytes);
    _tile_loadd(6, ws, 64);
    if constexpr (J > 1) _tile_loadd(7, ws + panel_stride, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (J > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (I > 1) {
      _tile_loadd(5, x + kTile * ldx + s * kDepth, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (J > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ldc_bytes = 2 * kTile * 4;
  _tile_stored(0, c, ldc_bytes);
  if constexpr (J > 1) _tile_stored(1, c + kTile, ldc_bytes);
  if constexpr (I > 1) _tile_stored(2, c + kTile * 2 * kTile, ldc_bytes);
  if constexpr (I > 1 && J > 1) _tile_stored(3, c + kTile * 2 * kTile + kTile, ldc_bytes);
}

struct AmxGemm {
  const at::BFloat16* x;  // rows padded to a multiple of 16
  int64_t ldx, M;         // M: valid rows
  const at::BFloat16* w;
  int64_t panel_stride, steps, panel_count;
  const float* bias;
  at::BFloat16* y;
  int64_t ldy, N;
};

// Rows [m0, m1) (m0 a multiple of 16) of panels p, p + 1 (p alone when it is the last).
void panel_pair(const AmxGemm& g, int64_t m0, int64_t m1, int64_t p) {
  pagedq_amx::load_tile_config();
  alignas(64) float c[2 * kTile * 2 * kTile];
  const int J = p + 1 < g.panel_count ? 2 : 1;
  const at::BFloat16* w = g.w + p * g.panel_stride;
  for (int64_t m = m0; m < m1; m += 2 * kTile) {
    const int I = m + kTile < m1 ? 2 : 1;
    const at::BFloat16* x = g.x + m * g.ldx;
    if (I == 2 && J == 2) tile_block<2, 2>(x, g.ldx, w, g.panel_stride, g.steps, c);
    else if (I == 2) tile_block<2, 1>(x, g.ldx, w, g.panel_stride, g.steps, c);
    else if (J == 2) tile_block<1, 2>(x, g.ldx, w, g.panel_stride, g.steps, c);
    else tile_block<1, 1>(x, g.ldx, w, g.panel_stride, g.steps, c);
    const int64_t rows = std::min<int64_t>(I * kTile, g.M - m);
    for (int j = 0; j < J; ++j) {
      const int64_t col = (p + j) * kTile;
      const int64_t valid = std::min(kTile, g.N - col);
      const __mmask16 mask = valid == kTile ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
      const __m512 b = g.bias ? _mm512_loadu_ps(g.bias + col) : _mm512_setzero_ps();
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 v = _mm512_add_ps(b, _mm512_load_ps(c + r * 2 * kTile + j * kTile));
        pagedq_simd::Dot<at::BFloat16>::store(g.y + (m + r) * g.ldy + col, mask, v);
      }
    }
  }
}
#endif

}  // namespace

bool gemm_amx_available() {
#ifdef PAGEDQ_AMX
  return tiles_permitted();
#else
  return false;
#endif
}

bool gemm_amx(const torch::Tensor& x, const torch::Tensor& packed, const float* bias, torch::Tensor& out) {
#ifdef PAGEDQ_AMX
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() != at::kBFloat16 || M < kAmxMinRows || K % kDepth != 0 || !tiles_permitted()) return false;
  torch::Tensor rows = x;
  if (M % kTile != 0) {  // the tiles load 16 rows at a time: pad with zero rows
    rows = torch::zeros({(M + kTile - 1) / kTile * kTile, K}, x.options());
    rows.narrow(0, 0, M).copy_(x);
  }
  const int64_t panel_count = packed.size(0);
  const AmxGemm g{rows.data_ptr<at::BFloat16>(), rows.stride(0), M, packed.data_ptr<at::BFloat16>(),
                  packed.size(1) * kTile * 2, K / kDepth, panel_count, bias, out.data_ptr<at::BFloat16>(),
                  out.stride(0), out.size(1)};
  const int64_t pairs = (panel_count + 1) / 2;
  for (int64_t m = 0; m < M; m += kBlockRows) {
    const int64_t m1 = std::min(m + kBlockRows, M);
    pagedq_parallel::run_items(pairs, [&](int64_t pair, int64_t) { panel_pair(g, m, m1, 2 * pair); });
  }
  return true;
#else
  (void)x, (void)packed, (void)bias, (void)out;
  return false;
#endif
}
