// Activations as the K-quant kernels take them (kquant_linear.cpp): each row quantized per 256
// to int8 as llama.cpp's Q8_K (one fp32 scale per 256 and the sums of every 16 quantized values,
// which the formats' mins and Q6_K's offset need), and the groups of 8 rows kquant_tile.h reads.
// Included by kquant_linear.cpp into its anonymous namespace (needs kquant_codes.h).

using kquant::lane_weight;

// activations quantized per 256: x ~ q * d
struct Q8K {
  int64_t K, nb;         // per row: values, super-blocks
  const int8_t* q;       // [M, K], each super-block in lane order on the SIMD paths
  const float* d;        // [M, nb]
  const int16_t* bsums;  // [M, K / 16]: sums of every 16 q
};

// Full groups of 8 activation rows interleaved per super-block for kquant_tile.h: values in lane
// order, on the VNNI path [G][nb][8 vectors][8 rows][32] (one 64-byte load holds two rows'
// vector v), on the AVX2 path [G][nb][8 rows][256] (its tile reads each row's vectors in turn;
// the VNNI order made it 0.7x as fast); dx [G][nb][8][8] (each row's dx 8 times); Q4_K / Q5_K bx [G][nb][8][8], each sub-block's sum of 32
// values times dx (the same fp32 product rows_dot takes); Q6_K offset [G][nb][128 x 4 bytes]:
// VNNI [2][8][8] int32, -32 times each sub-block's sum of 16 (half h: 8h..8h+7); AVX2 [8][2][16]
// int16, q6_pair_offsets
struct Q8KTile {
  int64_t nb;
  const int8_t* q;
  const float* d;
  const float* bx;
  const int32_t* offset;
};

// Q6_K on the AVX2 tiles: for each half h of a super-block's 256 values in lane order (x) and
// each int16 lane i of a vector, 32 * the sum over the half's 4 vectors of the pair x[2i],
// x[2i + 1]: what vpmaddubsw would give for codes of 32, subtracted from the codes' int16 sums
// (at most 4 * 2 * 32 * 127 = 32512)
inline void q6_pair_offsets(const int8_t* x, int16_t* out) {
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 16; ++i) {
      int s = 0;
      for (int v = 4 * h; v < 4 * h + 4; ++v) s += x[32 * v + 2 * i] + x[32 * v + 2 * i + 1];
      out[16 * h + i] = static_cast<int16_t>(32 * s);
    }
}


// one row quantized per 256; lanes: each super-block's values in the lane order of that kind
// (kquant_codes.h; the sums of 16 stay in weight order), or 0 for weight order
// (the SIMD forms compute the same values: the max is exact in any order, each product is the
// same fp32 multiply, and cvtps rounds to nearest even as nearbyint does in the default mode)
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int16_t* bsums, int lanes) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* xb = x + b * 256;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_setzero_ps();
    for (int j = 0; j < 256; j += 16)
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xb + j)));
    const float amax = _mm512_reduce_max_ps(vmax);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int g = 0; g < 16; ++g) {
      const __m512i v =
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * g), _mm512_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 256 + 16 * g), _mm512_cvtepi32_epi8(v));
      bsums[b * 16 + g] = static_cast<int16_t>(_mm512_reduce_add_epi32(v));
    }
#elif defined(__AVX2__)
    __m256 vmax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int j = 0; j < 256; j += 8)
      vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
    alignas(32) float m8[8];
    _mm256_store_ps(m8, vmax);
    float amax = 0.f;
    for (float v : m8) amax = std::max(amax, v);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int g = 0; g < 16; ++g) {
      const __m256 vi = _mm256_set1_ps(inv);
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * g), vi));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * g + 8), vi));
      const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);  // 16 x int16
      const __m128i b8 = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 256 + 16 * g), b8);
      const __m256i s8 = _mm256_add_epi32(lo, hi);
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      const __m128i s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1));
      bsums[b * 16 + g] = static_cast<int16_t>(_mm_cvtsi128_si32(s1));
    }
#else
    float amax = 0.f;
    for (int j = 0; j < 256; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int j = 0; j < 256; ++j)
      q[b * 256 + j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += q[b * 256 + g * 16 + j];
      bsums[b * 16 + g] = static_cast<int16_t>(sum);
    }
#endif
    d[b] = amax / 127.f;
    if (lanes) {
      int8_t w[256];
      std::memcpy(w, q + b * 256, 256);
      for (int p = 0; p < 256; p += 4) std::memcpy(q + b * 256 + p, w + lane_weight(lanes, p), 4);
    }
  }
}
