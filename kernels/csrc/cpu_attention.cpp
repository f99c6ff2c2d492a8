// Paged attention for short queries on the CPU: decode rows, draft verification chains and token trees.
//
// For each of m requests, its q_len new queries (rows q_start .. q_start + q_len of the flattened batch)
// attend to the request's seq_len keys, read through its block table from the paged caches
// k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim]. The first ctx = seq_len - q_len keys
// are context, seen by every query; among the new keys, query r sees key r' when r' <= r (causal) or when
// the request's tree attention mask says so (masks[mask_offset + r * q_len + r'], uint8).
// A sliding window (window > 0, Mistral / Gemma layers) hides keys at positions <= p - window from the
// query at position p: positions are ctx + r in a chain and ctx + depth inside a tree (depth: the node's
// visible new tokens - 1); keys before the first query's window are not read. Soft-capping (softcap > 0,
// Gemma 2) turns each scaled score s into softcap * tanh(s / softcap) before the softmax.
//
// One task per (request, KV head, chunk of the request's rows), at::parallel_for over them. A request's
// rows are its G * q_len (query, query head) pairs of the KV head (grouped-query attention), in groups of
// four; a (request, KV head) is split into chunks of whole groups only where that evens out the threads'
// work (a chain of 5 on SmolLM2's 3 KV heads and 2 threads: 2 chunks, 6 tasks instead of 3). Rows are
// independent, so the outputs do not depend on the split. Per task: the keys, 32 at a time, are widened
// to float32 and transposed in registers into a tile [head_dim, 32]; each score is one float32 FMA chain
// over head_dim (4 rows x 32 keys per step); the values are read from the cache and widened as they are
// summed, 4 rows at a time. Scores, softmax and the weighted sum of values are float32; float32 and bfloat16
// caches and queries. bfloat16 caches in blocks of a multiple of 16 keys (head_dim 64 or 128, no window or
// soft-cap) compute the scores, the softmax and the weighted values on AMX tiles instead where the CPU has
// it (cpu_attention_amx.h). Reference: specdec/attention/reference.py (masked SDPA / batched matmuls);
// tests/kernels/test_cpu_attention.py compares them.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#include "cpu_attention_amx.h"
#include "cpu_kernels.h"
#include "cpu_simd.h"

namespace {

using namespace specdec_cpu;

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bfloat16 widened exactly: its bits in the upper half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// out[rr][0 : 16 NV] = sum over keys j in [first, L) of p[rr * L + j] * v[off[j - first] + c0 : ...]
// (widened to float32) for the rows rr < nr (p holds 4 rows; rows past nr are not stored), keys in order,
// skipping p == 0 (masked FMAs: the same products added in the same order as axpy key by key). The values
// are read from the paged cache itself and widened once per key for the four rows.
template <int NV, typename T>
inline void weighted_values(const float* p, int64_t L, int64_t nr, int64_t first, const T* v,
                            const int64_t* off, float* out, int64_t out_stride) {
  __m512 a0[NV], a1[NV], a2[NV], a3[NV];
  for (int c = 0; c < NV; ++c) a0[c] = a1[c] = a2[c] = a3[c] = _mm512_setzero_ps();
  const float *p0 = p, *p1 = p + L, *p2 = p + 2 * L, *p3 = p + 3 * L;
  for (int64_t j = first; j < L; ++j) {
    const __mmask16 k0 = p0[j] != 0.f ? 0xFFFF : 0, k1 = p1[j] != 0.f ? 0xFFFF : 0,
                    k2 = p2[j] != 0.f ? 0xFFFF : 0, k3 = p3[j] != 0.f ? 0xFFFF : 0;
    if (!(k0 | k1 | k2 | k3)) continue;
    const __m512 b0 = _mm512_set1_ps(p0[j]), b1 = _mm512_set1_ps(p1[j]), b2 = _mm512_set1_ps(p2[j]),
                 b3 = _mm512_set1_ps(p3[j]);
    const T* src = v + off[j - first];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) {
      const __m512 vj = load16(src + 16 * c);
      a0[c] = _mm512_mask3_fmadd_ps(b0, vj, a0[c], k0);
      a1[c] = _mm512_mask3_fmadd_ps(b1, vj, a1[c], k1);
      a2[c] = _mm512_mask3_fmadd_ps(b2, vj, a2[c], k2);
      a3[c] = _mm512_mask3_fmadd_ps(b3, vj, a3[c], k3);
    }
  }
  // Stored by name, not through an array of the accumulators' addresses: taking them kept the
  // accumulators on the stack (every FMA a load and a masked store).
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) {
    _mm512_storeu_ps(out + 16 * c, a0[c]);
    if (nr > 1) _mm512_storeu_ps(out + out_stride + 16 * c, a1[c]);
    if (nr > 2) _mm512_storeu_ps(out + 2 * out_stride + 16 * c, a2[c]);
    if (nr > 3) _mm512_storeu_ps(out + 3 * out_stride + 16 * c, a3[c]);
  }
}

