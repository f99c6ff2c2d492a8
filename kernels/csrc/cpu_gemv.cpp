// Skinny matrix products on the CPU: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), M small (decode rows).
//
// Decode reads every weight once per step, so a step is bound by how fast these products stream the
// weights. Each thread takes a contiguous range of output rows n (at::parallel_for) and streams w[n, :]
// once for all M input rows (up to 8 at a time, so a verification of k + 1 <= 8 rows reads each weight
// once). float32 and bfloat16 weights (bfloat16 widened to float32 in registers, see load16) and
// inputs; float32 accumulation, 8-lane AVX2 FMA with two accumulators per row when the compiler targets AVX2, a scalar
// loop otherwise. bfloat16 weights with bfloat16 inputs on a CPU with AVX512_BF16: cpu_gemv_bf16dp.h instead. Reference: kernels/cpu_gemv.py:gemv_reference (F.linear); tests/kernels/test_cpu_gemv.py.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>
#include "cpu_simd.h"
#include "cpu_gemv_bf16dp.h"
#include "cpu_gemv_amx.h"
#include "cpu_gemv_bf16tiles.h"
#include "cpu_gemv_f32x16.h"

namespace {

using namespace specdec_cpu;

// 16 weights w[k .. k + 16) as two float32 vectors, and the input layout they pair with. float32: in
// order (lo = w[k..k+8), hi = w[k+8..k+16)). bfloat16: one 256-bit load split into the even elements
// (shifted into the high half of each 32-bit lane) and the odd ones (masked), so the input is stored
// permuted within each block of 16 (see prepare_x): two cheap integer ops per 16 weights instead of
// two widening loads.
#ifdef SPECDEC_AVX2
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load16(const at::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif
template <typename W>
constexpr bool permuted() { return std::is_same<W, at::BFloat16>::value; }

// xf [M, K] float32 from x [M, K] (float32 or bfloat16), in the layout load16<W> pairs with: for bfloat16
// weights each full block of 16 holds the even elements, then the odd ones.
template <typename W, typename X>
void prepare_x(const X* x, int64_t M, int64_t K, int64_t stride, float* xf) {
  for (int64_t m = 0; m < M; ++m) {
    const X* src = x + m * stride;
    float* dst = xf + m * K;
    int64_t k = 0;
#ifdef SPECDEC_AVX2
    if (permuted<W>())
      for (; k + 16 <= K; k += 16)
        for (int i = 0; i < 8; ++i) {
          dst[k + i] = to_float(src[k + 2 * i]);
          dst[k + 8 + i] = to_float(src[k + 2 * i + 1]);
        }
#endif
    for (; k < K; ++k) dst[k] = to_float(src[k]);
  }
}

// Rows m0..m0+MC of y at output row n: dot(w[n, :], x[m, :]), x prepared for W. Up to 4 rows: two
// accumulators per row (FMA latency); 5 to 8 rows: one each (16 registers in all), so a k = 4..7
// verification reads each weight once.
template <int MC, typename W>
inline void dot_rows(const W* row, const float* x, int64_t K, float* out) {
  constexpr bool two = MC <= 4;
  int64_t k = 0;
#ifdef SPECDEC_AVX2
  __m256 acc0[MC], acc1[MC];
  for (int j = 0; j < MC; ++j) acc0[j] = acc1[j] = _mm256_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    __m256 w0, w1;
    // bfloat16: software prefetch 4 rows ahead (measured 15 -> 22 GB/s on the LM head here; float32
    // streams as fast without it).
    _mm_prefetch(reinterpret_cast<const char*>(row + 4 * K + k), _MM_HINT_T0);
    load16(row + k, w0, w1);
    for (int j = 0; j < MC; ++j) {
      acc0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * K + k), acc0[j]);
      if (two) acc1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j * K + k + 8), acc1[j]);
      else acc0[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j * K + k + 8), acc0[j]);
    }
  }
  for (int j = 0; j < MC; ++j) out[j] = hsum(two ? _mm256_add_ps(acc0[j], acc1[j]) : acc0[j]);
#else
  for (int j = 0; j < MC; ++j) out[j] = 0.f;
#endif
  for (; k < K; ++k) {
    float wv = to_float(row[k]);
    for (int j = 0; j < MC; ++j) out[j] += wv * x[j * K + k];
  }
}

