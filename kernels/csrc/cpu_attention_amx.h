// Short-query paged attention for bfloat16 caches on Intel AMX tiles: the scores and the softmax of one
// task of the kernel in cpu_attention.cpp (the same requests, rows, masks and outputs; see its header),
// where the compiler targets AMX-BF16, the process has the tiles, the cache blocks hold a multiple of 16
// keys, head_dim is 64 or 128, and there is neither a sliding window nor a score soft-cap.
//
// Why: the AVX-512 path computes every score with float32 FMAs over the keys transposed in registers, so
// a chain of 5 (15 query rows per KV head on SmolLM2) or a 16-node tree (48) cost 2.5-7x a decode row at
// 512 keys: compute, not memory. One TDPBF16PS multiplies 16 x 32 bfloat16 by 32 x 16 in about 16 cycles.
//
// A task holds up to 16 rows (query, query head) of one request's KV head:
// - scores, transposed: S^T [keys, rows] = K [keys, D] @ Q^T [D, rows], 16 keys per tile. K's tile is read
//   from the paged cache as it lies (16 keys of one block are 16 rows at a fixed stride); Q^T is laid out
//   once per task as the tiles' pair-interleaved (VNNI) B operand. Products of bfloat16 values are exact in
//   float32; the tiles add them in float32 in their own order, the same for a key wherever it sits.
// - softmax across the keys with the rows in the vector lanes: scaled scores, masked (causal or tree mask)
//   to -inf, the maximum, e = exp(s - max) (exp16, cpu_simd.h) summed in float32 key by key (a masked key
//   adds an exact 0, so a tree row's sum equals the decode row's of its branch to the bit), then each
//   weight times its row's 1 / sum, transposed to the rows' order.
// The caller sums the weighted values with the AVX-512 path's float32 FMAs, key by key: TDPBF16PS adds a
// pair of keys' products in an order set by their places (tried: a tree row then parted from the decode
// row of its branch, and a greedy token tree from plain decoding on 1 of 16 SmolLM2 prompts; a zero
// partner per key did not fix it). Within one bfloat16 rounding of the float32 reference.
// Source: Intel Architecture Instruction Set Extensions Programming Reference, chapter 3 (AMX).
#pragma once
#include "cpu_gemv_amx.h"
#include "cpu_simd.h"
#if defined(SPECDEC_AMX) && defined(SPECDEC_AVX512)
#define SPECDEC_AMX_ATTENTION 1
#include <vector>

