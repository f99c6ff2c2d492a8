// Short-query paged attention for bfloat16 caches on Intel AMX tiles: the scores, the softmax and the
// weighted values of one task of the kernel in cpu_attention.cpp (the same requests, rows, masks and
// outputs; see its header), where the compiler targets AMX-BF16, the process has the tiles, the cache
// blocks hold a multiple of 16 keys, head_dim is 64 or 128, and there is neither a sliding window nor a
// score soft-cap.
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
// - the weighted values, also on tiles: O [rows, D] += P [rows, 32 keys] @ V [32 keys, D] per step, the
//   probabilities split into bfloat16 hi + lo (p = hi + lo to about 2^-17, so the sum keeps float32's
//   precision) and the values laid out as pair-interleaved B tiles. TDPBF16PS adds a pair of keys'
//   products in an order set by their places (a tree row whose visible keys sat among masked siblings
//   parted from the decode row of its branch, and a greedy token tree from plain decoding on 1 of 16
//   SmolLM2 prompts), so every row's nonzero products must sit where a decode row has them: decode and
//   chain rows (their masked keys come after the visible ones) take the keys in place; a tree row takes the
//   context keys in place up to the last whole 32 before the new keys, then, one tree node at a time, the
//   rest of the context and its visible new keys moved together to the places a decode row of its branch
//   has them (the other rows' weights 0 in that step: exact zeros). A 5-token chain then costs 1.2-1.35x
//   a decode row's attention instead of 1.6-1.8x, a 16-node tree 2.6-3.4x instead of 4.2-4.4x (float32
//   FMAs per row, the path before). A weight of 0 now multiplies the value rather than skipping it: a
//   non-finite value of a new token (a model that already overflows) reaches the rows that do not see it.
// Within one bfloat16 rounding of the float32 reference.
// Source: Intel Architecture Instruction Set Extensions Programming Reference, chapter 3 (AMX).
#pragma once
#include "cpu_gemv_amx.h"
#include "cpu_simd.h"
#if defined(SPECDEC_AMX) && defined(SPECDEC_AVX512) && defined(__AVX512BW__)
#define SPECDEC_AMX_ATTENTION 1
#include <vector>

namespace specdec_cpu_amx_attention {

using specdec_cpu::exp16;
using specdec_cpu::transpose16;

constexpr int64_t kRows = 16;  // rows per task: one tile's rows

// Every tile 16 rows of 64 bytes: float32 accumulators [16, 16] (scores: tile 0; values: tiles 0-3) and
// bfloat16 operands ([16, 32] A, [16 pairs, 16 x 2] B).
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
  std::vector<uint16_t> a;   // P's A tiles for 32 keys: hi [16 rows][32], then lo [16 rows][32]
  std::vector<uint16_t> b;   // V's B tiles for 32 keys, 64 columns: 4 of [16 pairs][16 columns][2]
  std::vector<float> cp;     // a tree node's probabilities at its decode row's places, [16 rows][Lt]
  std::vector<int64_t> keys; // the keys at those places
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
    const uint16_t* kb = k_cache + specdec_cpu::kv_offset(blocks, block_size, KVH, D, g, jb);
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
// caller sums the values (weighted_values, below).
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

// The A operands of rows n0 .. n1 - 1 (the others untouched): p (row stride ps floats, row n at p + n * ps)
// at keys jb .. jb + 31, each weight split into bfloat16 hi = RNE(p) and lo = RNE(p - hi); a: hi [16][32],
// then lo [16][32]. zero: write zeros instead (to clear the rows again).
inline void pack_probabilities(const float* p, int64_t ps, int64_t jb, int64_t n0, int64_t n1, uint16_t* a,
                               bool zero = false) {
  uint16_t* lo = a + 512;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t h = 0; h < 32; h += 16) {
      __m256i vh = _mm256_setzero_si256(), vl = vh;
      if (!zero) {
        const __m512 x = _mm512_loadu_ps(p + n * ps + jb + h);
        vh = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
        const __m512 xh = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(vh), 16));
        vl = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(x, xh)));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + n * 32 + h), vh);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + n * 32 + h), vl);
    }
}

// The B operands of 32 keys for output columns c0 .. c0 + 63: b[c][pr][n][e] = v[key 2 pr + e][c0 + 16 c + n]
// for c < 4, read at off[key] (element offsets of the keys' head_dim values in the cache; -1: a zero key,
// whatever the cache holds).
inline void pack_values(const uint16_t* v_cache, const int64_t* off, int64_t c0, uint16_t* b) {
  alignas(64) static const uint16_t pairs[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(pairs);
  for (int64_t pr = 0; pr < 16; ++pr) {
    const int64_t o0 = off[2 * pr], o1 = off[2 * pr + 1];
    for (int64_t c = 0; c < 4; ++c) {
      auto row = [&](int64_t o) {
        return o >= 0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_cache + o + c0 + 16 * c))
                      : _mm256_setzero_si256();
      };
      const __m256i x0 = row(o0), x1 = row(o1);
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1);
      _mm512_storeu_si512(b + (c * 16 + pr) * 32, _mm512_permutexvar_epi16(idx, both));
    }
  }
}