// acc [R, D] = p [R, L] (rows of probabilities; keys from `first` on) times the values at off (offsets of
// keys first .. L - 1 in the paged cache), four rows at a time through weighted_values. D % 16 == 0.
template <typename T>
inline void weighted_rows(const float* p, int64_t L, int64_t R, int64_t first, const T* v_cache,
                          const int64_t* off, int64_t D, float* acc) {
  for (int64_t rr = 0; rr < R; rr += 4) {
    const int64_t nr = std::min<int64_t>(4, R - rr);
    const float* prow = p + rr * L;
    float* dst = acc + rr * D;
    switch (D / 16) {  // accumulators in registers: a compile-time count of them
      case 4: weighted_values<4>(prow, L, nr, first, v_cache, off, dst, D); break;
      case 8: weighted_values<8>(prow, L, nr, first, v_cache, off, dst, D); break;
      default:
        for (int64_t c = 0; c < D; c += 16) weighted_values<1>(prow, L, nr, first, v_cache + c, off, dst + c, D);
    }
  }
}
#endif

// A task's rows u0 .. u1 of its request (u = r * G + h: query r, head h of the KV head's group), in whole
// groups of four (the score product's unit) split into `chunks` near-equal chunks; empty past them.
inline std::pair<int64_t, int64_t> task_rows(int64_t ql, int64_t G, int64_t chunks, int64_t chunk) {
  const int64_t groups = (ql * G + 3) / 4, per = (groups + chunks - 1) / chunks;
  const int64_t u0 = std::min(ql * G, chunk * per * 4);
  return {u0, std::min(ql * G, u0 + per * 4)};
}

// Stores a task's rows acc [u1 - u0, D] (float32) to out [tokens, H, D] at query q_start + u / G, head
// g * G + u % G.
template <typename T>
inline void store_rows(const float* acc, T* out, int64_t q_start, int64_t u0, int64_t u1, int64_t G, int64_t H,
                       int64_t g, int64_t D) {
  for (int64_t u = u0; u < u1; ++u) {
    T* dst = out + ((q_start + u / G) * H + g * G + u % G) * D;
    for (int64_t d = 0; d < D; ++d) from_float(acc[(u - u0) * D + d], dst + d);
  }
}

#ifdef SPECDEC_AMX_ATTENTION
// The AMX path (cpu_attention_amx.h): one task per (request, KV head, chunk of at most 16 rows in whole
// groups of four, a tile's rows); a (request, KV head) is split further only while there are fewer tasks
// than threads (a chain of 5 on SmolLM2's 3 KV heads and 2 threads: 3 tasks, 2 : 1 between the threads).
void attend_amx(const at::BFloat16* query, int64_t q_stride, const at::BFloat16* k_cache,
                const at::BFloat16* v_cache, const int64_t* block_table, int64_t bt_stride, const int64_t* reqs,
                const int64_t* q_start, const int64_t* q_len, const int64_t* seq_len, const int64_t* mask_offset,
                const uint8_t* masks, at::BFloat16* out, int64_t m, int64_t H, int64_t KVH, int64_t D,
                int64_t block_size, float scale) {
  namespace amx = specdec_cpu_amx_attention;
  const int64_t G = H / KVH;
  int64_t max_groups = 1;
  for (int64_t i = 0; i < m; ++i) max_groups = std::max(max_groups, (q_len[i] * G + 3) / 4);
  const int64_t threads = at::get_num_threads();
  int64_t chunks = (max_groups + 3) / 4;
  while (chunks < max_groups && m * KVH * chunks < threads) ++chunks;
  auto bits = [](const at::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); };
  at::parallel_for(0, m * KVH * chunks, 1, [&](int64_t t0, int64_t t1) {
    amx::configure();
    amx::Scratch s;
    std::vector<float> acc;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t i = task / (KVH * chunks), g = task / chunks % KVH, chunk = task % chunks;
      const int64_t ql = q_len[i], L = seq_len[i];
      const auto [u0, u1] = task_rows(ql, G, chunks, chunk);
      if (u0 >= u1) continue;
      const int64_t* blocks = block_table + reqs[i] * bt_stride;
      const uint8_t* mask = mask_offset[i] >= 0 ? masks + mask_offset[i] : nullptr;
      const int64_t Lp = amx::probabilities(bits(query), q_stride, bits(k_cache), blocks, block_size, q_start[i], ql,
                                            L, mask, u0, u1, H, KVH, D, g, scale, s);
      acc.resize(amx::kRows * D);
      amx::weighted_values(bits(v_cache), blocks, block_size, KVH, D, g, L, Lp, ql, mask, u0, u1, G, s,
                           acc.data());
      store_rows(acc.data(), out, q_start[i], u0, u1, G, H, g, D);
    }
    _tile_release();
  });
}
#endif