template <typename W, typename Y>
void gemv_impl(const float* x, const W* w, const float* bias, Y* y, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float out[8];
    for (int64_t n = n0; n < n1; ++n) {
      const W* row = w + n * K;
      const float b = bias ? bias[n] : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mc = std::min<int64_t>(8, M - m0);
        const float* xm = x + m0 * K;
        switch (mc) {
          case 8: dot_rows<8>(row, xm, K, out); break;
          case 7: dot_rows<7>(row, xm, K, out); break;
          case 6: dot_rows<6>(row, xm, K, out); break;
          case 5: dot_rows<5>(row, xm, K, out); break;
          case 4: dot_rows<4>(row, xm, K, out); break;
          case 3: dot_rows<3>(row, xm, K, out); break;
          case 2: dot_rows<2>(row, xm, K, out); break;
          default: dot_rows<1>(row, xm, K, out); break;
        }
        for (int64_t j = 0; j < mc; ++j) from_float(out[j] + b, y + (m0 + j) * N + n);
      }
    }
  });
}

template <typename W, typename X>
void gemv_typed(const torch::Tensor& x, const torch::Tensor& w, const float* bias, torch::Tensor& y) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const X* xp = x.data_ptr<X>();
  std::vector<float> buffer;
  const float* xf;
  if (std::is_same<X, float>::value && !permuted<W>() && x.stride(0) == K) {
    xf = reinterpret_cast<const float*>(xp);  // already float32, in order: no copy
  } else {
    buffer.resize(M * K);
    prepare_x<W, X>(xp, M, K, x.stride(0), buffer.data());
    xf = buffer.data();
  }
  gemv_impl<W, X>(xf, w.data_ptr<W>(), bias, y.data_ptr<X>(), M, N, K);
}

}  // namespace

// Whether bfloat16 x bfloat16 products use the AVX-512 BF16 dot-product kernel (cpu_gemv_bf16dp.h): built
// with it and not switched off. set_bf16_dot(false) selects the AVX2 path (A/B measurements, tests);
// returns whether the kernel is in use after the call.
static std::atomic<bool> use_bf16_dot{true};
bool has_bf16_dot() {
#ifdef SPECDEC_BF16DP
  return use_bf16_dot.load();
#else
  return false;
#endif
}
bool set_bf16_dot(bool enabled) {
  use_bf16_dot.store(enabled);
  return has_bf16_dot();
}

// x [M, K] (float32 or bfloat16, unit stride along K), w [N, K] (float32 or bfloat16, contiguous), bias
// [N], or undefined / empty for none. Returns y [M, N] in x's dtype.
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [M, K], w [N, K]");
  TORCH_CHECK(w.is_contiguous(), "gemv: w must be contiguous");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16,
              "gemv: w must be float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "gemv: x must be float32 or bfloat16");
  if (x.stride(1) != 1) x = x.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0) return y;  // no rows (the passes below divide by their count)
  torch::Tensor bf;
  const float* bp = nullptr;
  if (bias.defined() && bias.numel()) {
    bf = bias.to(torch::kFloat32).contiguous();
    bp = bf.data_ptr<float>();
  }
  const bool wf = w.scalar_type() == torch::kFloat32, xf = x.scalar_type() == torch::kFloat32;
#ifdef SPECDEC_BF16DP
  if (!wf && !xf && use_bf16_dot.load()) {  // bfloat16 x bfloat16: AVX-512 BF16 (cpu_gemv_bf16dp.h)
    specdec_cpu_bf16dp::gemv(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0),
                             reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), bp,
                             reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), x.size(0), w.size(0),
                             w.size(1));
    return y;
  }
#endif
#ifdef SPECDEC_F32X16
  if (wf && xf) {  // float32 x float32: 16-lane AVX-512 (cpu_gemv_f32x16.h)
    specdec_cpu_f32x16::gemv(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), bp, y.data_ptr<float>(),
                             x.size(0), w.size(0), w.size(1));
    return y;
  }
#endif
  if (wf && xf) gemv_typed<float, float>(x, w, bp, y);
  else if (wf) gemv_typed<float, at::BFloat16>(x, w, bp, y);
  else if (xf) gemv_typed<at::BFloat16, float>(x, w, bp, y);
  else gemv_typed<at::BFloat16, at::BFloat16>(x, w, bp, y);
  return y;
}

// Whether bfloat16 products of packed weights use AMX tiles (cpu_gemv_amx.h): built with them, the process
// granted them, and not switched off. set_amx(false): the AVX-512 BF16 kernel multiplies the tile layout
// instead (oneDNN, with set_tiles(false) too), and the attention's scores take the AVX-512 path (A/B
// measurements, tests); returns whether AMX is in use after the call.
static std::atomic<bool> use_amx{true};
bool has_amx() {
#ifdef SPECDEC_AMX
  return use_amx.load() && specdec_cpu_amx::permitted();
#else
  return false;
#endif
}
bool set_amx(bool enabled) {
  use_amx.store(enabled);
  return has_amx();
}

