// Short-query paged attention for bfloat16 caches on Intel AMX tiles: one task of the kernel in
// cpu_attention.cpp (the same requests, rows, masks and outputs; see its header), where the compiler
// targets AMX-BF16, the process has the tiles, the cache blocks hold a multiple of 16 keys, head_dim is 64
// or 128, and there is neither a sliding window nor a score soft-cap.
//
// Why: the AVX-512 path computes every score and every weighted value with float32 FMAs, so a chain of 5
// (15 query rows per KV head on SmolLM2) or a 16-node tree (48) costs 3-8x a decode row at 512 keys, the
// FMAs and not the memory bounding it. One TDPBF16PS multiplies 16 x 32 bfloat16 by 32 x 16 in about 16
// cycles, so up to 16 rows cost about what one does.
//
// A task holds up to 16 rows (query, query head) of one request's KV head:
// - scores, transposed: S^T [keys, rows] = K [keys, D] @ Q^T [D, rows], 16 keys per tile. K's tile is read
//   from the paged cache as it lies (16 keys of one block are 16 rows at a fixed stride); Q^T is laid out
//   once per task as the tiles' pair-interleaved (VNNI) B operand. Products of bfloat16 values are exact in
//   float32; the tiles add them in float32 in their own order.
// - softmax across the keys with the rows in the vector lanes: scaled scores, masked (causal or tree mask)
//   to -inf, the maximum, then e = exp(s - max) (exp16, cpu_simd.h) rounded to bfloat16 and summed in
//   float32 key by key. A masked key adds an exact 0, so a tree row's sum equals the decode row's of its
//   branch to the bit (tests/kernels/test_cpu_attention.py); the rounding to bfloat16 makes the sum that of
//   the weights the value product uses.
// - values: O [rows, D] = E [rows, keys] @ V [keys, D], 32 keys per step: E's rows (the transposed
//   exponentials) as the A tile, V's key pairs interleaved into four B tiles of 16 dims; O / sum, rounded
//   to bfloat16 (round to nearest even), is the output.
// Within one bfloat16 rounding of the float32 reference, like the AVX-512 path (the weights' rounding to
// bfloat16 is the extra error: relative 2^-9 per weight, independent across keys).
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
  std::vector<float> sums;   // [16]
  std::vector<uint16_t> e;   // exponentials as bfloat16, [16 rows][Lp]
  alignas(64) uint16_t vb[4][16 * 32];  // V's B tiles for one step of 32 keys: [dim block][pair][16 x 2]
  alignas(64) float o[16][64];          // O for 64 dims
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

// Rows u0 .. u1 (at most 16) of request (q_start, ql, L, mask) for KV head g; query [T, H, D] with token
// stride q_stride; out [T, H, D] (contiguous). All bfloat16 bits.
inline void task(const uint16_t* query, int64_t q_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                 const int64_t* blocks, int64_t block_size, int64_t q_start, int64_t ql, int64_t L,
                 const uint8_t* mask, int64_t u0, int64_t u1, int64_t H, int64_t KVH, int64_t D, int64_t g,
                 float scale, uint16_t* out, Scratch& s) {
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
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(y);  // rounded to bfloat16, as the value product reads it
    const __m512 yr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm512_storeu_ps(&s.st[j * kRows], yr);
    vsum = _mm512_add_ps(vsum, yr);
  }
  for (int64_t j = L; j < Lp; ++j) _mm512_storeu_ps(&s.st[j * kRows], _mm512_setzero_ps());
  alignas(64) float sums[16];
  _mm512_store_ps(sums, vsum);

  // E [16 rows][Lp] as bfloat16: 16 keys x 16 rows transposed at a time.
  s.e.resize(kRows * Lp);
  for (int64_t jb = 0; jb < Lp; jb += 16) {
    __m512 r[16];
    for (int c = 0; c < 16; ++c) r[c] = _mm512_loadu_ps(&s.st[(jb + c) * kRows]);
    transpose16(r);
    for (int n = 0; n < 16; ++n)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&s.e[n * Lp + jb]), (__m256i)_mm512_cvtneps_pbh(r[n]));
  }

  // O = E @ V, 64 dims per pass: V's key pairs interleaved (VNNI) per 16 dims, keys past L as zeros.
  alignas(64) static constexpr int16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  auto value_row = [&](int64_t j, int64_t d0) -> const uint16_t* {
    return v_cache + ((blocks[j / block_size] * block_size + j % block_size) * KVH + g) * D + d0;
  };
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t jb = 0; jb < L; jb += 32) {
      for (int64_t p = 0; p < 16; ++p) {
        const int64_t j = jb + 2 * p;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
        if (j < L) {
          const uint16_t* va = value_row(j, d0);
          a0 = _mm512_loadu_si512(va);
          a1 = _mm512_loadu_si512(va + 32);
        }
        if (j + 1 < L) {
          const uint16_t* vb = value_row(j + 1, d0);
          b0 = _mm512_loadu_si512(vb);
          b1 = _mm512_loadu_si512(vb + 32);
        }
        _mm512_store_si512(&s.vb[0][p * 32], _mm512_permutex2var_epi16(a0, lo, b0));
        _mm512_store_si512(&s.vb[1][p * 32], _mm512_permutex2var_epi16(a0, hi, b0));
        _mm512_store_si512(&s.vb[2][p * 32], _mm512_permutex2var_epi16(a1, lo, b1));
        _mm512_store_si512(&s.vb[3][p * 32], _mm512_permutex2var_epi16(a1, hi, b1));
      }
      _tile_loadd(4, &s.e[jb], Lp * 2);
      _tile_loadd(5, s.vb[0], 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, s.vb[1], 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, s.vb[2], 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, s.vb[3], 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, &s.o[0][0], 256);
    _tile_stored(1, &s.o[0][16], 256);
    _tile_stored(2, &s.o[0][32], 256);
    _tile_stored(3, &s.o[0][48], 256);
    for (int64_t n = 0; n < R; ++n) {
      const int64_t u = u0 + n;
      uint16_t* dst = out + ((q_start + u / G) * H + g * G + u % G) * D + d0;
      const __m512 inv = _mm512_set1_ps(1.f / sums[n]);
      for (int64_t c = 0; c < 64; c += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&s.o[n][c]), inv)));
    }
  }
}

}  // namespace specdec_cpu_amx_attention
#endif
