// SIMD helpers shared by the CPU kernels (cpu_gemv.cpp, cpu_attention.cpp): float32 / bfloat16 loads
// widened to float32, 8-lane AVX2 when the compiler targets it (SPECDEC_AVX2), scalar otherwise.
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECDEC_AVX2 1
#endif

namespace specdec_cpu {
// Element offset of key j's head_dim values for KV head g in a paged cache [num_blocks, block_size, KVH,
// D], read through the request's block table row `blocks`.
inline int64_t kv_offset(const int64_t* blocks, int64_t block_size, int64_t KVH, int64_t D, int64_t g,
                         int64_t j) {
  return ((blocks[j / block_size] * block_size + j % block_size) * KVH + g) * D;
}

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef SPECDEC_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}
#endif

// float32 value of a float32 or bfloat16 element, stored back in T.
inline void from_float(float v, float* p) { *p = v; }
inline void from_float(float v, at::BFloat16* p) { *p = at::BFloat16(v); }

// dot(a[0:n], b[0:n]), a in W (float32 or bfloat16), b float32. Four accumulators: one dependent FMA
// chain would wait on the FMA latency at every step.
template <typename W>
inline float dot(const W* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef SPECDEC_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm256_fmadd_ps(load8(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(load8(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(load8(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(load8(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(load8(a + i), _mm256_loadu_ps(b + i), acc0);
  s = hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
#endif
  for (; i < n; ++i) s += to_float(a[i]) * b[i];
  return s;
}

// y[0:n] += alpha * a[0:n], a in W, y float32.
template <typename W>
inline void axpy(float alpha, const W* a, float* y, int64_t n) {
  int64_t i = 0;
#ifdef SPECDEC_AVX2
  const __m256 va = _mm256_set1_ps(alpha);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8(a + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += alpha * to_float(a[i]);
}

#ifdef SPECDEC_AVX2
// exp(x), eight lanes: range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial (Cephes' expf
// constants, about 1 ulp); inputs below -87 (-inf among them) give 0, above 88.38 infinity (SiLU's
// exp(-x) of a gate below -88.38: without the clamp the exponent wrapped and SiLU returned about x).
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f), hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 overflow = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  return _mm256_blendv_ps(out, _mm256_set1_ps(std::numeric_limits<float>::infinity()), overflow);
}
#endif

#if defined(SPECDEC_AVX2) && defined(__AVX512F__)
#define SPECDEC_AVX512 1
// exp8 on sixteen lanes: the same operations in the same order, so each element gets exp8's bits.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.f), hi = _mm512_set1_ps(88.3762626647949f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  const __mmask16 overflow = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  const __m512 out = _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), y, _mm512_castsi512_ps(e));
  return _mm512_mask_blend_ps(overflow, out, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}
#endif

#ifdef SPECDEC_AVX512
// The lanes of the permutes of level S of transpose16: row i's (HI false) and row i + S's (HI true).
template <int S, bool HI>
struct TransposeIndex {
  alignas(64) int32_t lane[16];
  constexpr TransposeIndex() : lane() {
    for (int k = 0; k < 16; ++k) lane[k] = (k & S) ? (HI ? 16 + k : 16 + k - S) : (HI ? k + S : k);
  }
};

// One level of transpose16: bit S of the row and of the lane index exchanged between rows i and i + S.
template <int S>
inline void transpose_level(__m512 r[16]) {
  static constexpr TransposeIndex<S, false> kLo{};
  static constexpr TransposeIndex<S, true> kHi{};
  const __m512i lo = _mm512_load_si512(kLo.lane), hi = _mm512_load_si512(kHi.lane);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i & S) continue;
    const __m512 a = r[i], b = r[i + S];
    r[i] = _mm512_permutex2var_ps(a, lo, b);
    r[i + S] = _mm512_permutex2var_ps(a, hi, b);
  }
}

// r[0 .. 15] transposed in place (r[i][k] <-> r[k][i]): four levels of 16 two-source permutes, the
// indices compile-time constants (built in memory at run time they cost a store-forwarding stall each).
inline void transpose16(__m512 r[16]) {
  transpose_level<8>(r);
  transpose_level<4>(r);
  transpose_level<2>(r);
  transpose_level<1>(r);
}
#endif

// s[0:n] <- exp(s - max) / sum, in place (a softmax row; -inf entries become exactly 0).
inline void softmax_inplace(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t m = 0;
#ifdef SPECDEC_AVX2
  // The maximum does not depend on the order: eight lanes, then the tail.
  __m256 vmax = _mm256_set1_ps(mx);
  for (; m + 8 <= n; m += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + m));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float v : lanes) mx = std::max(mx, v);
#endif
  for (; m < n; ++m) mx = std::max(mx, s[m]);
  float sum = 0.f;
  int64_t j = 0;
#ifdef SPECDEC_AVX2
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 y = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
    _mm256_storeu_ps(s + j, y);
    vsum = _mm256_add_ps(vsum, y);
  }
  if (j < n) {
    // The tail as one more vector, padded with -inf (exp 0): element j always takes exp8 and lane j % 8,
    // so a row's sum does not depend on how many masked keys follow it (a verification row equals the
    // decode row bit for bit).
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), lane);
    const __m256 x = _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                                      _mm256_maskload_ps(s + j, live), _mm256_castsi256_ps(live));
    const __m256 y = exp8(_mm256_sub_ps(x, vmx));
    _mm256_maskstore_ps(s + j, live, y);
    vsum = _mm256_add_ps(vsum, y);
    j = n;
  }
  sum = hsum(vsum);
#endif
  for (; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
  const float inv = 1.f / sum;
  for (j = 0; j < n; ++j) s[j] *= inv;
}

inline bool has_avx2() {
#ifdef SPECDEC_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace specdec_cpu