// Accumulators (tiles 0-3, 64 output columns) += A_hi @ B + A_lo @ B (A hi in tile 4, lo in 6; B in 5, 7).
inline void accumulate(const uint16_t* a, const uint16_t* b) {
  _tile_loadd(4, a, 64);
  _tile_loadd(6, a + 512, 64);
  _tile_loadd(5, b, 64);
  _tile_dpbf16ps(0, 4, 5);
  _tile_dpbf16ps(0, 6, 5);
  _tile_loadd(7, b + 512, 64);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(1, 6, 7);
  _tile_loadd(5, b + 1024, 64);
  _tile_dpbf16ps(2, 4, 5);
  _tile_dpbf16ps(2, 6, 5);
  _tile_loadd(7, b + 1536, 64);
  _tile_dpbf16ps(3, 4, 7);
  _tile_dpbf16ps(3, 6, 7);
}

// acc [16 rows][D] float32 (rows past R: not meaningful) = the task's probabilities s.p [16][Lp] (from
// probabilities()) times the values of KV head g of a request with L keys, ql of them new (tree mask or
// causal); the task's rows are u0 .. u1 (u = r * G + h). 64 output columns at a time, their accumulators
// in tiles 0-3 over all the keys. See the header for the places each row's keys take.
inline void weighted_values(const uint16_t* v_cache, const int64_t* blocks, int64_t block_size, int64_t KVH,
                            int64_t D, int64_t g, int64_t L, int64_t Lp, int64_t ql, const uint8_t* mask,
                            int64_t u0, int64_t u1, int64_t G, Scratch& s, float* acc) {
  const int64_t R = u1 - u0, ctx = L - ql;
  auto key_offset = [&](int64_t j) { return specdec_cpu::kv_offset(blocks, block_size, KVH, D, g, j); };
  s.a.assign(1024, 0);
  s.b.resize(4 * 512);
  int64_t off[32];
  const int64_t shared_end = mask ? ctx / 32 * 32 : Lp;  // keys every row takes in place
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t jb = 0; jb < shared_end; jb += 32) {
      for (int64_t c = 0; c < 32; ++c) off[c] = jb + c < L ? key_offset(jb + c) : -1;
      pack_values(v_cache, off, c0, s.b.data());
      pack_probabilities(s.p.data(), Lp, jb, 0, R, s.a.data());
      accumulate(s.a.data(), s.b.data());
    }
    if (mask) {
      pack_probabilities(nullptr, 0, 0, 0, R, s.a.data(), true);
      for (int64_t n0 = 0; n0 < R;) {  // one tree node (its G heads' rows in this task) at a time
        const int64_t r = (u0 + n0) / G;
        int64_t n1 = n0;
        while (n1 < R && (u0 + n1) / G == r) ++n1;
        s.keys.clear();
        for (int64_t j = shared_end; j < ctx; ++j) s.keys.push_back(j);
        for (int64_t c = 0; c < ql; ++c)
          if (mask[r * ql + c]) s.keys.push_back(ctx + c);
        const int64_t nk = static_cast<int64_t>(s.keys.size()), Lt = (nk + 31) / 32 * 32;
        s.cp.assign(kRows * Lt, 0.f);
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t t = 0; t < nk; ++t) s.cp[n * Lt + t] = s.p[n * Lp + s.keys[t]];
        for (int64_t tb = 0; tb < Lt; tb += 32) {
          for (int64_t c = 0; c < 32; ++c) off[c] = tb + c < nk ? key_offset(s.keys[tb + c]) : -1;
          pack_values(v_cache, off, c0, s.b.data());
          pack_probabilities(s.cp.data(), Lt, tb, n0, n1, s.a.data());
          accumulate(s.a.data(), s.b.data());
        }
        pack_probabilities(nullptr, 0, 0, n0, n1, s.a.data(), true);
        n0 = n1;
      }
    }
    const int64_t stride = D * 4;
    _tile_stored(0, acc + c0, stride);
    _tile_stored(1, acc + c0 + 16, stride);
    _tile_stored(2, acc + c0 + 32, stride);
    _tile_stored(3, acc + c0 + 48, stride);
  }
}

}  // namespace specdec_cpu_amx_attention
#endif
