// How the attention kernels read one K/V row (one token, one KV head) of the paged cache: in
// the model dtype (PlainKV<T>), or quantized (octavo/model/layers/kv_quant.py): int8 values
// followed by the row's fp32 scale (Int8KV), or fp8 values with one scale per KV head
// (Fp8E4M3KV, Fp8E5M2KV). A reader widens a row's values to fp32 *unscaled* and gives the
// row's scale apart: the kernels multiply the scale into the dot product (K) or into the
// softmax weight (V) once per row, in registers, so no dequantized copy of the cache is made
// and a decode step reads 8 bits per value. fp8 values widen through fp16 (F16C): e5m2 has
// fp16's bit layout with the low byte cut, and e4m3 fits into it shifted; its exponent bias is
// 7 against fp16's 15, so the value read is 2^-8 of the stored one, a factor each head's scale
// carries (kUnit). Zeros, subnormals and every finite value widen exactly.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec_math.h"

namespace octavo {

template <typename T>
struct PlainKV {
  using S = T;  // the cache's element type
  static constexpr int64_t kExtra = 0;  // elements after a row's head_dim values
  static constexpr bool kQuant = false;
  static constexpr float kUnit = 1.f;
};

struct Int8KV {
  using S = int8_t;
  static constexpr int64_t kExtra = 4;  // the row's fp32 scale
  static constexpr bool kQuant = true;
  static constexpr float kUnit = 1.f;
};

struct Fp8E4M3KV {
  using S = uint8_t;
  static constexpr int64_t kExtra = 0;
  static constexpr bool kQuant = true;
  static constexpr float kUnit = 256.f;
};

struct Fp8E5M2KV {
  using S = uint8_t;
  static constexpr int64_t kExtra = 0;
  static constexpr bool kQuant = true;
  static constexpr float kUnit = 1.f;
};

// fp16 bits of an fp8 value (e4m3: 2^-8 of it, see above)
inline uint16_t e4m3_half_bits(uint8_t x) {
  return static_cast<uint16_t>(((x & 0x80u) << 8) | ((x & 0x7Fu) << 7));
}
inline uint16_t e5m2_half_bits(uint8_t x) { return static_cast<uint16_t>(x << 8); }

// one stored value widened, unscaled
template <typename KV>
inline float kv_value(typename KV::S x) {
  if constexpr (std::is_same_v<KV, Int8KV>) {
    return static_cast<float>(x);
  } else if constexpr (std::is_same_v<KV, Fp8E4M3KV>) {
    return c10::detail::fp16_ieee_to_fp32_value(e4m3_half_bits(x));
  } else if constexpr (std::is_same_v<KV, Fp8E5M2KV>) {
    return c10::detail::fp16_ieee_to_fp32_value(e5m2_half_bits(x));
  } else {
    return to_float(x);
  }
}

// the scale of the row whose head_dim values start at `row`; head_scale: the row's KV head's
// scale times kUnit (fp8; unused otherwise)
template <typename KV>
inline float row_scale(const typename KV::S* row, int64_t head_dim, float head_scale) {
  if constexpr (std::is_same_v<KV, Int8KV>) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof(s));
    return s;
  } else if constexpr (KV::kQuant) {
    return head_scale;
  } else {
    return 1.f;
  }
}

// a row's n values widened into buf, unscaled (float rows: the row itself)
template <typename KV>
inline const float* kv_row(const typename KV::S* src, float* buf, int64_t n) {
  if constexpr (!KV::kQuant) {
    return as_float(src, buf, n);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buf[i] = kv_value<KV>(src[i]);
    return buf;
  }
}

// per KV head: its fp8 scale times kUnit (1 for int8 and plain rows, whose scale is per row)
template <typename KV>
inline float head_scale(const float* scales, int64_t kv_head) {
  if constexpr (KV::kQuant && !std::is_same_v<KV, Int8KV>) return scales[kv_head] * KV::kUnit;
  return 1.f;
}

}  // namespace octavo
