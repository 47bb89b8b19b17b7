// The register kernels on int8 activations (GGUF's arithmetic) for decode-sized batches: QuantX
// and its quantizer, idot (NR weight rows x MT activation rows) in the AVX2 / AVX-512 builds
// and a portable one, and idot1 (block_row1.h) for one activation row. Included by
// block_linear.cpp inside its anonymous namespace, after Weights, the unpacking helpers and
// prefetch_ahead / prefetch_stream.

// ---- int8 activations (GGUF's arithmetic): each activation row is quantized per block of
// 32 to int8 with its own scale dx (x ~ xq * dx), and a block's dot product runs on integers:
// sum(q * xq) exactly in int32 (vpmaddubsw + vpmaddwd: 4-bit or |8-bit| weights times int8
// activations cannot saturate their int16 pair sums), then * (scale * dx) in fp32. The 4-bit
// min adds min * dx * sum(xq) per block. llama.cpp computes Q4_0/Q4_1/Q8_0 the same way.

struct QuantX {
  int64_t K, nb, nb_pad;  // blocks per row, and rounded up to 8 (dx, xs are zero-padded)
  const int8_t* q;        // [M, K]
  const float* dx;        // [M, nb_pad]
  const float* xs;        // [M, nb_pad]: dx * sum of the block's xq
};

void quantize_x(const float* x, int64_t K, int8_t* q, float* dx, float* xs) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
      q[b * 32 + j] = static_cast<int8_t>(v);
      sum += v;
    }
    dx[b] = d;
    xs[b] = d * static_cast<float>(sum);
  }
}

#if defined(__AVX2__)
// the fp16 scales (sr) and, 4-bit, mins (mr) of blocks b0..b0+cnt-1 of one weight row as fp32
// lanes, zero past cnt (a group of 64 or 128 repeats its scale). per_block: W.group == 32,
// computed once by the caller (read from W here, it cost idot1 15% on a Q8_0 LM head: the
// kernel's stores may alias W, so it was reloaded and tested on every call)
template <int KIND>
inline void block_scales(const Weights& W, bool per_block, const uint16_t* sr,
                         const uint16_t* mr, int64_t b0, int64_t cnt, __m256& dw, __m256& mw) {
  mw = _mm256_setzero_ps();
  if (per_block) {  // a row's last blocks (cnt < 8) through a zero-padded copy
    alignas(16) uint16_t sh[8] = {0}, mh[8] = {0};
    const uint16_t* sp = sr + b0;
    const uint16_t* mp = KIND == 0 ? mr + b0 : nullptr;
    if (cnt < 8) {
      std::memcpy(sh, sp, cnt * sizeof(uint16_t));
      if (KIND == 0) std::memcpy(mh, mp, cnt * sizeof(uint16_t));
      sp = sh, mp = mh;
    }
    dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
    if (KIND == 0) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp)));
    return;
  }
  alignas(32) float d8[8], m8[8];
  for (int i = 0; i < 8; ++i) {
    const int64_t g = (b0 + i) >> W.group_shift;
    d8[i] = i < cnt ? half_to_float(sr[g]) : 0.f;
    m8[i] = KIND == 0 && i < cnt ? half_to_float(mr[g]) : 0.f;
  }
  dw = _mm256_load_ps(d8);
  if (KIND == 0) mw = _mm256_load_ps(m8);
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}