namespace specdec_cpu_amx_attention {

using specdec_cpu::exp16;
using specdec_cpu::transpose16;

constexpr int64_t kRows = 16;  // rows per task: one tile's rows

// Every tile 16 rows of 64 bytes: tiles 0-3 float32 accumulators [16, 16], the others bfloat16 operands
// ([16, 32] A, [16 pairs, 16 x 2] B).
inline void configure() {
  specdec_cpu_amx::TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the config, so it may sink the other
  // stores past LDTILECFG (garbage row counts: #GP); the barrier keeps them before it.
  asm volatile("" ::: "memory");
  _tile_loadconfig(&c);
}

// Whether a batch can take this path (head_dim 64 or 128: its Q^T tiles fit beside the K and score tiles).
inline bool serves(int64_t D, int64_t block_size, int64_t window, float softcap) {
  return (D == 64 || D == 128) && block_size % 16 == 0 && window == 0 && softcap == 0.f;
}

// Per-thread buffers, reused across the thread's tasks.
struct Scratch {
  std::vector<uint16_t> qt;  // Q^T, D / 32 B tiles [16 pairs][16 rows][2]
  std::vector<float> st;     // scores then exponentials, [Lp][16 rows] (Lp: L up to a multiple of 32)
  std::vector<float> p;      // probabilities, [16 rows][Lp]
};

// S^T tiles: 16 keys x 16 rows per step, KB = D / 32 dims blocks (Q^T in tiles 1 .. KB, K in tile 5).
template <int KB>
inline void scores(const uint16_t* k_cache, const int64_t* blocks, int64_t block_size, int64_t KVH, int64_t g,
                   int64_t L, Scratch& s) {
  constexpr int64_t D = KB * 32;
  _tile_loadd(1, s.qt.data(), 64);
  _tile_loadd(2, s.qt.data() + 512, 64);
  if constexpr (KB == 4) {
    _tile_loadd(3, s.qt.data() + 1024, 64);
    _tile_loadd(4, s.qt.data() + 1536, 64);
  }
  const int64_t stride = KVH * D * 2;  // bytes from one key to the next within a block
  for (int64_t jb = 0; jb < L; jb += 16) {
    // 16 keys of one block (block_size is a multiple of 16); past L they are whatever the block holds,
    // and their scores are overwritten (-inf) before use.
    const uint16_t* kb = k_cache + ((blocks[jb / block_size] * block_size + jb % block_size) * KVH + g) * D;
    _tile_zero(0);
    _tile_loadd(5, kb, stride);
    _tile_dpbf16ps(0, 5, 1);
    _tile_loadd(5, kb + 32, stride);
    _tile_dpbf16ps(0, 5, 2);
    if constexpr (KB == 4) {
      _tile_loadd(5, kb + 64, stride);
      _tile_dpbf16ps(0, 5, 3);
      _tile_loadd(5, kb + 96, stride);
      _tile_dpbf16ps(0, 5, 4);
    }
    _tile_stored(0, &s.st[jb * kRows], 64);
  }
}

// Rows u0 .. u1 (at most 16) of request (q_start, ql, L, mask) for KV head g (query [T, H, D] with token
// stride q_stride, bfloat16 bits): their softmax probabilities over the request's L keys, into s.p [16
// rows][Lp] float32 (rows past R and keys past L: not meaningful / 0). Returns Lp, the rows' stride. The
// caller sums the values (the AVX-512 path's weighted_values, cpu_attention.cpp).
inline int64_t probabilities(const uint16_t* query, int64_t q_stride, const uint16_t* k_cache,
                             const int64_t* blocks, int64_t block_size, int64_t q_start, int64_t ql, int64_t L,
                             const uint8_t* mask, int64_t u0, int64_t u1, int64_t H, int64_t KVH, int64_t D,
                             int64_t g, float scale, Scratch& s) {
  const int64_t G = H / KVH, R = u1 - u0, ctx = L - ql, KB = D / 32;
  const int64_t Lp = (L + 31) / 32 * 32;
  // Q^T as B tiles: qt[kb][p][n][e] = row n's query[32 kb + 2 p + e]; rows past R are 0.
  s.qt.assign(KB * 512, 0);
  for (int64_t n = 0; n < R; ++n) {
    const int64_t u = u0 + n;
    const uint16_t* src = query + (q_start + u / G) * q_stride + (g * G + u % G) * D;
    for (int64_t d = 0; d < D; ++d) s.qt[(d / 32) * 512 + (d % 32 / 2) * 32 + n * 2 + (d & 1)] = src[d];
  }
  s.st.resize(Lp * kRows);
  if (KB == 2) scores<2>(k_cache, blocks, block_size, KVH, g, L, s);
  else scores<4>(k_cache, blocks, block_size, KVH, g, L, s);

  // Softmax with the rows in the lanes. Lanes past R (zero queries) see every key and are not stored.
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), vscale = _mm512_set1_ps(scale);
  __m512 vmax = ninf;
  for (int64_t j = 0; j < L; ++j) {
    __m512 x = _mm512_mul_ps(_mm512_loadu_ps(&s.st[j * kRows]), vscale);
    if (j >= ctx) {  // a new key: seen by row r when causal (j - ctx <= r) or by the tree mask
      const int64_t nj = j - ctx;
      __mmask16 seen = static_cast<__mmask16>(0xFFFF);
      for (int64_t n = 0; n < R; ++n) {
        const int64_t r = (u0 + n) / G;
        if (mask ? !mask[r * ql + nj] : nj > r) seen &= static_cast<__mmask16>(~(1u << n));
      }
      x = _mm512_mask_blend_ps(seen, ninf, x);
    }
    _mm512_storeu_ps(&s.st[j * kRows], x);
    vmax = _mm512_max_ps(vmax, x);
  }
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    const __m512 y = exp16(_mm512_sub_ps(_mm512_loadu_ps(&s.st[j * kRows]), vmax));
    _mm512_storeu_ps(&s.st[j * kRows], y);
    vsum = _mm512_add_ps(vsum, y);
  }
  for (int64_t j = L; j < Lp; ++j) _mm512_storeu_ps(&s.st[j * kRows], _mm512_setzero_ps());
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), vsum);

  // P [16 rows][Lp] float32, row-major (the value product's layout): each weight times its row's 1 / sum,
  // then 16 keys x 16 rows transposed at a time.
  s.p.resize(kRows * Lp);
  for (int64_t jb = 0; jb < Lp; jb += 16) {
    __m512 r[16];
    for (int c = 0; c < 16; ++c) r[c] = _mm512_mul_ps(_mm512_loadu_ps(&s.st[(jb + c) * kRows]), inv);
    transpose16(r);
    for (int n = 0; n < 16; ++n) _mm512_storeu_ps(&s.p[n * Lp + jb], r[n]);
  }
  return Lp;
}

}  // namespace specdec_cpu_amx_attention
#endif
