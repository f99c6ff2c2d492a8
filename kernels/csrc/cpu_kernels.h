// The CPU kernels' entry points, declared once for the files that call them across translation units
// (bindings.cpp, cpu_decode_stack.cpp); each is defined, and documented, in the file named beside it.
#pragma once
#include <torch/extension.h>

// cpu_gemv.cpp
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, torch::Tensor bias);
bool has_bf16_dot();
bool set_bf16_dot(bool enabled);
bool has_amx();
bool set_amx(bool enabled);
bool onednn_rows(int64_t M, int64_t N, int64_t K);
bool packed_rows(int64_t M, int64_t N, int64_t K);
bool has_tiles();
bool set_tiles(bool enabled);
torch::Tensor pack_tiles(const torch::Tensor& w);
torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& packed,
                            const torch::Tensor& bias);
torch::Tensor linear_packed_logits(const torch::Tensor& x, const torch::Tensor& w,
                                   const torch::Tensor& packed, const torch::Tensor& bias);
// cpu_gemv_int8.cpp
torch::Tensor gemv_int8(torch::Tensor x, const torch::Tensor& codes, const torch::Tensor& scales,
                        const torch::Tensor& bias, const torch::Tensor& packed = torch::Tensor());
bool has_int8_vnni();
bool has_int8_tiles();
torch::Tensor pack_int8_tiles(const torch::Tensor& codes);
// cpu_attention.cpp
void paged_attention_short(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor reqs, torch::Tensor q_start,
                           torch::Tensor q_len, torch::Tensor seq_len, torch::Tensor mask_offset,
                           torch::Tensor masks, torch::Tensor out, double scale, int64_t window,
                           double softcap);
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping);
// cpu_layer_ops.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool gemma);
torch::Tensor rope(const torch::Tensor& qk, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
// cpu_max_rows.cpp
std::tuple<torch::Tensor, torch::Tensor> max_rows(const torch::Tensor& x);
bool max_rows_vectorized();
// cpu_decode_stack.cpp
void bind_decode_stack(pybind11::module& m);
// RequestSuffixIndex, a request's own suffix trie for suffix decoding (suffix_index.cpp).
void bind_suffix_index(pybind11::module& m);
