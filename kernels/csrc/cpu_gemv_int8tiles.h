// Weight-only int8 products with AVX512_VNNI on codes packed into the pair-major tile order
// (cpu_gemv_tiles.h, int8 elements): y[M, N] = x[M, K] @ (codes[N, K] * scales[N])^T + bias. Included by
// cpu_gemv_int8.cpp, which quantizes each input row to int16 (one scale per row, as for its row-major
// kernel) and calls linear() here for a QuantizedLinear that holds packed codes.
//
// Why: the row-major kernel streams each weight row once for all input rows but ends every output with a
// horizontal sum, and its one memory stream per weight row (the Zen 4 choice) reads SmolLM2's short rows
// (576 codes) at 17-20 GB/s against the bfloat16 tile kernel's 26-30 (cpu_gemv_bf16tiles.h). Here, as in
// the bfloat16 tile kernel, one input pair's codes for a group's 64 outputs lie together (128 bytes): four
// 32-byte loads in memory order, each sign-extended to 16 int16 pairs (vpmovsxbw), each input pair
// broadcast once and met by the four (vpdpwssd: 16 lanes, each adding its output's two products), and the
// sums come out as whole vectors of outputs.
//
// Values: each output's integer sum is exact within each block of 512 columns (at most 512 * 127 * 32767
// < 2^31 per lane) and the blocks' sums are added in float32, in column order, whatever M or the other
// rows of the pass: a row's outputs do not depend on the batch. They differ from the row-major kernel's
// (which adds 16 lanes' partial sums in float32) by float32 rounding. Then y = sum * sx * scales[n] +
// bias[n] in float32, rounded to x's dtype (bfloat16: to nearest even).
// Reference: kernels/cpu_gemv_int8.py:gemv_int8_reference; tests/kernels/test_cpu_gemv_int8.py. Source:
// Intel Intrinsics Guide, _mm512_dpwssd_epi32, _mm512_cvtepi8_epi16.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECDEC_INT8TILES 1
#include <ATen/core/TensorBase.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include "cpu_gemv_tiles.h"

namespace specdec_cpu_int8tiles {

using namespace specdec_cpu_tiles;

// Input rows per pass: 4 weight vectors x 6 rows = 24 int32 accumulators, as the bfloat16 tile kernel.
constexpr int kMaxRows = 6;
// Tile blocks (32 columns each) summed exactly in int32 before a float32 flush: 512 columns.
constexpr int64_t kFlushBlocks = 16;
#ifndef SPECDEC_INT8_TILE_PREFETCH
#define SPECDEC_INT8_TILE_PREFETCH 4
#endif
// Software prefetch distance in kb steps (2 KB of codes each).
constexpr int64_t kPrefetch = SPECDEC_INT8_TILE_PREFETCH;

// 16 float32 values rounded to bfloat16 bits, to nearest even (NaN: 0x7FC0), as c10::BFloat16(float).
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}

inline void store16(float* y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }
inline void store16(at::BFloat16* y, __mmask16 mask, __m512 v) {
  _mm256_mask_storeu_epi16(y, mask, to_bf16(v));
}

// Outputs of tiles [j0, j0 + NT) of group pg for MR quantized input rows xq (row stride Kp >= KB * 32
// int16, zeros past K; row scales sx): y rows m (stride N).
template <int MR, int NT, typename X>
inline void pass(const int16_t* xq, int64_t Kp, const float* sx, const int8_t* pg, int64_t KB, int64_t j0,
                 int64_t n_first, int64_t N, const float* scales, const float* bias, X* y) {
  __m512 total[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NT; ++j) total[m][j] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < KB; b0 += kFlushBlocks) {
    __m512i acc[MR][NT];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_si512();
    const int64_t b1 = std::min(KB, b0 + kFlushBlocks);
    for (int64_t kb = b0; kb < b1; ++kb) {
      const int16_t* xk = xq + kb * kTileK;
      for (int64_t r = 0; r < kTileK / 2; ++r) {
        // Input pair r's codes for the group's 64 outputs (32 bytes per tile), read in memory order.
        const int8_t* wr = pg + ((kb * kTileK / 2 + r) * kGroup + j0) * 2 * kTileN;
        for (int j = 0; j < NT; j += 2)  // a cache line (two tiles' 32 bytes each), kPrefetch * 2 KB ahead
          _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch * kGroup * kTileElems + j * 2 * kTileN),
                       _MM_HINT_T0);
        __m512i wv[NT];
        for (int j = 0; j < NT; ++j)
          wv[j] = _mm512_cvtepi8_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + j * 2 * kTileN)));
        for (int m = 0; m < MR; ++m) {
          int32_t pair;  // the input pair (xq[2r], xq[2r + 1]) as one 32-bit lane, broadcast to all 16
          std::memcpy(&pair, xk + m * Kp + 2 * r, sizeof pair);
          const __m512i xv = _mm512_set1_epi32(pair);
          for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_dpwssd_epi32(acc[m][j], xv, wv[j]);
        }
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NT; ++j) total[m][j] = _mm512_add_ps(total[m][j], _mm512_cvtepi32_ps(acc[m][j]));
  }
  for (int j = 0; j < NT; ++j) {
    const int64_t n0 = n_first + j * kTileN;
    if (n0 >= N) break;
    const int64_t width = std::min<int64_t>(kTileN, N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1u);
    const __m512 sv = _mm512_maskz_loadu_ps(mask, scales + n0);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(total[m][j], _mm512_set1_ps(sx[m])), sv);
      store16(y + m * N + n0, mask, _mm512_add_ps(v, bv));
    }
  }
}

// y [M, N] (row stride N) = dequantized product on p = codes packed pair-major (specdec_cpu_tiles::pack with
// int8 elements): xq [M, Kp] the int16 input rows, sx [M] their scales. Passes as
// specdec_cpu_tiles::for_passes makes them (half-groups per thread, passes of at most kMaxRows rows).
template <typename X>
inline void linear(const int16_t* xq, int64_t Kp, const float* sx, int64_t M, const int8_t* p, int64_t N,
                   int64_t K, const float* scales, const float* bias, X* y) {
  const int64_t KB = (K + kTileK - 1) / kTileK;
  for_passes(M, N, kMaxRows, [&](int64_t g, int64_t j0, int64_t m0, auto mr, auto nt) {
    pass<decltype(mr)::value, decltype(nt)::value>(xq + m0 * Kp, Kp, sx + m0, p + g * KB * kGroup * kTileElems,
                                                   KB, j0, (g * kGroup + j0) * kTileN, N, scales, bias,
                                                   y + m0 * N);
  });
}

}  // namespace specdec_cpu_int8tiles
#endif
