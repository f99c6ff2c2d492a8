// Weight-only int8 skinny products on the CPU: y[M, N] = x[M, K] @ (codes[N, K] * scales[N])^T + bias, M
// small (decode rows of an int8 model, e.g. the quantized self-drafter's draft steps).
//
// An int8 weight is half a bfloat16 one, so a step bound by streaming the weights can run in half the time,
// if the product keeps up with the memory. Widening each code to bfloat16 or float32 costs three or four
// instructions per 16-32 weights; instead each input row is quantized once per call to int16 with one
// scale per row (sx = max |x| / 32767, round to nearest), each 32 codes are sign-extended to int16 in one
// instruction (vpmovsxbw), and vpdpwssd (AVX512_VNNI) multiplies 32 int16 pairs and adds each adjacent
// pair of products into one of 16 int32 lanes: two instructions per 32 weights and row, integer sums exact.
// Each weight row streams once for up to 16 input rows. y = sx * scales[n] * sum + bias[n], in float32,
// rounded to x's dtype.
//
// Error: the sum is exact for the quantized input, whose elements are each within sx / 2 of x's, so
// |y - x @ (codes * scales)^T| <= sx / 2 * scales[n] * sum_k |codes[n, k]| (plus the float32 product's and
// the output's rounding): the int16 input keeps about 15 bits of the row's largest element, more than
// bfloat16's 8. Overflow: a lane adds two products of at most 127 * 32767 per instruction; the int32
// lanes are flushed into float32 every kChunk columns (4096: at most 64 instructions, 5.3e8 per lane).
//
// The codes may also come as a second copy in the pair-major tile order (pack_int8_tiles below): the same
// quantized input and products through cpu_gemv_int8tiles.h, without horizontal sums.
//
// Without AVX512_VNNI (or AVX512BW) the same products run in float32 on the unquantized input, a plain
// loop the compiler vectorises. Reference: kernels/cpu_gemv_int8.py:gemv_int8_reference (dequantize, then
// F.linear); tests/kernels/test_cpu_gemv_int8.py. Source: Intel Intrinsics Guide, _mm512_dpwssd_epi32.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_gemv_int8tiles.h"
#include "cpu_gemv_passes.h"
#include "cpu_simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECDEC_INT8_VNNI 1
#include <immintrin.h>
#endif

namespace {

using specdec_cpu::from_float;
using specdec_cpu::to_float;

#ifdef SPECDEC_INT8_VNNI
constexpr int64_t kChunk = 4096;  // columns between int32 -> float32 flushes (see the header)
#ifndef SPECDEC_INT8_PREFETCH
#define SPECDEC_INT8_PREFETCH 8192
#endif
constexpr int64_t kPrefetch = SPECDEC_INT8_PREFETCH;  // bytes ahead

// 16 elements of x as float32 (bfloat16: its bits moved up; float32: loaded), the first n of them (the
// rest zero; n <= 0: none read).
inline __mmask16 first(int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1u);
}
inline __m512 load16(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline __m512 load16(const at::BFloat16* p, int64_t n) {
  const __m256i h = _mm256_maskz_loadu_epi16(first(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Input rows quantized to int16: xq [M, Kp] (Kp = K rounded up to 64, zero-padded), sx [M]. Vectorised: a
// call's fixed cost is part of every small product (SmolLM2's o projection, 576 x 576, streams in ~12 us);
// the values equal the scalar form's (max |x| is exact; _mm512_cvtps_epi32 rounds to nearest even, as
// std::nearbyint in the default rounding mode; |x * inv| <= 32767 plus rounding, so the int16 pack never
// saturates a value the scalar cast would keep).
template <typename X>
void quantize_rows(const X* x, int64_t xs, int64_t M, int64_t K, int64_t Kp, int16_t* xq, float* sx) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t m = 0; m < M; ++m) {
    const X* row = x + m * xs;
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
      vmax = _mm512_max_ps(vmax, _mm512_and_ps(load16(row + k, K - k), abs_mask));
    const float amax = _mm512_reduce_max_ps(vmax);
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    sx[m] = amax > 0.f ? amax / 32767.f : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    int16_t* q = xq + m * Kp;
    for (int64_t k = 0; k < Kp; k += 16) {  // past K: zeros (load16 masks them)
      const __m512i i32 = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + k, K - k), vinv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm512_cvtsepi32_epi16(i32));
    }
  }
}

