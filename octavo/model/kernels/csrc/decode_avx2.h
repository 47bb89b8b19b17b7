// The AVX2 + FMA path of paged_decode.cpp, for CPUs without AVX-512 (built with -mavx2 -mfma
// -mf16c; cpu_ops.py). The same algorithm as decode_avx512.h with 8 keys at a time: for each
// query head, the 8 dot products of a chunk are 8 vectors of partial sums folded into one
// vector of 8 scores by a horizontal-add tree, exp() runs on 8 lanes, and the V rows accumulate
// into fp32 registers. K/V rows are read and widened to fp32 straight from the cache blocks.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include "block_prefetch.h"
#include "vec_math.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace octavo {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// exp for 8 lanes, the same polynomial as exp_approx (vec_math.h); lanes below -87.3 give 0.
// Inputs are <= 0 here (scores minus their running max).
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// v[t] (8 vectors) -> one vector whose lane t is the sum of v[t]'s 8 lanes.
inline __m256 sum_lanes8(const __m256 v[8]) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  // b0 = [v0..v3 low halves | v0..v3 high halves], b1 the same for v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

inline float reduce_max8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

inline float reduce_add8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

// One query head's online-softmax step over the scores of 8 keys in buf (32-byte aligned;
// lanes n.. hold no key): soft cap, the running max m raised (raise_max: l and the head's
// accumulator a rescaled), and the 8 weights exp(score - m) returned, their sum added to l.
template <int HD>
inline __m256 softmax8(float* buf, int n, float softcap, float& m, float& l, float* a) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < 8; ++t)
    buf[t] = t >= n ? neg_inf : (softcap > 0.f ? softcap * std::tanh(buf[t] / softcap) : buf[t]);
  const __m256 scores = _mm256_load_ps(buf);
  raise_max<HD>(reduce_max8(scores), m, l, a);
  const __m256 p = exp8(_mm256_sub_ps(scores, _mm256_set1_ps(m)));
  l += reduce_add8(p);
  return p;
}

// One sequence: keys at table slots lo..len-1. q: [num_heads, HD] already scaled, fp32. State
// per query head in m, l, acc. softcap 0: none. row: elements between slots in the cache (the
// cache's KV heads x HD; more than num_kv_heads x HD where the caller passes a subset of the
// KV heads, with k_cache / v_cache pointing at the first of them).
template <typename T, int HD>
void decode_seq_avx2(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
                     int64_t lo, int64_t len, int64_t num_heads, int64_t num_kv_heads,
                     int64_t row, int64_t block_size, float softcap, float* m, float* l,
                     float* acc, T* out) {
  constexpr int C = HD / 8;
  // register blocking, measured on head sizes 128 and 256 (docs/bench/notes/attention-decode.md)
  constexpr int GB = 4;              // query heads whose V sums are in registers at a time
  constexpr int CV = C < 2 ? C : 2;  // vectors of a V row per head in registers at a time
  constexpr int CQ = C < 2 ? C : 2;  // q vectors held in registers at a time
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_elems = block_size * row;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(T));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < num_heads; ++h) m[h] = neg_inf, l[h] = 0.f;
  for (int64_t i = 0; i < num_heads * HD; ++i) acc[i] = 0.f;
  alignas(32) float buf[8];
  alignas(32) float pw[8 * GB];  // softmax weights of GB query heads for 8 keys
  const int64_t nblocks = (len + block_size - 1) / block_size;
  const int64_t j0 = lo / block_size;
  // the next block is prefetched a slice after each query head's scores (block_prefetch.h)
  BlockPrefetch ahead(block_bytes, num_heads * ((block_size + 7) / 8));
  for (int64_t j = j0; j < nblocks; ++j) {
    if (j + 1 < nblocks)
      ahead.start(k_cache + table[j + 1] * block_elems, v_cache + table[j + 1] * block_elems);
    const int64_t block_len = std::min(block_size, len - j * block_size);
    for (int64_t t0 = j == j0 ? lo % block_size : 0; t0 < block_len; t0 += 8) {
      const int n = static_cast<int>(std::min<int64_t>(8, block_len - t0));
      const T* kb = k_cache + table[j] * block_elems + t0 * row;
      const T* vb = v_cache + table[j] * block_elems + t0 * row;
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        const T* kh = kb + kvh * HD;
        const T* vh = vb + kvh * HD;
        // the group's query heads GB at a time: each head's scores and softmax weights, then
        // the V rows, each read once for the GB heads (CV of a row's vectors at a time)
        for (int64_t g0 = 0; g0 < group; g0 += GB) {
          const int gn = static_cast<int>(std::min<int64_t>(GB, group - g0));
          for (int gi = 0; gi < gn; ++gi) {
            const int64_t head = kvh * group + g0 + gi;
            const float* qh = q + head * HD;
            // CQ vectors of q stay in registers while the 8 keys' partial sums take them, so
            // each FMA loads one operand (the key's), not two. Each lane adds its products
            // in the same order as a whole-row loop (an FMA onto zero is the rounded product).
            __m256 part[8];
            for (int t = 0; t < 8; ++t) part[t] = _mm256_setzero_ps();
            for (int c0 = 0; c0 < C; c0 += CQ) {
              __m256 qv[CQ];
              for (int c = 0; c < CQ; ++c) qv[c] = _mm256_loadu_ps(qh + 8 * (c0 + c));
              for (int t = 0; t < 8; ++t) {
                if (t < n) {
                  const T* kt = kh + t * row + 8 * c0;
                  for (int c = 0; c < CQ; ++c)
                    part[t] = _mm256_fmadd_ps(qv[c], load8(kt + 8 * c), part[t]);
                }
              }
            }
            _mm256_store_ps(buf, sum_lanes8(part));
            _mm256_store_ps(pw + 8 * gi,
                            softmax8<HD>(buf, n, softcap, m[head], l[head], acc + head * HD));
            ahead.some();
          }
          // acc[head] += p[head][t] * v_t; each lane still adds its keys in the same order
          float* a0 = acc + (kvh * group + g0) * HD;
          for (int c0 = 0; c0 < C; c0 += CV) {
            __m256 av[GB][CV];
            for (int gi = 0; gi < GB; ++gi)
              if (gi < gn)
                for (int c = 0; c < CV; ++c)
                  av[gi][c] = _mm256_loadu_ps(a0 + gi * HD + 8 * (c0 + c));
            for (int t = 0; t < n; ++t) {
              __m256 vv[CV];
              for (int c = 0; c < CV; ++c) vv[c] = load8(vh + t * row + 8 * (c0 + c));
              for (int gi = 0; gi < GB; ++gi) {
                if (gi < gn) {
                  const __m256 pt = _mm256_broadcast_ss(pw + 8 * gi + t);
                  for (int c = 0; c < CV; ++c) av[gi][c] = _mm256_fmadd_ps(pt, vv[c], av[gi][c]);
                }
              }
            }
            for (int gi = 0; gi < GB; ++gi)
              if (gi < gn)
                for (int c = 0; c < CV; ++c)
                  _mm256_storeu_ps(a0 + gi * HD + 8 * (c0 + c), av[gi][c]);
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

#define OCTAVO_HAVE_AVX2_DECODE 1
#endif  // __AVX2__ && __FMA__ && !__AVX512F__
