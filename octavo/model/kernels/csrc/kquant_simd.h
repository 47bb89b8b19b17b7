// The 256-bit integer dot products of K-quant super-blocks (GGUF Q4_K, Q5_K, Q6_K: 256 weights
// each) against activations quantized per 256 to int8 (kquant_linear.cpp's Q8K). Included twice
// by kquant_linear.cpp: as plain AVX2 (namespace kq_avx2), and in the AVX-512 build a second time
// under the avx512vnni target (namespace kq_vnni, chosen at run time where the CPU has it), where
// each 32-weight product-and-scale is vpdpbusd + vpdpwssd instead of vpmaddubsw + vpmaddwd +
// vpaddd.
//
// The arithmetic is llama.cpp's (ggml_vec_dot_q{4,5,6}_K_q8_K): per super-block the weights'
// integer codes q times the activations' xq, summed exactly in int32 with each sub-block's
// integer scale, then one fp32 multiply by d(weights) * d(activations). Q4_K / Q5_K subtract
// dmin * dx * sum(min_s * sum of sub-block s's xq) (the sums come with the activations);
// Q6_K's codes are q - 32, and 32 * sum(scale_s * sum of xq) comes from the same sums.
// Exactness: a vpmaddubsw pair is at most 2 * 63 * 127 = 16002 (no int16 saturation); a
// vpdpbusd quad at most 4 * 63 * 127 = 32004, so it is exact as the low int16 of its lane, which
// vpdpwssd multiplies by the scale (the scale vector's high int16 is 0).
//
// Needs before inclusion: KQ_NS, KQ_VNNI (0 or 1), struct Q8K, kBytes, half_to_float. The
// super-block layouts are kquant_linear.cpp's (in memory, after kquant.repack).

namespace KQ_NS {

// VNNI's vpdpwssd adds into its accumulator, so a super-block's 8 scaled products form one
// chain of dependent instructions (about 4 cycles each) where AVX2's vpaddd takes one: VNNI
// sums the odd sub-blocks in a second chain, added to the first at the super-block's end
// (integer sums: the same bits either way)
constexpr int kChains = KQ_VNNI ? 2 : 1;

// sumi + sum over the 32 bytes of q (unsigned codes) * x (int8), each 4-byte quad (VNNI) or
// 2-byte pair (AVX2) times its lane's scale in `sc`
static inline __m256i dot_scaled(__m256i sumi, __m256i q, __m256i x, __m256i sc) {
#if KQ_VNNI
  return _mm256_dpwssd_epi32(sumi, _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x), sc);
#else
  return _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), sc));
#endif
}

// shuffle masks that spread an int16 scale over a 32-weight product: AVX2, every int16 lane
// (pairs); VNNI, the low int16 of every int32 lane (quads), the high int16 zeroed (0x80)
#if KQ_VNNI
#define KQ_S(a, b) a, b, -128, -128, a, b, -128, -128, a, b, -128, -128, a, b, -128, -128
#else
#define KQ_S(a, b) a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b
#endif
// Q4_K / Q5_K: sub-block k's scale (int16 element k of both 128-bit lanes) in both lanes
alignas(32) static const int8_t kMask4[8][32] = {
    {KQ_S(0, 1), KQ_S(0, 1)},     {KQ_S(2, 3), KQ_S(2, 3)},     {KQ_S(4, 5), KQ_S(4, 5)},
    {KQ_S(6, 7), KQ_S(6, 7)},     {KQ_S(8, 9), KQ_S(8, 9)},     {KQ_S(10, 11), KQ_S(10, 11)},
    {KQ_S(12, 13), KQ_S(12, 13)}, {KQ_S(14, 15), KQ_S(14, 15)}};
// Q6_K: a 32-weight group k of a half holds sub-blocks 2k (low 128-bit lane) and 2k+1 (high)
alignas(32) static const int8_t kMask6[4][32] = {{KQ_S(0, 1), KQ_S(2, 3)},
                                                 {KQ_S(4, 5), KQ_S(6, 7)},
                                                 {KQ_S(8, 9), KQ_S(10, 11)},
                                                 {KQ_S(12, 13), KQ_S(14, 15)}};
#undef KQ_S

static inline __m256i mask(const int8_t* m) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
}

static inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

static inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

