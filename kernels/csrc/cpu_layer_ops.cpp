// The small per-layer operations of a decoder step on the CPU, one call each instead of 3-8 torch ops:
// RMSNorm, rotary embedding of the query and key heads, and SiLU(gate) * up.
//
// At batch 1 a SmolLM2-135M step spends about as long in the ~1,300 small torch calls between its
// linears (each a few microseconds of dispatch and allocation) as the linears spend streaming the
// weights; these three kernels replace ~23 of those calls per layer. Every kernel reproduces its torch
// reference's roundings (kernels/cpu_layer_ops.py: float32 arithmetic, results rounded to the input dtype
// where the reference rounds them), so bfloat16 outputs equal the reference's except where a reduction
// or exp() rounds its last float32 bit differently (SiLU takes exp eight lanes at a time, exp8 of
// cpu_simd.h, within about 1 ulp of std::exp; exp16 gives the same bits on sixteen lanes). Rows are
// independent: at::parallel_for over rows in tasks of kRowGrain (up to 4 rows, a decode row among them,
// run inline on the calling thread; SiLU * up splits more rows into column parts).
//
// Floating-point contraction is off in this file: the reference rounds a * b before adding c, and a fused
// multiply-add would not.
#pragma GCC optimize("fp-contract=off")
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <type_traits>

#include "cpu_simd.h"

namespace {

inline float f32(float v) { return v; }
inline float f32(at::BFloat16 v) { return static_cast<float>(v); }

// Rows per parallel task: up to 4 rows (a decode row) run inline on the calling thread; a k = 4 chain's 5
// rows and a token tree's 16 split across threads (SiLU * up of 16 rows: 30 -> ~17 µs on 2 threads).
constexpr int64_t kRowGrain = 4;

#ifdef SPECDEC_AVX2
// Eight float32 values rounded to T's precision, as float32: identity for float32; bfloat16 round to
// nearest even (NaN kept a quiet NaN), as at::BFloat16(float) rounds.
template <typename T>
inline __m256 round8(__m256 v) {
  if (std::is_same<T, float>::value) return v;
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                     _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
#ifdef SPECDEC_AVX512
// round8 on sixteen lanes (the same integer operations).
template <typename T>
inline __m512 round16(__m512 v) {
  if (std::is_same<T, float>::value) return v;
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                     _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 unordered = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512 nan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000));
  return _mm512_mask_blend_ps(unordered, _mm512_castsi512_ps(r), nan);
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// v already rounded to bfloat16 precision (round16): its high halves.
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
#endif
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// v already rounded to bfloat16 precision (round8): its high halves.
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t rows, int64_t H, float eps,
                   bool gemma) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * H;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= H; i += 8)
        for (int j = 0; j < 8; ++j) {
          const float v = f32(xr[i + j]);
          acc[j] += v * v;
        }
      float ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; i < H; ++i) ss += f32(xr[i]) * f32(xr[i]);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
      if (gemma) {  // (h * (1 + w)) in float32, rounded once
        for (int64_t k = 0; k < H; ++k) o[k] = static_cast<T>((f32(xr[k]) * inv) * (1.0f + f32(w[k])));
      } else {  // h rounded to T, then w * h rounded (Llama's order)
        int64_t k = 0;
#ifdef SPECDEC_AVX2
        const __m256 inv8 = _mm256_set1_ps(inv);
        for (; k + 8 <= H; k += 8) {
          const __m256 h = round8<T>(_mm256_mul_ps(specdec_cpu::load8(xr + k), inv8));
          store8(o + k, round8<T>(_mm256_mul_ps(specdec_cpu::load8(w + k), h)));
        }
#endif
        for (; k < H; ++k) {
          const T h = static_cast<T>(f32(xr[k]) * inv);
          o[k] = static_cast<T>(f32(w[k]) * f32(h));
        }
      }
    }
  });
}

template <typename T>
void rope_rows(const T* qk, int64_t s_tok, int64_t s_head, const T* cos, const T* sin, T* out, int64_t T_,
               int64_t NH, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < NH; ++h) {
        const T* x = qk + t * s_tok + h * s_head;
        T* o = out + (t * NH + h) * D;
        int64_t d = 0;
#ifdef SPECDEC_AVX2
        if (half % 8 == 0) {  // eight at a time within each half, the same roundings as below
          const __m256 minus = _mm256_set1_ps(-0.0f);
          for (; d < D; d += 8) {
            const __m256 rot = d < half ? _mm256_xor_ps(specdec_cpu::load8(x + d + half), minus)
                                        : specdec_cpu::load8(x + d - half);
            const __m256 a = round8<T>(_mm256_mul_ps(specdec_cpu::load8(x + d), specdec_cpu::load8(c + d)));
            const __m256 b = round8<T>(_mm256_mul_ps(rot, specdec_cpu::load8(s + d)));
            store8(o + d, round8<T>(_mm256_add_ps(a, b)));
          }
        }
#endif
        for (; d < D; ++d) {
          // rotate_half: (-x[half:], x[:half])
          const float rot = d < half ? -f32(x[d + half]) : f32(x[d - half]);
          const T a = static_cast<T>(f32(x[d]) * f32(c[d]));
          const T b = static_cast<T>(rot * f32(s[d]));
          o[d] = static_cast<T>(f32(a) + f32(b));
        }
      }
    }
  });
}

