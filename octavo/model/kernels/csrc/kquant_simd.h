// The 256-bit integer dot products of K-quant super-blocks (GGUF Q4_K, Q5_K, Q6_K: 256 weights
// each) against activations quantized per 256 to int8 (kquant_linear.cpp's Q8K). Included twice
// by kquant_linear.cpp: as plain AVX2 (namespace kq_avx2), and in the AVX-512 build a second time
// under the avx512vnni target (namespace kq_vnni, chosen at run time where the CPU has it), where
// each 32-weight product is one vpdpbusd instead of vpmaddubsw + vpmaddwd + vpaddd.
//
// Lane order (kquant.py): a super-block's codes are 8 vectors of 32, and each 4-byte lane j of
// every vector holds codes of one sub-block (Q4_K / Q5_K: sub-block j; Q6_K: sub-block j in
// vectors 0-3, 8 + j in vectors 4-7); the activations are permuted the same way per super-block
// (kquant_linear.cpp). So a super-block's integer products sum per lane into the sub-blocks' dot
// products, exact in int32 whatever the order, with no scale in the integer loop; then per
// super-block, in fp32: acc += (-dmin * min_j) * (bsum_j * dx) and acc += (d * scale_j) *
// (dot_j * dx) over the 8 lanes (Q6_K: the two groups of 8 sub-blocks, each dot_j starting from
// -32 * bsum_j for the codes' offset of 32), then one horizontal sum per output. kquant_tile.h
// computes the same operations on the same operands in the same order, so a row's result is the
// same bits in any batch.
// Exactness: a vpmaddubsw pair is at most 2 * 63 * 127 = 16002 (no int16 saturation); a lane's
// sum is at most 32 * 63 * 127 plus the offset, far inside int32.
//
// Needs before inclusion: KQ_NS, KQ_VNNI (0 or 1), struct Q8K, kBytes, half_to_float. The
// super-block layouts are kquant_linear.cpp's (in memory, after kquant.repack).

namespace KQ_NS {

// sumi + the 32 products of q (unsigned codes) and x (int8), summed per 4-byte lane
static inline __m256i dot4(__m256i sumi, __m256i q, __m256i x) {
#if KQ_VNNI
  return _mm256_dpbusd_epi32(sumi, q, x);
#else
  return _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

static inline __m128i load8(const void* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

static inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Q4_K / Q5_K: the super-block's d * scale_j (s) and -dmin * min_j (mn) as fp32 lanes
static inline void q45_scales(const uint8_t* blk, __m256& s, __m256& mn) {
  s = _mm256_mul_ps(_mm256_set1_ps(half_to_float(blk)),
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(blk + 4))));
  mn = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(blk + 2)),
                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(blk + 12))));
}

// Q6_K: d * scale_j of sub-blocks 0-7 (lo) and 8-15 (hi)
static inline void q6_scales(const uint8_t* blk, __m256& lo, __m256& hi) {
  const __m256 d = _mm256_set1_ps(half_to_float(blk + 208));
  lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(blk + 192))));
  hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(blk + 200))));
}

// acc + scale lanes * (the integer lanes * dx)
static inline __m256 scaled(__m256 acc, __m256 s, __m256i sumi, __m256 dx) {
  return _mm256_fmadd_ps(s, _mm256_mul_ps(_mm256_cvtepi32_ps(sumi), dx), acc);
}

// Q4_K / Q5_K: the 8 sums of 32 quantized activations (from the 16 sums of 16) times dx
static inline __m256 q45_bx(const int16_t* bs, __m256 dx) {
  const __m256i s16 = load32(bs);
  const __m128i s32 = _mm_hadd_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(s32)), dx);
}

// Q6_K: a group of 8 sub-blocks' dot products start at -32 * (their sums of 16)
static inline __m256i q6_offset(const int16_t* bs) {
  return _mm256_sub_epi32(_mm256_setzero_si256(),
                          _mm256_slli_epi32(_mm256_cvtepi16_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(bs))), 5));
}

// Q6_K: vector 4h + k (0..7) of a super-block's codes (0..63), from half h's 64 bytes of low
// nibbles (b1: vectors k = 0 and 2, b2: 1 and 3) and 32 bytes of high bit pairs (bh: bits 2k, 2k+1)
static inline __m256i q6_codes(__m256i b1, __m256i b2, __m256i bh, int k) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  const __m256i lo = _mm256_and_si256(k & 2 ? _mm256_srli_epi16(k & 1 ? b2 : b1, 4) : (k & 1 ? b2 : b1), m4);
  const __m256i hi = _mm256_and_si256(bh, _mm256_slli_epi16(m2, 2 * k));
  return _mm256_or_si256(lo, k < 2 ? _mm256_slli_epi16(hi, 4 - 2 * k) : _mm256_srli_epi16(hi, 2 * k - 4));
}

