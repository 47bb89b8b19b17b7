// The decoder layers of a decode step, looped in C++ (octavo/model/worker/decode_stack.py): for a step
// whose rows are all single-token decodes, every layer's ops run here one after the other,
// the same kernels in the same order as the Python layers (layers.py) with the compiled CPU
// ops, so the results are identical, without the interpreter between them. At batch 1 that
// interpreter time was a third of the step on a 4-bit model (BENCHMARKS.md section 14).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/python.h>

#include <functional>
#include <string>
#include <vector>

#include "ops.h"

namespace {

enum LinearType : int64_t {
  kBlock = 0, kOneDNN = 1, kInt8 = 2, kPlain = 3, kKQuant = 4, kConcat = 5
};

struct Linear {
  int64_t type;
  std::vector<at::Tensor> t;  // block: q, scale[, mins]; onednn: packed; int8: q, scale;
                              // plain: weight; kquant: the super-blocks
  c10::optional<at::Tensor> bias;
  int64_t kind = 0, group = 32;
  bool int8_activations = false;
  // onednn: up to gemv_rows rows, packed_gemv reads the packed weight at gemv_ptr ([N, Kp] in
  // blocks of gemv_block outputs)
  int64_t gemv_ptr = 0, gemv_n = 0, gemv_kp = 0, gemv_rows = 0, gemv_block = 64;
  std::vector<Linear> parts;  // concat: layers whose outputs are joined by columns

