// bfloat16 x bfloat16 skinny matrix products with AVX-512 BF16 dot-product instructions (vdpbf16ps):
// y[M, N] = x[M, K] @ w[N, K]^T (+ bias), M <= 16, float32 accumulation. Included by cpu_gemv.cpp, which
// uses it for bfloat16 weights and inputs when the compiler targets AVX512F + AVX512_BF16 (SPECDEC_BF16DP);
// the AVX2 path there serves every other case and every other CPU.
//
// vdpbf16ps multiplies 32 bfloat16 pairs and adds each adjacent pair of products into one of 16 float32
// lanes: w[n, k..k+32) and x[m, k..k+32) in their natural order give 16 partial sums of the dot product, so
// neither operand is widened or permuted (the AVX2 path spends two integer ops per 16 weights widening them
// and two FMAs per row). Each weight row is streamed once for up to 16 input rows, one accumulator per input
// row. Tiles of several weight rows (each input vector loaded once for them) measured slower here: 21-23
// against 29-35 GB/s at one row, 13-17 against 23-39 at five (2-core AMD EPYC with AVX512_BF16, a
// standalone microbenchmark): the memory system streams one row at a time best. The K tail uses masked
// loads (zeros add nothing), so there is no scalar loop.
// Products of bfloat16 values are exact in float32; the sums round to nearest in float32 (denormals flushed,
// as the instruction specifies), within one bfloat16 step of F.linear's float32 result after the output
// rounding. Reference: kernels/cpu_gemv.py:gemv_reference; tests/kernels/test_cpu_gemv.py.
// Source: Intel Intrinsics Guide, _mm512_dpbf16_ps (AVX512_BF16).
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SPECDEC_BF16DP 1
#include <ATen/Parallel.h>
#include "cpu_gemv_passes.h"
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace specdec_cpu_bf16dp {

// One weight row w[0:K] against MC input rows (x + j * xs): out[j] = dot(w, x_j), MC accumulators.
template <int MC>
inline void dot_rows(const uint16_t* w, int64_t K, const uint16_t* x, int64_t xs, float* out) {
  __m512 acc[MC];
  for (int j = 0; j < MC; ++j) acc[j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    // The row 4 ahead (the same prefetch distance as the AVX2 path, cpu_gemv.cpp).
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * K + k), _MM_HINT_T0);
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int j = 0; j < MC; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(x + j * xs + k), wv);
  }
  if (k < K) {
    const __mmask32 m = static_cast<__mmask32>((1u << (K - k)) - 1u);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k);
    for (int j = 0; j < MC; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_maskz_loadu_epi16(m, x + j * xs + k), wv);
  }
  for (int j = 0; j < MC; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
}

inline uint16_t round_bf16(float v) {  // round to nearest even, NaN kept a NaN (as at::BFloat16)
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Output rows [n0, n1) for the MC input rows at x (row stride xs), one weight row at a time.
template <int MC>
inline void rows(const uint16_t* x, int64_t xs, const uint16_t* w, const float* bias, uint16_t* y,
                 int64_t N, int64_t K, int64_t n0, int64_t n1) {
  float out[MC];
  for (int64_t n = n0; n < n1; ++n) {
    dot_rows<MC>(w + n * K, K, x, xs, out);
    const float b = bias ? bias[n] : 0.f;
    for (int j = 0; j < MC; ++j) y[j * N + n] = round_bf16(out[j] + b);
  }
}

// y [M, N] (bfloat16 bits, row stride N) = x [M, K] (row stride xs) @ w [N, K]^T + bias, any M (in
// passes of at most 16 rows, each streaming the weights once), threads over output rows.
inline void gemv(const uint16_t* x, int64_t xs, const uint16_t* w, const float* bias, uint16_t* y,
                 int64_t M, int64_t N, int64_t K) {
  specdec_cpu_passes::passes(M, N, [&](int64_t m0, auto r, int64_t n0, int64_t n1) {
    rows<decltype(r)::value>(x + m0 * xs, xs, w, bias, y + m0 * N, N, K, n0, n1);
  });
}

}  // namespace specdec_cpu_bf16dp
#endif