// Q4_K / Q5_K: vector v's 32 codes (Q4_K 0..15, Q5_K 0..31) from the 32 nibble bytes of the
// pair v / 2 (low nibbles: the even vector), and for Q5_K the fifth bits (hbits: bit v of byte
// l is vector v's byte l)
template <int KIND>
static inline __m256i q45_codes(__m256i bits, __m256i hbits, int v) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256i q = _mm256_and_si256(v & 1 ? _mm256_srli_epi16(bits, 4) : bits, m4);
  if (KIND == kQ5K)
    q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(v)),
                                                              _mm256_set1_epi8(1)),
                                             4));
  return q;
}

// rows_dot's set-up of super-block b: the NR weight rows' blocks (blk), and each activation row's
// values (xq), sums of 16 (bs) and dx. A decode's one row streams the weights: one weight row asks
// for the bytes kStreamAhead past this super-block; NR rows read in step are NR short streams,
// which the hardware's prefetcher does not follow (Q4_K from memory, 4 rows: 6.4 GB/s, 11.4 with
// the one-row distance), so each super-block asks, in order, for as many bytes of the group of
// NR rows kAheadGroups groups ahead
template <int KIND, int NR, int MT>
static inline void super_block(const uint8_t* row0, int64_t row_bytes, const Q8K& X, int64_t m0,
                               int64_t b, const uint8_t* (&blk)[NR], const int8_t* (&xq)[MT],
                               const int16_t* (&bs)[MT], __m256 (&dx)[MT]) {
  for (int r = 0; r < NR; ++r) {
    blk[r] = row0 + r * row_bytes + b * kBytes[KIND];
    if (MT == 1 && NR == 1)
      for (int64_t l = 0; l < kBytes[KIND]; l += 64) __builtin_prefetch(blk[r] + kStreamAhead + l, 0, 3);
  }
  if (MT == 1 && NR > 1) {
    const uint8_t* next = row0 + kAheadGroups * NR * row_bytes + b * NR * kBytes[KIND];
    for (int64_t l = 0; l < NR * kBytes[KIND]; l += 64) __builtin_prefetch(next + l, 0, 3);
  }
  for (int m = 0; m < MT; ++m) {
    xq[m] = X.q + (m0 + m) * X.K + b * 256;
    bs[m] = X.bsums + (m0 + m) * (X.K / 16) + b * 16;
    dx[m] = _mm256_set1_ps(X.d[(m0 + m) * X.nb + b]);
  }
}

