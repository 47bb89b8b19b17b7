// Prefill-sized batches of K-quant layers: weight rows against a group of 8 activation rows
// whose quantized values (in lane order), dx and per-super-block terms kquant_linear.cpp
// interleaved per super-block (Q8KTile), so that every load of the tile's inner loop is one base
// pointer plus a constant, and the per-row work of kquant_simd.h's rows_dot that does not depend
// on the weights (the mins' bsum_j * dx; Q6_K's offsets of the codes' 32: -32 * bsum_j on the VNNI
// path, q6_pair_offsets on the AVX2 path) was done once per call instead of once per weight row.
//
// The result is rows_dot<KIND, 1, 1>'s bit for bit: each int32 lane of a super-block's sums holds
// the same products (integer sums are exact in any order), each fp32 lane takes the same
// multiplies and fmadds with the same operands in super-block order (the stored bsum_j * dx is
// the same single rounding rows_dot makes), then the same horizontal sum. A row's result therefore
// stays the same whatever batch computes it (tests/model/quant/test_kquant.py checks the bits).
//
// Included by kquant_linear.cpp after kquant_simd.h, into the same KQ_NS. Needs Q8KTile and
// kBytes.

namespace KQ_NS {

#if KQ_VNNI
// AVX-512 VNNI: NR = 1 or 2 weight rows against the group's 8 activation rows in 512-bit
// registers, a pair of activation rows per register (one 64-byte load: rows 2p and 2p + 1 of
// vector v lie side by side), each weight row's codes in both halves. 2 rows x 4 pairs keep 8
// sums and 8 accumulators in registers (the 256-bit tiles' 16 + 16 did not fit in 32 and
// spilled), and each vpdpbusd takes 64 products: Zen 4 runs one a cycle, the same products as
// two 256-bit ones, with half the instructions and loads around them.

static inline __m512i load64(const void* p) { return _mm512_loadu_si512(p); }
static inline __m512i bcast32(const void* p) {  // 32 bytes into both halves
  return _mm512_broadcast_i64x4(load32(p));
}
static inline __m512 bcast8(__m256 v) {  // (AVX512F's 64x4 forms: no AVX512DQ needed)
  const __m256d d = _mm256_castps_pd(v);
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(d), d, 1));
}
static inline __m256 high8(__m512 v) {  // the upper half
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

// Q4_K / Q5_K: vector v's codes in both halves (q45_codes on 512 bits)
template <int KIND>
static inline __m512i q45_codes2(__m512i bits, __m512i hbits, int v) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512i q = _mm512_and_si512(v & 1 ? _mm512_srli_epi16(bits, 4) : bits, m4);
  if (KIND == kQ5K)
    q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hbits, v),
                                                              _mm512_set1_epi8(1)),
                                             4));
  return q;
}

// Q6_K: vector 4h + k's codes in both halves (q6_codes on 512 bits)
static inline __m512i q6_codes2(__m512i b1, __m512i b2, __m512i bh, int k) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
  const __m512i lo = _mm512_and_si512(k & 2 ? _mm512_srli_epi16(k & 1 ? b2 : b1, 4) : (k & 1 ? b2 : b1), m4);
  const __m512i hi = _mm512_and_si512(bh, _mm512_slli_epi16(m2, 2 * k));
  return _mm512_or_si512(lo, k < 2 ? _mm512_slli_epi16(hi, 4 - 2 * k) : _mm512_srli_epi16(hi, 2 * k - 4));
}

// acc + s * (the integer lanes * dx): scaled() lane for lane
static inline __m512 scaled2(__m512 acc, __m512 s, __m512i sumi, __m512 dx) {
  return _mm512_fmadd_ps(s, _mm512_mul_ps(_mm512_cvtepi32_ps(sumi), dx), acc);
}

