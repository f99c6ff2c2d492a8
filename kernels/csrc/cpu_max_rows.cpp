// Each row's maximum and its first index: torch.max(x, dim=-1) for float32 rows of a vocabulary's width,
// in one pass at the memory's speed (kernels/cpu_max_rows.py). torch's own reduction with indices runs at
// ~45 us a row of 49,152 here, its value-only amax at ~7 us.
//
// Semantics (torch.max's): the largest value and the first index holding it; a row with a NaN gives NaN
// and the index of its first NaN; -inf and +inf compare as numbers (a row of -inf gives -inf at 0). Lane
// by lane a strictly greater value replaces the lane's best, so each lane keeps its first maximum; the
// lanes are then reduced to the largest value and, among the lanes holding it, the smallest index.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_simd.h"

namespace {

// Rows up to this count run on the calling thread (a row is ~10 us): more are split over the threads.
constexpr int64_t kInlineRows = 2;

void max_row(const float* x, int64_t n, float* value, int64_t* index) {
  int64_t k = 0;
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  bool nan = false;
#ifdef SPECDEC_AVX512
  if (n >= 16) {
    __m512 vbest = _mm512_loadu_ps(x);
    __m512i vat = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i vk = vat;
    __mmask16 unordered = _mm512_cmp_ps_mask(vbest, vbest, _CMP_UNORD_Q);
    for (k = 16; k + 16 <= n; k += 16) {
      vk = _mm512_add_epi32(vk, step);
      const __m512 v = _mm512_loadu_ps(x + k);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vbest = _mm512_mask_mov_ps(vbest, greater, v);
      vat = _mm512_mask_mov_epi32(vat, greater, vk);
    }
    nan = unordered != 0;
    alignas(64) float lanes[16];
    alignas(64) int32_t lane_at[16];
    _mm512_store_ps(lanes, vbest);
    _mm512_store_si512(reinterpret_cast<__m512i*>(lane_at), vat);
    best = lanes[0];
    at = lane_at[0];
    for (int j = 1; j < 16; ++j)
      if (lanes[j] > best || (lanes[j] == best && lane_at[j] < at)) {
        best = lanes[j];
        at = lane_at[j];
      }
  }
#endif
  if (k == 0 && n > 0) {  // no vector pass: start from the first element
    best = x[0];
    at = 0;
    nan = std::isnan(best);
    k = 1;
  }
  for (; k < n; ++k) {
    const float v = x[k];
    if (v > best) {
      best = v;
      at = k;
    } else if (std::isnan(v)) {
      nan = true;
    }
  }
  if (nan) {  // torch: NaN is the maximum, at its first index
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) {
        *value = x[j];
        *index = j;
        return;
      }
  }
  *value = best;
  *index = at;
}

}  // namespace

bool max_rows_vectorized() {
#ifdef SPECDEC_AVX512
  return true;
#else
  return false;
#endif
}

std::tuple<torch::Tensor, torch::Tensor> max_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0 &&
                  x.stride(1) == 1 && x.size(1) < (int64_t(1) << 31),
              "max_rows: x must be [rows, n] float32 on the CPU with contiguous rows, 0 < n < 2^31");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto values = torch::empty({rows}, x.options());
  auto indices = torch::empty({rows}, x.options().dtype(at::kLong));
  const float* src = x.data_ptr<float>();
  float* out_v = values.data_ptr<float>();
  int64_t* out_i = indices.data_ptr<int64_t>();
  at::parallel_for(0, rows, rows <= kInlineRows ? rows : 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) max_row(src + r * stride, n, out_v + r, out_i + r);
  });
  return {values, indices};
}
