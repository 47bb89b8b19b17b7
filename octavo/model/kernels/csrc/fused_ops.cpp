// Elementwise parts of a Llama layer, fused: RMSNorm (optionally after the residual add), RoPE on
// q and k in place, and silu(gate) * up. Each follows transformers' op order and, in bf16/fp16,
// rounds to the model dtype after the same ops torch would, so they stand in for the torch code
// in octavo/model/models/llama.py (which remains the fallback).
//
// Compiled without -ftrapping-math: GCC then vectorises silu's loop, where exp_approx's clamp
// and select otherwise count as control flow (the FP exceptions they might raise are never
// read; each value is computed by the same operations, so the bits do not change).
#pragma GCC optimize("no-trapping-math")
#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"
#include "vec_math.h"

namespace {

using octavo::exp_approx;
using octavo::round_to;
using octavo::store;
using octavo::to_float;

constexpr int64_t kRowGrain = 8;

template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float h = round_to<T>(to_float(x[i]) * inv);  // hidden_states.to(input_dtype)
    store(out + i, to_float(w[i]) * h);
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "a contiguous [tokens, hidden] tensor expected");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must have one dtype");
}

template <typename T>
void add_rows(T* residual, const T* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) store(residual + i, to_float(residual[i]) + to_float(x[i]));
}

// x * cos + rotate_half(x) * sin for one head, with cos/sin cast to the model dtype first.
template <typename T>
void rope_head(T* x, const float* c, const float* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const float c1 = round_to<T>(c[i]), c2 = round_to<T>(c[i + half]);
    const float s1 = round_to<T>(s[i]), s2 = round_to<T>(s[i + half]);
    const float o1 = round_to<T>(x1 * c1) + round_to<T>(-x2 * s1);
    const float o2 = round_to<T>(x2 * c2) + round_to<T>(x1 * s2);
    store(x + i, o1);
    store(x + i + half, o2);
  }
}

template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_float(g[i]);
    const float act = round_to<T>(x / (1.f + exp_approx(-x)));
    store(o + i, act * to_float(u[i]));
  }
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, weight);
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight,
                            double eps) {
  check_rows(residual, weight);
  TORCH_CHECK(x.sizes() == residual.sizes() && x.is_contiguous() &&
                  x.scalar_type() == residual.scalar_type(),
              "x must match the residual's shape and dtype");
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_rows(rp + r * n, xp + r * n, n);
        rms_norm_row(rp + r * n, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

void rope_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t num_heads,
           int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous [tokens, width]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous float32 [tokens, head_dim]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == qkv.size(0) && cos.size(1) == head_dim &&
                  sin.sizes() == cos.sizes(),
              "cos and sin must be [tokens, head_dim]");
  TORCH_CHECK(head_dim % 2 == 0 && (num_heads + num_kv_heads) * head_dim <= qkv.size(1),
              "qkv is too narrow for the q and k heads");
  const int64_t rows = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  const int64_t heads = num_heads + num_kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_", [&] {
    using T = scalar_t;
    T* base = qkv.data_ptr<T>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* c = cp + r * head_dim;
        const float* s = sp + r * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
          rope_head(base + r * width + h * head_dim, c, s, half);
        }
      }
    });
  });
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [tokens, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    using T = scalar_t;
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = gp + r * 2 * inter;
        silu_mul_row(g, g + inter, op + r * inter, inter);
      }
    });
  });
  return out;
}