template <int KIND, int NR>
static void tile_dot(const uint8_t* row, int64_t row_bytes, const Q8KTile& T, int64_t g,
                     float* out, int64_t ldo, const float* bias) {
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int p = 0; p < 4; ++p) acc[r][p] = _mm512_setzero_ps();
  const int8_t* xg = T.q + g * T.nb * 2048;
  const float* dxg = T.d + g * T.nb * 64;
  for (int64_t b = 0; b < T.nb; ++b) {
    const uint8_t* blk[NR];
    for (int r = 0; r < NR; ++r) blk[r] = row + r * row_bytes + b * kBytes[KIND];
    const int8_t* xb = xg + b * 2048;
    const float* dxb = dxg + b * 64;
    __m512i sums[NR][4];
    if (KIND == kQ6K) {
      const int32_t* off = T.offset + (g * T.nb + b) * 128;
      __m512 sc[NR][2];
      for (int r = 0; r < NR; ++r) {
        __m256 lo, hi;
        q6_scales(blk[r], lo, hi);
        sc[r][0] = bcast8(lo), sc[r][1] = bcast8(hi);
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        for (int p = 0; p < 4; ++p) {
          const __m512i init = load64(off + 64 * h + 16 * p);
          for (int r = 0; r < NR; ++r) sums[r][p] = init;
        }
        __m512i b1[NR], b2[NR], bh[NR];
        for (int r = 0; r < NR; ++r) {
          b1[r] = bcast32(blk[r] + 64 * h), b2[r] = bcast32(blk[r] + 64 * h + 32);
          bh[r] = bcast32(blk[r] + 128 + 32 * h);
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          __m512i q[NR];
          for (int r = 0; r < NR; ++r) q[r] = q6_codes2(b1[r], b2[r], bh[r], k);
          for (int p = 0; p < 4; ++p) {
            const __m512i x = load64(xb + 256 * (4 * h + k) + 64 * p);
            for (int r = 0; r < NR; ++r) sums[r][p] = _mm512_dpbusd_epi32(sums[r][p], q[r], x);
          }
        }
        for (int r = 0; r < NR; ++r)
          for (int p = 0; p < 4; ++p)
            acc[r][p] = scaled2(acc[r][p], sc[r][h], sums[r][p], _mm512_loadu_ps(dxb + 16 * p));
      }
    } else {
      const float* bx = T.bx + (g * T.nb + b) * 64;
      for (int r = 0; r < NR; ++r)
        for (int p = 0; p < 4; ++p) sums[r][p] = _mm512_setzero_si512();
      __m512i hbits[NR];
      for (int r = 0; r < NR; ++r)
        hbits[r] = KIND == kQ5K ? bcast32(blk[r] + 20) : _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i bits[NR];
        for (int r = 0; r < NR; ++r) bits[r] = bcast32(blk[r] + (KIND == kQ4K ? 20 : 52) + 32 * j);
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          const int v = 2 * j + e;
          __m512i q[NR];
          for (int r = 0; r < NR; ++r) q[r] = q45_codes2<KIND>(bits[r], hbits[r], v);
          for (int p = 0; p < 4; ++p) {
            const __m512i x = load64(xb + 256 * v + 64 * p);
            for (int r = 0; r < NR; ++r) sums[r][p] = _mm512_dpbusd_epi32(sums[r][p], q[r], x);
          }
        }
      }
      for (int r = 0; r < NR; ++r) {
        __m256 s, mn;
        q45_scales(blk[r], s, mn);
        const __m512 s2 = bcast8(s), mn2 = bcast8(mn);
        for (int p = 0; p < 4; ++p) {
          const __m512 a = _mm512_fmadd_ps(mn2, _mm512_loadu_ps(bx + 16 * p), acc[r][p]);
          acc[r][p] = scaled2(a, s2, sums[r][p], _mm512_loadu_ps(dxb + 16 * p));
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int p = 0; p < 4; ++p) {
      out[2 * p * ldo + r] = hsum8(_mm512_castps512_ps256(acc[r][p])) + bias[r];
      out[(2 * p + 1) * ldo + r] = hsum8(high8(acc[r][p])) + bias[r];
    }
}

#else
// AVX2: sums[m] += NV vectors' products with row m's values at x + 256 m + 32 i, their
// vpmaddubsw pair sums added as int16 and widened once (vpmaddwd by ones): 3 NV instructions
// become 2 NV + 1 per row. Every vector's lane j belongs to the same sub-block, so the int16
// sums stay per lane; they cannot wrap: a pair is at most 2 * 15 * 127 = 3810 for Q4_K (4 of
// them 15240), 2 * 31 * 127 = 7874 for Q5_K (31496), and the activations are -127..127 (Q4_K
// and Q5_K; Q6_K takes pairs4)
template <int NV>
static inline void dot8_pairs(__m256i (&sums)[1][8], const __m256i (&q)[NV], const int8_t* x) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < 8; ++m) {
    __m256i p = _mm256_maddubs_epi16(q[0], load32(x + 256 * m));
    for (int i = 1; i < NV; ++i)
      p = _mm256_add_epi16(p, _mm256_maddubs_epi16(q[i], load32(x + 256 * m + 32 * i)));
    sums[0][m] = _mm256_add_epi32(sums[0][m], _mm256_madd_epi16(p, ones));
  }
}

// AVX2, Q6_K: the int16 sum of 4 vectors' vpmaddubsw pair sums (codes q[0..3], values at x + 32 i);
// less the offset of the codes' 32 it is at most 4 * 2 * 32 * 127 = 32512 (int16 adds wrap, so
// only the final sum must fit)
static inline __m256i pairs4(const __m256i* q, const int8_t* x) {
  return _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(q[0], load32(x)), _mm256_maddubs_epi16(q[1], load32(x + 32))),
                          _mm256_add_epi16(_mm256_maddubs_epi16(q[2], load32(x + 64)), _mm256_maddubs_epi16(q[3], load32(x + 96))));
}

