// The row passes shared by the AVX-512 skinny-product kernels (cpu_gemv_bf16dp.h, cpu_gemv_f32x16.h,
// cpu_gemv_int8.cpp): threads over output rows, input rows in passes of at most 16 (each pass streams the
// weights once), a pass's row count a compile-time constant for its kernel (with_rows, which the packed
// tile kernels' passes use too, cpu_gemv_tiles.h).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace specdec_cpu_passes {

// f(std::integral_constant<int, R>{}) for R = n, 1 <= n <= Max (anything else: R = 1); Max <= 16. The packed
// tile kernels (cpu_gemv_tiles.h) take passes of at most 6 rows: Max = 6.
template <int Max = 16, typename F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (Max > 1) {
    if (n == Max) {
      f(std::integral_constant<int, Max>{});
      return;
    }
    with_rows<Max - 1>(n, std::forward<F>(f));
  } else {
    f(std::integral_constant<int, 1>{});
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
