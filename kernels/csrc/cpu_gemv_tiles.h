// The tile-packed weight layout shared by the packed-weight kernels (cpu_gemv_amx.h: AMX tiles;
// cpu_gemv_bf16tiles.h: AVX-512 BF16 dot products), and its packing.
//
// Packed layout (pack; pack_tiles_reference in kernels/cpu_gemv.py): [G, KB, 4, 16, 32] bfloat16, G =
// ceil(N / 64) groups of four 16-output tiles, KB = ceil(K / 32); element [g, kb, j, r, 2c + e] is w[64 g +
// 16 j + c, 32 kb + 2 r + e] (zero past N or K): each 1 KB tile holds 16 rows of input pairs for 16 outputs
// (the "VNNI" B operand of TDPBF16PS; one row of it, 64 bytes, is the weight operand of one vdpbf16ps for
// 16 outputs), and a group's tiles for one kb lie together, so a thread streams one contiguous range.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_gemv_passes.h"

namespace specdec_cpu_tiles {

constexpr int64_t kTileN = 16;  // outputs per weight tile
constexpr int64_t kTileK = 32;  // inputs per tile (16 pairs)
constexpr int64_t kGroup = 4;   // weight tiles per group
constexpr int64_t kTileElems = kTileN * kTileK;

// w [N, K] (bfloat16 bits, row-major) into the packed layout above, p [G * KB * 4 * 512]; pair_major: the
// tiles' rows interleaved instead, [G, KB, 16, 4, 32] (element [g, kb, r, j, 2c + e]), so that one input
// pair's weights for the group's 64 outputs lie together (the AVX-512 BF16 kernel's order). T = int8_t:
// int8 codes in the same order (the int8 kernel's, cpu_gemv_int8tiles.h).
template <typename T>
inline void pack(const T* w, int64_t N, int64_t K, T* p, bool pair_major = false) {
  const int64_t KB = (K + kTileK - 1) / kTileK, G = (N + kGroup * kTileN - 1) / (kGroup * kTileN);
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t kb = 0; kb < KB; ++kb)
        for (int64_t j = 0; j < kGroup; ++j) {
          T* t = p + (g * KB + kb) * kGroup * kTileElems;
          for (int64_t r = 0; r < kTileK / 2; ++r) {
            T* row = t + (pair_major ? (r * kGroup + j) : (j * kTileK / 2 + r)) * 2 * kTileN;
            for (int64_t c = 0; c < kTileN; ++c)
              for (int64_t e = 0; e < 2; ++e) {
                const int64_t n = (g * kGroup + j) * kTileN + c, k = kb * kTileK + 2 * r + e;
                row[c * 2 + e] = (n < N && k < K) ? w[n * K + k] : 0;
              }
          }
        }
  });
}

// Threads split the groups' halves (two tiles each: 576 outputs are 9 groups, which two threads would
// share 5 : 4, ~11 % slower than an even split): f(g, j0, j1) for each group g a thread holds, tiles [j0,
// j1) of it (all four where it holds both halves).
template <typename F>
inline void for_half_groups(int64_t G, F&& f) {
  at::parallel_for(0, 2 * G, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t g = u0 / 2; g < (u1 + 1) / 2; ++g) {
      const int64_t j0 = 2 * (std::max(u0, 2 * g) - 2 * g), j1 = 2 * (std::min(u1, 2 * g + 2) - 2 * g);
      f(g, j0, j1);
    }
  });
}

// f(std::integral_constant<int, MR>{}, std::integral_constant<int, NT>{}) for a pass of MR = rows input
// rows (1-6) over NT = tiles of a group (4: the whole group, else 2: a half): the packed kernels' passes
// take both as compile-time constants (their accumulators, MR x NT vectors, stay in registers).
template <typename F>
inline void with_pass_shape(int64_t rows, int64_t tiles, F&& f) {
  specdec_cpu_passes::with_rows<6>(rows, [&](auto mr) {
    if (tiles == 4) f(mr, std::integral_constant<int, 4>{});
    else f(mr, std::integral_constant<int, 2>{});
  });
}

// The passes of an [M, K] x [N, K]^T product on a packed weight (the packed kernels' loop): threads take
// half-groups (for_half_groups); per group the M input rows go in equal passes of at most max_rows (<= 6),
// each streaming the group's weights (from memory the first time, from the cache after).
// f(g, j0, m0, mr, nt): group g's tiles [j0, j0 + NT) for input rows [m0, m0 + MR), MR and NT
// std::integral_constants (with_pass_shape).
template <typename F>
inline void for_passes(int64_t M, int64_t N, int64_t max_rows, F&& f) {
  const int64_t G = (N + kGroup * kTileN - 1) / (kGroup * kTileN);
  const int64_t count = (M + max_rows - 1) / max_rows, per_pass = (M + count - 1) / count;
  for_half_groups(G, [&](int64_t g, int64_t j0, int64_t j1) {
    for (int64_t m0 = 0; m0 < M; m0 += per_pass)
      with_pass_shape(std::min<int64_t>(per_pass, M - m0), j1 - j0,
                      [&](auto mr, auto nt) { f(g, j0, m0, mr, nt); });
  });
}

}  // namespace specdec_cpu_tiles
