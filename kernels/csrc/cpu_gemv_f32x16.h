// float32 x float32 skinny matrix products with 16-lane AVX-512 FMAs: y[M, N] = x[M, K] @ w[N, K]^T
// (+ bias), float32 accumulation. Included by cpu_gemv.cpp, which uses it for float32 weights and inputs
// when the compiler targets AVX512F (SPECDEC_F32X16); the AVX2 path there serves every other case.
//
// Why: the AVX2 path keeps 8-lane accumulators, at most 8 input rows per pass over the weights, so 16
// concurrent requests read every weight twice. Here each weight row is streamed once for up to 16 input
// rows (one 16-lane accumulator per row, 16 of the 32 registers), with a software prefetch 4 rows ahead.
// On a 2-core Intel Xeon (AVX-512), SmolLM2-135M shapes, weights cold, microseconds at 1 / 16 rows:
// gate/up 3072 x 576 259 / 496 on the AVX2 path. Sums round in float32 in another order than F.linear:
// within 1e-5 relative. Reference: kernels/cpu_gemv.py:gemv_reference; tests/kernels/test_cpu_gemv.py.
#pragma once
#if defined(__AVX512F__)
#define SPECDEC_F32X16 1
#include <ATen/Parallel.h>
#include "cpu_gemv_passes.h"
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace specdec_cpu_f32x16 {

// One weight row w[0:K] against MC input rows (x + j * xs): out[j] = dot(w, x_j).
template <int MC>
inline void dot_rows(const float* w, int64_t K, const float* x, int64_t xs, float* out) {
  __m512 acc[MC];
  for (int j = 0; j < MC; ++j) acc[j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * K + k), _MM_HINT_T0);
    const __m512 wv = _mm512_loadu_ps(w + k);
    for (int j = 0; j < MC; ++j) acc[j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + j * xs + k), acc[j]);
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m512 wv = _mm512_maskz_loadu_ps(m, w + k);
    for (int j = 0; j < MC; ++j) acc[j] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + j * xs + k), acc[j]);
  }
  for (int j = 0; j < MC; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
}

template <int MC>
inline void rows(const float* x, int64_t xs, const float* w, const float* bias, float* y, int64_t N,
                 int64_t K, int64_t n0, int64_t n1) {
  float out[MC];
  for (int64_t n = n0; n < n1; ++n) {
    dot_rows<MC>(w + n * K, K, x, xs, out);
    const float b = bias ? bias[n] : 0.f;
    for (int j = 0; j < MC; ++j) y[j * N + n] = out[j] + b;
  }
}

// y [M, N] (row stride N) = x [M, K] (row stride xs) @ w [N, K]^T + bias, any M (passes of at most 16
// rows, equal in size), threads over output rows.
inline void gemv(const float* x, int64_t xs, const float* w, const float* bias, float* y, int64_t M,
                 int64_t N, int64_t K) {
  specdec_cpu_passes::passes(M, N, [&](int64_t m0, auto r, int64_t n0, int64_t n1) {
    rows<decltype(r)::value>(x + m0 * xs, xs, w, bias, y + m0 * N, N, K, n0, n1);
  });
}

}  // namespace specdec_cpu_f32x16
#endif