// NR weight rows x MT activation rows; the 4-bit/8-bit block is unpacked once for all MT
template <int KIND, int NR, int MT>
void idot(const Weights& W, int64_t n0, const QuantX& X, int64_t m0, float* out, int64_t ldo,
          const float* bias) {
  __m256 acc[NR][MT], macc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = macc[r][m] = _mm256_setzero_ps();
#if defined(__AVX512F__)
  __m512 acc512[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) acc512[r][m] = _mm512_setzero_ps();
#endif
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int64_t G = W.groups();
  const bool per_block = W.group == 32;
  for (int64_t b0 = 0; b0 < X.nb; b0 += 8) {
    const int64_t cnt = std::min<int64_t>(8, X.nb - b0);
    alignas(32) float dw[NR][8], mw[NR][8], cs[NR][MT][8];
    for (int r = 0; r < NR; ++r) {
      __m256 d, mn;
      block_scales<KIND>(W, per_block, W.scale + (n0 + r) * G,
                         KIND == 0 ? W.mins + (n0 + r) * G : nullptr, b0, cnt, d, mn);
      _mm256_store_ps(dw[r], d);
      _mm256_store_ps(mw[r], mn);
      if (KIND == 0)
        for (int m = 0; m < MT; ++m)
          macc[r][m] = _mm256_fmadd_ps(_mm256_load_ps(mw[r]),
                                       _mm256_loadu_ps(X.xs + (m0 + m) * X.nb_pad + b0),
                                       macc[r][m]);
      // the 8 blocks' combined scales, weight scale x activation scale
      for (int m = 0; m < MT; ++m)
        _mm256_store_ps(cs[r][m], _mm256_mul_ps(_mm256_load_ps(dw[r]),
                                                _mm256_loadu_ps(X.dx + (m0 + m) * X.nb_pad + b0)));
    }
    int64_t i = 0;
#if defined(__AVX512F__)
    // two blocks per 512-bit register; the leftover odd block takes the 256-bit code below
    const __m512i ones512 = _mm512_set1_epi16(1);
    // lanes 0-7 take block i's combined scale, lanes 8-15 block i+1's
    const __m512i pair_idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    // (kind 5's blocks are unpacked to kind 1's bytes, two at a time, and take kind 1's code:
    // the same bits)
    for (; i + 2 <= cnt; i += 2) {
      const int64_t b = b0 + i;
      const __m512i idx = _mm512_add_epi32(pair_idx, _mm512_set1_epi32(static_cast<int>(i)));
      for (int r = 0; r < NR; ++r) {
        prefetch_ahead<KIND>(W, n0 + r, b);
        __m512i w, aw;
        __mmask64 neg = 0;
        if (KIND == 0) {
          // blocks b and b+1: 32 bytes of nibbles -> [lo_b, hi_b, lo_b1, hi_b1] (xq's order)
          const __m256i raw = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(W.q + (n0 + r) * (W.K / 2) + b * 16));
          const __m256i lo = _mm256_and_si256(raw, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
          const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
          aw = w = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
        } else {
          if (KIND == 5) {
            const uint8_t* blk = W.q + (n0 + r) * W.row_bytes<5>() + b * 20;
            w = _mm512_inserti64x4(_mm512_castsi256_si512(fives8(blk)), fives8(blk + 20), 1);
          } else {
            w = _mm512_loadu_si512(W.q + (n0 + r) * W.K + b * 32);
          }
          aw = _mm512_abs_epi8(w);
          neg = _mm512_movepi8_mask(w);
        }
        for (int m = 0; m < MT; ++m) {
          __m512i xq = _mm512_loadu_si512(X.q + (m0 + m) * X.K + b * 32);
          if (KIND != 0) xq = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
          const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(aw, xq), ones512);
          const __m512 sc = _mm512_permutexvar_ps(
              idx, _mm512_castps256_ps512(_mm256_load_ps(cs[r][m])));
          acc512[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc512[r][m]);
        }
      }
    }
#endif
    for (; i < cnt; ++i) {
      const int64_t b = b0 + i;
      for (int r = 0; r < NR; ++r) {
        __m256i w;
        prefetch_ahead<KIND>(W, n0 + r, b);
        if (KIND == 0) {
          const __m128i raw = _mm_loadu_si128(
              reinterpret_cast<const __m128i*>(W.q + (n0 + r) * (W.K / 2) + b * 16));
          w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
        } else if (KIND == 5) {
          w = fives8(W.q + (n0 + r) * W.row_bytes<5>() + b * 20);
        } else {
          w = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(W.q + (n0 + r) * W.K + b * 32));
        }
        const __m256i aw = KIND == 0 ? w : _mm256_abs_epi8(w);
        for (int m = 0; m < MT; ++m) {
          __m256i xq = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(X.q + (m0 + m) * X.K + b * 32));
          if (KIND != 0) xq = _mm256_sign_epi8(xq, w);
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xq), ones);
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&cs[r][m][i]),
                                      acc[r][m]);
        }
      }
    }
  }
#if defined(__AVX512F__)
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m)
      acc[r][m] = _mm256_add_ps(acc[r][m],
                                _mm256_add_ps(_mm512_castps512_ps256(acc512[r][m]),
                                              _mm512_extractf32x8_ps(acc512[r][m], 1)));
#endif
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m)
      out[m * ldo + r] = hsum8(_mm256_add_ps(acc[r][m], macc[r][m])) +
                         (bias != nullptr ? bias[n0 + r] : 0.f);
}
constexpr int kIRows = 4, kIMT = 4;
#include "block_row1.h"  // idot1: one activation row, AVX2 and AVX-512 builds
#else
// portable: the same integer arithmetic in plain loops
template <int KIND, int NR, int MT>
void idot(const Weights& W, int64_t n0, const QuantX& X, int64_t m0, float* out, int64_t ldo,
          const float* bias) {
  const int64_t G = W.groups();
  for (int r = 0; r < NR; ++r) {
    const int64_t n = n0 + r;
    for (int m = 0; m < MT; ++m) {
      const int8_t* xq = X.q + (m0 + m) * X.K;
      float acc = 0.f;
      for (int64_t b = 0; b < X.nb; ++b) {
        const int64_t g = n * G + (b >> W.group_shift);
        int32_t isum = 0;
        if (KIND == 0) {
          const uint8_t* qs = W.q + n * (W.K / 2) + b * 16;
          for (int j = 0; j < 16; ++j)
            isum += (qs[j] & 15) * xq[b * 32 + j] + (qs[j] >> 4) * xq[b * 32 + j + 16];
        } else if (KIND == 5) {
          int8_t qs[32];
          fives(W.q + n * W.row_bytes<5>() + b * 20, qs);
          for (int j = 0; j < 32; ++j) isum += qs[j] * xq[b * 32 + j];
        } else {
          const int8_t* qs = reinterpret_cast<const int8_t*>(W.q) + n * W.K + b * 32;
          for (int j = 0; j < 32; ++j) isum += qs[j] * xq[b * 32 + j];
        }
        const float dx = X.dx[(m0 + m) * X.nb_pad + b];
        acc += static_cast<float>(isum) * (half_to_float(W.scale[g]) * dx);
        if (KIND == 0) acc += half_to_float(W.mins[g]) * X.xs[(m0 + m) * X.nb_pad + b];
      }
      out[m * ldo + r] = acc + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}
constexpr int kIRows = 1, kIMT = 4;
#endif
