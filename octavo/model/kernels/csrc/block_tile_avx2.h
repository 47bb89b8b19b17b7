// Prefill-sized batches of the 32-weight formats on int8 activations, AVX2 build: block_tile.h's
// layout on 256-bit registers without VNNI. 8 weight rows per vector (one per int32 lane),
// vector v of a block holding bytes 4v..4v+3 of each row's block; 4 activation bytes broadcast
// against them per vpmaddubsw, whose first operand must be unsigned:
//   - the 4-bit kind's codes (0..15) and the 5-bit kind's x = w + 16 (0..31) are unsigned: their
//     int16 pair sums (at most 2 * 31 * 127) add over 4 vectors (8 for the 4-bit codes) before
//     one vpmaddwd widens them, and the 5-bit kind's sums start at -16 sum(xq);
//   - Q8_0's signed bytes go as |w| against sign(xq, w), one vpmaddwd per vector (a pair sum
//     reaches 2 * 128 * 127, so two of them could wrap).
// Each lane then holds a block's exact integer dot product for its row, and the fp32 step is
// block_tile.h's: acc += float(sum) * (dw * dx) (+ mw * xs), 8 rows' outputs stored at once.
// The activations are quantize_x's (the same xq, dx and xs as the register kernels).
//
// Included by block_linear.cpp in its anonymous namespace after Weights, QuantX, quantize_x,
// with_kind, block_values, unpack_lanes and half_to_float, into BLOCK_TILE_AVX2_NS: the AVX2 build's `tiles`,
// and the AVX-512 build's `tiles_avx2`, which its `tiles` take on a CPU without avx512_vnni
// (every AVX-512 CPU runs vpmaddubsw).

namespace BLOCK_TILE_AVX2_NS {

constexpr int kLanes = 8;         // weight rows per vector
constexpr int kMT = 4;            // activation rows per tile
constexpr int64_t kChunk = 64;    // weight rows unpacked at a time (whole groups)
constexpr int64_t kMinRows = 17;  // below: the register kernels (SMALL_BATCH in block_quant.py)

bool available() { return true; }

struct Acts {
  std::unique_ptr<int8_t[]> q;    // [M][K] xq
  std::unique_ptr<float[]> d;     // [2][M][nb_pad]: dx, then dx * sum(xq)
  std::unique_ptr<int32_t[]> s16;  // [M][nb]: -16 * sum(xq) (the 5-bit kind's start)
  int64_t nb, nb_pad;
  const float* dx(int64_t m) const { return d.get() + m * nb_pad; }
  const float* xs(int64_t m, int64_t M) const { return d.get() + (M + m) * nb_pad; }
};

Acts quantize(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / 32, nb_pad = (nb + 7) / 8 * 8;
  Acts A{std::make_unique_for_overwrite<int8_t[]>(M * K),
         std::make_unique<float[]>(2 * M * nb_pad),
         std::make_unique_for_overwrite<int32_t[]>(M * nb), nb, nb_pad};
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* q = A.q.get() + m * K;
      quantize_x(x + m * K, K, q, A.d.get() + m * nb_pad, A.d.get() + (M + m) * nb_pad);
      for (int64_t b = 0; b < nb; ++b) {
        int32_t sum = 0;
        for (int j = 0; j < 32; ++j) sum += q[b * 32 + j];
        A.s16[m * nb + b] = -16 * sum;
      }
    }
  });
  return A;
}

// weight rows [n0, n0 + rows) in groups of 8 (unpack_lanes): the 4-bit codes, the 5-bit
// x = w + 16 (vpmaddubsw's unsigned operand), Q8_0's signed bytes
template <int KIND>
void unpack(const Weights& W, int64_t n0, int64_t rows, uint8_t* q, float* dw, float* mw) {
  unpack_lanes<KIND, kLanes>(W, n0, rows, q, dw, mw, [](int8_t* w, int64_t) {
    if (KIND == 5)
      for (int j = 0; j < 32; ++j) w[j] = static_cast<int8_t>(w[j] + 16);
  });
}