template <typename T>
void attend(const T* query, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* block_table,
            int64_t bt_stride, const int64_t* reqs, const int64_t* q_start, const int64_t* q_len,
            const int64_t* seq_len, const int64_t* mask_offset, const uint8_t* masks, T* out, int64_t m,
            int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int64_t window, float softcap) {
  const int64_t G = H / KVH;
#ifdef SPECDEC_AMX_ATTENTION
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (specdec_cpu_amx_attention::serves(D, block_size, window, softcap) && has_amx()) {
      attend_amx(query, q_stride, k_cache, v_cache, block_table, bt_stride, reqs, q_start, q_len, seq_len,
                 mask_offset, masks, out, m, H, KVH, D, block_size, scale);
      return;
    }
  }
#endif
  // A request's rows u = r * G + h (query r, head g * G + h of KV head g) in groups of four (the score
  // product's unit); each (request, KV head) split into chunks of whole groups where that evens out the
  // threads' work: the smallest count giving a multiple of the thread count, or at least 4 tasks per thread
  // (a chain of 5 on SmolLM2's 3 KV heads and 2 threads: 2 chunks, 6 tasks instead of 3). Rows are
  // independent, so the outputs do not depend on the split.
  int64_t max_groups = 1;
  for (int64_t i = 0; i < m; ++i) max_groups = std::max(max_groups, (q_len[i] * G + 3) / 4);
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 1;
  while (chunks < max_groups && (m * KVH * chunks) % threads != 0 && m * KVH * chunks < 4 * threads) ++chunks;
  at::parallel_for(0, m * KVH * chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> q, scores, acc, kt, compact, kv(D);
    std::vector<int64_t> off;  // element offsets of the task's keys / values in the caches
    std::vector<int64_t> pos;  // positions of the request's new tokens
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t i = task / (KVH * chunks), g = task / chunks % KVH, chunk = task % chunks;
      const int64_t ql = q_len[i], L = seq_len[i], ctx = L - ql;
      const auto [u0, u1] = task_rows(ql, G, chunks, chunk);
      if (u0 >= u1) continue;
      const int64_t R = u1 - u0, r0 = u0 / G, r1 = (u1 - 1) / G + 1;  // rows; queries r0 .. r1 touched
      const int64_t* blocks = block_table + reqs[i] * bt_stride;
      const uint8_t* mask = mask_offset[i] >= 0 ? masks + mask_offset[i] : nullptr;
      // Task row rr = u - u0: query u / G of the request, head g * G + u % G, pre-scaled, as float32.
      q.assign((R + 3) / 4 * 4 * D, 0.f);  // whole blocks of four rows for the score product
      for (int64_t u = u0; u < u1; ++u) {
        const T* src = query + (q_start[i] + u / G) * q_stride + (g * G + u % G) * D;
        for (int64_t d = 0; d < D; ++d) q[(u - u0) * D + d] = to_float(src[d]) * scale;
      }
      pos.resize(ql);
      int64_t first_key = 0;
      if (window > 0) {
        int64_t min_pos = ctx + ql;
        for (int64_t r = 0; r < ql; ++r) {
          int64_t depth = r;
          if (mask) {
            depth = -1;
            for (int64_t c = 0; c < ql; ++c) depth += mask[r * ql + c] ? 1 : 0;
          }
          pos[r] = ctx + depth;
          if (r >= r0 && r < r1) min_pos = std::min(min_pos, pos[r]);
        }
        first_key = std::max<int64_t>(0, min_pos - window + 1);
      }
      // Whole groups of four rows; the rows past R stay 0 (they add nothing, and are not stored).
      scores.assign((R + 3) / 4 * 4 * L, -std::numeric_limits<float>::infinity());
      std::fill(scores.begin() + R * L, scores.end(), 0.f);
      // Whether query r sees key j (causal or tree mask among the new keys, sliding window).
      auto visible = [&](int64_t r, int64_t j) {
        const int64_t nj = j - ctx;  // index among the new keys, negative for context
        if (nj >= 0 && (mask ? !mask[r * ql + nj] : nj > r)) return false;
        const int64_t key_pos = (window > 0 && nj >= 0) ? pos[nj] : j;
        return !(window > 0 && pos[r] - key_pos >= window);
      };
      // Element offsets of keys / values first_key .. L - 1 of KV head g in the paged caches.
      off.resize(L - first_key);
      for (int64_t j = first_key; j < L; ++j)
        off[j - first_key] = kv_offset(blocks, block_size, KVH, D, g, j);
#ifdef __AVX512F__
      // Scores as a small matrix product, 32 keys at a time: the keys widened and transposed into the
      // tile kt [D, 32] (in registers, 16 x 16 at a time, where D is a multiple of 16), then up to 4 query
      // rows per step, one float32 FMA chain per score over d = 0 .. D - 1 (a dot product per (query, key)
      // spent most of its time in horizontal sums). A score's sum does not depend on the other rows or
      // keys, nor on how the tile was filled.
      constexpr int64_t kTile = 32;  // keys per tile: two 16-lane vectors per query row
      kt.resize(D * kTile);
      alignas(64) float block[4][kTile];
      for (int64_t jb = first_key; jb < L; jb += kTile) {
        const int64_t nkeys = std::min<int64_t>(kTile, L - jb);
        const int64_t* ob = &off[jb - first_key];
        if (D % 16 == 0) {
          for (int64_t half = 0; half < kTile; half += 16)
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
              __m512 rows[16];
              for (int64_t c = 0; c < 16; ++c)
                rows[c] = half + c < nkeys ? load16(k_cache + ob[half + c] + d0) : _mm512_setzero_ps();
              transpose16(rows);
              for (int64_t t = 0; t < 16; ++t) _mm512_storeu_ps(&kt[(d0 + t) * kTile + half], rows[t]);
            }
        } else {
          for (int64_t c = 0; c < kTile; ++c)
            for (int64_t d = 0; d < D; ++d) kt[d * kTile + c] = c < nkeys ? to_float(k_cache[ob[c] + d]) : 0.f;
        }
        for (int64_t rr0 = 0; rr0 < R; rr0 += 4) {
          const int64_t nr = std::min<int64_t>(4, R - rr0);
          // Four rows always (q holds zero rows past R), so the accumulators stay in registers.
          const float* q0 = &q[rr0 * D];
          __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
          for (int64_t d = 0; d < D; ++d) {
            const __m512 kd = _mm512_loadu_ps(&kt[d * kTile]), ke = _mm512_loadu_ps(&kt[d * kTile + 16]);
            const __m512 x0 = _mm512_set1_ps(q0[d]), x1 = _mm512_set1_ps(q0[D + d]);
            const __m512 x2 = _mm512_set1_ps(q0[2 * D + d]), x3 = _mm512_set1_ps(q0[3 * D + d]);
            a0 = _mm512_fmadd_ps(x0, kd, a0);
            a1 = _mm512_fmadd_ps(x1, kd, a1);
            a2 = _mm512_fmadd_ps(x2, kd, a2);
            a3 = _mm512_fmadd_ps(x3, kd, a3);
            b0 = _mm512_fmadd_ps(x0, ke, b0);
            b1 = _mm512_fmadd_ps(x1, ke, b1);
            b2 = _mm512_fmadd_ps(x2, ke, b2);
            b3 = _mm512_fmadd_ps(x3, ke, b3);
          }
          _mm512_store_ps(block[0], a0);
          _mm512_store_ps(block[1], a1);
          _mm512_store_ps(block[2], a2);
          _mm512_store_ps(block[3], a3);
          _mm512_store_ps(block[0] + 16, b0);
          _mm512_store_ps(block[1] + 16, b1);
          _mm512_store_ps(block[2] + 16, b2);
          _mm512_store_ps(block[3] + 16, b3);
          if (jb + kTile <= ctx && window == 0 && softcap == 0.f) {  // context keys, seen by every row
            for (int64_t i = 0; i < nr; ++i) std::memcpy(&scores[(rr0 + i) * L + jb], block[i], sizeof block[i]);
            continue;
          }
          for (int64_t i = 0; i < nr; ++i) {
            const int64_t rr = rr0 + i, r = (u0 + rr) / G;
            for (int64_t c = 0; c < nkeys; ++c) {
              const int64_t j = jb + c;
              if ((j >= ctx || window > 0) && !visible(r, j)) continue;  // context keys: seen without a window
              float sc = block[i][c];
              if (softcap > 0.f) sc = softcap * std::tanh(sc / softcap);
              scores[rr * L + j] = sc;
            }
          }
        }
      }
