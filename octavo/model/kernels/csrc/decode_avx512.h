// The AVX-512 path of paged_decode.cpp: the same algorithm (per sequence, block by block, online
// softmax in fp32), with 16 keys at a time. For each query head, the 16 dot products of a chunk
// are 16 vectors of partial sums folded into one vector of 16 scores by a transpose-and-add tree
// (no horizontal sum per key), exp() runs on all 16 lanes at once; then the V rows are read once
// for the query heads of a GQA group (up to 4 at a time) and accumulated into register-resident
// fp32 accumulators. K/V rows are read and widened to fp32 straight from the cache blocks.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include "block_prefetch.h"
#include "vec_math.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace octavo {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp for 16 lanes, the same polynomial as exp_approx (vec_math.h); lanes below -87.3 give 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, fx));
}

// v[t] (16 vectors) -> one vector whose lane t is the sum of v[t]'s 16 lanes.
inline __m512 sum_lanes16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // b[i], 128-bit lane L: partial sums (lane L of v) of keys 4i..4i+3
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// cap * tanh(s / cap) on the first n lanes (scalar tanh: Gemma 2's soft-capped layers only).
inline __m512 softcap16(__m512 s, int n, float cap) {
  alignas(64) float buf[16];
  _mm512_store_ps(buf, s);
  for (int t = 0; t < n; ++t) buf[t] = cap * std::tanh(buf[t] / cap);
  return _mm512_load_ps(buf);
}

// One query head's online-softmax step over 16 keys' dot products (lanes outside `valid`, n
// and up, hold no key): soft cap, the running max m raised (raise_max: l and the head's
// accumulator a rescaled), and the 16 weights exp(score - m) returned, their sum added to l.
template <int HD>
inline __m512 softmax16(__m512 dots, __mmask16 valid, int n, float softcap, float& m, float& l,
                        float* a) {
  if (softcap > 0.f) dots = softcap16(dots, n, softcap);
  const __m512 scores = _mm512_mask_mov_ps(
      _mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, dots);
  raise_max<HD>(_mm512_reduce_max_ps(scores), m, l, a);
  const __m512 p = exp16(_mm512_sub_ps(scores, _mm512_set1_ps(m)));
  l += _mm512_reduce_add_ps(p);
  return p;
}

// acc[h] += sum_t p[h][t] * v_t for HN query heads sharing one KV head: each V row is loaded
// once for all of them, and the HN * HD / 16 accumulators are independent FMA chains (one head
// alone is HD / 16 chains of n dependent FMAs, bound by their latency). Each head's sum runs
// over t in order, as one head at a time would.
template <typename T, int HD, int HN>
inline void accumulate_v(const T* vh, int64_t row, int n, const float (*p)[16], float* const* a) {
  constexpr int C = HD / 16;
  __m512 av[HN][C];
  for (int h = 0; h < HN; ++h)
    for (int c = 0; c < C; ++c) av[h][c] = _mm512_loadu_ps(a[h] + 16 * c);
  for (int t = 0; t < n; ++t) {
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(vh + t * row + 16 * c);
    for (int h = 0; h < HN; ++h) {
      const __m512 pt = _mm512_set1_ps(p[h][t]);
      for (int c = 0; c < C; ++c) av[h][c] = _mm512_fmadd_ps(pt, vv[c], av[h][c]);
    }
  }
  for (int h = 0; h < HN; ++h)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(a[h] + 16 * c, av[h][c]);
}

