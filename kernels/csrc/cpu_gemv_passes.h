// The row passes shared by the AVX-512 skinny-product kernels (cpu_gemv_bf16dp.h, cpu_gemv_f32x16.h):
// threads over output rows, input rows in passes of at most 16 (each pass streams the weights once), a
// pass's row count a compile-time constant for its kernel.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace specdec_cpu_passes {

// f(std::integral_constant<int, R>{}) for R = n, 1 <= n <= 16 (anything else: R = 1).
template <typename F>
inline void with_rows(int64_t n, F&& f) {
  switch (n) {
#define SPECDEC_ROWS_CASE(R) \
  case R: f(std::integral_constant<int, R>{}); break;
    SPECDEC_ROWS_CASE(16) SPECDEC_ROWS_CASE(15) SPECDEC_ROWS_CASE(14) SPECDEC_ROWS_CASE(13)
    SPECDEC_ROWS_CASE(12) SPECDEC_ROWS_CASE(11) SPECDEC_ROWS_CASE(10) SPECDEC_ROWS_CASE(9)
    SPECDEC_ROWS_CASE(8) SPECDEC_ROWS_CASE(7) SPECDEC_ROWS_CASE(6) SPECDEC_ROWS_CASE(5)
    SPECDEC_ROWS_CASE(4) SPECDEC_ROWS_CASE(3) SPECDEC_ROWS_CASE(2)
#undef SPECDEC_ROWS_CASE
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// pass(m0, rows, n0, n1) for the output rows [n0, n1) of each thread and each pass of input rows [m0,
// m0 + rows): passes of equal size (17 rows as 9 + 8, not 16 + 1), rows a std::integral_constant.
template <typename Pass>
inline void passes(int64_t M, int64_t N, Pass&& pass) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    const int64_t count = (M + 15) / 16, per_pass = (M + count - 1) / count;
    for (int64_t m0 = 0; m0 < M; m0 += per_pass)
      with_rows(std::min<int64_t>(per_pass, M - m0), [&](auto rows) { pass(m0, rows, n0, n1); });
  });
}

}  // namespace specdec_cpu_passes
