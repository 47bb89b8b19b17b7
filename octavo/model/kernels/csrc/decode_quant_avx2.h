// The AVX2 + FMA decode path of paged_decode.cpp for quantized pages (kv_rows.h: int8 rows with
// their fp32 scale, fp8 rows with a scale per KV head). The same online softmax as
// decode_avx2.h, 8 keys at a time, arranged so that each stored value is widened to fp32 once
// per step, not once per query head: widening an int8 or fp8 vector costs 2-4 instructions
// where an fp32 one is a load, and a GQA group's heads all read the same K/V rows.
//   - scores: a key's row is widened into registers, up to 8 vectors at a time, and dotted
//     with every query head of the group; the per-lane partial sums go to a small buffer
//     (part) that the horizontal-add tree of decode_avx2.h folds into 8 scores per head, times
//     the 8 rows' scales;
//   - values: for 8 dims at a time, each key's widened V vector feeds the accumulators of up
//     to 8 heads, its softmax weight already multiplied by the row's scale.
// The K/V bytes read are the pages' own: nothing is dequantized into memory.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include "block_prefetch.h"
#include "decode_avx2.h"
#include "kv_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace octavo {

// 8 stored values widened to fp32, unscaled (kv_rows.h)
template <typename KV>
inline __m256 kv_load8(const typename KV::S* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<KV, Int8KV>) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
  } else if constexpr (std::is_same_v<KV, Fp8E4M3KV>) {
    // sign-extended, shifted by 7: the sign lands on bit 15 (and a copy on bit 14, cleared),
    // exponent and mantissa on fp16's bits 13..7
    const __m128i x = _mm_slli_epi16(_mm_cvtepi8_epi16(raw), 7);
    return _mm256_cvtph_ps(_mm_and_si128(x, _mm_set1_epi16(static_cast<int16_t>(0xBF80))));
  } else {
    static_assert(std::is_same_v<KV, Fp8E5M2KV>);
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8));
  }
}

// Arguments as decode_seq_avx2's; k_hs / v_hs: per KV head, its fp8 scale times kUnit
// (kv_rows.h's head_scale); work: 128 * (num_heads / num_kv_heads) floats of scratch.
template <typename T, typename KV, int HD>
void decode_seq_quant_avx2(const float* q, const typename KV::S* k_cache,
                           const typename KV::S* v_cache, const int64_t* table, int64_t lo,
                           int64_t len, int64_t num_heads, int64_t num_kv_heads, int64_t row,
                           int64_t block_size, float softcap, const float* k_hs,
                           const float* v_hs, float* m, float* l, float* acc, float* work,
                           T* out) {
  using S = typename KV::S;
  constexpr int C = HD / 8;
  constexpr int CB = C < 8 ? C : 8;  // widened K vectors held in registers at a time
  constexpr int GB = 8;              // heads whose V accumulators share a widened V vector
  constexpr int64_t HS = HD + KV::kExtra;  // elements between a slot's KV heads
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_elems = block_size * row;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(S));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < num_heads; ++h) m[h] = neg_inf, l[h] = 0.f;
  for (int64_t i = 0; i < num_heads * HD; ++i) acc[i] = 0.f;
  float* part = work;              // [group][8 keys][8 lanes]: partial dot products
  float* pw = work + 64 * group;   // [group][8 keys]: softmax weight x the row's V scale
  alignas(32) float buf[8];
  alignas(32) float ks[8] = {}, vs[8] = {};  // the chunk's rows' scales
  const int64_t nblocks = (len + block_size - 1) / block_size;
  const int64_t j0 = lo / block_size;
  BlockPrefetch ahead(block_bytes, num_heads * ((block_size + 7) / 8));
  for (int64_t j = j0; j < nblocks; ++j) {
    if (j + 1 < nblocks)
      ahead.start(k_cache + table[j + 1] * block_elems, v_cache + table[j + 1] * block_elems);
    const int64_t block_len = std::min(block_size, len - j * block_size);
    for (int64_t t0 = j == j0 ? lo % block_size : 0; t0 < block_len; t0 += 8) {
      const int n = static_cast<int>(std::min<int64_t>(8, block_len - t0));
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
        // part[g][t] = q_g . k_t, lane by lane, each K vector widened once for the group
        for (int t = 0; t < n; ++t) {
          const S* kr = kh + t * row;
          for (int cb = 0; cb < C; cb += CB) {
            __m256 kv[CB];
            for (int i = 0; i < CB; ++i) kv[i] = kv_load8<KV>(kr + 8 * (cb + i));
            for (int64_t g = 0; g < group; ++g) {
              const float* qh = qg + g * HD + 8 * cb;
              float* pt = part + (g * 8 + t) * 8;
              __m256 s = cb == 0 ? _mm256_mul_ps(_mm256_loadu_ps(qh), kv[0])
                                 : _mm256_fmadd_ps(_mm256_loadu_ps(qh), kv[0], _mm256_loadu_ps(pt));
              for (int i = 1; i < CB; ++i)
                s = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), kv[i], s);
              _mm256_storeu_ps(pt, s);
            }
          }
        }
        const __m256 ksv = _mm256_load_ps(ks), vsv = _mm256_load_ps(vs);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = kvh * group + g;
          __m256 p8[8];
          for (int t = 0; t < 8; ++t)
            p8[t] = t < n ? _mm256_loadu_ps(part + (g * 8 + t) * 8) : _mm256_setzero_ps();
          _mm256_store_ps(buf, _mm256_mul_ps(sum_lanes8(p8), ksv));
          const __m256 p = softmax8<HD>(buf, n, softcap, m[head], l[head], acc + head * HD);
          _mm256_storeu_ps(pw + g * 8, _mm256_mul_ps(p, vsv));
          ahead.some();
        }
        // acc[h] += sum_t pw[h][t] * v_t, 8 dims at a time, each V vector widened once
        for (int64_t g0 = 0; g0 < group; g0 += GB) {
          const int gn = static_cast<int>(std::min<int64_t>(GB, group - g0));
          float* a0 = acc + (kvh * group + g0) * HD;
          for (int c = 0; c < C; ++c) {
            __m256 av[GB];
            for (int h = 0; h < GB; ++h)
              if (h < gn) av[h] = _mm256_loadu_ps(a0 + h * HD + 8 * c);
            for (int t = 0; t < n; ++t) {
              const __m256 vv = kv_load8<KV>(vh + t * row + 8 * c);
              for (int h = 0; h < GB; ++h)
                if (h < gn)
                  av[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(pw + (g0 + h) * 8 + t), vv, av[h]);
            }
            for (int h = 0; h < GB; ++h)
              if (h < gn) _mm256_storeu_ps(a0 + h * HD + 8 * c, av[h]);
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

#define OCTAVO_HAVE_AVX2_QUANT_DECODE 1
#endif  // __AVX2__ && __FMA__ && !__AVX512F__