static inline float hsum4(__m128 s) {
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Q6_K: group k (0..3) of a half super-block's 128 codes (0..63), from its 64 bytes of low
// nibbles (b1: groups 0 and 2, b2: 1 and 3) and 32 bytes of high bit pairs (bh: bits 2k, 2k+1)
static inline __m256i q6_codes(__m256i b1, __m256i b2, __m256i bh, int k) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  const __m256i lo = _mm256_and_si256(k & 2 ? _mm256_srli_epi16(k & 1 ? b2 : b1, 4) : (k & 1 ? b2 : b1), m4);
  const __m256i hi = _mm256_and_si256(bh, _mm256_slli_epi16(m2, 2 * k));
  return _mm256_or_si256(lo, k < 2 ? _mm256_slli_epi16(hi, 4 - 2 * k) : _mm256_srli_epi16(hi, 2 * k - 4));
}

// Q4_K / Q5_K: sub-block s's 32 codes (Q4_K 0..15, Q5_K 0..31) from the 32 nibble bytes of the
// pair s / 2 (low nibbles: the even sub-block), and for Q5_K the fifth bits (hbits: bit s of
// byte l is sub-block s's element l)
template <int KIND>
static inline __m256i q45_codes(__m256i bits, __m256i hbits, int s) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256i q = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(bits, 4) : bits, m4);
  if (KIND == kQ5K)
    q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(s)),
                                                              _mm256_set1_epi8(1)),
                                             4));
  return q;
}

