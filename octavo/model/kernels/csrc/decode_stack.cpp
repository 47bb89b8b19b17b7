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
  at::Tensor norm1, norm2;
  Linear qkv, o, gate_up, down;
  int64_t cache_slot;
};

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
    layers_.push_back(Layer{std::move(norm1), std::move(norm2), lin(qkv), lin(o), lin(gate_up),
                            lin(down), cache_slot});
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

  // x: the embeddings [T, hidden]; returns (the last layer's MLP output, the residual stream)
  std::vector<at::Tensor> forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                  at::Tensor device_cache, at::Tensor slot_mapping,
                                  at::Tensor block_tables, at::Tensor context_lens) {
    const int64_t T = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    TORCH_CHECK(T <= max_rows_, "a decode step of ", T, " rows; this stack runs up to ",
                max_rows_);
    at::Tensor residual;
    for (const Layer& L : layers_) {
      at::Tensor h;
      if (!residual.defined()) {
        residual = x;
        h = rms_norm(x, L.norm1, eps_);
      } else {
        h = add_rms_norm_(x, residual, L.norm1, eps_);
      }
      at::Tensor qkv = L.qkv(h);
      rope_(qkv, cos, sin, heads_, kv_heads_, head_dim_);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({T, heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads_, head_dim_});
      at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads_, head_dim_});
      if (!k_offsets_.empty() || rotation_.has_value()) {  // as kv_smoothing.smooth_qkv
        at::Tensor kf = k.to(at::kFloat);
        if (!k_offsets_.empty()) kf = kf - k_offsets_[&L - layers_.data()];
        if (rotation_.has_value()) {
          kf = at::matmul(kf, *rotation_);
          q = at::matmul(q.to(at::kFloat), *rotation_).to(q.scalar_type());
          v = at::matmul(v.to(at::kFloat), *rotation_).to(v.scalar_type());
        }
        k = kf.to(k.scalar_type());
      }
      const at::Tensor layer_cache = device_cache.select(0, L.cache_slot);
      const at::Tensor k_cache = layer_cache.select(0, 0), v_cache = layer_cache.select(0, 1);
      // quantized pages (kv_quant.py): written quantized, read as stored, as the Python layers do
      c10::optional<at::Tensor> ks, vs;
      if (!k_scales_.empty()) {
        ks = k_scales_[&L - layers_.data()];
        vs = v_scales_[&L - layers_.data()];
      }
      if (k_cache.scalar_type() == x.scalar_type()) {
        k_cache.view({-1, kv_heads_, head_dim_}).index_copy_(0, slot_mapping, k);
        v_cache.view({-1, kv_heads_, head_dim_}).index_copy_(0, slot_mapping, v);
      } else {
        kv_write(k, v, k_cache, v_cache, slot_mapping, ks, vs);
      }
      at::Tensor attn = paged_decode(q.contiguous(), k_cache, v_cache, block_tables,
                                     context_lens, scale_, c10::nullopt, 0, 0.0, ks, vs);
      if (rotation_.has_value()) {  // the output over rotated values, turned back (unrotate)
        attn = at::matmul(attn.to(at::kFloat), *rotation_).to(attn.scalar_type());
      }
      h = L.o(attn.reshape({-1, q_size}));
      h = add_rms_norm_(h, residual, L.norm2, eps_);
      x = L.down(silu_and_mul(L.gate_up(h)));
    }
    return {x, residual};
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t max_rows_;
  std::vector<Layer> layers_;
  std::vector<at::Tensor> k_scales_, v_scales_;  // fp8 KV pages only
  std::vector<at::Tensor> k_offsets_;  // key smoothing only
  c10::optional<at::Tensor> rotation_;
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
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_kv_scales", &DecodeStack::set_kv_scales,
           "fp8 KV pages: every layer's K and V scales, in layer order", py::arg("k_scales"),
           py::arg("v_scales"))
      .def("set_key_smoothing", &DecodeStack::set_key_smoothing,
           "quantized KV pages with key smoothing: every layer's key offset (or none) and the "
           "rotation (or None)", py::arg("k_offsets"), py::arg("rotation"))
      .def("forward", &DecodeStack::forward,
           "every layer of an all-decode step: (last MLP output, residual)");
}