  at::Tensor operator()(const at::Tensor& x) const {
    switch (type) {
      case kBlock:
        return block_linear(x, kind, t[0], t[1],
                            t.size() > 2 ? c10::optional<at::Tensor>(t[2]) : c10::nullopt, group,
                            bias, int8_activations);
      case kOneDNN: {
        if (x.size(0) <= gemv_rows) {
          return packed_gemv(x, gemv_ptr, gemv_n, gemv_kp, bias, gemv_block);
        }
        static const auto op =
            c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
        torch::jit::Stack stack{x, t[0], bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                                c10::IValue(std::string("none")),
                                c10::IValue(c10::List<c10::optional<at::Scalar>>()),
                                c10::IValue(std::string(""))};
        op.callBoxed(&stack);
        return stack[0].toTensor();
      }
      case kInt8:
        return int8_linear(x, t[0], t[1], bias);
      case kKQuant:
        return kquant_linear(x, kind, t[0], bias);
      case kConcat: {
        std::vector<at::Tensor> outs;
        for (const Linear& p : parts) outs.push_back(p(x));
        return at::cat(outs, 1);
      }
      default:
        return at::linear(x, t[0], bias);
    }
  }
};

struct Layer {
  // pre-norm (Llama): the input and post-attention norms, fused with the residual adds;
  // sandwich (Gemma): input, post-attention, pre- and post-feedforward, each its own norm
  at::Tensor norm1, norm2, norm3, norm4;
  at::Tensor q_norm, k_norm;  // per-head norms of q and k (Qwen3, Gemma 3); undefined: none
  Linear qkv, o, gate_up, down;
  int64_t cache_slot;
  int64_t group = 0;  // KV cache group: which block tables, context lengths and slots
  int64_t rope = 0;  // which cos/sin table (Gemma 3's local layers rotate with their own)
  int64_t window = 0;  // sliding window (0: none)
  double softcap = 0.0;  // attention-score soft cap (0: none)
};

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1, kGelu = 2 };

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
              double scale, int64_t max_rows)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(scale), max_rows_(max_rows) {}

  // the most rows a step may have to run here (block_quant.py's SMALL_BATCH where a layer
  // has block weights: larger batches take its tiled path, in Python)
  int64_t max_rows() const { return max_rows_; }

  static Linear make_linear(int64_t type, std::vector<at::Tensor> tensors,
                            c10::optional<at::Tensor> bias, int64_t kind, int64_t group,
                            bool int8_activations) {
    TORCH_CHECK(type >= kBlock && type <= kConcat, "unknown linear type ", type);
    TORCH_CHECK(type == kConcat || !tensors.empty(), "a linear layer needs its weight");
    return Linear{type, std::move(tensors), std::move(bias), kind, group, int8_activations};
  }

  void add_layer(at::Tensor norm1, at::Tensor norm2, int64_t cache_slot, py::tuple qkv,
                 py::tuple o, py::tuple gate_up, py::tuple down) {
    std::function<Linear(const py::tuple&)> lin = [&lin](const py::tuple& a) {
      Linear l = make_linear(a[0].cast<int64_t>(), a[1].cast<std::vector<at::Tensor>>(),
                             a[2].cast<c10::optional<at::Tensor>>(), a[3].cast<int64_t>(),
                             a[4].cast<int64_t>(), a[5].cast<bool>());
      if (l.type == kConcat) {  // the parts' own specs
        TORCH_CHECK(a.size() > 6, "a concatenation needs its parts");
        for (const auto& part : a[6].cast<py::list>()) l.parts.push_back(lin(part.cast<py::tuple>()));
        TORCH_CHECK(!l.parts.empty(), "a concatenation needs its parts");
      } else if (a.size() > 6) {  // (weight_ptr, n, k_padded, rows, block) of packed_gemv
        const auto g = a[6].cast<std::vector<int64_t>>();
        TORCH_CHECK(g.size() == 5,
                    "packed_gemv arguments are (weight_ptr, n, k_padded, rows, block)");
        l.gemv_ptr = g[0], l.gemv_n = g[1], l.gemv_kp = g[2], l.gemv_rows = g[3];
        l.gemv_block = g[4];
      }
      return l;
    };
    Layer layer;
    layer.norm1 = std::move(norm1);
    layer.norm2 = std::move(norm2);
    layer.qkv = lin(qkv), layer.o = lin(o), layer.gate_up = lin(gate_up), layer.down = lin(down);
    layer.cache_slot = cache_slot;
    layers_.push_back(std::move(layer));
  }

  // the last added layer's options: its KV cache group, rope table, sliding window, soft cap,
  // q/k norms and (sandwich layers) pre- and post-feedforward norms
  void set_layer_options(int64_t group, int64_t rope, int64_t window, double softcap,
                         c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                         c10::optional<at::Tensor> norm3, c10::optional<at::Tensor> norm4) {
    TORCH_CHECK(!layers_.empty(), "set_layer_options follows add_layer");
    TORCH_CHECK(group >= 0 && rope >= 0 && window >= 0 && softcap >= 0.0,
                "a layer's group, rope table, window and soft cap are >= 0");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    TORCH_CHECK(norm3.has_value() == sandwich_ && norm4.has_value() == sandwich_,
                "sandwich layers, and only they, have pre- and post-feedforward norms");
    Layer& L = layers_.back();
    L.group = group, L.rope = rope, L.window = window, L.softcap = softcap;
    if (q_norm.has_value()) L.q_norm = *q_norm, L.k_norm = *k_norm;
    if (norm3.has_value()) L.norm3 = *norm3, L.norm4 = *norm4;
  }

  // the layers' shape, set before any is added: sandwich (Gemma's four norms, none fused
  // with a residual add) or pre-norm, and the MLP's activation ("silu", "gelu_tanh", "gelu")
  void set_style(bool sandwich, const std::string& activation) {
    TORCH_CHECK(layers_.empty(), "set_style comes before the layers");
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh" || activation == "gelu",
                "activation ", activation, " is not one of silu, gelu_tanh, gelu");
    sandwich_ = sandwich;
    activation_ = activation == "silu" ? kSilu : activation == "gelu_tanh" ? kGeluTanh : kGelu;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // fp8 KV pages: every layer's K and V scales ([num_kv_heads] each), in layer order
  void set_kv_scales(std::vector<at::Tensor> k_scales, std::vector<at::Tensor> v_scales) {
    TORCH_CHECK(k_scales.size() == layers_.size() && v_scales.size() == layers_.size(),
                "one K and one V scale tensor per layer expected");
    k_scales_ = std::move(k_scales);
    v_scales_ = std::move(v_scales);
  }

  // key smoothing (kv_smoothing.py): every layer's key offset [num_kv_heads, head_dim] (an
  // empty list: none) and the rotation [head_dim, head_dim] (undefined: none)
  void set_key_smoothing(std::vector<at::Tensor> k_offsets, c10::optional<at::Tensor> rotation) {
    TORCH_CHECK(k_offsets.empty() || k_offsets.size() == layers_.size(),
                "one key offset per layer, or none, expected");
    k_offsets_ = std::move(k_offsets);
    rotation_ = std::move(rotation);
  }

  // x: the embeddings [T, hidden]; per rope table its cos/sin rows, per KV cache group its
  // slot mapping, block tables, context lengths and first positions (sliding-window groups,
  // None: tables start at position 0). Returns (the last layer's MLP output, the residual
  // stream) for pre-norm layers, (the residual stream) for sandwich ones.
  std::vector<at::Tensor> forward(at::Tensor x, std::vector<at::Tensor> cos,
                                  std::vector<at::Tensor> sin, at::Tensor device_cache,
                                  std::vector<at::Tensor> slot_mapping,
                                  std::vector<at::Tensor> block_tables,
                                  std::vector<at::Tensor> context_lens,
                                  std::vector<c10::optional<at::Tensor>> first_pos) {
    const int64_t T = x.size(0);
    TORCH_CHECK(T <= max_rows_, "a decode step of ", T, " rows; this stack runs up to ",
                max_rows_);
    TORCH_CHECK(cos.size() == sin.size(), "one sin table per cos table");
    const size_t groups = slot_mapping.size();
    TORCH_CHECK(block_tables.size() == groups && context_lens.size() == groups &&
                    first_pos.size() == groups,
                "every KV cache group needs its slots, block tables, context lengths and first "
                "positions");
    for (const Layer& L : layers_) {
      TORCH_CHECK(static_cast<size_t>(L.group) < groups, "a layer's KV cache group ", L.group,
                  " has no metadata");
      TORCH_CHECK(static_cast<size_t>(L.rope) < cos.size(), "a layer's rope table ", L.rope,
                  " was not given");
    }
    at::Tensor residual;
    for (const Layer& L : layers_) {
      const size_t i = &L - layers_.data();
      if (sandwich_) {  // Gemma: x is the residual stream, every branch normed before its add
        at::Tensor h = attention(L, i, rms_norm(x.contiguous(), L.norm1, eps_), cos, sin,
                                 device_cache, slot_mapping, block_tables, context_lens,
                                 first_pos);
        x = x + rms_norm(h.contiguous(), L.norm2, eps_);
        h = mlp(L, rms_norm(x.contiguous(), L.norm3, eps_));
        x = x + rms_norm(h.contiguous(), L.norm4, eps_);
        continue;
      }
      at::Tensor h;
      if (!residual.defined()) {
        residual = x;
        h = rms_norm(x, L.norm1, eps_);
      } else {
        h = add_rms_norm_(x, residual, L.norm1, eps_);
      }
      h = attention(L, i, h, cos, sin, device_cache, slot_mapping, block_tables, context_lens,
                    first_pos);
      h = add_rms_norm_(h, residual, L.norm2, eps_);
      x = mlp(L, h);
    }
    if (sandwich_) return {x};
    return {x, residual};
  }

 private:
  // one layer's attention on its normed input h, through o_proj (as layers.py's Attention)
  at::Tensor attention(const Layer& L, size_t i, const at::Tensor& h,
                       const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                       const at::Tensor& device_cache, const std::vector<at::Tensor>& slot_mapping,
                       const std::vector<at::Tensor>& block_tables,
                       const std::vector<at::Tensor>& context_lens,
                       const std::vector<c10::optional<at::Tensor>>& first_pos) const {
    const int64_t T = h.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    at::Tensor qkv = L.qkv(h);
    if (L.q_norm.defined()) {  // as Attention._norm_heads: head by head, written back
      at::Tensor qs = qkv.narrow(1, 0, q_size), ks = qkv.narrow(1, q_size, kv_size);
      qs.copy_(rms_norm(qs.reshape({-1, head_dim_}).contiguous(), L.q_norm, eps_)
                   .view({-1, q_size}));
      ks.copy_(rms_norm(ks.reshape({-1, head_dim_}).contiguous(), L.k_norm, eps_)
                   .view({-1, kv_size}));
    }
    rope_(qkv, cos[L.rope], sin[L.rope], heads_, kv_heads_, head_dim_);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({T, heads_, head_dim_});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads_, head_dim_});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads_, head_dim_});
    if (!k_offsets_.empty() || rotation_.has_value()) {  // as kv_smoothing.smooth_qkv
      at::Tensor kf = k.to(at::kFloat);
      if (!k_offsets_.empty()) kf = kf - k_offsets_[i];
      if (rotation_.has_value()) {
        kf = at::matmul(kf, *rotation_);
        q = at::matmul(q.to(at::kFloat), *rotation_).to(q.scalar_type());
        v = at::matmul(v.to(at::kFloat), *rotation_).to(v.scalar_type());
      }
      k = kf.to(k.scalar_type());
    }
    const at::Tensor layer_cache = device_cache.select(0, L.cache_slot);
    const at::Tensor k_cache = layer_cache.select(0, 0), v_cache = layer_cache.select(0, 1);
    const at::Tensor& slots = slot_mapping[L.group];
    // quantized pages (kv_quant.py): written quantized, read as stored, as the Python layers do
    c10::optional<at::Tensor> kscale, vscale;
    if (!k_scales_.empty()) {
      kscale = k_scales_[i];
      vscale = v_scales_[i];
    }
    if (k_cache.scalar_type() == h.scalar_type()) {
      k_cache.view({-1, kv_heads_, head_dim_}).index_copy_(0, slots, k);
      v_cache.view({-1, kv_heads_, head_dim_}).index_copy_(0, slots, v);
    } else {
      kv_write(k, v, k_cache, v_cache, slots, kscale, vscale);
    }
    at::Tensor attn = paged_decode(q.contiguous(), k_cache, v_cache, block_tables[L.group],
                                   context_lens[L.group], scale_, first_pos[L.group], L.window,
                                   L.softcap, kscale, vscale);
    if (rotation_.has_value()) {  // the output over rotated values, turned back (unrotate)
      attn = at::matmul(attn.to(at::kFloat), *rotation_).to(attn.scalar_type());
    }
    return L.o(attn.reshape({-1, q_size}));
  }

  // the gated MLP on its normed input (as layers.py's MLP, gemma.py's GemmaMLP)
  at::Tensor mlp(const Layer& L, const at::Tensor& h) const {
    at::Tensor gate_up = L.gate_up(h);
    if (activation_ == kSilu) return L.down(silu_and_mul(gate_up));
    const int64_t inter = gate_up.size(1) / 2;
    at::Tensor gate = gate_up.narrow(1, 0, inter), up = gate_up.narrow(1, inter, inter);
    return L.down(at::gelu(gate, activation_ == kGeluTanh ? "tanh" : "none") * up);
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t max_rows_;
  std::vector<Layer> layers_;
  std::vector<at::Tensor> k_scales_, v_scales_;  // fp8 KV pages only
  std::vector<at::Tensor> k_offsets_;  // key smoothing only
  c10::optional<at::Tensor> rotation_;
  bool sandwich_ = false;
  Activation activation_ = kSilu;
};

}  // namespace