// Whether an [M, K] x [N, K]^T bfloat16 product is faster through oneDNN's GEMM on pre-packed weights than
// through the kernel above (measured on a 2-core AMD EPYC with AVX512_BF16, SmolLM2 shapes, weights cold:
// at 16 rows oneDNN 88-119 G multiply-adds/s against the kernel's 52-71; at 5 rows 48-61 against 39-49 for
// the wide matrices, while the kernel stays ahead on the small ones and at 1-2 rows).
bool onednn_rows(int64_t M, int64_t N, int64_t K) { return M >= 12 || (M >= 5 && (N >= 2048 || K >= 1024)); }

// Whether packed bfloat16 weights take the tile layout (cpu_gemv_tiles.h): the AMX kernel where has_amx(),
// else the AVX-512 BF16 kernel on it (cpu_gemv_bf16tiles.h) where the kernels were built with AVX512_BF16
// and it is not switched off. set_tiles(false): oneDNN's packing and GEMM where there is no AMX (A/B
// measurements, tests; SPECDEC_CPU_TILES=0); returns whether the tile layout is in use after the call.
static std::atomic<bool> use_tiles{true};
bool has_tiles() {
#ifdef SPECDEC_BF16TILES
  if (use_tiles.load()) return true;
#endif
  return has_amx();
}
bool set_tiles(bool enabled) {
  use_tiles.store(enabled);
  return has_tiles();
}

// Whether a product of M rows with a packed [N, K] weight takes linear_packed rather than the kernel: with
// the tile layout every product, one row included (AMX: the tiles stream the weights as fast at 2-16 rows
// as the kernel at one, cpu_gemv_amx.h; AVX-512 BF16: the tile order's products need no horizontal sums,
// cpu_gemv_bf16tiles.h), and each output row's sums do not depend on the other rows, so a row verified
// among k + 1 gets the bits it gets decoded alone: greedy speculative decoding equals greedy plain
// decoding bit for bit in bfloat16; else onednn_rows. One rule for the linear layers
// (specdec/models/cpu_linear.py) and the layer stack (cpu_decode_stack.cpp), so both take the same path
// for the same product.
bool packed_rows(int64_t M, int64_t N, int64_t K) { return has_tiles() ? M >= 1 : onednn_rows(M, N, K); }

// w [N, K] bfloat16 packed in tile order (layouts in cpu_gemv_tiles.h): for the AMX kernel where has_amx(),
// [G, KB, 4, 16, 32]; else pair-major for the AVX-512 BF16 kernel, [G, KB, 16, 4, 32].
torch::Tensor pack_tiles(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack_tiles: w must be [N, K] bfloat16");
#if defined(SPECDEC_AMX) || defined(SPECDEC_BF16TILES)
  using namespace specdec_cpu_tiles;
  const auto wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t G = (N + kGroup * kTileN - 1) / (kGroup * kTileN), KB = (K + kTileK - 1) / kTileK;
  const bool pair_major = !has_amx();
  auto p = pair_major ? torch::empty({G, KB, kTileK / 2, kGroup, 2 * kTileN}, w.options())
                      : torch::empty({G, KB, kGroup, kTileK / 2, 2 * kTileN}, w.options());
  pack(reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), N, K,
       reinterpret_cast<uint16_t*>(p.data_ptr<at::BFloat16>()), pair_major);
  return p;
#else
  TORCH_CHECK(false, "pack_tiles: the kernels were built without AMX or AVX512_BF16");
#endif
}