// AVX2: NR weight rows (row, row + row_bytes, ...) against the group's 8 activation rows:
// out[m * ldo + r] (NR = 1). The group's per-super-block data as Q8KTile lays it out for this
// path: values [nb][8 rows][256], dx [nb][8][8], and the format's per-row terms: Q4_K / Q5_K
// [nb][8][8] fp32 bsum_j * dx; Q6_K [nb][8][2][16] int16, q6_pair_offsets.
template <int KIND, int NR>
static void tile_dot(const uint8_t* row, int64_t row_bytes, const Q8KTile& T, int64_t g,
                     float* out, int64_t ldo, const float* bias) {
  alignas(32) float acc[NR][8][8];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < 8; ++m) _mm256_store_ps(acc[r][m], _mm256_setzero_ps());
  const int8_t* xg = T.q + g * T.nb * 2048;
  const float* dxg = T.d + g * T.nb * 64;
  for (int64_t b = 0; b < T.nb; ++b) {
    const uint8_t* blk[NR];
    for (int r = 0; r < NR; ++r) blk[r] = row + r * row_bytes + b * kBytes[KIND];
    const int8_t* xb = xg + b * 2048;
    const float* dxb = dxg + b * 64;
    __m256i sums[NR][8];
    if (KIND == kQ6K) {
      // the super-block's 8 code vectors stay in registers while each row in turn takes its
      // int16 sums of 4 vectors less the offset of the codes' 32 (q6_pair_offsets), the scales
      // in the vpmaddwd, and one fmadd: rows_dot's Q6_K integers and fp32 steps
      static_assert(NR == 1, "the AVX2 tiles take one weight row");
      const int16_t* off = reinterpret_cast<const int16_t*>(T.offset) + (g * T.nb + b) * 256;
      const __m256i sc0 = q6_scale16(blk[0], 0), sc1 = q6_scale16(blk[0], 1);
      const __m256 d = _mm256_set1_ps(half_to_float(blk[0] + 208));
      __m256i q[8];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i b1 = load32(blk[0] + 64 * h), b2 = load32(blk[0] + 64 * h + 32);
        const __m256i bh = load32(blk[0] + 128 + 32 * h);
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) q[4 * h + k] = q6_codes(b1, b2, bh, k);
      }
#pragma GCC unroll 8
      for (int m = 0; m < 8; ++m) {
        const int8_t* x = xb + 256 * m;
        const __m256i p0 = _mm256_sub_epi16(pairs4(q, x), load32(off + 32 * m));
        const __m256i p1 = _mm256_sub_epi16(pairs4(q + 4, x + 128), load32(off + 32 * m + 16));
        const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(p0, sc0), _mm256_madd_epi16(p1, sc1));
        _mm256_store_ps(acc[0][m], scaled_sum(_mm256_load_ps(acc[0][m]), sum,
                                              _mm256_mul_ps(d, _mm256_broadcast_ss(dxb + 8 * m))));
      }
    } else {
      const float* bx = T.bx + (g * T.nb + b) * 64;
      for (int r = 0; r < NR; ++r)
        for (int m = 0; m < 8; ++m) sums[r][m] = _mm256_setzero_si256();
      static_assert(NR == 1, "the AVX2 tiles take one weight row");
      const uint8_t* qs = blk[0] + (KIND == kQ4K ? 20 : 52);
      const __m256i hbits = KIND == kQ5K ? load32(blk[0] + 20) : _mm256_setzero_si256();
      for (int v = 0; v < 8; v += 4) {
        const __m256i bits0 = load32(qs + 32 * (v / 2)), bits1 = load32(qs + 32 * (v / 2 + 1));
        const __m256i qq[4] = {q45_codes<KIND>(bits0, hbits, v), q45_codes<KIND>(bits0, hbits, v + 1),
                               q45_codes<KIND>(bits1, hbits, v + 2), q45_codes<KIND>(bits1, hbits, v + 3)};
        dot8_pairs<4>(sums, qq, xb + 32 * v);
      }
      for (int r = 0; r < NR; ++r) {
        __m256 s, mn;
        q45_scales(blk[r], s, mn);
        for (int m = 0; m < 8; ++m) {
          const __m256 a =
              _mm256_fmadd_ps(mn, _mm256_load_ps(bx + 8 * m), _mm256_load_ps(acc[r][m]));
          _mm256_store_ps(acc[r][m], scaled(a, s, sums[r][m], _mm256_broadcast_ss(dxb + 8 * m)));
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < 8; ++m) out[m * ldo + r] = hsum8(_mm256_load_ps(acc[r][m])) + bias[r];
}

#endif

}  // namespace KQ_NS
