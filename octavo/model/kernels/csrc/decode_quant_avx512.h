// The AVX-512 decode path of paged_decode.cpp for quantized pages (kv_rows.h), 16 keys at a
// time: decode_quant_avx2.h's arrangement on 16 lanes. Each stored K/V value is widened to
// fp32 once per step (not once per query head): a key's row, up to 8 vectors of 16 values at
// a time, is dotted with every query head of its GQA group, the partial sums folded into 16
// scores per head by decode_avx512.h's transpose-and-add tree and multiplied by the rows'
// scales; V is accumulated 16 dims at a time for up to 8 heads per widened vector, each
// softmax weight already multiplied by its row's scale.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include "block_prefetch.h"
#include "decode_avx512.h"
#include "kv_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace octavo {

// 16 stored values widened to fp32, unscaled (kv_rows.h)
template <typename KV>
inline __m512 kv_load16(const typename KV::S* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<KV, Int8KV>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
  } else if constexpr (std::is_same_v<KV, Fp8E4M3KV>) {
    // as decode_quant_avx2.h: sign-extended and shifted into fp16's sign, exponent, mantissa
    const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(x, _mm256_set1_epi16(static_cast<int16_t>(0xBF80))));
  } else {
    static_assert(std::is_same_v<KV, Fp8E5M2KV>);
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8));
  }
}

// Arguments as decode_seq_avx512's; k_hs / v_hs: per KV head, its fp8 scale times kUnit;
// work: 272 * (num_heads / num_kv_heads) floats of scratch.
template <typename T, typename KV, int HD>
void decode_seq_quant_avx512(const float* q, const typename KV::S* k_cache,
                             const typename KV::S* v_cache, const int64_t* table, int64_t lo,
                             int64_t len, int64_t num_heads, int64_t num_kv_heads, int64_t row,
                             int64_t block_size, float softcap, const float* k_hs,
                             const float* v_hs, float* m, float* l, float* acc, float* work,
                             T* out) {
  using S = typename KV::S;
  constexpr int C = HD / 16;
  constexpr int CB = C < 8 ? C : 8;  // widened K vectors held in registers at a time
  constexpr int GB = 8;              // heads whose V accumulators share a widened V vector
  constexpr int64_t HS = HD + KV::kExtra;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_elems = block_size * row;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(S));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < num_heads; ++h) m[h] = neg_inf, l[h] = 0.f;
  for (int64_t i = 0; i < num_heads * HD; ++i) acc[i] = 0.f;
  float* part = work;              // [group][16 keys][16 lanes]
  float* pw = work + 256 * group;  // [group][16 keys]
  alignas(64) float ks[16] = {}, vs[16] = {};
  const int64_t nblocks = (len + block_size - 1) / block_size;
  const int64_t j0 = lo / block_size;
  BlockPrefetch ahead(block_bytes, num_heads * ((block_size + 15) / 16));
  for (int64_t j = j0; j < nblocks; ++j) {
    if (j + 1 < nblocks)
      ahead.start(k_cache + table[j + 1] * block_elems, v_cache + table[j + 1] * block_elems);
    const int64_t block_len = std::min(block_size, len - j * block_size);
    for (int64_t t0 = j == j0 ? lo % block_size : 0; t0 < block_len; t0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, block_len - t0));
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
      const S* kb = k_cache + table[j] * block_elems + t0 * row;
      const S* vb = v_cache + table[j] * block_elems + t0 * row;
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        const S* kh = kb + kvh * HS;
        const S* vh = vb + kvh * HS;
        const float* qg = q + kvh * group * HD;
        for (int t = 0; t < n; ++t) {
          ks[t] = row_scale<KV>(kh + t * row, HD, k_hs[kvh]);
          vs[t] = row_scale<KV>(vh + t * row, HD, v_hs[kvh]);
        }
        for (int t = 0; t < n; ++t) {
          const S* kr = kh + t * row;
          for (int cb = 0; cb < C; cb += CB) {
            __m512 kv[CB];
            for (int i = 0; i < CB; ++i) kv[i] = kv_load16<KV>(kr + 16 * (cb + i));
            for (int64_t g = 0; g < group; ++g) {
              const float* qh = qg + g * HD + 16 * cb;
              float* pt = part + (g * 16 + t) * 16;
              __m512 s = cb == 0 ? _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0])
                                 : _mm512_fmadd_ps(_mm512_loadu_ps(qh), kv[0], _mm512_loadu_ps(pt));
              for (int i = 1; i < CB; ++i)
                s = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i), kv[i], s);
              _mm512_storeu_ps(pt, s);
            }
          }
        }
        const __m512 ksv = _mm512_load_ps(ks), vsv = _mm512_load_ps(vs);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = kvh * group + g;
          __m512 p16[16];
          for (int t = 0; t < 16; ++t)
            p16[t] = t < n ? _mm512_loadu_ps(part + (g * 16 + t) * 16) : _mm512_setzero_ps();
          const __m512 p = softmax16<HD>(_mm512_mul_ps(sum_lanes16(p16), ksv), valid, n,
                                         softcap, m[head], l[head], acc + head * HD);
          _mm512_storeu_ps(pw + g * 16, _mm512_mul_ps(p, vsv));
          ahead.some();
        }
        for (int64_t g0 = 0; g0 < group; g0 += GB) {
          const int gn = static_cast<int>(std::min<int64_t>(GB, group - g0));
          float* a0 = acc + (kvh * group + g0) * HD;
          for (int c = 0; c < C; ++c) {
            __m512 av[GB];
            for (int h = 0; h < GB; ++h)
              if (h < gn) av[h] = _mm512_loadu_ps(a0 + h * HD + 16 * c);
            for (int t = 0; t < n; ++t) {
              const __m512 vv = kv_load16<KV>(vh + t * row + 16 * c);
              for (int h = 0; h < GB; ++h)
                if (h < gn)
                  av[h] = _mm512_fmadd_ps(_mm512_set1_ps(pw[(g0 + h) * 16 + t]), vv, av[h]);
            }
            for (int h = 0; h < GB; ++h)
              if (h < gn) _mm512_storeu_ps(a0 + h * HD + 16 * c, av[h]);
          }
        }
      }
    }
  }
  for (int64_t head = 0; head < num_heads; ++head) {
    const float inv = 1.f / l[head];
    for (int i = 0; i < HD; ++i) store(out + head * HD + i, acc[head * HD + i] * inv);
  }
}

}  // namespace octavo

#define OCTAVO_HAVE_AVX512_QUANT_DECODE 1
#endif  // __AVX512F__
