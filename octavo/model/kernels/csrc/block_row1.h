// One activation row on int8 activations (a decode's batch of one): idot1, the kernel of each
// AVX build, which gives the bits of idot's MT = 1. Included by block_idot.h (in
// block_linear.cpp's anonymous namespace) after idot; it uses Weights, QuantX, block_scales,
// prefetch_stream, fives8 and hsum8.

#if !defined(__AVX512F__)
#define OCTAVO_IDOT1 1
// One activation row (a decode's batch of one), AVX2 build: idot's arithmetic for MT = 1 in
// the same order (so the same bits as a row of a larger batch), written so that the compiler
// keeps every accumulator in a register (idot's array of them went through the stack on
// every block, a store-to-load chain), and the weights streamed (prefetch_stream). A Q8_0
// LM head of 262,144 x 640 at one thread: see prefetch_stream.
template <int KIND, int NR>
void idot1(const Weights& W, int64_t n0, const QuantX& X, float* out, const float* bias) {
  const int64_t G = W.groups();
  const bool per_block = W.group == 32;
  const int64_t row = W.row_bytes<KIND>();
  const uint8_t* q[NR];
  const uint16_t* sr[NR];
  const uint16_t* mr[NR];
  __m256 acc[NR], macc[NR];
  for (int r = 0; r < NR; ++r) {
    q[r] = W.q + (n0 + r) * row;
    sr[r] = W.scale + (n0 + r) * G;
    mr[r] = KIND == 0 ? W.mins + (n0 + r) * G : nullptr;
    acc[r] = macc[r] = _mm256_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t b0 = 0; b0 < X.nb; b0 += 8) {
    const int64_t cnt = std::min<int64_t>(8, X.nb - b0);
    for (int r = 0; r < NR; ++r) prefetch_stream<KIND>(W, n0 + r, b0, cnt);
    const __m256 dx = _mm256_loadu_ps(X.dx + b0);  // zero past nb (nb_pad)
    alignas(32) float cs[NR][8];
    for (int r = 0; r < NR; ++r) {
      __m256 dw, mw;
      block_scales<KIND>(W, per_block, sr[r], mr[r], b0, cnt, dw, mw);
      if (KIND == 0) macc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(X.xs + b0), macc[r]);
      _mm256_store_ps(cs[r], _mm256_mul_ps(dw, dx));
    }
    for (int64_t i = 0; i < cnt; ++i) {
      const int64_t b = b0 + i;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.q + b * 32));
      const __m256i ax = _mm256_abs_epi8(x);
      for (int r = 0; r < NR; ++r) {
        __m256i p;
        if (KIND == 0) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[r] + b * 16));
          const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
          p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
        } else {  // |x| * sign(w, x) = w * x, as idot's |w| * sign(x, w), pair sums exact
          const __m256i w =
              KIND == 5 ? fives8(q[r] + b * 20)
                        : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + b * 32));
          p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, x)), ones);
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&cs[r][i]), acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    out[r] = hsum8(_mm256_add_ps(acc[r], macc[r])) + (bias != nullptr ? bias[n0 + r] : 0.f);
}
#else
#define OCTAVO_IDOT1 1
// One activation row, AVX-512 build: idot's arithmetic for MT = 1 in the same order (pairs of
// blocks in 512-bit registers, the odd one left in 256 bits, the two folded at the end), so
// the same bits as a row of a larger batch; as the AVX2 build's idot1, the accumulators kept
// in registers and the weights streamed (prefetch_stream). Without it, a decode's one row took
// idot<KIND, 4, 1>, whose accumulator arrays go through the stack: Gemma 3 270M decoded at
// 0.55x llama.cpp's tg128 at one thread on an AVX512-VNNI EPYC.
//
// The 5-bit kind's pairs of blocks are computed on their unsigned codes x = w + 16 (0..31):
// the int32 lanes sum(x * xq) - 16 sum(xq) over each 4 bytes (`c5`, 16 sum(xq) per lane and
// pair of blocks, computed once per call by fives_offsets) are exactly idot's sum(w * xq), with
// neither the sign steps nor the signed unpack (Q5_0 rows ran at half the Q8_0 rows' bytes/s).
template <int KIND, int NR>
void idot1(const Weights& W, int64_t n0, const QuantX& X, float* out, const float* bias,
           const __m512i* c5 = nullptr) {
  const int64_t G = W.groups();
  const bool per_block = W.group == 32;
  const int64_t row = W.row_bytes<KIND>();
  const uint8_t* q[NR];
  const uint16_t* sr[NR];
  const uint16_t* mr[NR];
  __m256 acc[NR], macc[NR];
  __m512 acc512[NR];
  for (int r = 0; r < NR; ++r) {
    q[r] = W.q + (n0 + r) * row;
    sr[r] = W.scale + (n0 + r) * G;
    mr[r] = KIND == 0 ? W.mins + (n0 + r) * G : nullptr;
    acc[r] = macc[r] = _mm256_setzero_ps();
    acc512[r] = _mm512_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m512i ones512 = _mm512_set1_epi16(1);
  const __m512i pair_idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t b0 = 0; b0 < X.nb; b0 += 8) {
    const int64_t cnt = std::min<int64_t>(8, X.nb - b0);
    for (int r = 0; r < NR; ++r) prefetch_stream<KIND>(W, n0 + r, b0, cnt);
    const __m256 dx = _mm256_loadu_ps(X.dx + b0);  // zero past nb (nb_pad)
    alignas(32) float cs[NR][8];
    for (int r = 0; r < NR; ++r) {
      __m256 dw, mw;
      block_scales<KIND>(W, per_block, sr[r], mr[r], b0, cnt, dw, mw);
      if (KIND == 0) macc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(X.xs + b0), macc[r]);
      _mm256_store_ps(cs[r], _mm256_mul_ps(dw, dx));
    }
    int64_t i = 0;
    for (; i + 2 <= cnt; i += 2) {
      const int64_t b = b0 + i;
      const __m512i idx = _mm512_add_epi32(pair_idx, _mm512_set1_epi32(static_cast<int>(i)));
      const __m512i x = _mm512_loadu_si512(X.q + b * 32);
      for (int r = 0; r < NR; ++r) {
        __m512i aw;
        __m512i xq = x;
        if (KIND == 0) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + b * 16));
          const __m256i lo = _mm256_and_si256(raw, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
          const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
          aw = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
        } else if (KIND == 5 && c5 != nullptr) {
          // x = low nibble + 16 * fifth bit, element order [b lo, b hi, b+1 lo, b+1 hi]
          const uint8_t* blk = q[r] + b * 20;
          const __m256i raw = _mm256_set_m128i(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 20)),
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
          const __m256i lo = _mm256_and_si256(raw, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
          const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
          uint32_t h0, h1;
          std::memcpy(&h0, blk + 16, 4);
          std::memcpy(&h1, blk + 36, 4);
          const __mmask64 fifth = _cvtu64_mask64(h0 | static_cast<uint64_t>(h1) << 32);
          const __m512i codes = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
          aw = _mm512_mask_add_epi8(codes, fifth, codes, _mm512_set1_epi8(16));
        } else {
          __m512i w;
          if (KIND == 5) {
            const uint8_t* blk = q[r] + b * 20;
            w = _mm512_inserti64x4(_mm512_castsi256_si512(fives8(blk)), fives8(blk + 20), 1);
          } else {
            w = _mm512_loadu_si512(q[r] + b * 32);
          }
          aw = _mm512_abs_epi8(w);
          xq = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
        }
        __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(aw, xq), ones512);
        if (KIND == 5 && c5 != nullptr) p = _mm512_sub_epi32(p, c5[b / 2]);
        const __m512 sc = _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(_mm256_load_ps(cs[r])));
        acc512[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc512[r]);
      }
    }
    for (; i < cnt; ++i) {
      const int64_t b = b0 + i;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.q + b * 32));
      for (int r = 0; r < NR; ++r) {
        __m256i w;
        if (KIND == 0) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[r] + b * 16));
          w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
        } else if (KIND == 5) {
          w = fives8(q[r] + b * 20);
        } else {
          w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + b * 32));
        }
        const __m256i aw = KIND == 0 ? w : _mm256_abs_epi8(w);
        const __m256i xq = KIND != 0 ? _mm256_sign_epi8(x, w) : x;
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xq), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&cs[r][i]), acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m256 a = _mm256_add_ps(acc[r], _mm256_add_ps(_mm512_castps512_ps256(acc512[r]),
                                                          _mm512_extractf32x8_ps(acc512[r], 1)));
    out[r] = hsum8(_mm256_add_ps(a, macc[r])) + (bias != nullptr ? bias[n0 + r] : 0.f);
  }
}

// idot1's c5 for activation row 0: per pair of blocks (2i, 2i + 1), 16 sum(xq) over each 4
// bytes; out must hold nb / 2 vectors
inline void fives_offsets(const QuantX& X, __m512i* out) {
  const __m512i sixteen = _mm512_set1_epi8(16), ones = _mm512_set1_epi16(1);
  for (int64_t b = 0; b + 2 <= X.nb; b += 2)
    out[b / 2] = _mm512_madd_epi16(
        _mm512_maddubs_epi16(sixteen, _mm512_loadu_si512(X.q + b * 32)), ones);
}
#endif