// R weight rows codes[r * K : (r + 1) * K] against MC quantized input rows: out[r * MC + j] = sum_k
// xq[j, k] * codes[r, k] (exact within each chunk, summed in float32 across chunks). Several weight rows at
// once (R up to 4) keep several memory streams and independent accumulator chains in flight: at one input
// row, 14-16 GB/s of codes one weight row at a time, 18-24 with four on a 2-core Intel Xeon (AMX host).
// Each (row, input row) pair sums into C int32 accumulators (C = 2 U: U blocks of 64 columns per loop
// step, each block's two halves into their own accumulator), added together at the chunk's end: the sums
// are exact integers, so C changes no value, only how many vpdpwssd chains run at once. At R = MC = 1 (one
// weight stream, the Zen 4 choice) a single chain waits on vpdpwssd's latency at every instruction: 3072 x
// 576 at one row, weights in cache, 37 us with one chain, 32 with four (Zen 4).
template <int MC, int R>
constexpr int blocks_per_step() { return R * MC == 1 ? 4 : R * MC <= 4 ? 2 : 1; }

template <int MC, int R>
inline void dot_rows(const int8_t* w, int64_t K, const int16_t* xq, int64_t Kp, float* out) {
  constexpr int U = blocks_per_step<MC, R>(), C = 2 * U;
  __m512 sum[R][MC];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MC; ++j) sum[r][j] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
    const int64_t c1 = std::min(K, c0 + kChunk);
    __m512i acc[C][R][MC];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < MC; ++j) acc[c][r][j] = _mm512_setzero_si512();
    // Columns [k, k + 64) into accumulators 2u and 2u + 1.
    auto block = [&](int64_t k, int u) {
      __m512i lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        const int8_t* row = w + r * K + k;
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch), _MM_HINT_T0);
        lo[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
        hi[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32)));
      }
      for (int j = 0; j < MC; ++j) {
        const __m512i q0 = _mm512_loadu_si512(xq + j * Kp + k), q1 = _mm512_loadu_si512(xq + j * Kp + k + 32);
        for (int r = 0; r < R; ++r) {
          acc[2 * u][r][j] = _mm512_dpwssd_epi32(acc[2 * u][r][j], q0, lo[r]);
          acc[2 * u + 1][r][j] = _mm512_dpwssd_epi32(acc[2 * u + 1][r][j], q1, hi[r]);
        }
      }
    };
    int64_t k = c0;
    for (; k + 64 * U <= c1; k += 64 * U)
      for (int u = 0; u < U; ++u) block(k + 64 * u, u);
    for (; k + 64 <= c1; k += 64) block(k, 0);
    for (; k < c1; k += 32) {  // the last columns: codes masked, xq zero-padded to Kp
      const int64_t left = c1 - k;
      const __mmask32 mask = left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << left) - 1u);
      for (int r = 0; r < R; ++r) {
        const __m512i v = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + r * K + k));
        for (int j = 0; j < MC; ++j)
          acc[0][r][j] = _mm512_dpwssd_epi32(acc[0][r][j], _mm512_loadu_si512(xq + j * Kp + k), v);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < MC; ++j) {
        __m512i total = acc[0][r][j];
        for (int c = 1; c < C; ++c) total = _mm512_add_epi32(total, acc[c][r][j]);
        sum[r][j] = _mm512_add_ps(sum[r][j], _mm512_cvtepi32_ps(total));
      }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MC; ++j) out[r * MC + j] = _mm512_reduce_add_ps(sum[r][j]);
}

