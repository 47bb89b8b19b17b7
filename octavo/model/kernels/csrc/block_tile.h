// Prefill-sized batches of the 32-weight formats on int8 activations (GGUF's Q8_0, Q5_0, Q4_0,
// Q4_1), AVX-512 VNNI: integer products per block of 32, vpdpbusd 64 at a time.
//
// The layout is chosen for the instruction, per call (the file's blocks stay as they are): a
// weight row per int32 lane. Per group of 16 weight rows and block of 32, vector v (0..7) holds
// bytes 4v..4v+3 of each row's block in that row's lane; one vpdpbusd takes 4 activation bytes,
// broadcast, against them, and eight leave in each lane the block's whole integer dot product
// for that row. The fp32 step comes once per block and (16 rows, activation row):
// acc += float(sum) * (dw * dx), plus the 4-bit kind's min term mw * xs; the 16 lanes are 16
// consecutive outputs of the activation row, stored at once, with no horizontal sum (a first
// layout with a block per lane spent as much on those sums as on the products at K = 640).
// The activations are quantized per block of 32 as quantize_x quantizes them (the same xq, dx
// and xs), written as unsigned xq + 128, with the weights' signed bytes as vpdpbusd's second
// operand; each block's sums start at -128 * sum(w), so they are sum(w * xq) exactly. Weight
// rows are unpacked into that layout 64 at a time, per thread, into a reused buffer (an unpack
// per weight row and call, shared by every activation row).
//
// Against the register kernels (idot, idot1) a row's integer sums are the same; only the order
// of the fp32 sums differs, as it did for the widened tiles + GEMM this path replaces.
//
// Included by block_linear.cpp in its anonymous namespace, AVX-512 build, after Weights,
// with_kind, block_values, unpack_lanes and half_to_float; the build's `tiles` take these where the CPU has
// avx512_vnni and block_tile_avx2.h's otherwise.

#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")

namespace tiles_vnni {

constexpr int kLanes = 16;        // weight rows per vector (one per int32 lane)
constexpr int kG = 2, kMT = 4;    // 16-row groups x activation rows per tile
constexpr int64_t kChunk = 64;    // weight rows unpacked at a time (whole groups)
constexpr int64_t kMinRows = 17;  // below: the register kernels (SMALL_BATCH in block_quant.py)

bool available() {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  return vnni;
}

// activation rows quantized per block of 32: quantize_x's xq (+ 128, vpdpbusd's unsigned
// operand), dx and xs
struct Acts {
  std::unique_ptr<uint8_t[]> q;  // [M][K]
  std::unique_ptr<float[]> dx;   // [M][nb]
  std::unique_ptr<float[]> xs;   // [M][nb]: dx * sum(xq)
};

Acts quantize(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  Acts A{std::make_unique_for_overwrite<uint8_t[]>(M * K),
         std::make_unique_for_overwrite<float[]>(M * nb),
         std::make_unique_for_overwrite<float[]>(M * nb)};
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    const __m128i flip = _mm_set1_epi8(-128);
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + m * K + b * 32;
        const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        // quantize_x's operations: inv = 127 / amax, xq = nearbyint(x * inv), dx = amax / 127
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        const __m512 sv = _mm512_set1_ps(inv);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(lo, sv));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(hi, sv));
        uint8_t* qb = A.q.get() + m * K + b * 32;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb),
                         _mm_xor_si128(_mm512_cvtepi32_epi8(q0), flip));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16),
                         _mm_xor_si128(_mm512_cvtepi32_epi8(q1), flip));
        const float d = amax / 127.f;
        A.dx[m * nb + b] = d;
        A.xs[m * nb + b] = d * static_cast<float>(
            _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      }
  });
  return A;
}

// weight rows [n0, n0 + rows) in groups of 16 (unpack_lanes), and per lane -128 * the block's
// byte sum (where its sums start). The signed bytes are the 4-bit kind's codes 0..15 and the
// 5-bit kind's x - 16; rows past the end zero.
template <int KIND>
void unpack(const Weights& W, int64_t n0, int64_t rows, uint8_t* q, int32_t* start, float* dw,
            float* mw) {
  std::memset(start, 0, (rows + kLanes - 1) / kLanes * (W.K / 32) * kLanes * sizeof(int32_t));
  unpack_lanes<KIND, kLanes>(W, n0, rows, q, dw, mw, [start](const int8_t* w, int64_t at) {
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) sum += w[j];
    start[at] = -128 * sum;
  });
}