#if KQ_VNNI
// NR weight rows (row0, row0 + row_bytes, ...) against activation rows m0..m0+MT-1:
// out[m * ldo + r]. Each (weight row, activation row) pair takes exactly the arithmetic of NR = 1
// (so the same bits); NR > 1 shares the activations' loads between weight rows and gives the
// core independent work (a decode's one activation row takes NR = 2 for Q4_K and Q5_K).
template <int KIND, int NR, int MT>
static void rows_dot(const uint8_t* row0, int64_t row_bytes, const Q8K& X, int64_t m0,
                     float* out, int64_t ldo, const float* bias) {
  __m256 acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < X.nb; ++b) {
    const uint8_t* blk[NR];
    const int8_t* xq[MT];
    const int16_t* bs[MT];
    __m256 dx[MT];
    super_block<KIND, NR, MT>(row0, row_bytes, X, m0, b, blk, xq, bs, dx);
    if (KIND == kQ6K) {
      __m256i sums[2][NR][MT];  // sub-blocks 0-7 (vectors 0-3), 8-15 (vectors 4-7)
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < MT; ++m) {
          const __m256i init = q6_offset(bs[m] + 8 * h);
          for (int r = 0; r < NR; ++r) sums[h][r][m] = init;
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
          for (int r = 0; r < NR; ++r)
            for (int m = 0; m < MT; ++m)
              sums[h][r][m] = dot4(sums[h][r][m], q[r][k], load32(xq[m] + 128 * h + 32 * k));
      }
      for (int r = 0; r < NR; ++r) {
        __m256 lo, hi;
        q6_scales(blk[r], lo, hi);
        for (int m = 0; m < MT; ++m) {
          acc[r][m] = scaled(acc[r][m], lo, sums[0][r][m], dx[m]);
          acc[r][m] = scaled(acc[r][m], hi, sums[1][r][m], dx[m]);
        }
      }
    } else {
      // two chains per output (even and odd vectors; the lanes' integer sums are exact in
      // any order): vpdpbusd accumulates, so one chain would wait on each product in turn
      __m256i even[NR][MT], odd[NR][MT];
      for (int r = 0; r < NR; ++r)
        for (int m = 0; m < MT; ++m) even[r][m] = odd[r][m] = _mm256_setzero_si256();
      const uint8_t* qs[NR];
      __m256i hbits[NR];
      for (int r = 0; r < NR; ++r) {
        qs[r] = blk[r] + (KIND == kQ4K ? 20 : 52);
        hbits[r] = KIND == kQ5K ? load32(blk[r] + 20) : _mm256_setzero_si256();
      }
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < NR; ++r) {
          const __m256i bits = load32(qs[r] + 32 * j);
          const __m256i lo = q45_codes<KIND>(bits, hbits[r], 2 * j);
          const __m256i hi = q45_codes<KIND>(bits, hbits[r], 2 * j + 1);
          for (int m = 0; m < MT; ++m) {
            even[r][m] = dot4(even[r][m], lo, load32(xq[m] + 64 * j));
            odd[r][m] = dot4(odd[r][m], hi, load32(xq[m] + 64 * j + 32));
          }
        }
      __m256 bx[MT];
      for (int m = 0; m < MT; ++m) bx[m] = q45_bx(bs[m], dx[m]);
      for (int r = 0; r < NR; ++r) {
        __m256 s, mn;
        q45_scales(blk[r], s, mn);
        for (int m = 0; m < MT; ++m) {
          acc[r][m] = _mm256_fmadd_ps(mn, bx[m], acc[r][m]);
          acc[r][m] = scaled(acc[r][m], s, _mm256_add_epi32(even[r][m], odd[r][m]), dx[m]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) out[m * ldo + r] = hsum8(acc[r][m]) + (bias ? bias[r] : 0.f);
}

#else
// AVX2 (no VNNI): a 32-weight product is vpmaddubsw (int16 pair sums), and the pair sums of
// several vectors are added as int16 before one vpmaddwd (the sums of one lane, one sub-block):
// Q4_K 8 vectors (at most 8 * 2 * 15 * 127 = 30480), Q5_K 4 (31496), Q6_K 2 (32004); the
// activations are -127..127. Q4_K / Q5_K take the fp32 steps described above (the vpmaddwd by
// ones gives dot_j). Q6_K's vpmaddwd takes the sub-block scales, as llama.cpp's AVX2 loops do:
// lane j of the pair sums belongs to sub-block j (vectors 0-3) or 8 + j (4-7), so vpmaddwd by
// (scale, scale) gives, exactly, sum_j = scale_j * (dot_j - 32 bsum_j) + scale_{8+j} *
// (dot_{8+j} - 32 bsum_{8+j}), and the super-block's fp32 steps are one conversion and one
// fmadd: acc += float(sum_j) * (d * dx). kquant_tile.h's AVX2 tiles make the same integers in
// their own order and the same fp32 steps, so a row's result is the same bits in any batch.

// 8 bytes as 16 int16: lane j (two int16) holds byte j twice, zero- or sign-extended
template <bool SIGNED>
static inline __m256i pair16(const uint8_t* p) {
  const __m128i b = _mm_shuffle_epi8(load8(p), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
  return SIGNED ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
}

// Q6_K: the scales of sub-blocks 0-7 (h = 0) or 8-15 (h = 1) as vpmaddwd pairs
static inline __m256i q6_scale16(const uint8_t* blk, int h) { return pair16<true>(blk + 192 + 8 * h); }

// Q6_K: -32 * sum_j scale_j * bsum_j over both halves (bs: the 16 sums of 16), exact
static inline __m256i q6_offset_scaled(const int16_t* bs, __m256i sc0, __m256i sc1) {
  // each sum of 16 zero-extended into its lane's low int16, so vpmaddwd takes it once
  const __m128i* b = reinterpret_cast<const __m128i*>(bs);
  const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(_mm256_cvtepu16_epi32(_mm_loadu_si128(b)), sc0),
                                     _mm256_madd_epi16(_mm256_cvtepu16_epi32(_mm_loadu_si128(b + 1)), sc1));
  return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s, 5));
}

// acc + float(sum) * ddx (ddx = d * dx)
static inline __m256 scaled_sum(__m256 acc, __m256i sum, __m256 ddx) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), ddx, acc);
}

