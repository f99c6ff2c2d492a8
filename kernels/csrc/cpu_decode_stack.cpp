// A decoder's whole layer stack for short queries on the CPU, in one call from Python.
//
// At batch 1 a SmolLM2-135M bfloat16 step spent ~180 of each layer's ~470 microseconds outside its four
// linears: Python module calls, argument conversion and torch dispatch around the layer's small kernels
// (RMSNorm, RoPE, K/V write, paged attention, SiLU * up, residual adds). This file runs the same kernels
// (cpu_layer_ops.cpp, cpu_gemv.cpp, cpu_attention.cpp) in the same order on the same tensors for every
// layer, so its outputs equal the per-layer Python path bit for bit (tests/kernels/test_cpu_decode_stack.py);
// only the overhead between them goes. The reference is DecoderLM.layer_stack's per-layer path
// (specdec/models/decoder.py); kernels/cpu_decode_stack.py decides which models and batches it serves.
//
// Layers served: pre-norm decoder layers with one RMSNorm (Llama or Gemma form) before attention and one
// before a SiLU-gated MLP, fused QKV and gate/up projections with optional biases (dense, or int8 codes
// with one scale per output row: an int8-quantized model such as the quantized self-drafter), RoPE on every query
// and key head, grouped-query attention with an optional sliding window and score soft-cap (Llama,
// SmolLM2, Qwen2, Mistral). Batches served: every request's new tokens attended by the short-query kernel,
// and, in layers without a sliding window or soft-cap, prompt chunks beside them (a request arriving into a
// running batch): each chunk attended by SDPA's fused kernel over its cached keys, as the per-layer path
// attends it (ReferenceAttention._prefills), so that a step with a chunk does not run layer by layer in
// Python (~5 ms over a decode step of SmolLM2 at 32 requests).
#include <ATen/ATen.h>
#include <torch/extension.h>

#include <vector>

#include "cpu_kernels.h"

namespace {

// A linear layer's product as its module computes it: int8 codes (QuantizedLinear, scales given) through
// the int8 kernel (on their tile-order copy where packed is one); else its packed weight (AMX or oneDNN)
// where packed_rows says so and the layer has one (bfloat16), else the GEMV kernel (GemvLinear).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
                     const torch::Tensor& packed, const torch::Tensor& scales) {
  if (w.scalar_type() == torch::kChar) return gemv_int8(x, w, scales, bias, packed);
  if (packed.numel() && packed_rows(x.size(0), w.size(0), w.size(1))) return linear_packed(x, w, packed, bias);
  return gemv(x, w, bias);
}

// One layer's weights (shared with the model's modules, not copied; int8 codes for a quantized linear),
// their packed copies (AMX or oneDNN; int8: tile order; empty: none), the int8 linears' float32 scales
// (empty: not int8) and shape. Empty biases: none.
struct Layer {
  torch::Tensor input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, gate_up_bias, down, down_bias;
  torch::Tensor qkv_packed, o_packed, gate_up_packed, down_packed;
  torch::Tensor qkv_scales, o_scales, gate_up_scales, down_scales;
  int64_t num_heads, num_kv_heads, head_dim, window;
  double eps, scale, softcap;
  bool gemma;
};

