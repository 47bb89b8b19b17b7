// Prefill-sized batches of K-quant layers: one weight row against a group of 8 activation rows
// whose quantized values (in lane order), dx and per-super-block terms kquant_linear.cpp
// interleaved per super-block (Q8KTile), so that every load of the tile's inner loop is one base
// pointer plus a constant, and the per-row work of kquant_simd.h's rows_dot that does not depend
// on the weights (the mins' bsum_j * dx, Q6_K's -32 * bsum_j) was done once per call instead of
// once per weight row.
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

// sums[r][m] += the 32 codes q[r] times row m's 32 values at x + 256 m, per 4-byte lane: each
// activation load serves NR weight rows
template <int NR>
static inline void dot8(__m256i (&sums)[NR][8], const __m256i (&q)[NR], const int8_t* x) {
  for (int m = 0; m < 8; ++m) {
    const __m256i xm = load32(x + 256 * m);
    for (int r = 0; r < NR; ++r) sums[r][m] = dot4(sums[r][m], q[r], xm);
  }
}

#if !KQ_VNNI
// AVX2: sums[m] += NV vectors' products with row m's values at x + 256 m + 32 i, their
// vpmaddubsw pair sums added as int16 and widened once (vpmaddwd by ones): 3 NV instructions
// become 2 NV + 1 per row. Every vector's lane j belongs to the same sub-block, so the int16
// sums stay per lane; they cannot wrap: a pair is at most 2 * 15 * 127 = 3810 for Q4_K (4 of
// them 15240), 2 * 31 * 127 = 7874 for Q5_K (31496), 2 * 63 * 127 = 16002 for Q6_K (NV = 2:
// 32004), and the activations are -127..127
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
#endif

// NR weight rows (row, row + row_bytes, ...) against the group's 8 activation rows:
// out[m * ldo + r]. The group's per-super-block data as stored: values [nb][8][256], dx [nb][8],
// and the format's per-row terms: Q4_K / Q5_K [nb][8][8] fp32 bsum_j * dx; Q6_K [nb][8][16]
// int32 -32 * bsum_j. NR = 2 (the VNNI build, whose 32 registers hold 16 sums) halves the
// activations' reads per product: at K = 8960 a group's 70 KB is read from L2, not L1.
template <int KIND, int NR>
static void tile_dot(const uint8_t* row, int64_t row_bytes, const Q8KTile& T, int64_t g,
                     float* out, int64_t ldo, const float* bias) {
  alignas(32) float acc[NR][8][8];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < 8; ++m) _mm256_store_ps(acc[r][m], _mm256_setzero_ps());
  const int8_t* xg = T.q + g * T.nb * 2048;
  const float* dxg = T.d + g * T.nb * 8;
  for (int64_t b = 0; b < T.nb; ++b) {
    const uint8_t* blk[NR];
    for (int r = 0; r < NR; ++r) blk[r] = row + r * row_bytes + b * kBytes[KIND];
    const int8_t* xb = xg + b * 2048;
    const float* dxb = dxg + b * 8;
    __m256i sums[NR][8];
    [[maybe_unused]] __m256i q[NR];
    if (KIND == kQ6K) {
      const int32_t* off = T.offset + (g * T.nb + b) * 128;
      __m256 sc[NR][2];
      for (int r = 0; r < NR; ++r) q6_scales(blk[r], sc[r][0], sc[r][1]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        for (int m = 0; m < 8; ++m) {
          const __m256i init = load32(off + 16 * m + 8 * h);
          for (int r = 0; r < NR; ++r) sums[r][m] = init;
        }
#if KQ_VNNI
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          for (int r = 0; r < NR; ++r)
            q[r] = q6_codes(load32(blk[r] + 64 * h), load32(blk[r] + 64 * h + 32),
                            load32(blk[r] + 128 + 32 * h), k);
          dot8<NR>(sums, q, xb + 128 * h + 32 * k);
        }
#else
        static_assert(NR == 1, "the AVX2 tiles take one weight row");
        const __m256i b1 = load32(blk[0] + 64 * h), b2 = load32(blk[0] + 64 * h + 32);
        const __m256i bh = load32(blk[0] + 128 + 32 * h);
        for (int k = 0; k < 4; k += 2) {
          const __m256i qq[2] = {q6_codes(b1, b2, bh, k), q6_codes(b1, b2, bh, k + 1)};
          dot8_pairs<2>(sums, qq, xb + 128 * h + 32 * k);
        }
#endif
        for (int r = 0; r < NR; ++r)
          for (int m = 0; m < 8; ++m)
            _mm256_store_ps(acc[r][m], scaled(_mm256_load_ps(acc[r][m]), sc[r][h], sums[r][m],
                                              _mm256_broadcast_ss(dxb + m)));
      }
    } else {
      const float* bx = T.bx + (g * T.nb + b) * 64;
      for (int r = 0; r < NR; ++r)
        for (int m = 0; m < 8; ++m) sums[r][m] = _mm256_setzero_si256();
#if KQ_VNNI
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        for (int r = 0; r < NR; ++r) {
          const uint8_t* qs = blk[r] + (KIND == kQ4K ? 20 : 52);
          const __m256i hbits = KIND == kQ5K ? load32(blk[r] + 20) : _mm256_setzero_si256();
          q[r] = q45_codes<KIND>(load32(qs + 32 * (v / 2)), hbits, v);
        }
        dot8<NR>(sums, q, xb + 32 * v);
      }
#else
      static_assert(NR == 1, "the AVX2 tiles take one weight row");
      const uint8_t* qs = blk[0] + (KIND == kQ4K ? 20 : 52);
      const __m256i hbits = KIND == kQ5K ? load32(blk[0] + 20) : _mm256_setzero_si256();
      for (int v = 0; v < 8; v += 4) {
        const __m256i bits0 = load32(qs + 32 * (v / 2)), bits1 = load32(qs + 32 * (v / 2 + 1));
        const __m256i qq[4] = {q45_codes<KIND>(bits0, hbits, v), q45_codes<KIND>(bits0, hbits, v + 1),
                               q45_codes<KIND>(bits1, hbits, v + 2), q45_codes<KIND>(bits1, hbits, v + 3)};
        dot8_pairs<4>(sums, qq, xb + 32 * v);
      }
#endif
      for (int r = 0; r < NR; ++r) {
        __m256 s, mn;
        q45_scales(blk[r], s, mn);
        for (int m = 0; m < 8; ++m) {
          const __m256 a =
              _mm256_fmadd_ps(mn, _mm256_load_ps(bx + 8 * m), _mm256_load_ps(acc[r][m]));
          _mm256_store_ps(acc[r][m], scaled(a, s, sums[r][m], _mm256_broadcast_ss(dxb + m)));
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < 8; ++m) out[m * ldo + r] = hsum8(_mm256_load_ps(acc[r][m])) + bias[r];
}

}  // namespace KQ_NS