// Weight rows at once for MC input rows (accumulators R * MC within the 32 vector registers), at most
// int8_streams(): four weight rows' streams interleaved ran 18-24 GB/s against 14-16 for one on a 2-core
// Intel Xeon (AMX host), while on a 2-core AMD EPYC (Zen 4) one stream ran 27-29 GB/s and four 15
// (SmolLM2 shapes, one input row, weights cold), the memory system there streaming one row at a time best
// (as with bfloat16 weights, cpu_gemv_bf16dp.h and cpu_gemv_bf16tiles.h).
template <int MC>
constexpr int rows_at_once() { return MC <= 2 ? 4 : MC <= 4 ? 2 : 1; }
inline int int8_streams() {
  static const int streams = __builtin_cpu_is("amd") ? 1 : 4;
  return streams;
}

template <typename X>
void gemv_int8_vnni(const X* x, int64_t xs, const int8_t* w, const int8_t* packed, const float* scales,
                    const float* bias, X* y, int64_t M, int64_t N, int64_t K) {
  const int64_t Kp = (K + 63) / 64 * 64;
  std::vector<int16_t> xq(M * Kp);
  std::vector<float> sx(M);
  quantize_rows(x, xs, M, K, Kp, xq.data(), sx.data());
  if (packed) {  // codes in tile order (pack_int8_tiles)
    specdec_cpu_int8tiles::linear<X>(xq.data(), Kp, sx.data(), M, packed, N, K, scales, bias, y);
    return;
  }
  auto run = [&](auto one_stream) {
    specdec_cpu_passes::passes(M, N, [&](int64_t m0, auto rows, int64_t n0, int64_t n1) {
      constexpr int MC = decltype(rows)::value, R = decltype(one_stream)::value ? 1 : rows_at_once<MC>();
      float out[R * MC];
      auto store = [&](int64_t n, int r) {
        const float b = bias ? bias[n] : 0.f;
        for (int j = 0; j < MC; ++j)
          from_float(out[r * MC + j] * sx[m0 + j] * scales[n] + b, y + (m0 + j) * N + n);
      };
      int64_t n = n0;
      for (; n + R <= n1; n += R) {
        dot_rows<MC, R>(w + n * K, K, xq.data() + m0 * Kp, Kp, out);
        for (int r = 0; r < R; ++r) store(n + r, r);
      }
      for (; n < n1; ++n) {
        dot_rows<MC, 1>(w + n * K, K, xq.data() + m0 * Kp, Kp, out);
        store(n, 0);
      }
    });
  };
  if (int8_streams() == 1) run(std::true_type{});
  else run(std::false_type{});
}
#endif

// Without VNNI: float32 sums of x * codes, one output row at a time for all M rows.
template <typename X>
void gemv_int8_plain(const X* x, int64_t xs, const int8_t* w, const float* scales, const float* bias, X* y,
                     int64_t M, int64_t N, int64_t K) {
  std::vector<float> xf(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = to_float(x[m * xs + k]);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* row = w + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = xf.data() + m * K;
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += xm[k] * static_cast<float>(row[k]);
        from_float(s * scales[n] + (bias ? bias[n] : 0.f), y + m * N + n);
      }
    }
  });
}

template <typename X>
void gemv_int8_typed(const torch::Tensor& x, const torch::Tensor& w, const int8_t* packed, const float* scales,
                     const float* bias, torch::Tensor& y) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const X* xp = x.data_ptr<X>();
#ifdef SPECDEC_INT8_VNNI
  gemv_int8_vnni<X>(xp, x.stride(0), w.data_ptr<int8_t>(), packed, scales, bias, y.data_ptr<X>(), M, N, K);
#else
  gemv_int8_plain<X>(xp, x.stride(0), w.data_ptr<int8_t>(), scales, bias, y.data_ptr<X>(), M, N, K);