class DecodeStack {
 public:
  void add_layer(torch::Tensor input_norm, torch::Tensor qkv, torch::Tensor qkv_bias, torch::Tensor o,
                 torch::Tensor o_bias, torch::Tensor post_norm, torch::Tensor gate_up,
                 torch::Tensor gate_up_bias, torch::Tensor down, torch::Tensor down_bias, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, double eps, bool gemma, double scale,
                 int64_t window, double softcap, torch::Tensor qkv_packed, torch::Tensor o_packed,
                 torch::Tensor gate_up_packed, torch::Tensor down_packed, torch::Tensor qkv_scales,
                 torch::Tensor o_scales, torch::Tensor gate_up_scales, torch::Tensor down_scales) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim % 2 == 0,
                "DecodeStack: head counts / head_dim");
    TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == (num_heads + 2 * num_kv_heads) * head_dim,
                "DecodeStack: qkv weight [(H + 2 KVH) D, hidden]");
    const std::pair<const torch::Tensor*, const torch::Tensor*> int8[] = {
        {&qkv, &qkv_scales}, {&o, &o_scales}, {&gate_up, &gate_up_scales}, {&down, &down_scales}};
    for (const auto& [w, s] : int8)
      TORCH_CHECK(w->scalar_type() != torch::kChar ||
                      (s->scalar_type() == torch::kFloat32 && s->numel() == w->size(0) && s->is_contiguous()),
                  "DecodeStack: an int8 weight needs float32 scales [out_features]");
    layers_.push_back(Layer{input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, gate_up_bias, down,
                            down_bias, qkv_packed, o_packed, gate_up_packed, down_packed, qkv_scales,
                            o_scales, gate_up_scales, down_scales, num_heads,
                            num_kv_heads, head_dim, window, eps, scale, softcap, gemma});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [T, hidden] (the embedded tokens); cos, sin [T, 1, D] of hidden's dtype; k_caches, v_caches one
  // [num_blocks, block_size, KVH, D] each per layer; slot_mapping [T] int64; the short-query batch as
  // paged_attention_short takes it. attention_input: empty, or [T, K] the first layer's attention input in
  // place of rms_norm(hidden) (an EAGLE-3 layer: its embeddings' and features' norms side by side, K = 2
  // hidden; hidden is then the residual stream only). Returns the residual stream after the last layer,
  // then the streams entering each of feature_layers (an index equal to the layer count: the last layer's
  // output). prefill_rows: per prompt chunk (start row, query_len, keys), prefill_blocks its cache blocks
  // (empty: no earlier keys, the chunk's own new keys), prefill_masks its [query_len, keys] bool mask
  // (empty: causal); the short-query batch then holds the other requests (reqs may be empty).
  std::vector<torch::Tensor> forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const std::vector<torch::Tensor>& k_caches,
                                     const std::vector<torch::Tensor>& v_caches,
                                     const torch::Tensor& slot_mapping, const torch::Tensor& block_table,
                                     const torch::Tensor& reqs, const torch::Tensor& q_start,
                                     const torch::Tensor& q_len, const torch::Tensor& seq_len,
                                     const torch::Tensor& mask_offset, const torch::Tensor& masks,
                                     const std::vector<int64_t>& feature_layers,
                                     const torch::Tensor& attention_input,
                                     const std::vector<int64_t>& prefill_rows,
                                     const std::vector<torch::Tensor>& prefill_blocks,
                                     const std::vector<torch::Tensor>& prefill_masks) {
    const int64_t L = size();
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L,
                "DecodeStack: one K and one V cache per layer");
    TORCH_CHECK(hidden.dim() == 2, "DecodeStack: hidden [T, hidden_size]");
    const int64_t T = hidden.size(0);
    const bool given = attention_input.numel() > 0;
    TORCH_CHECK(!given || (L > 0 && attention_input.dim() == 2 && attention_input.size(0) == T &&
                           attention_input.size(1) == layers_[0].qkv.size(1) &&
                           attention_input.scalar_type() == hidden.scalar_type() &&
                           attention_input.is_contiguous()),
                "DecodeStack: attention_input [T, qkv in_features], hidden's dtype, contiguous");
    const size_t P = prefill_blocks.size();
    TORCH_CHECK(prefill_rows.size() == 3 * P && prefill_masks.size() == P,
                "DecodeStack: one (start, query_len, keys) triple, block list and mask per prompt chunk");
    for (size_t p = 0; p < P; ++p)
      TORCH_CHECK(prefill_rows[3 * p] >= 0 && prefill_rows[3 * p + 1] > 0 &&
                      prefill_rows[3 * p] + prefill_rows[3 * p + 1] <= T && prefill_rows[3 * p + 2] > 0,
                  "DecodeStack: a prompt chunk's rows out of range");
    for (int64_t i = 0; P && i < L; ++i)
      TORCH_CHECK(layers_[i].window <= 0 && layers_[i].softcap == 0,
                  "DecodeStack: prompt chunks only in layers without a sliding window or soft-cap");
    std::vector<torch::Tensor> out(1 + feature_layers.size());
    auto keep = [&](int64_t i, const torch::Tensor& h) {
      for (size_t f = 0; f < feature_layers.size(); ++f)
        if (feature_layers[f] == i) out[1 + f] = h;
    };
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers_[i];
      keep(i, hidden);
      const int64_t H = l.num_heads, KVH = l.num_kv_heads, D = l.head_dim;
      auto x = i == 0 && given ? attention_input : rms_norm(hidden, l.input_norm, l.eps, l.gemma);
      auto qkv = linear(x, l.qkv, l.qkv_bias, l.qkv_packed, l.qkv_scales).view({T, H + 2 * KVH, D});
      auto qk = rope(qkv.narrow(1, 0, H + KVH), cos, sin);
      auto v = qkv.narrow(1, H + KVH, KVH);
      write_kv(qk.narrow(1, H, KVH), v, k_caches[i], v_caches[i], slot_mapping);
      auto q = qk.narrow(1, 0, H);  // the kernel reads it in place (token stride H + KVH heads)
      auto attn = torch::empty({T, H, D}, hidden.options());
      if (reqs.numel())
        paged_attention_short(q, k_caches[i], v_caches[i], block_table, reqs, q_start, q_len, seq_len,
                              mask_offset, masks, attn, l.scale, l.window, l.softcap);
      for (size_t p = 0; p < P; ++p) {
        const int64_t start = prefill_rows[3 * p], ql = prefill_rows[3 * p + 1], keys = prefill_rows[3 * p + 2];
        torch::Tensor k, vv;
        if (prefill_blocks[p].numel()) {
          k = k_caches[i].index_select(0, prefill_blocks[p]).flatten(0, 1).narrow(0, 0, keys);
          vv = v_caches[i].index_select(0, prefill_blocks[p]).flatten(0, 1).narrow(0, 0, keys);
        } else {
          k = qk.narrow(1, H, KVH).narrow(0, start, ql);
          vv = v.narrow(0, start, ql);
        }
        const bool causal = prefill_masks[p].numel() == 0;
        std::optional<torch::Tensor> mask;
        if (!causal) mask = prefill_masks[p].unsqueeze(0).unsqueeze(0);
        // [1, H, q, D] operands: SDPA's fused flash kernel on the CPU (3-D ones take its math path)
        auto o = at::scaled_dot_product_attention(q.narrow(0, start, ql).transpose(0, 1).unsqueeze(0),
                                                  k.transpose(0, 1).unsqueeze(0), vv.transpose(0, 1).unsqueeze(0),
                                                  mask, 0.0, causal, l.scale, H != KVH);
        attn.narrow(0, start, ql).copy_(o.squeeze(0).transpose(0, 1));
      }
      hidden = hidden + linear(attn.view({T, H * D}), l.o, l.o_bias, l.o_packed, l.o_scales);
      auto gate_up = linear(rms_norm(hidden, l.post_norm, l.eps, l.gemma), l.gate_up, l.gate_up_bias,
                            l.gate_up_packed, l.gate_up_scales);
      hidden = hidden + linear(silu_mul(gate_up), l.down, l.down_bias, l.down_packed, l.down_scales);
    }
    keep(L, hidden);
    out[0] = hidden;
    return out;
  }

 private:
  std::vector<Layer> layers_;
};

}  // namespace

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack",
                                "a decoder's layer stack for short queries (kernels/csrc/cpu_decode_stack.cpp)")
      .def(pybind11::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("__len__", &DecodeStack::size)
      .def("forward", &DecodeStack::forward);
}
