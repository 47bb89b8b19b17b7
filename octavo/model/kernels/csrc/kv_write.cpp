// The KV write into quantized pages (octavo/model/layers/kv_quant.py is the definition, bit for
// bit): each token's K and V rows, every KV head, go to slot slot_mapping[t] of the layer's
// cache, quantized as they go:
//   int8: s = max(amax |x|, 1e-12) / 127, q = rint(x / s) in [-127, 127], s stored after q;
//   fp8:  fp8(clamp(x / scale[head], -max, max)), rounded to nearest even by c10's conversion
//         (the one torch's .to(float8) uses).
// A negative slot skips its token. Plain caches are not written here (index_copy_ is).
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>

#include "ops.h"
#include "vec_math.h"

namespace {

using octavo::to_float;

template <typename T>
void int8_row(const T* x, int8_t* out, int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float s = std::max(amax, 1e-12f) / 127.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::nearbyint(to_float(x[i]) / s);
    out[i] = static_cast<int8_t>(std::min(std::max(v, -127.f), 127.f));
  }
  std::memcpy(out + n, &s, sizeof(s));
}

template <typename T, typename F8>
void fp8_row(const T* x, uint8_t* out, int64_t n, float scale, float max) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::min(std::max(to_float(x[i]) / scale, -max), max);
    out[i] = F8(v).x;
  }
}

// kind: 1 int8, 2 fp8 e4m3, 3 fp8 e5m2
template <typename T>
void write_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots, int kind,
                const float* scales) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2);
  const int64_t width = cache.size(-1), stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  uint8_t* cp = static_cast<uint8_t*>(cache.data_ptr());
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        const T* row = xp + t * stride + h * D;
        uint8_t* dst = cp + (slots[t] * H + h) * width;
        if (kind == 1) {
          int8_row(row, reinterpret_cast<int8_t*>(dst), D);
        } else if (kind == 2) {
          fp8_row<T, c10::Float8_e4m3fn>(row, dst, D, scales[h], 448.f);
        } else {
          fp8_row<T, c10::Float8_e5m2>(row, dst, D, scales[h], 57344.f);
        }
      }
    }
  });
}

int kv_kind(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kChar: return 1;
    case at::kFloat8_e4m3fn: return 2;
    case at::kFloat8_e5m2: return 3;
    default: return 0;
  }
}

void write_one(const at::Tensor& x, at::Tensor& cache, const at::Tensor& slots,
               const c10::optional<at::Tensor>& scale) {
  const int kind = kv_kind(cache);
  TORCH_CHECK(kind != 0, "kv_write writes int8 or fp8 caches, got ", cache.scalar_type());
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "k/v must be [T, kv_heads, head_dim] with contiguous rows");
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 4 && cache.size(2) == x.size(1),
              "cache must be a contiguous [blocks, block_size, kv_heads, row]");
  TORCH_CHECK(cache.size(3) == x.size(2) + (kind == 1 ? 4 : 0),
              "cache rows do not fit head_dim ", x.size(2), " in this format");
  at::Tensor s;
  if (kind != 1) {
    TORCH_CHECK(scale.has_value(), "fp8 caches need a scale per KV head");
    s = scale->to(at::kFloat).contiguous();
    TORCH_CHECK(s.numel() == x.size(1), "one fp8 scale per KV head expected");
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kv_write", [&] {
    write_rows<scalar_t>(x, cache, sp, kind, s.defined() ? s.data_ptr<float>() : nullptr);
  });
}

}  // namespace

KVCacheFormat kv_cache_format(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
                              const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches differ in dtype");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "K and V caches differ in shape");
  const int kind = kv_kind(k_cache);
  const int64_t D = q.size(-1);
  KVCacheFormat fmt{static_cast<KVKind>(kind), nullptr, nullptr, {}, {}};
  if (kind == 0) {
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the cache must have one dtype");
    TORCH_CHECK(k_cache.size(3) == D, "cache head_dim differs from q's");
    return fmt;
  }
  TORCH_CHECK(k_cache.size(3) == D + (kind == 1 ? 4 : 0),
              "cache rows do not fit q's head_dim ", D, " in this KV format");
  if (kind != 1) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(),
                "fp8 caches need k_scale and v_scale (one per KV head)");
    fmt.k_hold = k_scale->to(at::kFloat).contiguous();
    fmt.v_hold = v_scale->to(at::kFloat).contiguous();
    TORCH_CHECK(fmt.k_hold.numel() == k_cache.size(2) && fmt.v_hold.numel() == k_cache.size(2),
                "one fp8 scale per KV head expected");
    fmt.k_scales = fmt.k_hold.data_ptr<float>();
    fmt.v_scales = fmt.v_hold.data_ptr<float>();
  }
  return fmt;
}

void kv_write(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_mapping, c10::optional<at::Tensor> k_scale,
              c10::optional<at::Tensor> v_scale) {
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slot_mapping.numel() == k.size(0) && v.size(0) == k.size(0),
              "one slot per token expected");
  write_one(k, k_cache, slot_mapping, k_scale);
  write_one(v, v_cache, slot_mapping, v_scale);
}
