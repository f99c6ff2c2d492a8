// bfloat16 x bfloat16 matrix products with AVX-512 BF16 dot products (vdpbf16ps) on a weight packed into
// tile order (cpu_gemv_tiles.h): y[M, N] = x[M, K] @ w[N, K]^T (+ bias), float32 accumulation, any M.
// Included by cpu_gemv.cpp, which uses it for a linear layer's products on a CPU with AVX512_BF16 but no
// AMX (where AMX is, cpu_gemv_amx.h multiplies the same layout).
//
// Why: the row-major kernel (cpu_gemv_bf16dp.h) streams each weight row once for all input rows but ends
// every output with a horizontal sum per input row, and past a few rows oneDNN's GEMM took over, reading
// the weights in its own packing. Here one input pair's weights for a group's 64 outputs lie together
// (the pair-major tile order, cpu_gemv_tiles.h): four 64-byte loads in memory order, each input pair
// broadcast once and met by the four weight vectors, 4 x (up to 6) accumulators of 16 outputs each, and the
// sums come out as whole vectors of outputs with no horizontal step. The AMX order (each tile's rows
// together, the four tiles 1 KB apart) read here tile by tile or interleaved ran 1.3-2x slower: the
// memory system streams one sequential range best. On a 2-core AMD EPYC (Zen 4) with AVX512_BF16, SmolLM2
// shapes, weights cold, against the row-major kernel and oneDNN's packed GEMM in the same run: at five rows
// 3072 x 576 81-88 us (row-major 121-129, oneDNN 121-128), 49152 x 576 1.2-1.4 ms (1.6-2.7, 1.4-1.9); at
// 16 rows 166-180 us (310, 205) and 2.7-2.9 ms (5.2, 2.9-3.1); at one row level with the row-major
// kernel; from 32 to 256 rows (prefill chunks) 1.1-1.9x faster than F.linear (docs/kernels.md).
//
// Each output's sum runs over the input pairs in order, into one float32 lane, whatever M and whichever
// rows share a pass: a row verified among k + 1 gets the bits it gets decoded alone, so greedy speculative
// decoding equals greedy plain decoding bit for bit in bfloat16 (as with AMX). Products of bfloat16 values
// are exact in float32 and the sums round to nearest in float32 (denormals flushed, as the instruction
// specifies): within one bfloat16 rounding of F.linear's float32 result after the output rounding.
// Reference: kernels/cpu_gemv.py:gemv_reference; tests/kernels/test_cpu_gemv.py. Source: Intel Intrinsics
// Guide, _mm512_dpbf16_ps, _mm512_cvtneps_pbh (AVX512_BF16).
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SPECDEC_BF16TILES 1
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include "cpu_gemv_tiles.h"

namespace specdec_cpu_bf16tiles {

using namespace specdec_cpu_tiles;

// Input rows per pass: 4 weight vectors x 6 rows = 24 accumulators, with the 4 weight vectors and a
// broadcast input, 29 of the 32 vector registers (6 rather than 5: 16 rows in 3 passes, not 4; 5-9 % faster
// there).
constexpr int kMaxRows = 6;
#ifndef SPECDEC_TILE_PREFETCH
#define SPECDEC_TILE_PREFETCH 2
#endif
// Software prefetch distance in kb steps (4 KB each).
constexpr int64_t kPrefetch = SPECDEC_TILE_PREFETCH;
#ifndef SPECDEC_TILE_FAR_PREFETCH
#define SPECDEC_TILE_FAR_PREFETCH 8
#endif
// Passes of more than one row also prefetch into L2 this many kb steps ahead (32 KB). Their arithmetic
// (MR x NT dot products per input pair) holds the loop long enough that the memory idles between the
// near prefetches; the far ones keep it streaming under the arithmetic. A/B of experiments.bench_step
// (SmolLM2-135M bfloat16, 2-core AMD EPYC Zen 4, two runs of each in turn; ratios to the plain step, which
// this does not touch): a chain of 5 1.11-1.13 -> 1.07-1.08, a 16-node tree 1.69-1.75 -> 1.58-1.66. One-row
// passes omit it: there it cost 3-5 % in a first A/B. Interleaving the passes over chunks of blocks (so the
// later passes read a chunk from L1 while memory streams the next) measured level and was not kept.
constexpr int64_t kFarPrefetch = SPECDEC_TILE_FAR_PREFETCH;

// Outputs of tiles [j0, j0 + NT) of group pg for MR input rows at x (row stride xs, KB * 32 elements each,
// zeros past K): y rows m (stride N), bias added, rounded to bfloat16.
template <int MR, int NT>
inline void pass(const uint16_t* x, int64_t xs, const uint16_t* pg, int64_t KB, int64_t j0, int64_t n_first,
                 int64_t N, const float* bias, uint16_t* y) {
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint16_t* xk = x + kb * kTileK;
    for (int64_t r = 0; r < kTileK / 2; ++r) {
      // The input pair r's weights for the group's 64 outputs lie together (pair-major layout): tiles [j0,
      // j0 + NT) of them are read in memory order.
      const uint16_t* wr = pg + ((kb * kTileK / 2 + r) * kGroup + j0) * 2 * kTileN;
      for (int j = 0; j < NT; ++j) {  // a cache line per tile row, kPrefetch * 4 KB ahead (and kFarPrefetch)
        _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch * kGroup * kTileElems + j * 2 * kTileN),
                     _MM_HINT_T0);
        if constexpr (MR > 1)
          _mm_prefetch(reinterpret_cast<const char*>(wr + kFarPrefetch * kGroup * kTileElems + j * 2 * kTileN),
                       _MM_HINT_T1);
      }
      __m512bh wv[NT];
      for (int j = 0; j < NT; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wr + j * 2 * kTileN);
      for (int m = 0; m < MR; ++m) {
        int32_t pair;  // the input pair (x[2r], x[2r + 1]) as one 32-bit lane, broadcast to all 16
        std::memcpy(&pair, xk + m * xs + 2 * r, sizeof pair);
        const __m512i xv = _mm512_set1_epi32(pair);
        for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)xv, wv[j]);
      }
    }
  }
  for (int j = 0; j < NT; ++j) {
    const int64_t n0 = n_first + j * kTileN;
    if (n0 >= N) break;
    const int64_t width = std::min<int64_t>(kTileN, N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      // Round to nearest even (vcvtneps2bf16), as the other kernels round their float32 sums.
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], bv));
      _mm256_mask_storeu_epi16(y + m * N + n0, mask, (__m256i)out);
    }
  }
}

// y [M, N] (bfloat16 bits, row stride N) = x @ w^T + bias. x: rows of at least KB * 32 elements (zeros
// past K), row stride xs elements; p packed pair-major by specdec_cpu_tiles::pack. Passes as
// specdec_cpu_tiles::for_passes makes them (half-groups per thread; per group passes of at most kMaxRows
// rows: a group holds 4 KB of weights per 32 inputs, read from the cache after the first pass).
inline void linear(const uint16_t* x, int64_t xs, int64_t M, const uint16_t* p, int64_t N, int64_t K,
                   const float* bias, uint16_t* y) {
  const int64_t KB = (K + kTileK - 1) / kTileK;
  for_passes(M, N, kMaxRows, [&](int64_t g, int64_t j0, int64_t m0, auto mr, auto nt) {
    pass<decltype(mr)::value, decltype(nt)::value>(x + m0 * xs, xs, p + g * KB * kGroup * kTileElems, KB, j0,
                                                   (g * kGroup + j0) * kTileN, N, bias, y + m0 * N);
  });
}

}  // namespace specdec_cpu_bf16tiles
#endif
