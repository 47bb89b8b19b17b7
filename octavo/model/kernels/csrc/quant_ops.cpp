// The elementwise ends of a W8A8 linear layer (octavo/model/quant/quantization.py), fused: per-row
// symmetric int8 quantization of the activations (one pass for the max, one to quantize), and
// the epilogue that turns the int32 GEMM sums back into the model dtype
// (sum * x_scale[row] * w_scale[col] + bias). In torch each is four to eight separate ops per
// layer; a decode step runs 120 such layers. int8_linear chains them around int8_mm.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "ops.h"
#include "vec_math.h"

namespace {

using octavo::store;
using octavo::to_float;

template <typename T>
void quantize_row(const T* x, int8_t* q, float* scale, int64_t n, float qmax) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float s = std::max(amax, 1e-12f) / qmax;
  *scale = s;
  // x / s rounded half to even, as torch.round: nearbyint under the default rounding mode
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::nearbyint(to_float(x[i]) / s);
    q[i] = static_cast<int8_t>(std::min(std::max(v, -qmax), qmax));
  }
}

template <typename T>
void epilogue_row(const int32_t* a, float s, const float* ws, const float* bias, T* o,
                  int64_t n) {
  if (bias != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store(o + i, static_cast<float>(a[i]) * s * ws[i] + bias[i]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store(o + i, static_cast<float>(a[i]) * s * ws[i]);
  }
}

}  // namespace

std::vector<at::Tensor> quantize_rows_int8(at::Tensor x, double qmax) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, cols]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto q = at::empty({rows, n}, x.options().dtype(at::kChar));
  auto scale = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        quantize_row(xp + r * n, qp + r * n, sp + r, n, static_cast<float>(qmax));
    });
  });
  return {q, scale};
}

at::Tensor int8_epilogue(at::Tensor acc, at::Tensor x_scale, at::Tensor w_scale,
                         c10::optional<at::Tensor> bias, at::ScalarType dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kInt,
              "acc must be a contiguous int32 [rows, cols]");
  const int64_t rows = acc.size(0), n = acc.size(1);
  TORCH_CHECK(x_scale.numel() == rows && x_scale.scalar_type() == at::kFloat &&
                  x_scale.is_contiguous(), "x_scale must be float32 [rows]");
  TORCH_CHECK(w_scale.numel() == n && w_scale.scalar_type() == at::kFloat &&
                  w_scale.is_contiguous(), "w_scale must be float32 [cols]");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "bias must be [cols]");
  }
  auto out = at::empty({rows, n}, acc.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "int8_epilogue", [&] {
    const int32_t* ap = acc.data_ptr<int32_t>();
    const float* xs = x_scale.data_ptr<float>();
    const float* ws = w_scale.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) epilogue_row(ap + r * n, xs[r], ws, bp, op + r * n, n);
    });
  });
  return out;
}

at::Tensor int8_linear(at::Tensor x, at::Tensor wq, at::Tensor w_scale,
                       c10::optional<at::Tensor> bias) {
  auto qs = quantize_rows_int8(x.contiguous(), 127.0);
  return int8_epilogue(int8_mm(qs[0], wq), qs[1], w_scale, bias, x.scalar_type());
}