// One sequence: keys at table slots lo..len-1. q: [num_heads, HD] already scaled, fp32. State
// per query head in m, l, acc. softcap 0: none. row: elements between slots in the cache (the
// cache's KV heads x HD; more than num_kv_heads x HD where the caller passes a subset of the
// KV heads, with k_cache / v_cache pointing at the first of them).
template <typename T, int HD>
void decode_seq_avx512(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
                       int64_t lo, int64_t len, int64_t num_heads, int64_t num_kv_heads,
                       int64_t row, int64_t block_size, float softcap, float* m, float* l,
                       float* acc, T* out) {
  constexpr int C = HD / 16;
  constexpr int HB = C >= 16 ? 1 : C >= 8 ? 2 : 4;  // heads per V pass: <= 16 accumulators
  constexpr int64_t kGroupBatch = 16;  // query heads of a KV head scored per pass
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_elems = block_size * row;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(T));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < num_heads; ++h) m[h] = neg_inf, l[h] = 0.f;
  for (int64_t i = 0; i < num_heads * HD; ++i) acc[i] = 0.f;
  alignas(64) float p_buf[kGroupBatch][16];
  const int64_t nblocks = (len + block_size - 1) / block_size;
  const int64_t j0 = lo / block_size;
  // The next block is prefetched while this one is computed, a slice of its lines after each
  // query head's scores (BlockPrefetch): issued as one burst at the start of a block, its
  // prefetches filled the miss queues and stalled the loads of the block being read (a step of
  // `mixed` read its K/V at 20 GB/s that way, 31 spread out; bf16 2.4x faster).
  BlockPrefetch ahead(block_bytes, num_heads * ((block_size + 15) / 16));
  for (int64_t j = j0; j < nblocks; ++j) {
    if (j + 1 < nblocks)
      ahead.start(k_cache + table[j + 1] * block_elems, v_cache + table[j + 1] * block_elems);
    const int64_t block_len = std::min(block_size, len - j * block_size);
    for (int64_t t0 = j == j0 ? lo % block_size : 0; t0 < block_len; t0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, block_len - t0));
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
      const T* kb = k_cache + table[j] * block_elems + t0 * row;
      const T* vb = v_cache + table[j] * block_elems + t0 * row;
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        const T* kh = kb + kvh * HD;
        const T* vh = vb + kvh * HD;
        for (int64_t g0 = 0; g0 < group; g0 += kGroupBatch) {
          const int64_t gn = std::min(kGroupBatch, group - g0);
          // the scores of this chunk for each query head, then its softmax weights p_buf
          for (int64_t gi = 0; gi < gn; ++gi) {
            const int64_t head = kvh * group + g0 + gi;
            __m512 qv[C];
            for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + head * HD + 16 * c);
            __m512 part[16];
            for (int t = 0; t < 16; ++t) {
              if (t < n) {
                __m512 s = _mm512_mul_ps(qv[0], load16(kh + t * row));
                for (int c = 1; c < C; ++c)
                  s = _mm512_fmadd_ps(qv[c], load16(kh + t * row + 16 * c), s);
                part[t] = s;
              } else {
                part[t] = _mm512_setzero_ps();
              }
            }
            _mm512_store_ps(p_buf[gi], softmax16<HD>(sum_lanes16(part), valid, n, softcap,
                                                     m[head], l[head], acc + head * HD));
            ahead.some();
          }
          // acc += p . V, the V rows read once for up to HB heads
          for (int64_t gi = 0; gi < gn; gi += HB) {
            const int hn = static_cast<int>(std::min<int64_t>(HB, gn - gi));
            float* a[HB];
            for (int h = 0; h < hn; ++h) a[h] = acc + (kvh * group + g0 + gi + h) * HD;
            const float(*p)[16] = p_buf + gi;
            switch (hn) {  // hn <= HB
              case 1: accumulate_v<T, HD, 1>(vh, row, n, p, a); break;
              case 2: if constexpr (HB >= 2) accumulate_v<T, HD, 2>(vh, row, n, p, a); break;
              case 3: if constexpr (HB >= 3) accumulate_v<T, HD, 3>(vh, row, n, p, a); break;
              default: if constexpr (HB >= 4) accumulate_v<T, HD, 4>(vh, row, n, p, a); break;
            }
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

#define OCTAVO_HAVE_AVX512_DECODE 1
#endif  // __AVX512F__
