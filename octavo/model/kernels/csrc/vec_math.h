// Scalar helpers written so that GCC vectorises the loops that call them (-O3 -march=native).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace octavo {

// The online softmax's step when a block of keys raises a query head's running max m to
// block_max: its running sum l and its HD-wide accumulator a are rescaled by exp(m -
// block_max) (0 while m is still -inf, before any key). No-op if the max is not raised.
template <int HD>
inline void raise_max(float block_max, float& m, float& l, float* a) {
  if (!(block_max > m)) return;
  const float f = m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m - block_max);
  for (int i = 0; i < HD; ++i) a[i] *= f;
  l *= f;
  m = block_max;
}

// exp(x): Cephes' expf polynomial after x = n ln2 + r, |r| <= ln2/2 (about 1 ulp). Inputs are
// clamped to [-87.3, 88.7]; below -87.3 the result is 0.
inline float exp_approx(float x) {
  const float lo = -87.3f, hi = 88.7f;
  const bool zero = x < lo;
  x = x < lo ? lo : (x > hi ? hi : x);
  const float fx = std::nearbyint(x * 1.44269504088896341f);
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return zero ? 0.f : p * scale;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(double x) { return static_cast<float>(x); }

// float -> bfloat16 bits, round to nearest even (NaN stays NaN), as c10 does, but in plain
// integer arithmetic that vectorises (c10's conversion does not).
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return std::isnan(x) ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

inline void store(float* p, float x) { *p = x; }
inline void store(c10::BFloat16* p, float x) { reinterpret_cast<uint16_t*>(p)[0] = bf16_bits(x); }
inline void store(c10::Half* p, float x) { *p = static_cast<c10::Half>(x); }
inline void store(double* p, float x) { *p = x; }

// Round a float to T and back, as torch does after every op in a reduced-precision dtype.
template <typename T>
inline float round_to(float x) { return to_float(static_cast<T>(x)); }
template <>
inline float round_to<float>(float x) { return x; }
template <>
inline float round_to<double>(float x) { return x; }
template <>
inline float round_to<c10::BFloat16>(float x) {
  const uint32_t u = static_cast<uint32_t>(bf16_bits(x)) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// A row of n values as fp32: the row itself for float, converted into buf otherwise.
inline const float* as_float(const float* src, float* /*buf*/, int64_t /*n*/) { return src; }
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = to_float(src[i]);
  return buf;
}

}  // namespace octavo