// NR weight rows (row0, row0 + row_bytes, ...) against activation rows m0..m0+MT-1:
// out[m * ldo + r]. Each (weight row, activation row) pair takes exactly the arithmetic of NR = 1
// (so the same bits); NR > 1 shares the activations' loads between weight rows and gives the
// core independent work (a decode's one activation row takes NR = 2 for Q4_K and Q5_K).
template <int KIND, int NR, int MT>
static void rows_dot(const uint8_t* row0, int64_t row_bytes, const Q8K& X, int64_t m0,
                     float* out, int64_t ldo, const float* bias) {
  __m256 acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < X.nb; ++b) {
    const uint8_t* blk[NR];
    const int8_t* xq[MT];
    const int16_t* bs[MT];
    __m256 dx[MT];
    super_block<KIND, NR, MT>(row0, row_bytes, X, m0, b, blk, xq, bs, dx);
    __m256i sum[NR][MT];
    if (KIND == kQ6K) {
      __m256i sc[NR][2];
      for (int r = 0; r < NR; ++r) {
        sc[r][0] = q6_scale16(blk[r], 0), sc[r][1] = q6_scale16(blk[r], 1);
        for (int m = 0; m < MT; ++m) sum[r][m] = q6_offset_scaled(bs[m], sc[r][0], sc[r][1]);
      }
      for (int h = 0; h < 2; ++h) {
        __m256i q[NR][4];
        for (int r = 0; r < NR; ++r) {
          const __m256i b1 = load32(blk[r] + 64 * h), b2 = load32(blk[r] + 64 * h + 32);
          const __m256i bh = load32(blk[r] + 128 + 32 * h);
          for (int k = 0; k < 4; ++k) q[r][k] = q6_codes(b1, b2, bh, k);
        }
        for (int k = 0; k < 4; k += 2)
          for (int r = 0; r < NR; ++r)
            for (int m = 0; m < MT; ++m) {
              const int8_t* x = xq[m] + 128 * h + 32 * k;
              const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(q[r][k], load32(x)),
                                                 _mm256_maddubs_epi16(q[r][k + 1], load32(x + 32)));
              sum[r][m] = _mm256_add_epi32(sum[r][m], _mm256_madd_epi16(p, sc[r][h]));
            }
      }
      for (int r = 0; r < NR; ++r) {
        const __m256 d = _mm256_set1_ps(half_to_float(blk[r] + 208));
        for (int m = 0; m < MT; ++m) acc[r][m] = scaled_sum(acc[r][m], sum[r][m], _mm256_mul_ps(d, dx[m]));
      }
    } else {
      // int16 sums of NV = 8 (Q4_K) or 4 (Q5_K) vectors, then one vpmaddwd by ones: dot_j
      constexpr int NV = KIND == kQ4K ? 8 : 4;
      const __m256i ones = _mm256_set1_epi16(1);
      __m256i p[NR][MT];
      const uint8_t* qs[NR];
      __m256i hbits[NR];
      for (int r = 0; r < NR; ++r) {
        qs[r] = blk[r] + (KIND == kQ4K ? 20 : 52);
        hbits[r] = KIND == kQ5K ? load32(blk[r] + 20) : _mm256_setzero_si256();
        for (int m = 0; m < MT; ++m) sum[r][m] = _mm256_setzero_si256();
      }
      for (int j = 0; j < 4; ++j) {
        for (int r = 0; r < NR; ++r) {
          const __m256i bits = load32(qs[r] + 32 * j);
          const __m256i lo = q45_codes<KIND>(bits, hbits[r], 2 * j);
          const __m256i hi = q45_codes<KIND>(bits, hbits[r], 2 * j + 1);
          for (int m = 0; m < MT; ++m) {
            const __m256i pj = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load32(xq[m] + 64 * j)),
                                                _mm256_maddubs_epi16(hi, load32(xq[m] + 64 * j + 32)));
            p[r][m] = (2 * j) % NV == 0 ? pj : _mm256_add_epi16(p[r][m], pj);
            if ((2 * j + 2) % NV == 0) sum[r][m] = _mm256_add_epi32(sum[r][m], _mm256_madd_epi16(p[r][m], ones));
          }
        }
      }
      __m256 bx[MT];
      for (int m = 0; m < MT; ++m) bx[m] = q45_bx(bs[m], dx[m]);
      for (int r = 0; r < NR; ++r) {
        __m256 s, mn;
        q45_scales(blk[r], s, mn);
        for (int m = 0; m < MT; ++m) {
          acc[r][m] = _mm256_fmadd_ps(mn, bx[m], acc[r][m]);
          acc[r][m] = scaled(acc[r][m], s, sum[r][m], dx[m]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) out[m * ldo + r] = hsum8(acc[r][m]) + (bias ? bias[r] : 0.f);
}

#endif

// One weight row (its super-blocks at `row`) against activation rows m0..m0+MT-1: out[m * ldo]
template <int KIND, int MT>
static void row_dot(const uint8_t* row, const Q8K& X, int64_t m0, float* out, int64_t ldo,
                    float bias) {
  rows_dot<KIND, 1, MT>(row, 0, X, m0, out, ldo, &bias);
}

}  // namespace KQ_NS