// NR weight rows (row0, row0 + row_bytes, ...) against activation rows m0..m0+MT-1:
// out[m * ldo + r]. Each (weight row, activation row) pair takes exactly the arithmetic of NR = 1
// (so the same bits); NR > 1 shares the activations' loads and sums between weight rows and
// gives the core independent work (a decode's one activation row takes NR = 2).
template <int KIND, int NR, int MT>
static void rows_dot(const uint8_t* row0, int64_t row_bytes, const Q8K& X, int64_t m0,
                     float* out, int64_t ldo, const float* bias) {
  __m256 acc[NR][MT];
  __m128 accm[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) {
      acc[r][m] = _mm256_setzero_ps();
      accm[r][m] = _mm_setzero_ps();
    }
  for (int64_t b = 0; b < X.nb; ++b) {
    const uint8_t* blk[NR];
    for (int r = 0; r < NR; ++r) {
      blk[r] = row0 + r * row_bytes + b * kBytes[KIND];
      // a decode's one row streams the weights: one weight row asks for the bytes kStreamAhead
      // past this super-block; NR rows read in step are NR short streams, which the hardware's
      // prefetcher does not follow (Q4_K from memory, 4 rows: 6.4 GB/s, 11.4 with the one-row
      // distance), so each asks for the same super-block of its row in the next NR rows
      if (MT == 1 && NR == 1)
        for (int64_t l = 0; l < kBytes[KIND]; l += 64)
          __builtin_prefetch(blk[r] + kStreamAhead + l, 0, 3);
    }
    if (MT == 1 && NR > 1) {
      const uint8_t* next = row0 + NR * row_bytes + b * NR * kBytes[KIND];
      for (int64_t l = 0; l < NR * kBytes[KIND]; l += 64) __builtin_prefetch(next + l, 0, 3);
    }
    const int8_t* xq[MT];
    const int16_t* bs[MT];
    float dx[MT];
    for (int m = 0; m < MT; ++m) {
      xq[m] = X.q + (m0 + m) * X.K + b * 256;
      bs[m] = X.bsums + (m0 + m) * (X.K / 16) + b * 16;
      dx[m] = X.d[(m0 + m) * X.nb + b];
    }
    __m256i sumi[NR][MT], odd[NR][MT];  // odd: a second chain of sums (see kChains)
    float d[NR];
    if (KIND == kQ6K) {
      __m256i halves[NR][2];
      for (int r = 0; r < NR; ++r) {
        d[r] = half_to_float(blk[r] + 208);
        const __m256i sc16 =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[r] + 192)));
        for (int m = 0; m < MT; ++m) {  // the codes' -32: 32 * sum(scale_s * sum of xq in s)
          sumi[r][m] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                        _mm256_slli_epi32(_mm256_madd_epi16(sc16, load32(bs[m])), 5));
          odd[r][m] = _mm256_setzero_si256();
        }
        // each half's 8 scales in both 128-bit lanes (the shuffles pick within a lane)
        halves[r][0] = _mm256_permute4x64_epi64(sc16, 0x44);
        halves[r][1] = _mm256_permute4x64_epi64(sc16, 0xEE);
      }
      for (int h = 0; h < 2; ++h) {
        __m256i q[NR][4];
        for (int r = 0; r < NR; ++r) {
          const uint8_t* ql = blk[r];
          const uint8_t* qh = blk[r] + 128;
          const __m256i b1 = load32(ql + 64 * h), b2 = load32(ql + 64 * h + 32);
          const __m256i bh = load32(qh + 32 * h);
          for (int k = 0; k < 4; ++k) q[r][k] = q6_codes(b1, b2, bh, k);
        }
        for (int k = 0; k < 4; ++k)
          for (int r = 0; r < NR; ++r) {
            const __m256i sc = _mm256_shuffle_epi8(halves[r][h], mask(kMask6[k]));
            for (int m = 0; m < MT; ++m) {
              __m256i& s = kChains == 2 && (k & 1) ? odd[r][m] : sumi[r][m];
              s = dot_scaled(s, q[r][k], load32(xq[m] + 128 * h + 32 * k), sc);
            }
          }
      }
    } else {
      __m128i s32[MT];
      for (int m = 0; m < MT; ++m) {
        const __m256i s16 = load32(bs[m]);  // sums of 16 -> sums of 32 (sub-blocks 0..7)
        s32[m] = _mm_hadd_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
      }
      __m256i src[NR], hbits[NR];
      const uint8_t* qs[NR];
      for (int r = 0; r < NR; ++r) {
        d[r] = half_to_float(blk[r]);
        const float dmin = half_to_float(blk[r] + 2);
        // the 8 scales and 8 mins, a byte each (unpacked at load)
        const __m128i sc8 =
            _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk[r] + 4)));
        const __m128i mn8 =
            _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk[r] + 12)));
        src[r] = _mm256_set_m128i(sc8, sc8);
        for (int m = 0; m < MT; ++m) {
          accm[r][m] = _mm_fmadd_ps(_mm_set1_ps(-dmin * dx[m]),
                                    _mm_cvtepi32_ps(_mm_madd_epi16(mn8, s32[m])), accm[r][m]);
          sumi[r][m] = odd[r][m] = _mm256_setzero_si256();
        }
        qs[r] = blk[r] + (KIND == kQ4K ? 20 : 52);
        hbits[r] = KIND == kQ5K ? load32(blk[r] + 20) : _mm256_setzero_si256();
      }
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < NR; ++r) {
          const __m256i bits = load32(qs[r] + 32 * j);
          const __m256i lo = q45_codes<KIND>(bits, hbits[r], 2 * j);
          const __m256i hi = q45_codes<KIND>(bits, hbits[r], 2 * j + 1);
          const __m256i sl = _mm256_shuffle_epi8(src[r], mask(kMask4[2 * j]));
          const __m256i sh = _mm256_shuffle_epi8(src[r], mask(kMask4[2 * j + 1]));
          for (int m = 0; m < MT; ++m) {
            sumi[r][m] = dot_scaled(sumi[r][m], lo, load32(xq[m] + 64 * j), sl);
            __m256i& s = kChains == 2 ? odd[r][m] : sumi[r][m];
            s = dot_scaled(s, hi, load32(xq[m] + 64 * j + 32), sh);
          }
        }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m)
        acc[r][m] = _mm256_fmadd_ps(_mm256_set1_ps(d[r] * dx[m]),
                                    _mm256_cvtepi32_ps(_mm256_add_epi32(sumi[r][m], odd[r][m])),
                                    acc[r][m]);
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m)
      out[m * ldo + r] = hsum8(acc[r][m]) + hsum4(accm[r][m]) + (bias ? bias[r] : 0.f);
}

// One weight row (its super-blocks at `row`) against activation rows m0..m0+MT-1: out[m * ldo]
template <int KIND, int MT>
static void row_dot(const uint8_t* row, const Q8K& X, int64_t m0, float* out, int64_t ldo,
                    float bias) {
  rows_dot<KIND, 1, MT>(row, 0, X, m0, out, ldo, &bias);
}

}  // namespace KQ_NS