// one group of 8 unpacked weight rows x MT activation rows, every block: 8 consecutive outputs
// per activation row (stored up to `valid` rows)
template <int KIND, int MT>
inline void tile(const uint8_t* wq, const float* dw, const float* mw, const Acts& A, int64_t M,
                 int64_t m0, int64_t K, float* out, int64_t ldo, int64_t valid,
                 const float* bias) {
  const int64_t nb = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xb = A.q.get() + m0 * K + b * 32;
    const uint8_t* wb = wq + b * 256;
    __m256i sums[MT];
    if (KIND == 1) {
      for (int m = 0; m < MT; ++m) sums[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + 32 * v));
        const __m256i aw = _mm256_abs_epi8(w);
        for (int m = 0; m < MT; ++m) {
          int32_t four;
          std::memcpy(&four, xb + m * K + 4 * v, 4);
          const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(four), w);
          sums[m] = _mm256_add_epi32(sums[m],
                                     _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones));
        }
      }
    } else {
      for (int m = 0; m < MT; ++m)
        sums[m] = KIND == 5 ? _mm256_set1_epi32(A.s16[(m0 + m) * nb + b]) : _mm256_setzero_si256();
      constexpr int kRun = KIND == 5 ? 4 : 8;  // vectors whose int16 pair sums add unwrapped
#pragma GCC unroll 2
      for (int v0 = 0; v0 < 8; v0 += kRun) {
        __m256i s16[MT];
        for (int m = 0; m < MT; ++m) s16[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int v = v0; v < v0 + kRun; ++v) {
          const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + 32 * v));
          for (int m = 0; m < MT; ++m) {
            int32_t four;
            std::memcpy(&four, xb + m * K + 4 * v, 4);
            s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(w, _mm256_set1_epi32(four)));
          }
        }
        for (int m = 0; m < MT; ++m)
          sums[m] = _mm256_add_epi32(sums[m], _mm256_madd_epi16(s16[m], ones));
      }
    }
    const __m256 d = _mm256_loadu_ps(dw + b * kLanes);
    for (int m = 0; m < MT; ++m) {
      const __m256 cs = _mm256_mul_ps(d, _mm256_set1_ps(A.dx(m0 + m)[b]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[m]), cs, acc[m]);
      if (KIND == 0)
        acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(mw + b * kLanes),
                                 _mm256_set1_ps(A.xs(m0 + m, M)[b]), acc[m]);
    }
  }
  const int n = static_cast<int>(std::min<int64_t>(kLanes, valid));
  alignas(32) int32_t keep[8];
  for (int i = 0; i < 8; ++i) keep[i] = i < n ? -1 : 0;
  const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(keep));
  const __m256 bv = bias != nullptr ? _mm256_maskload_ps(bias, mask) : _mm256_setzero_ps();
  for (int m = 0; m < MT; ++m)
    _mm256_maskstore_ps(out + m * ldo, mask, _mm256_add_ps(acc[m], bv));
}

// x [M, K] fp32 -> out [M, N]; W.group must be 32
void run(const Weights& W, const float* x, int64_t M, int64_t N, float* out, const float* bias) {
  const int64_t K = W.K, nb = K / 32, per_group = nb * kLanes;
  const Acts A = quantize(x, M, K);
  at::parallel_for(0, (N + kChunk - 1) / kChunk, 1, [&](int64_t c_begin, int64_t c_end) {
    constexpr int64_t groups = kChunk / kLanes;
    auto q = std::unique_ptr<uint8_t[], void (*)(void*)>(
        static_cast<uint8_t*>(std::aligned_alloc(32, groups * nb * 256)), std::free);
    auto dw = std::make_unique_for_overwrite<float[]>(groups * per_group);
    auto mw = std::make_unique_for_overwrite<float[]>(W.kind == 0 ? groups * per_group : 1);
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t n0 = c * kChunk, rows_here = std::min(kChunk, N - n0);
      with_kind(W, [&](auto kind) {
        constexpr int KIND = decltype(kind)::value;
        unpack<KIND>(W, n0, rows_here, q.get(), dw.get(), mw.get());
        for (int64_t g = 0; g * kLanes < rows_here; ++g) {
          const int64_t first = g * kLanes, at = g * per_group;
          const uint8_t* wq = q.get() + g * nb * 256;
          const float* mwp = KIND == 0 ? mw.get() + at : nullptr;
          const float* bp = bias != nullptr ? bias + n0 + first : nullptr;
          float* o = out + n0 + first;
          int64_t m = 0;
          for (; m + kMT <= M; m += kMT)
            tile<KIND, kMT>(wq, dw.get() + at, mwp, A, M, m, K, o + m * N, N,
                            rows_here - first, bp);
          for (; m < M; ++m)
            tile<KIND, 1>(wq, dw.get() + at, mwp, A, M, m, K, o + m * N, N, rows_here - first,
                          bp);
        }
      });
    }
  });
}

}  // namespace BLOCK_TILE_AVX2_NS
