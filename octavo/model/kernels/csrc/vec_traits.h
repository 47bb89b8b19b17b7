// One fp32 SIMD vector type per build (cpu_ops.py builds this code once per ISA): AVX-512
// (16 lanes), AVX2 + FMA (8 lanes) and portable (8 lanes in plain loops the compiler vectorises
// for its baseline). Kernels written against `Vec` (paged_prefill.cpp) compile to each.
// exp() is the same polynomial everywhere (vec_math.h's exp_approx): lanes below -87.3, -inf
// and NaN give 0.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "decode_avx2.h"
#include "decode_avx512.h"
#include "vec_math.h"

namespace octavo {

#if defined(__AVX512F__)
struct Vec {
  static constexpr int L = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend Vec exp(Vec a) { return {exp16(a.v)}; }
  // lanes where lo <= x <= hi keep s, the others become -inf
  friend Vec keep_between(Vec s, Vec x, Vec lo, Vec hi) {
    const __mmask16 k = _mm512_cmp_ps_mask(lo.v, x.v, _CMP_LE_OQ) &
                        _mm512_cmp_ps_mask(x.v, hi.v, _CMP_LE_OQ);
    return {_mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), k, s.v)};
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  static constexpr int L = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  friend Vec exp(Vec a) { return {exp8(a.v)}; }
  friend Vec keep_between(Vec s, Vec x, Vec lo, Vec hi) {
    const __m256 k = _mm256_and_ps(_mm256_cmp_ps(lo.v, x.v, _CMP_LE_OQ),
                                   _mm256_cmp_ps(x.v, hi.v, _CMP_LE_OQ));
    return {_mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), s.v, k)};
  }
};
#else
// GCC/Clang vector extensions: the compiler splits the 8 lanes into its baseline's registers
// (two SSE2 registers on x86-64) and keeps them there.
typedef float float8 __attribute__((vector_size(32)));
struct Vec {
  static constexpr int L = 8;
  float8 v;
  static Vec zero() { return {float8{}}; }
  static Vec set1(float x) { return {float8{} + x}; }
  static Vec load(const float* p) {
    Vec r;
    std::memcpy(&r.v, p, sizeof(r.v));
    return r;
  }
  void store(float* p) const { std::memcpy(p, &v, sizeof(v)); }
  friend Vec fma(Vec a, Vec b, Vec c) { return {a.v * b.v + c.v}; }
  friend Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
  friend Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
  friend Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
  friend Vec max(Vec a, Vec b) { return {a.v > b.v ? a.v : b.v}; }
  friend Vec exp(Vec a) {  // lane by lane (SSE2 has no vector round for exp_approx)
    alignas(32) float x[L];
    std::memcpy(x, &a.v, sizeof(x));
    for (int i = 0; i < L; ++i) x[i] = x[i] == x[i] ? exp_approx(x[i]) : 0.f;
    return load(x);
  }
  friend Vec keep_between(Vec s, Vec x, Vec lo, Vec hi) {
    const float8 neg_inf = float8{} - std::numeric_limits<float>::infinity();
    return {lo.v <= x.v && x.v <= hi.v ? s.v : neg_inf};
  }
};
#endif

}  // namespace octavo
