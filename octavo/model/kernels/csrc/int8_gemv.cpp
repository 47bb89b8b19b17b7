// int8 x int8 -> int32 products for the few rows of a decode step (W8A8 layers,
// octavo/model/quant/quantization.py): acc[m, n] = sum_k xq[m, k] * wq[n, k], exact in int32, so the
// result is the same as torch._int_mm's (oneDNN's) bit for bit, and the epilogue after it is
// unchanged. oneDNN's int8 GEMM is built for many rows; at one to sixteen rows a step is a
// stream over the weights, which this kernel reads once, 8 rows ahead of use.
//
// |w| * sign(x, w) on vpmaddubsw: |w| <= 128 as u8 times x in [-127, 127] gives int16 pair sums
// of at most 2 * 128 * 127 = 32512, which never saturate (full-range weights are fine here
// whatever the CPU); vpmaddwd then widens to int32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "ops.h"
#include "vec_traits.h"

namespace {

constexpr int64_t kAheadRows = 8;
#if defined(__AVX512F__)
constexpr int kRows = 4;  // weight rows per tile: 4 x 4 accumulators of 32 registers
#else
constexpr int kRows = 2;  // 16 registers on AVX2
#endif

#if defined(__AVX2__)
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}
#endif

// weight rows n0..n0+NR-1 against activation rows m0..m0+MT-1 over the whole K
template <int NR, int MT>
void tile(const int8_t* x, const int8_t* w, int64_t K, int64_t n0, int64_t m0, int32_t* out,
          int64_t N) {
  int64_t k = 0;
  int32_t sums[NR][MT] = {};
#if defined(__AVX512F__)
  {
    __m512i acc[NR][MT];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi16(1);
    for (; k + 64 <= K; k += 64) {
      for (int r = 0; r < NR; ++r) {
        const int8_t* wr = w + (n0 + r) * K + k;
        __builtin_prefetch(wr + kAheadRows * K, 0, 3);
        const __m512i wv = _mm512_loadu_si512(wr);
        const __m512i aw = _mm512_abs_epi8(wv);
        const __mmask64 neg = _mm512_movepi8_mask(wv);
        for (int m = 0; m < MT; ++m) {
          __m512i xv = _mm512_loadu_si512(x + (m0 + m) * K + k);
          xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
          acc[r][m] = _mm512_add_epi32(
              acc[r][m], _mm512_madd_epi16(_mm512_maddubs_epi16(aw, xv), ones));
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) sums[r][m] = _mm512_reduce_add_epi32(acc[r][m]);
  }
#elif defined(__AVX2__)
  {
    __m256i acc[NR][MT];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (; k + 32 <= K; k += 32) {
      for (int r = 0; r < NR; ++r) {
        const int8_t* wr = w + (n0 + r) * K + k;
        __builtin_prefetch(wr + kAheadRows * K, 0, 3);
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr));
        const __m256i aw = _mm256_abs_epi8(wv);
        for (int m = 0; m < MT; ++m) {
          const __m256i xv = _mm256_sign_epi8(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + (m0 + m) * K + k)), wv);
          acc[r][m] = _mm256_add_epi32(
              acc[r][m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones));
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) sums[r][m] = hsum_epi32(acc[r][m]);
  }
#endif
  // the rest of K (all of it on the portable build), in plain integer loops
  for (int r = 0; r < NR; ++r) {
    const int8_t* wr = w + (n0 + r) * K;
    for (int m = 0; m < MT; ++m) {
      const int8_t* xr = x + (m0 + m) * K;
      int32_t s = 0;
      for (int64_t j = k; j < K; ++j) s += static_cast<int32_t>(xr[j]) * wr[j];
      out[(m0 + m) * N + n0 + r] = sums[r][m] + s;
    }
  }
}

template <int NR>
void rows(const int8_t* x, const int8_t* w, int64_t M, int64_t K, int64_t n0, int32_t* out,
          int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<NR, 4>(x, w, K, n0, m, out, N);
  for (; m + 2 <= M; m += 2) tile<NR, 2>(x, w, K, n0, m, out, N);
  for (; m < M; ++m) tile<NR, 1>(x, w, K, n0, m, out, N);
}

}  // namespace

at::Tensor int8_gemv(at::Tensor xq, at::Tensor wq) {
  TORCH_CHECK(xq.dim() == 2 && wq.dim() == 2 && xq.size(1) == wq.size(1),
              "xq [M, K] and wq [N, K] expected");
  TORCH_CHECK(xq.scalar_type() == at::kChar && wq.scalar_type() == at::kChar,
              "xq and wq must be int8");
  TORCH_CHECK(xq.is_contiguous() && wq.is_contiguous(), "xq and wq must be contiguous");
  const int64_t M = xq.size(0), K = xq.size(1), N = wq.size(0);
  auto out = at::empty({M, N}, xq.options().dtype(at::kInt));
  const int8_t* xp = xq.data_ptr<int8_t>();
  const int8_t* wp = wq.data_ptr<int8_t>();
  int32_t* op = out.data_ptr<int32_t>();
  at::parallel_for(0, (N + 7) / 8, 4, [&](int64_t begin, int64_t end) {
    int64_t n = begin * 8;
    const int64_t n_end = std::min(end * 8, N);
    for (; n + kRows <= n_end; n += kRows) rows<kRows>(xp, wp, M, K, n, op, N);
    for (; n < n_end; ++n) rows<1>(xp, wp, M, K, n, op, N);
  });
  return out;
}

at::Tensor int8_mm(at::Tensor xq, at::Tensor wq) {
  return xq.size(0) <= kInt8GemvRows ? int8_gemv(xq, wq) : at::_int_mm(xq, wq.t());
}
