// Python bindings of the CPU kernels (one extension module, built by kernels/cpu_ext.py).
#include <torch/extension.h>
#include "cpu_kernels.h"
#include "cpu_simd.h"

// The GEMV kernel as a dispatcher operator, specdec_cpu::gemv: a linear layer calls it ~120 times per
// decode step, and through the dispatcher a call costs a few microseconds where a Python custom op costs
// ~25. kernels/cpu_gemv.py defines its schema, "gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor", and its
// fake (for torch.compile) at import, before this module is built; loading the module adds the CPU kernel.
torch::Tensor gemv_op(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias) {
  return gemv(x, w, bias.has_value() ? *bias : torch::Tensor());
}

// A linear layer's product on its packed weight (tile order or oneDNN's), specdec_cpu::linear_packed, for
// the same reason; schema "linear_packed(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor".
torch::Tensor linear_packed_op(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& packed,
                               const std::optional<torch::Tensor>& bias) {
  return linear_packed(x, w, packed, bias.has_value() ? *bias : torch::Tensor());
}

// linear_packed's output widened to float32 (an LM head's logits), specdec_cpu::linear_packed_logits;
// schema "linear_packed_logits(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor".
torch::Tensor linear_packed_logits_op(const torch::Tensor& x, const torch::Tensor& w,
                                      const torch::Tensor& packed, const std::optional<torch::Tensor>& bias) {
  return linear_packed_logits(x, w, packed, bias.has_value() ? *bias : torch::Tensor());
}

// The weight-only int8 product (cpu_gemv_int8.cpp), specdec_cpu::gemv_int8, likewise; schema
// "gemv_int8(Tensor x, Tensor codes, Tensor scales, Tensor? bias, Tensor? packed=None) -> Tensor"
// (kernels/cpu_gemv_int8.py).
torch::Tensor gemv_int8_op(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           const std::optional<torch::Tensor>& bias,
                           const std::optional<torch::Tensor>& packed) {
  return gemv_int8(x, codes, scales, bias.has_value() ? *bias : torch::Tensor(),
                   packed.has_value() ? *packed : torch::Tensor());
}

TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) {
  m.impl("gemv", &gemv_op);
  m.impl("linear_packed", &linear_packed_op);
  m.impl("linear_packed_logits", &linear_packed_logits_op);
  m.impl("gemv_int8", &gemv_int8_op);
  // The layer's small operations (kernels/csrc/cpu_layer_ops.cpp; schemas and fakes in
  // kernels/cpu_layer_ops.py), dispatcher operators for the same reason.
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  // Each row's maximum and first index (kernels/csrc/cpu_max_rows.cpp; schema in kernels/cpu_max_rows.py).
  m.impl("max_rows", &max_rows);
}

// A oneDNN-packed weight is an MkldnnCPU tensor, which sends the call to that key.
TORCH_LIBRARY_IMPL(specdec_cpu, MkldnnCPU, m) {
  m.impl("linear_packed", &linear_packed_op);
  m.impl("linear_packed_logits", &linear_packed_logits_op);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ w^T + bias for a few rows (kernels/csrc/cpu_gemv.cpp)");
  m.def("paged_attention_short", &paged_attention_short,
        "paged attention of short queries (kernels/csrc/cpu_attention.cpp)");
  m.def("write_kv", &write_kv, "store new K/V rows at their cache slots (kernels/csrc/cpu_attention.cpp)");
  m.def("has_bf16_dot", &has_bf16_dot,
        "whether bfloat16 products use AVX-512 BF16 dot products (kernels/csrc/cpu_gemv_bf16dp.h)");
  m.def("set_bf16_dot", &set_bf16_dot, "use (true) or skip (false) the AVX-512 BF16 kernel; returns has_bf16_dot()");
  m.def("has_amx", &has_amx, "whether packed bfloat16 products and bfloat16 attention scores use AMX tiles (cpu_gemv_amx.h, cpu_attention_amx.h)");
  m.def("set_amx", &set_amx, "use (true) or skip (false) AMX for packed weights and attention scores; returns has_amx()");
  m.def("has_tiles", &has_tiles,
        "whether packed bfloat16 weights take the tile layout (AMX or AVX-512 BF16; csrc/cpu_gemv.cpp)");
  m.def("set_tiles", &set_tiles,
        "use (true) or skip (false) the tile layout where there is no AMX; returns has_tiles()");
  m.def("pack_tiles", &pack_tiles,
        "a bfloat16 weight [N, K] in the packed kernels' tile order (kernels/csrc/cpu_gemv_tiles.h)");
  m.def("packed_rows", &packed_rows,
        "whether an [M, K] x [N, K]^T bfloat16 product takes the packed weight (kernels/csrc/cpu_gemv.cpp)");
  m.def("onednn_rows", &onednn_rows,
        "whether an [M, K] x [N, K]^T bfloat16 product takes oneDNN's packed GEMM (kernels/csrc/cpu_gemv.cpp)");
  m.def("gemv_int8", &gemv_int8,
        "y = x @ (codes * scales)^T + bias, int8 codes, tile-packed or not (csrc/cpu_gemv_int8.cpp)",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("bias"),
        pybind11::arg("packed") = torch::Tensor());
  m.def("has_int8_tiles", &has_int8_tiles,
        "whether int8 codes may be packed in tile order (kernels/csrc/cpu_gemv_int8.cpp)");
  m.def("pack_int8_tiles", &pack_int8_tiles,
        "int8 codes [N, K] in the tile kernel's pair-major order (kernels/csrc/cpu_gemv_int8tiles.h)");
  m.def("has_int8_vnni", &has_int8_vnni, "whether int8 products use AVX512_VNNI (kernels/csrc/cpu_gemv_int8.cpp)");
  m.def("has_avx2", &specdec_cpu::has_avx2, "whether the kernels were compiled with AVX2 + FMA");
  m.def("max_rows_vectorized", &max_rows_vectorized,
        "whether max_rows runs sixteen lanes at a time (AVX-512; else its scalar loop, slower than torch's)");
  bind_decode_stack(m);
  bind_suffix_index(m);
}
