// Skinny matrix products on the CPU: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), M small (decode rows).
//
// Decode reads every weight once per step, so a step is bound by how fast these products stream the
// weights. Each thread takes a contiguous range of output rows n (at::parallel_for) and streams w[n, :]
// once for all M input rows (up to 4 at a time, so a verification of k + 1 rows reads each weight once
// per 4 rows). float32 and bfloat16 weights (bfloat16 widened to float32 in registers); float32
// accumulation, 8-lane AVX2 FMA with two accumulators per row when the compiler targets AVX2, a scalar
// loop otherwise. Reference: kernels/cpu_gemv.py:gemv_reference (F.linear); tests/kernels/test_cpu_gemv.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <algorithm>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECDEC_AVX2 1
#endif

namespace {

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

// Rows m0..m0+MC of y at output row n: dot(w[n, :], x[m, :]).
template <int MC, typename W>
inline void dot_rows(const W* row, const float* x, int64_t K, float* out) {
  int64_t k = 0;
#ifdef SPECDEC_AVX2
  __m256 acc0[MC], acc1[MC];
  for (int j = 0; j < MC; ++j) acc0[j] = acc1[j] = _mm256_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    __m256 w0 = load8(row + k), w1 = load8(row + k + 8);
    for (int j = 0; j < MC; ++j) {
      acc0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * K + k), acc0[j]);
      acc1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j * K + k + 8), acc1[j]);
    }
  }
  for (int j = 0; j < MC; ++j) out[j] = hsum(_mm256_add_ps(acc0[j], acc1[j]));
#else
  for (int j = 0; j < MC; ++j) out[j] = 0.f;
#endif
  for (; k < K; ++k) {
    float wv = to_float(row[k]);
    for (int j = 0; j < MC; ++j) out[j] += wv * x[j * K + k];
  }
}

template <typename W>
void gemv_impl(const float* x, const W* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float out[4];
    for (int64_t n = n0; n < n1; ++n) {
      const W* row = w + n * K;
      const float b = bias ? bias[n] : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mc = std::min<int64_t>(4, M - m0);
        const float* xm = x + m0 * K;
        switch (mc) {
          case 4: dot_rows<4>(row, xm, K, out); break;
          case 3: dot_rows<3>(row, xm, K, out); break;
          case 2: dot_rows<2>(row, xm, K, out); break;
          default: dot_rows<1>(row, xm, K, out); break;
        }
        for (int64_t j = 0; j < mc; ++j) y[(m0 + j) * N + n] = out[j] + b;
      }
    }
  });
}

}  // namespace

// x [M, K] (float32 or bfloat16), w [N, K] (float32 or bfloat16, contiguous), bias [N] or empty.
// Returns y [M, N] in x's dtype.
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [M, K], w [N, K]");
  TORCH_CHECK(w.is_contiguous(), "gemv: w must be contiguous");
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto y = torch::empty({M, N}, xf.options());
  torch::Tensor bf;
  const float* bp = nullptr;
  if (bias.numel()) {
    bf = bias.to(torch::kFloat32).contiguous();
    bp = bf.data_ptr<float>();
  }
  if (w.scalar_type() == torch::kFloat32) {
    gemv_impl<float>(xf.data_ptr<float>(), w.data_ptr<float>(), bp, y.data_ptr<float>(), M, N, K);
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "gemv: w must be float32 or bfloat16");
    gemv_impl<at::BFloat16>(xf.data_ptr<float>(), w.data_ptr<at::BFloat16>(), bp, y.data_ptr<float>(), M, N, K);
  }
  return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
}

bool has_avx2() {
#ifdef SPECDEC_AVX2
  return true;
#else
  return false;
#endif
}