#else
      for (int64_t j = first_key; j < L; ++j) {
        const T* k = k_cache + off[j - first_key];
        for (int64_t d = 0; d < D; ++d) kv[d] = to_float(k[d]);  // exact: the same sums as on k itself
        for (int64_t u = u0; u < u1; ++u) {
          if (!visible(u / G, j)) continue;
          float sc = dot(kv.data(), &q[(u - u0) * D], D);
          if (softcap > 0.f) sc = softcap * std::tanh(sc / softcap);
          scores[(u - u0) * L + j] = sc;
        }
      }
#endif
      // Softmax per row. A tree row's visible new keys (its ancestors and itself, in node order, which is
      // depth order) are first moved together, to the places a decode row at the same depth has them (ctx,
      // ctx + 1, ...): the softmax sums in vector lanes by place, so the row's probabilities then equal that
      // decode row's bit for bit (with the masked siblings in between, its sums could round differently and
      // a token tree's greedy output part from plain decoding's). Chain rows have their masked keys after
      // the visible ones, which the softmax's lane-by-place tail already makes harmless.
      for (int64_t rr = 0; rr < R; ++rr) {
        float* row = &scores[rr * L];
        if (!mask) {
          softmax_inplace(row, L);
          continue;
        }
        const uint8_t* seen = mask + ((u0 + rr) / G) * ql;
        compact.resize(L);
        std::copy(row, row + ctx, compact.begin());
        int64_t n = ctx;
        for (int64_t c = 0; c < ql; ++c)
          if (seen[c]) compact[n++] = row[ctx + c];
        softmax_inplace(compact.data(), n);
        std::copy(compact.begin(), compact.begin() + ctx, row);
        n = ctx;
        for (int64_t c = 0; c < ql; ++c) row[ctx + c] = seen[c] ? compact[n++] : 0.f;
      }
      acc.assign(R * D, 0.f);