#endif
}

}  // namespace

// Whether the int8 products use AVX512_VNNI (built for a CPU that has it), else the float32 loop.
bool has_int8_vnni() {
#ifdef SPECDEC_INT8_VNNI
  return true;
#else
  return false;
#endif
}

// Whether int8 codes may be packed in tile order here (AVX512_VNNI; see pack_int8_tiles).
bool has_int8_tiles() {
#ifdef SPECDEC_INT8_VNNI
  return true;
#else
  return false;
#endif
}

// codes [N, K] int8 in the pair-major tile order, [G, KB, 16, 4, 32] int8 (cpu_gemv_tiles.h; zeros past N
// or K), for gemv_int8's packed argument. Needs has_int8_tiles().
torch::Tensor pack_int8_tiles(const torch::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kChar, "pack_int8_tiles: codes [N, K] int8");
  TORCH_CHECK(has_int8_tiles(), "pack_int8_tiles: the kernels were built without AVX512_VNNI");
#ifdef SPECDEC_INT8_VNNI
  using namespace specdec_cpu_tiles;
  const auto wc = codes.contiguous();
  const int64_t N = codes.size(0), K = codes.size(1);
  const int64_t G = (N + kGroup * kTileN - 1) / (kGroup * kTileN), KB = (K + kTileK - 1) / kTileK;
  auto p = torch::empty({G, KB, kTileK / 2, kGroup, 2 * kTileN}, codes.options());
  pack(wc.data_ptr<int8_t>(), N, K, p.data_ptr<int8_t>(), /*pair_major=*/true);
  return p;
#else
  return torch::Tensor();
#endif
}

// x [M, K] (float32 or bfloat16, unit stride along K), codes [N, K] int8 contiguous, scales [N] (any
// floating dtype), bias [N] or undefined / empty for none; packed: empty, or pack_int8_tiles(codes) (the
// tile kernel, cpu_gemv_int8tiles.h). Returns y [M, N] in x's dtype.
torch::Tensor gemv_int8(torch::Tensor x, const torch::Tensor& codes, const torch::Tensor& scales,
                        const torch::Tensor& bias, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1),
              "gemv_int8: x [M, K], codes [N, K]");
  TORCH_CHECK(codes.scalar_type() == torch::kChar && codes.is_contiguous(),
              "gemv_int8: codes must be contiguous int8");
  TORCH_CHECK(scales.numel() == codes.size(0), "gemv_int8: one scale per output row");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "gemv_int8: x must be float32 or bfloat16");
  const bool tiles = packed.defined() && packed.numel() > 0;
  if (tiles) {
    const int64_t N = codes.size(0), K = codes.size(1);
    TORCH_CHECK(has_int8_tiles() && packed.scalar_type() == torch::kChar && packed.is_contiguous() &&
                    packed.numel() == (N + 63) / 64 * 64 * ((K + 31) / 32 * 32),
                "gemv_int8: packed must be pack_int8_tiles(codes)");
  }
  if (x.stride(1) != 1) x = x.contiguous();
  auto y = torch::empty({x.size(0), codes.size(0)}, x.options());
  if (x.size(0) == 0) return y;
  const auto sf = scales.to(torch::kFloat32).contiguous();
  torch::Tensor bf;
  const float* bp = nullptr;
  if (bias.defined() && bias.numel()) {
    bf = bias.to(torch::kFloat32).contiguous();
    bp = bf.data_ptr<float>();
  }
  const int8_t* pk = tiles ? packed.data_ptr<int8_t>() : nullptr;
  if (x.scalar_type() == torch::kFloat32) gemv_int8_typed<float>(x, codes, pk, sf.data_ptr<float>(), bp, y);
  else gemv_int8_typed<at::BFloat16>(x, codes, pk, sf.data_ptr<float>(), bp, y);
  return y;
}
