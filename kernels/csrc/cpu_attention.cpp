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
// One task per (request, KV head, chunk of the request's queries), at::parallel_for over them: the task's
// G * rows query rows (G query heads per KV head, grouped-query attention) are scored against each key as
// it is read, each key and value widened to float32 once for all of them. A request's queries are split
// into chunks only where the batch has fewer (request, KV head) pairs than 4 per thread (a 16-node tree
// of SmolLM2, 3 KV heads, on 2 threads: 3 chunks, 9 tasks instead of 3), so the threads share the work;
// rows are independent, so the outputs do not depend on the split. Scores, softmax and the weighted sum of values are float32; float32 and bfloat16
// caches and queries. Reference: specdec/attention/reference.py (masked SDPA / batched matmuls);
// tests/kernels/test_cpu_attention.py compares them.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include "cpu_simd.h"

namespace {

using namespace specdec_cpu;

#ifdef __AVX512F__
// out[0 : 16 NV] = sum over keys j in [first, L) of p[j] * v[(j - first) * stride : ...], keys in order,
// skipping p[j] == 0 (the same products added in the same order as axpy key by key).
template <int NV>
inline void weighted_values(const float* p, int64_t first, int64_t L, const float* v, float* out,
                            int64_t stride = 16 * NV) {
  __m512 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm512_setzero_ps();
  for (int64_t j = first; j < L; ++j) {
    if (p[j] == 0.f) continue;
    const __m512 pv = _mm512_set1_ps(p[j]);
    const float* vj = v + (j - first) * stride;
    for (int c = 0; c < NV; ++c) a[c] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vj + 16 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + 16 * c, a[c]);
}
#endif

template <typename T>
void attend(const T* query, const T* k_cache, const T* v_cache, const int64_t* block_table, int64_t bt_stride,
            const int64_t* reqs, const int64_t* q_start, const int64_t* q_len, const int64_t* seq_len,
            const int64_t* mask_offset, const uint8_t* masks, T* out, int64_t m, int64_t H, int64_t KVH,
            int64_t D, int64_t block_size, float scale, int64_t window, float softcap) {
  const int64_t G = H / KVH;
  int64_t max_q = 1;
  for (int64_t i = 0; i < m; ++i) max_q = std::max(max_q, q_len[i]);
  const int64_t want = 4 * at::get_num_threads();
  const int64_t chunks = m * KVH >= want || max_q < 8 ? 1 : std::min(max_q, (want + m * KVH - 1) / (m * KVH));
  at::parallel_for(0, m * KVH * chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> q, scores, acc, kt, vf, kv(D);
    std::vector<int64_t> pos;  // positions of the request's new tokens
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t i = task / (KVH * chunks), g = task / chunks % KVH, chunk = task % chunks;
      const int64_t ql = q_len[i], L = seq_len[i], ctx = L - ql;
      // This task's queries r0 .. r1 of the request (chunks of near-equal size; empty past q_len).
      const int64_t per = (ql + chunks - 1) / chunks, r0 = std::min(ql, chunk * per), r1 = std::min(ql, r0 + per);
      if (r0 >= r1) continue;
      const int64_t R = (r1 - r0) * G;
      const int64_t* blocks = block_table + reqs[i] * bt_stride;
      const uint8_t* mask = mask_offset[i] >= 0 ? masks + mask_offset[i] : nullptr;
      // Query rows rr = (r - r0) * G + h: query r of the request, head g * G + h, pre-scaled, as float32.
      q.assign((R + 3) / 4 * 4 * D, 0.f);  // whole blocks of four rows for the score product
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t h = 0; h < G; ++h) {
          const T* src = query + ((q_start[i] + r) * H + g * G + h) * D;
          for (int64_t d = 0; d < D; ++d) q[((r - r0) * G + h) * D + d] = to_float(src[d]) * scale;
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
      scores.assign(R * L, -std::numeric_limits<float>::infinity());
      // Whether query r sees key j (causal or tree mask among the new keys, sliding window).
      auto visible = [&](int64_t r, int64_t j) {
        const int64_t nj = j - ctx;  // index among the new keys, negative for context
        if (nj >= 0 && (mask ? !mask[r * ql + nj] : nj > r)) return false;
        const int64_t key_pos = (window > 0 && nj >= 0) ? pos[nj] : j;
        return !(window > 0 && pos[r] - key_pos >= window);
      };
#ifdef __AVX512F__
      // Scores as a small matrix product: the task's keys widened once into kt [D, nk] (transposed, nk a
      // multiple of 16, zero-padded), then 16 keys x up to 4 query rows per step, one float32 FMA chain
      // per score over d = 0 .. D - 1 (a dot product per (query, key) spent most of its time in
      // horizontal sums). A score's sum does not depend on the other rows or keys.
      const int64_t nk = ((L - first_key) + 15) / 16 * 16;
      kt.assign(D * nk, 0.f);
      for (int64_t j = first_key; j < L; ++j) {
        const T* k = k_cache + ((blocks[j / block_size] * block_size + j % block_size) * KVH + g) * D;
        for (int64_t d = 0; d < D; ++d) kt[d * nk + (j - first_key)] = to_float(k[d]);
      }
      alignas(64) float block[4][16];
      for (int64_t jb = 0; jb < nk; jb += 16) {
        for (int64_t rr0 = 0; rr0 < R; rr0 += 4) {
          const int64_t nr = std::min<int64_t>(4, R - rr0);
          // Four rows always (q holds zero rows past R), so the accumulators stay in registers.
          const float* q0 = &q[rr0 * D];
          __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (int64_t d = 0; d < D; ++d) {
            const __m512 kd = _mm512_loadu_ps(&kt[d * nk + jb]);
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[d]), kd, a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(q0[D + d]), kd, a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(q0[2 * D + d]), kd, a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(q0[3 * D + d]), kd, a3);
          }
          _mm512_store_ps(block[0], a0);
          _mm512_store_ps(block[1], a1);
          _mm512_store_ps(block[2], a2);
          _mm512_store_ps(block[3], a3);
          for (int64_t i = 0; i < nr; ++i) {
            const int64_t rr = rr0 + i, r = r0 + rr / G;
            for (int64_t c = 0; c < 16; ++c) {
              const int64_t j = first_key + jb + c;
              if (j >= L || !visible(r, j)) continue;
              float sc = block[i][c];
              if (softcap > 0.f) sc = softcap * std::tanh(sc / softcap);
              scores[rr * L + j] = sc;
            }
          }
        }
      }
#else
      for (int64_t j = first_key; j < L; ++j) {
        const T* k = k_cache + ((blocks[j / block_size] * block_size + j % block_size) * KVH + g) * D;
        for (int64_t d = 0; d < D; ++d) kv[d] = to_float(k[d]);  // exact: the same sums as on k itself
        for (int64_t r = r0; r < r1; ++r) {
          if (!visible(r, j)) continue;
          for (int64_t h = 0; h < G; ++h) {
            float sc = dot(kv.data(), &q[((r - r0) * G + h) * D], D);
            if (softcap > 0.f) sc = softcap * std::tanh(sc / softcap);
            scores[((r - r0) * G + h) * L + j] = sc;
          }
        }
      }
#endif
      for (int64_t rr = 0; rr < R; ++rr) softmax_inplace(&scores[rr * L], L);
      acc.assign(R * D, 0.f);
#ifdef __AVX512F__
      if (D % 16 == 0) {
        // Values widened once into vf [L - first_key, D]; each output row summed over the keys in
        // registers (the same products added in the same order as the axpy loop below, key by key).
        vf.resize((L - first_key) * D);
        for (int64_t j = first_key; j < L; ++j) {
          const T* v = v_cache + ((blocks[j / block_size] * block_size + j % block_size) * KVH + g) * D;
          for (int64_t d = 0; d < D; ++d) vf[(j - first_key) * D + d] = to_float(v[d]);
        }
        for (int64_t rr = 0; rr < R; ++rr) {
          const float* prow = &scores[rr * L];
          float* dst = &acc[rr * D];
          switch (D / 16) {  // accumulators in registers: a compile-time count of them
            case 4: weighted_values<4>(prow, first_key, L, vf.data(), dst); break;
            case 8: weighted_values<8>(prow, first_key, L, vf.data(), dst); break;
            default:
              for (int64_t c = 0; c < D; c += 16) weighted_values<1>(prow, first_key, L, vf.data() + c, dst + c, D);
          }
        }
      } else
#endif
      {
        for (int64_t j = first_key; j < L; ++j) {
          const T* v = v_cache + ((blocks[j / block_size] * block_size + j % block_size) * KVH + g) * D;
          for (int64_t d = 0; d < D; ++d) kv[d] = to_float(v[d]);
          for (int64_t rr = 0; rr < R; ++rr) {
            const float p = scores[rr * L + j];
            if (p != 0.f) axpy(p, kv.data(), &acc[rr * D], D);
          }
        }
      }
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t h = 0; h < G; ++h) {
          T* dst = out + ((q_start[i] + r) * H + g * G + h) * D;
          for (int64_t d = 0; d < D; ++d) from_float(acc[((r - r0) * G + h) * D + d], dst + d);
        }
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

// query [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] (query's dtype, contiguous);
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
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "paged_attention_short: contiguous query, caches and out");
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
    attend<float>(query.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                  block_table.data_ptr<int64_t>(), block_table.stride(0), reqs.data_ptr<int64_t>(),
                  q_start.data_ptr<int64_t>(), q_len.data_ptr<int64_t>(), seq_len.data_ptr<int64_t>(),
                  mask_offset.data_ptr<int64_t>(), mp, out.data_ptr<float>(), m, H, KVH, D, block_size,
                  static_cast<float>(scale), window, static_cast<float>(softcap));
  } else {
    TORCH_CHECK(query.scalar_type() == torch::kBFloat16, "paged_attention_short: float32 or bfloat16");
    attend<at::BFloat16>(query.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                         v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int64_t>(),
                         block_table.stride(0), reqs.data_ptr<int64_t>(), q_start.data_ptr<int64_t>(),
                         q_len.data_ptr<int64_t>(), seq_len.data_ptr<int64_t>(),
                         mask_offset.data_ptr<int64_t>(), mp, out.data_ptr<at::BFloat16>(), m, H, KVH, D,
                         block_size, static_cast<float>(scale), window, static_cast<float>(softcap));
  }
}
