// Prefill-sized batches of K-quant layers: one weight row against a group of 8 activation rows
// whose quantized values, scales and sums kquant_linear.cpp interleaved per super-block (Q8KTile),
// so that every load of the tile's inner loop is one base pointer plus a constant, and the
// per-row scalar work of kquant_simd.h's row_dot (d * dx, -dmin * dx, the sums of 32) is one
// vector multiply per super-block or was done once per call instead of once per weight row.
//
// The result is row_dot<KIND, 8>'s bit for bit: each int32 lane of a super-block's sum holds the
// same products (the same dot_scaled over the same bytes; integer sums are exact in any order),
// and each fp32 accumulator lane takes the same fmadd with the same operands in super-block
// order, then the same horizontal sums. A row's result therefore stays the same whatever batch
// computes it (tests/model/quant/test_kquant.py checks the bits).
//
// Included by kquant_linear.cpp after kquant_simd.h, into the same KQ_NS (dot_scaled, the masks, load32,
// hsum8, hsum4). Needs Q8KTile and kBytes.

namespace KQ_NS {

// sums[m] += the 32 codes q times row m's 32 values at x + 256 m, each pair (quad) times its
// lane's scale: dot_scaled over the tile's 8 rows. In the AVX2 build GCC kept more of the
// unpacked codes and scales live than its 16 vector registers hold and spilled the sums to the
// stack (a store and a reload per product); the assembly keeps the 8 sums, q, sc and one
// temporary in registers. With AVX-512's 32 registers (the VNNI build) the intrinsics do.
static inline void dot8(__m256i (&sums)[8], __m256i q, __m256i sc, const int8_t* x) {
#if KQ_VNNI || !defined(__GNUC__) || defined(__AVX512F__)
  for (int m = 0; m < 8; ++m) sums[m] = dot_scaled(sums[m], q, load32(x + 256 * m), sc);
#else
#define KQ_ROW(M, OFF)                    \
  "vpmaddubsw " OFF "(%[x]), %[q], %[t]\n\t" \
  "vpmaddwd %[sc], %[t], %[t]\n\t"         \
  "vpaddd %[t], %[s" M "], %[s" M "]\n\t"
  __m256i t;
  __asm__(KQ_ROW("0", "0") KQ_ROW("1", "256") KQ_ROW("2", "512") KQ_ROW("3", "768")
              KQ_ROW("4", "1024") KQ_ROW("5", "1280") KQ_ROW("6", "1536") KQ_ROW("7", "1792")
          : [s0] "+x"(sums[0]), [s1] "+x"(sums[1]), [s2] "+x"(sums[2]), [s3] "+x"(sums[3]),
            [s4] "+x"(sums[4]), [s5] "+x"(sums[5]), [s6] "+x"(sums[6]), [s7] "+x"(sums[7]),
            [t] "=&x"(t)
          : [x] "r"(x), [q] "x"(q), [sc] "x"(sc),
            "m"(*reinterpret_cast<const int8_t(*)[7 * 256 + 32]>(x)));
#undef KQ_ROW
#endif
}

// The group's per-super-block data as stored: values [nb][8][256], dx [nb][8], and the sums the
// format needs, [nb][8][8] sums of 32 (Q4_K / Q5_K) or [nb][8][16] sums of 16 (Q6_K)
template <int KIND>
static void tile_dot(const uint8_t* row, const Q8KTile& T, int64_t g, float* out, int64_t ldo,
                     float bias) {
  constexpr int kSums = KIND == kQ6K ? 16 : 8;
  alignas(32) float acc[8][8];
  alignas(32) float accm[4][8];  // the mins' 4 lanes of rows 2p (low half) and 2p + 1 (high)
  alignas(32) float dd[8];
  for (int m = 0; m < 8; ++m) {
    _mm256_store_ps(acc[m], _mm256_setzero_ps());
    _mm256_store_ps(accm[m / 2], _mm256_setzero_ps());
  }
  const int8_t* xg = T.q + g * T.nb * 2048;
  const float* dxg = T.d + g * T.nb * 8;
  const int16_t* sg = T.sums + g * T.nb * 8 * kSums;
  for (int64_t b = 0; b < T.nb; ++b) {
    const uint8_t* blk = row + b * kBytes[KIND];
    const int8_t* xb = xg + b * 2048;
    const __m256 dxv = _mm256_loadu_ps(dxg + b * 8);
    const int16_t* sb = sg + b * 8 * kSums;
    __m256i sumi[8];
    if (KIND == kQ6K) {
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      _mm256_store_ps(dd, _mm256_mul_ps(_mm256_set1_ps(half_to_float(blk + 208)), dxv));
      const __m256i sc16 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      for (int m = 0; m < 8; ++m)  // the codes' -32: 32 * sum(scale_s * sum of xq in s)
        sumi[m] = _mm256_sub_epi32(
            _mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, load32(sb + 16 * m)), 5));
      const __m256i halves[2] = {_mm256_permute4x64_epi64(sc16, 0x44),
                                 _mm256_permute4x64_epi64(sc16, 0xEE)};
      for (int h = 0; h < 2; ++h) {
        const __m256i b1 = load32(ql + 64 * h), b2 = load32(ql + 64 * h + 32);
        const __m256i bh = load32(qh + 32 * h);
        for (int k = 0; k < 4; ++k) {
          const __m256i q = q6_codes(b1, b2, bh, k);
          const __m256i sc = _mm256_shuffle_epi8(halves[h], mask(kMask6[k]));
          dot8(sumi, q, sc, xb + 128 * h + 32 * k);
        }
      }
    } else {
      const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
      _mm256_store_ps(dd, _mm256_mul_ps(_mm256_set1_ps(d), dxv));
      const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(-dmin), dxv);
      const __m128i sc8 =
          _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 4)));
      const __m256i mn16 = _mm256_broadcastsi128_si256(
          _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 12))));
      for (int p = 0; p < 4; ++p) {  // rows 2p and 2p + 1: their sums of 32 are adjacent
        const __m256i lanes = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1,
                                                2 * p + 1, 2 * p + 1);
        const __m256 mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(mn16, load32(sb + 16 * p)));
        _mm256_store_ps(accm[p], _mm256_fmadd_ps(_mm256_permutevar8x32_ps(dm, lanes), mins,
                                                 _mm256_load_ps(accm[p])));
      }
      for (int m = 0; m < 8; ++m) sumi[m] = _mm256_setzero_si256();
      const __m256i src = _mm256_set_m128i(sc8, sc8);
      const uint8_t* qs = blk + (KIND == kQ4K ? 20 : 52);
      __m256i hbits = _mm256_setzero_si256();
      if (KIND == kQ5K) hbits = load32(blk + 20);
      for (int j = 0; j < 4; ++j) {
        const __m256i bits = load32(qs + 32 * j);
        for (int half = 0; half < 2; ++half) {
          const __m256i q = q45_codes<KIND>(bits, hbits, 2 * j + half);
          const __m256i sc = _mm256_shuffle_epi8(src, mask(kMask4[2 * j + half]));
          dot8(sumi, q, sc, xb + 64 * j + 32 * half);
        }
      }
    }
    for (int m = 0; m < 8; ++m)
      _mm256_store_ps(acc[m], _mm256_fmadd_ps(_mm256_broadcast_ss(dd + m),
                                              _mm256_cvtepi32_ps(sumi[m]),
                                              _mm256_load_ps(acc[m])));
  }
  for (int m = 0; m < 8; ++m)
    out[m * ldo] =
        hsum8(_mm256_load_ps(acc[m])) + hsum4(_mm_load_ps(accm[m / 2] + 4 * (m % 2))) + bias;
}

}  // namespace KQ_NS