// Columns per parallel unit of SiLU * up: a row in four parts (multiples of 16 columns), so that 5 rows
// split evenly over 2 threads (whole rows went 4 : 1).
constexpr int64_t kSiluParts = 4;

template <typename T>
void silu_mul_rows(const T* gu, int64_t stride, T* out, int64_t rows, int64_t I) {
  const int64_t part = (I + kSiluParts * 16 - 1) / (kSiluParts * 16) * 16;
  // Up to kRowGrain rows inline on the calling thread (as the other kernels); more split evenly.
  const int64_t grain = rows <= kRowGrain ? rows * kSiluParts : 1;
  at::parallel_for(0, rows * kSiluParts, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / kSiluParts, k0 = std::min(I, p % kSiluParts * part);
      const int64_t k1 = p % kSiluParts == kSiluParts - 1 ? I : std::min(I, k0 + part);
      const T* g = gu + r * stride;
      const T* u = g + I;
      T* o = out + r * I;
      int64_t k = k0;
#ifdef SPECDEC_AVX512
      // Sixteen at a time: exp16 gives exp8's bits, and the division and roundings are element-wise, so
      // each element equals the eight-lane loop's below (parts start at multiples of 16: an element takes
      // the same path, vector or scalar tail, as in one pass over the row).
      for (; k + 16 <= k1; k += 16) {
        const __m512 x = load16(g + k);
        const __m512 e = specdec_cpu::exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 act = round16<T>(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        store16(o + k, round16<T>(_mm512_mul_ps(act, load16(u + k))));
      }
#endif
#ifdef SPECDEC_AVX2
      // Eight at a time: exp(-x) by exp8 (within about 1 ulp of std::exp), the division, both roundings
      // to T and the product as the scalar loop below computes them (a vector division rounds as a scalar
      // one does; round8 is at::BFloat16's rounding), so the result does not depend on where a row's
      // tail starts.
      for (; k + 8 <= k1; k += 8) {
        const __m256 x = specdec_cpu::load8(g + k);
        const __m256 e = specdec_cpu::exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        const __m256 act = round8<T>(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
        store8(o + k, round8<T>(_mm256_mul_ps(act, specdec_cpu::load8(u + k))));
      }
#endif
      for (; k < k1; ++k) {
        const float x = f32(g[k]);
        const T act = static_cast<T>(x / (1.0f + std::exp(-x)));
        o[k] = static_cast<T>(f32(act) * f32(u[k]));
      }
    }
  });
}

void check_dtype(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

}  // namespace

// x [T, H] (rows strided, elements contiguous), weight [H] of x's dtype -> [T, H].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool gemma) {
  check_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, H] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [H] tensor of x's dtype");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), out.data_ptr<float>(),
                  x.size(0), x.size(1), static_cast<float>(eps), gemma);
  else
    rms_norm_rows(x.data_ptr<at::BFloat16>(), x.stride(0), weight.data_ptr<at::BFloat16>(),
                  out.data_ptr<at::BFloat16>(), x.size(0), x.size(1), static_cast<float>(eps), gemma);
  return out;
}

// qk [T, NH, D] (head rows contiguous, any token and head stride), cos / sin [T, 1, D] contiguous -> [T, NH, D].
torch::Tensor rope(const torch::Tensor& qk, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_dtype(qk, "qk");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.size(2) % 2 == 0,
              "rope: qk must be [T, heads, D] with contiguous head rows and an even D");
  const int64_t T_ = qk.size(0), NH = qk.size(1), D = qk.size(2);
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->is_contiguous() && t->numel() == T_ * D && t->scalar_type() == qk.scalar_type(),
                "rope: cos and sin must be contiguous [T, 1, D] tensors of qk's dtype");
  auto out = torch::empty({T_, NH, D}, qk.options());
  if (qk.scalar_type() == at::kFloat)
    rope_rows(qk.data_ptr<float>(), qk.stride(0), qk.stride(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
              out.data_ptr<float>(), T_, NH, D);
  else
    rope_rows(qk.data_ptr<at::BFloat16>(), qk.stride(0), qk.stride(1), cos.data_ptr<at::BFloat16>(),
              sin.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), T_, NH, D);
  return out;
}

// gate_up [T, 2I] (rows strided) -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_dtype(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [T, 2I] with contiguous rows");
  const int64_t I = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), I}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat)
    silu_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(), gate_up.size(0), I);
  else
    silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), gate_up.stride(0), out.data_ptr<at::BFloat16>(),
                  gate_up.size(0), I);
  return out;
}