void bind_decode_stack(py::module& m) {
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("scale"), py::arg("max_rows"))
      .def("max_rows", &DecodeStack::max_rows)
      .def("add_layer", &DecodeStack::add_layer,
           "one decoder layer: its norms' weights, its KV cache slot and its four linear layers "
           "as (type, tensors, bias, kind, group, int8_activations[, (weight_ptr, n, k_padded, "
           "rows, block) of packed_gemv, or a concatenation's parts' tuples])")
      .def("set_layer_options", &DecodeStack::set_layer_options,
           "the last added layer's KV cache group, rope table, window (0: none), soft cap (0: "
           "none), q/k norms and (sandwich layers) pre- and post-feedforward norms",
           py::arg("group"), py::arg("rope"), py::arg("window"), py::arg("softcap"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("norm3"), py::arg("norm4"))
      .def("set_style", &DecodeStack::set_style,
           "before the layers: sandwich (Gemma's four norms) or pre-norm layers, and the MLP's "
           "activation (silu, gelu_tanh, gelu)", py::arg("sandwich"), py::arg("activation"))
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_kv_scales", &DecodeStack::set_kv_scales,
           "fp8 KV pages: every layer's K and V scales, in layer order", py::arg("k_scales"),
           py::arg("v_scales"))
      .def("set_key_smoothing", &DecodeStack::set_key_smoothing,
           "quantized KV pages with key smoothing: every layer's key offset (or none) and the "
           "rotation (or None)", py::arg("k_offsets"), py::arg("rotation"))
      .def("forward", &DecodeStack::forward,
           "every layer of an all-decode step: (last MLP output, residual) for pre-norm layers, "
           "(residual) for sandwich ones");
}
