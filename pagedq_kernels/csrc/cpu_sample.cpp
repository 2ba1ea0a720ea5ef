// Greedy sampling on the CPU: the index of each row's first maximum, as torch's `max(dim=-1).indices`.
//
// A greedy step reduces [rows, vocab] logits (64 x 49,152 for SmolLM2 at 64 requests): torch's reduction
// took about 1.5 ms of it on a 2-core AVX-512 machine, single-threaded over bf16. Here each thread takes
// whole rows, 16 lanes at a time: every lane keeps its own first maximum and its index, then the lanes
// holding the row's maximum give the smallest index. A row with a NaN gives its first NaN, as torch's
// max (which propagates NaN) does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_avx512.h"

namespace {

template <typename T>
int64_t first_nan(const T* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(static_cast<float>(row[i]))) return i;
  return -1;
}

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
#ifdef PAGEDQ_SIMD512
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = neg_inf;
  __m512i best_at = _mm512_setzero_si512();
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = pagedq_simd::load16(row + i);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
    best = _mm512_mask_mov_ps(best, gt, v);
    best_at = _mm512_mask_mov_epi32(best_at, gt, at);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    at = _mm512_add_epi32(at, step);
  }
  if (nan) return first_nan(row, n);
  const float top = _mm512_reduce_max_ps(best);
  int64_t index = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ), best_at);
  float value = top;
  if (i == 0) value = -std::numeric_limits<float>::infinity(), index = 0;
  for (; i < n; ++i) {  // the tail, in order after every full chunk
    const float v = static_cast<float>(row[i]);
    if (std::isnan(v)) return first_nan(row, n);
    if (v > value) value = v, index = i;
  }
  return index;
#else
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (std::isnan(v)) return i;
    if (v > value) value = v, index = i;
  }
  return index;
#endif
}

template <typename T>
void argmax_rows(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  // A row per task once rows are long enough to be worth a thread (a parallel region costs microseconds).
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, n));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * ld, n);
  });
}

}  // namespace

bool greedy_argmax_fast() {
#ifdef PAGEDQ_SIMD512
  return true;
#else
  return false;
#endif
}

torch::Tensor greedy_argmax(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "greedy_argmax: x must be [rows, n > 0], unit stride");
  TORCH_CHECK(x.size(1) <= std::numeric_limits<int32_t>::max(), "greedy_argmax: rows longer than 2^31");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  switch (x.scalar_type()) {
    case at::kFloat: argmax_rows<float>(x, out); break;
    case at::kBFloat16: argmax_rows<at::BFloat16>(x, out); break;
    case at::kHalf: argmax_rows<at::Half>(x, out); break;
    default: TORCH_CHECK(false, "greedy_argmax: float32, bfloat16 or float16 only");
  }
  return out;
}
