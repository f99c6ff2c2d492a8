// bfloat16 x bfloat16 matrix products on Intel AMX tiles (TDPBF16PS): y[M, N] = x[M, K] @ w[N, K]^T
// (+ bias) against a weight packed once into tile order (pack), float32 accumulation, any M. Included by
// cpu_gemv.cpp, which uses it for a linear layer's products of 2 rows and more (verification chains and
// trees, batched decode rows, prefill chunks) where the compiler targets AMX-TILE + AMX-BF16 and the
// kernel may use the tiles (Linux grants them on request, arch_prctl(ARCH_REQ_XCOMP_PERM)).
//
// Why: vdpbf16ps (cpu_gemv_bf16dp.h) issues one 32-pair dot product about every two cycles here, so past
// one row its products, not the memory, bound a GEMV: on a 2-core Intel Xeon with AMX (SmolLM2-135M
// shapes, weights cold) 3072 x 576 took 140 us at one row and 221 us at five. One TDPBF16PS multiplies a
// 16-row input tile by a 16-output weight tile over 32 inputs (16 x 16 x 32 multiply-adds) in about 16
// cycles, so the same weights stream at the memory's speed for every row count up to 16: 130-135 us at
// 1-8 rows, 146 at 16 (26-27 GB/s; 49152 x 576: 2.0-2.1 ms at 1-8 rows). A standalone microbenchmark
// measured it; oneDNN's AMX GEMM on its own packed weights took 170 us at every row count.
//
// Packed layout: cpu_gemv_tiles.h (shared with the AVX-512 BF16 kernel on packed weights,
// cpu_gemv_bf16tiles.h), each 1 KB tile the "VNNI" B operand of TDPBF16PS. Products of bfloat16 values
// are exact in float32; TDPBF16PS adds them in float32 in its own order (denormals flushed), so outputs
// agree with F.linear's float32 result within one bfloat16 rounding, like the other kernels. Source:
// Intel Architecture Instruction Set Extensions Programming Reference, chapter 3 (AMX): TILELOADD,
// TDPBF16PS, LDTILECFG; Linux Documentation/arch/x86/xstate.rst.
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define SPECDEC_AMX 1
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "cpu_gemv_tiles.h"
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace specdec_cpu_amx {

using specdec_cpu_tiles::kGroup;
using specdec_cpu_tiles::kTileElems;
using specdec_cpu_tiles::kTileK;
using specdec_cpu_tiles::kTileN;

// Whether this process may use the tiles: Linux hands out the AMX register state on request, once per
// process (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); false on kernels or CPUs that refuse.
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// Tiles 0-3: accumulators [rows, 16] float32; 4: the input [rows, 32] bfloat16; 5-7: weight tiles [16
// pairs, 16 outputs x 2].
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void configure(int rows) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette_id = 1;
  for (int t = 0; t < 5; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 64;
  }
  for (int t = 5; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the config, so it may sink the other
  // stores past LDTILECFG (garbage row counts: #GP); the barrier keeps them before it.
  asm volatile("" ::: "memory");
  _tile_loadconfig(&c);
}

// C[0 .. NT) += x-block (rows of this block) @ the group's tiles J0 .. J0 + NT, over every kb.
template <int J0, int NT>
inline void group_product(const uint16_t* xb, int64_t xs, const uint16_t* pg, int64_t KB) {
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint16_t* t = pg + (kb * kGroup + J0) * kTileElems;
    _tile_loadd(4, xb + kb * kTileK, xs * 2);
    _tile_loadd(5, t, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, t + kTileElems, 64);
    _tile_dpbf16ps(1, 4, 6);
    if (NT == 4) {
      _tile_loadd(7, t + 2 * kTileElems, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, t + 3 * kTileElems, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
}

// y rows [m0, m0 + rows) for outputs [n0, n0 + 16) of tile (g, j) = acc + bias, rounded to bfloat16; Out =
// float: that bfloat16 value widened to float32 (what the bfloat16 output's .float() holds, without the
// bfloat16 tensor and the second pass over it).
template <typename Out>
inline void store_rows(const float (*acc)[kTileN], int64_t m0, int64_t rows, int64_t g, int64_t j, int64_t N,
                       const float* bias, Out* y) {
  const int64_t n0 = (g * kGroup + j) * kTileN;
  if (n0 >= N) return;
  const int64_t width = std::min<int64_t>(kTileN, N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1u);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    // Round to nearest even (vcvtneps2bf16), as the other kernels round their float32 sums.
    const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(acc[m]), bv));
    if constexpr (std::is_same_v<Out, float>)
      _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, mask, _mm512_cvtpbh_ps(out));
    else
      _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0, mask, (__m256i)out);
  }
}

// y [M, N] (Out = uint16_t: bfloat16 bits; float: those values widened, store_rows; row stride N) = x @
// w^T + bias. x: M rows of at least KB * 32 elements (zeros past K), row stride xs elements; past 16 rows,
// the rows of a last, partial block of 16 are read from tail instead (16 rows of the same width, row
// stride ts, zeros past M: the caller copies them there); p packed by pack. Threads split the groups' halves (two tiles each: 576 outputs are 9 groups, which two
// threads would share 5 : 4, ~11 % slower than an even split); a thread holding both halves of a group runs
// its four tiles together. Each weight is read from memory once and, for M > 16, again from the cache for
// each further block of 16 rows (on the Xeon of docs/kernels.md each such block costs ~25 % of the
// one-block product, however few its rows; loading each weight tile once for two blocks was no faster).
// Each output row's sums run in the same order (TDPBF16PS over kb = 0 .. KB) whatever the other rows.
template <typename Out>
inline void linear(const uint16_t* x, int64_t xs, int64_t M, const uint16_t* tail, int64_t ts,
                   const uint16_t* p, int64_t N, int64_t K, const float* bias, Out* y) {
  const int64_t KB = (K + kTileK - 1) / kTileK, G = (N + kGroup * kTileN - 1) / (kGroup * kTileN);
  const int rows = static_cast<int>(std::min<int64_t>(M, 16));
  const int64_t blocks = (M + 15) / 16, full = M / 16;
  auto in_tail = [&](int64_t b) { return M > 16 && b >= full; };
  at::parallel_for(0, 2 * G, 1, [&](int64_t u0, int64_t u1) {
    configure(rows);
    alignas(64) float c[kGroup][16][kTileN];
    for (int64_t g = u0 / 2; g < (u1 + 1) / 2; ++g) {
      const int64_t j0 = 2 * (std::max(u0, 2 * g) - 2 * g), j1 = 2 * (std::min(u1, 2 * g + 2) - 2 * g);
      const uint16_t* pg = p + g * KB * kGroup * kTileElems;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t valid_rows = std::min<int64_t>(16, M - b * 16);
        const uint16_t* xb = in_tail(b) ? tail : x + b * 16 * xs;
        const int64_t s = in_tail(b) ? ts : xs;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (j1 - j0 == 4) group_product<0, 4>(xb, s, pg, KB);
        else if (j0 == 0) group_product<0, 2>(xb, s, pg, KB);
        else group_product<2, 2>(xb, s, pg, KB);
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (j1 - j0 == 4) {
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
        }
        for (int64_t j = j0; j < j1; ++j) store_rows(c[j - j0], b * 16, valid_rows, g, j, N, bias, y);
      }
    }
    _tile_release();
  });
}

}  // namespace specdec_cpu_amx
#endif