#ifdef __AVX512F__
      if (D % 16 == 0) {
        // Each output row summed over the keys in registers, the values read from the cache and widened
        // as they are read (the same products added in the same order as the axpy loop below).
        weighted_rows(scores.data(), L, R, first_key, v_cache, off.data(), D, acc.data());
      } else
#endif
      {
        for (int64_t j = first_key; j < L; ++j) {
          const T* v = v_cache + off[j - first_key];
          for (int64_t d = 0; d < D; ++d) kv[d] = to_float(v[d]);
          for (int64_t rr = 0; rr < R; ++rr) {
            const float p = scores[rr * L + j];
            if (p != 0.f) axpy(p, kv.data(), &acc[rr * D], D);
          }
        }
      }
      store_rows(acc.data(), out, q_start[i], u0, u1, G, H, g, D);
    }
  });
}

template <typename T>
void write_rows(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots, int64_t n) {
  const int64_t KVH = cache.size(2), D = cache.size(3);
  const T* s = src.data_ptr<T>();
  T* c = cache.data_ptr<T>();
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < KVH; ++h)
      std::memcpy(c + (slots[t] * KVH + h) * D, s + t * src.stride(0) + h * src.stride(1), D * sizeof(T));
  }
}

}  // namespace

// key, value [T, KVH, D] (unit stride along D) stored at slot_mapping [T] (int64; -1: skipped) of
// k_cache, v_cache [num_blocks, block_size, KVH, D], all of one dtype (float32 or bfloat16).
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && key.size(1) == k_cache.size(2) &&
                  key.size(2) == k_cache.size(3),
              "write_kv: key/value [T, KVH, D], caches [num_blocks, block_size, KVH, D]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "write_kv: unit stride along head_dim and contiguous caches");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: key, value and caches of one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "write_kv: slot_mapping [T] int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t n = key.size(0), capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(slots[t] < capacity, "write_kv: slot out of range");
  if (key.scalar_type() == torch::kFloat32) {
    write_rows<float>(key, k_cache, slots, n);
    write_rows<float>(value, v_cache, slots, n);
  } else {
    TORCH_CHECK(key.scalar_type() == torch::kBFloat16, "write_kv: float32 or bfloat16");
    write_rows<at::BFloat16>(key, k_cache, slots, n);
    write_rows<at::BFloat16>(value, v_cache, slots, n);
  }
}