// G groups of 16 unpacked weight rows x MT activation rows, every block; the 16 results of a
// group and activation row are 16 consecutive outputs (stored up to `valid` rows)
template <int KIND, int G, int MT>
inline void tile(const uint8_t* wq, const int32_t* start, const float* dw, const float* mw,
                 const Acts& A, int64_t m0, int64_t K, float* out, int64_t ldo, int64_t valid,
                 const float* bias) {
  const int64_t nb = K / 32;
  __m512 acc[G][MT];
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MT; ++m) acc[g][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i sums[G][MT];
    for (int g = 0; g < G; ++g) {
      const __m512i init = _mm512_loadu_si512(start + (g * nb + b) * kLanes);
      for (int m = 0; m < MT; ++m) sums[g][m] = init;
    }
    const uint8_t* xb = A.q.get() + m0 * K + b * 32;
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
      __m512i w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm512_loadu_si512(wq + (g * nb + b) * 512 + 64 * v);
      for (int m = 0; m < MT; ++m) {
        int32_t four;
        std::memcpy(&four, xb + m * K + 4 * v, 4);
        const __m512i x = _mm512_set1_epi32(four);
        for (int g = 0; g < G; ++g) sums[g][m] = _mm512_dpbusd_epi32(sums[g][m], x, w[g]);
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m512 dx = _mm512_set1_ps(A.dx[(m0 + m) * nb + b]);
      for (int g = 0; g < G; ++g) {
        const int64_t at = (g * nb + b) * kLanes;
        const __m512 cs = _mm512_mul_ps(_mm512_loadu_ps(dw + at), dx);
        acc[g][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[g][m]), cs, acc[g][m]);
        if (KIND == 0)
          acc[g][m] = _mm512_fmadd_ps(_mm512_loadu_ps(mw + at),
                                      _mm512_set1_ps(A.xs[(m0 + m) * nb + b]), acc[g][m]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t n = std::min<int64_t>(kLanes, valid - g * kLanes);
    if (n <= 0) break;
    const __mmask16 k = static_cast<__mmask16>((1u << n) - 1);
    const __m512 bv =
        bias != nullptr ? _mm512_maskz_loadu_ps(k, bias + g * kLanes) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m)
      _mm512_mask_storeu_ps(out + m * ldo + g * kLanes, k, _mm512_add_ps(acc[g][m], bv));
  }
}

template <int KIND, int G>
void rows(const uint8_t* wq, const int32_t* start, const float* dw, const float* mw,
          const Acts& A, int64_t M, int64_t K, float* out, int64_t N, int64_t valid,
          const float* bias) {
  int64_t m = 0;
  for (; m + kMT <= M; m += kMT)
    tile<KIND, G, kMT>(wq, start, dw, mw, A, m, K, out + m * N, N, valid, bias);
  for (; m < M; ++m) tile<KIND, G, 1>(wq, start, dw, mw, A, m, K, out + m * N, N, valid, bias);
}

// x [M, K] fp32 -> out [M, N]; W.group must be 32
void run(const Weights& W, const float* x, int64_t M, int64_t N, float* out, const float* bias) {
  const int64_t K = W.K, nb = K / 32, per_group = nb * kLanes;
  const Acts A = quantize(x, M, K);
  at::parallel_for(0, (N + kChunk - 1) / kChunk, 1, [&](int64_t c_begin, int64_t c_end) {
    constexpr int64_t groups = kChunk / kLanes;
    auto q = std::make_unique_for_overwrite<uint8_t[]>(groups * nb * 512);
    auto start = std::make_unique_for_overwrite<int32_t[]>(groups * per_group);
    auto dw = std::make_unique_for_overwrite<float[]>(groups * per_group);
    auto mw = std::make_unique_for_overwrite<float[]>(W.kind == 0 ? groups * per_group : 1);
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t n0 = c * kChunk, rows_here = std::min(kChunk, N - n0);
      with_kind(W, [&](auto kind) {
        constexpr int KIND = decltype(kind)::value;
        unpack<KIND>(W, n0, rows_here, q.get(), start.get(), dw.get(), mw.get());
        const int64_t used = (rows_here + kLanes - 1) / kLanes;
        int64_t g = 0;
        for (; g < used; g += (g + kG <= used ? kG : 1)) {
          const int64_t at = g * per_group, first = g * kLanes;
          const float* mwp = KIND == 0 ? mw.get() + at : nullptr;
          const float* bp = bias != nullptr ? bias + n0 + first : nullptr;
          if (g + kG <= used)
            rows<KIND, kG>(q.get() + g * nb * 512, start.get() + at, dw.get() + at, mwp, A, M, K,
                           out + n0 + first, N, rows_here - first, bp);
          else
            rows<KIND, 1>(q.get() + g * nb * 512, start.get() + at, dw.get() + at, mwp, A, M, K,
                          out + n0 + first, N, rows_here - first, bp);
        }
      });
    }
  });
}

}  // namespace tiles_vnni

#pragma GCC pop_options