namespace {

#if defined(SPECDEC_AMX) || defined(SPECDEC_BF16TILES)
// x [M, K] @ w^T + bias on packed = pack_tiles(w): the AMX kernel where has_amx(), else the AVX-512 BF16
// one; x copied into a zero-padded buffer where K is not a multiple of 32 (the AMX kernel, past 16 rows,
// reads a last, partial block of 16 rows from a padded copy of those rows only).
torch::Tensor linear_tiles(torch::Tensor x, const torch::Tensor& packed, int64_t N, int64_t K,
                           const torch::Tensor& bias, bool float_out = false) {
  using namespace specdec_cpu_tiles;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16,
              "linear_packed: x must be bfloat16 with a tile-packed weight");
  TORCH_CHECK(packed.dim() == 5 && packed.size(0) * kGroup * kTileN >= N && packed.size(1) * kTileK == (K + kTileK - 1) / kTileK * kTileK,
              "linear_packed: the packed weight does not match [N, K]");
  // The layout tells the kernel: [G, KB, 4, 16, 32] the AMX one's (used for a weight packed for it even
  // after set_amx(false), as long as the tiles are granted), [G, KB, 16, 4, 32] the AVX-512 one's.
  const bool amx = packed.size(2) == kGroup;
#ifdef SPECDEC_AMX
  TORCH_CHECK(!amx || specdec_cpu_amx::permitted(),
              "linear_packed: a weight packed for AMX, but the tiles are not granted");
#else
  TORCH_CHECK(!amx, "linear_packed: a weight packed for AMX, but the kernels were built without it");
#endif
  const int64_t M = x.size(0), Kp = packed.size(1) * kTileK;
  if (x.stride(1) != 1) x = x.contiguous();
  if (Kp != K) {
    auto padded = torch::zeros({M, Kp}, x.options());
    padded.narrow(1, 0, K).copy_(x);
    x = padded;
  }
  // float_out: float32 logits straight from the AMX kernel (its bfloat16 values widened); the AVX-512 BF16
  // kernel's bfloat16 result is widened after.
  const bool widen_in_kernel = float_out && amx;
  auto y = torch::empty({M, N},
                        x.options().dtype(widen_in_kernel ? torch::kFloat32 : torch::kBFloat16));
  // No rows: a tile configured with none is invalid.
  if (M == 0) return float_out ? y.to(torch::kFloat32) : y;
  torch::Tensor bf;
  const float* bp = nullptr;
  if (bias.defined() && bias.numel()) {
    bf = bias.to(torch::kFloat32).contiguous();
    bp = bf.data_ptr<float>();
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
#ifdef SPECDEC_AMX
  if (amx) {
    // Past 16 rows the tiles hold 16 rows: a last, partial block is read from a zero-padded copy of its
    // rows (a buffer of this thread's, kept between calls: no allocation or torch call per product).
    thread_local std::vector<uint16_t> tail;
    const int64_t full = M / 16, rest = M % 16;
    if (M > 16 && rest) {
      tail.resize(16 * Kp);
      for (int64_t m = 0; m < rest; ++m)
        std::memcpy(tail.data() + m * Kp, xp + (full * 16 + m) * x.stride(0), Kp * sizeof(uint16_t));
      std::fill(tail.begin() + rest * Kp, tail.end(), 0);
    }
    if (widen_in_kernel)
      specdec_cpu_amx::linear(xp, x.stride(0), M, tail.data(), Kp, pp, N, K, bp, y.data_ptr<float>());
    else
      specdec_cpu_amx::linear(xp, x.stride(0), M, tail.data(), Kp, pp, N, K, bp,
                              reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
    return y;
  }
#endif
#ifdef SPECDEC_BF16TILES
  specdec_cpu_bf16tiles::linear(xp, x.stride(0), M, pp, N, K, bp,
                                reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return float_out ? y.to(torch::kFloat32) : y;
#else
  TORCH_CHECK(false, "linear_packed: a tile-packed weight, but the kernels were built without AVX512_BF16");
#endif
}
#endif

// x @ W^T + bias through oneDNN (mkldnn::_linear_pointwise) on packed = mkldnn::_reorder_linear_weight(W).
torch::Tensor linear_onednn(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.reserve(6);
  stack.emplace_back(x.is_contiguous() ? x : x.contiguous());
  stack.emplace_back(packed);
  if (bias.defined() && bias.numel()) stack.emplace_back(bias);
  else stack.emplace_back(c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

// y [M, N] = x [M, K] @ w^T + bias on w's packed copy: packed by pack_tiles ([G, KB, 4, 16, 32]) through the
// AMX or AVX-512 BF16 kernel, else by mkldnn::_reorder_linear_weight through oneDNN. w [N, K] gives the
// shape (its values are not read); bias [N] of x's dtype, or undefined / empty for none.
torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& packed,
                            const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_packed: x [M, K], w [N, K]");
  if (packed.dim() == 5) {
#if defined(SPECDEC_AMX) || defined(SPECDEC_BF16TILES)
    return linear_tiles(x, packed, w.size(0), w.size(1), bias);
#else
    TORCH_CHECK(false,
                "linear_packed: a tile-packed weight, but the kernels were built without AMX or AVX512_BF16");
#endif
  }
  return linear_onednn(x, packed, bias);
}

// linear_packed(x, w, packed, bias).float(), bit for bit: an LM head's float32 logits [M, N]. On AMX the
// kernel writes them itself (no bfloat16 logits tensor, no conversion pass over it: that pass took 0.37 ms
// a step at 24 rows of SmolLM2's 49,152-token head and 0.97 ms at 53, timed in the engine); the AVX-512
// BF16 tile kernel and oneDNN convert after. Errors: linear_packed's.
torch::Tensor linear_packed_logits(const torch::Tensor& x, const torch::Tensor& w,
                                   const torch::Tensor& packed, const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_packed_logits: x [M, K], w [N, K]");
#if defined(SPECDEC_AMX) || defined(SPECDEC_BF16TILES)
  if (packed.dim() == 5) return linear_tiles(x, packed, w.size(0), w.size(1), bias, true);
#endif
  return linear_packed(x, w, packed, bias).to(torch::kFloat32);
}