// query [T, H, D] (heads and dims contiguous, any token stride: the q of a fused qkv); k_cache, v_cache
// [num_blocks, block_size, KVH, D] (query's dtype, contiguous);
// block_table [B, max_blocks] int64; reqs, q_start, q_len, seq_len, mask_offset [m] int64 (reqs: rows of
// block_table; mask_offset -1: causal); masks uint8 (flat tree masks); out [T, H, D], rows of the m
// requests written; window: sliding window in positions (0: none); softcap: score soft-cap (0: none).
void paged_attention_short(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor reqs, torch::Tensor q_start,
                           torch::Tensor q_len, torch::Tensor seq_len, torch::Tensor mask_offset,
                           torch::Tensor masks, torch::Tensor out, double scale, int64_t window,
                           double softcap) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention_short: query [T, H, D], caches [num_blocks, block_size, KVH, D]");
  TORCH_CHECK(query.stride(2) == 1 && (query.size(1) == 1 || query.stride(1) == query.size(2)) &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "paged_attention_short: query with contiguous heads, contiguous caches and out");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type(),
              "paged_attention_short: query, caches and out of one dtype");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.stride(1) == 1,
              "paged_attention_short: block_table int64 with contiguous rows");
  for (const auto& t : {reqs, q_start, q_len, seq_len, mask_offset})
    TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous(), "paged_attention_short: int64 vectors");
  TORCH_CHECK(masks.scalar_type() == torch::kUInt8 && masks.is_contiguous(), "paged_attention_short: uint8 masks");
  const int64_t H = query.size(1), D = query.size(2), KVH = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "paged_attention_short: head_dim / head counts mismatch");
  const int64_t m = reqs.numel();
  const uint8_t* mp = masks.numel() ? masks.data_ptr<uint8_t>() : nullptr;
  if (query.scalar_type() == torch::kFloat32) {
    attend<float>(query.data_ptr<float>(), query.stride(0), k_cache.data_ptr<float>(),
                  v_cache.data_ptr<float>(), block_table.data_ptr<int64_t>(), block_table.stride(0),
                  reqs.data_ptr<int64_t>(), q_start.data_ptr<int64_t>(), q_len.data_ptr<int64_t>(),
                  seq_len.data_ptr<int64_t>(), mask_offset.data_ptr<int64_t>(), mp, out.data_ptr<float>(), m, H,
                  KVH, D, block_size,
                  static_cast<float>(scale), window, static_cast<float>(softcap));
  } else {
    TORCH_CHECK(query.scalar_type() == torch::kBFloat16, "paged_attention_short: float32 or bfloat16");
    attend<at::BFloat16>(query.data_ptr<at::BFloat16>(), query.stride(0), k_cache.data_ptr<at::BFloat16>(),
                         v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int64_t>(),
                         block_table.stride(0), reqs.data_ptr<int64_t>(), q_start.data_ptr<int64_t>(),
                         q_len.data_ptr<int64_t>(), seq_len.data_ptr<int64_t>(),
                         mask_offset.data_ptr<int64_t>(), mp, out.data_ptr<at::BFloat16>(), m, H, KVH, D,
                         block_size, static_cast<float>(scale), window, static_cast<float>(softcap));
  }
}
