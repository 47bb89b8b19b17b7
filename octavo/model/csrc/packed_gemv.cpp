// Decode-sized linear layers read straight from oneDNN's packed weights (linear.py's
// PackedLinear): up to about 16 rows a linear layer is a stream over its weights, and a call
// into oneDNN through torch costs more set-up than that stream needs (primitive lookup, memory
// descriptors, allocations: a tenth of a batch-1 step, BENCHMARKS.md section 8). This kernel
// reads the same buffer, so the weights stay in memory once.
//
// The layout (oneDNN's brgemm blocking for these shapes; linear.py checks it for every shape
// and dtype before a layer uses this kernel, and keeps oneDNN wherever it differs):
//   fp32: [ceil(N/64)][Kp][64]        weight (n, k) at ((n/64) * Kp + k) * 64 + n%64
//   bf16: [ceil(N/64)][Kp/2][64][2]   weight (n, k) at ((n/64) * Kp + k - k%2) * 64 + 2*(n%64) + k%2
// with Kp >= K (padding holds zeros). Each block of 64 outputs is a contiguous run of Kp rows of
// 64 weights: its outputs stay in registers while x's values are broadcast, one row at a time.
//
// Work items are (block, K chunk), each over every row of the step in register tiles of a few
// rows; the chunks are fixed by the shape alone (never by
// the thread count), and their partial sums are added in chunk order, so a row's result does
// not depend on the threads or on the other rows of the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec_traits.h"

namespace {

using octavo::Vec;
constexpr int64_t kBlock = 64;  // outputs per block of the packed layout
// the cache lines 4 KB ahead of a block's current row are requested from memory: measured
// 1.1-1.2x at 2-6 rows over the hardware prefetcher alone, the same at one row (AVX-512)
constexpr int64_t kAhead = 16;

// rows computed together (a register tile): 6 rows x 4 zmm accumulators + 6 broadcasts + 1 load
// of 32 zmm; on AVX2 one row's 8 ymm accumulators (3 rows of 32 columns measured 1.1-1.4x
// slower). A step of more rows runs its rows tile by tile over the same work item, whose
// weights the first tile brought into L1/L2.
constexpr int64_t kTileRows = Vec::L == 16 ? 6 : 1;

// the most rows of a step the engine gives packed_gemv (packed_gemv_max_rows), measured against
// oneDNN on the embedded model's layers (BENCHMARKS.md section 8): AVX-512 fp32 1.1-1.3x up to
// 16 rows, 1.0-1.15x at 24-32, 0.98-1.1x at 64 (2 threads); bf16 1.1-1.5x up to 24 rows, 0.9x
// from 48; AVX2 (against oneDNN held to AVX2) 1.1-1.4x up to 16 rows, 0.9x at 24
#if defined(__AVX512F__)
constexpr int64_t kMaxRowsFp32 = 32, kMaxRowsBf16 = 24;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kMaxRowsFp32 = 16, kMaxRowsBf16 = 0;
#else
constexpr int64_t kMaxRowsFp32 = 0, kMaxRowsBf16 = 0;  // portable: oneDNN computes them all
#endif
constexpr int64_t kCallRows = 64;  // the most rows one call takes

// The K chunks of a layer: one chunk where there are blocks enough to spread over the threads,
// else chunks of about 128 rows (a multiple of 16, dividing K's 16-row units evenly), so that
// a layer of a few blocks still keeps every thread busy.
int64_t chunk_rows(int64_t n_blocks, int64_t k) {
  const int64_t units = (k + 15) / 16;
  if (n_blocks >= 64 || units <= 8) return units * 16;
  int64_t chunks = (units + 7) / 8;
  while (units % chunks) ++chunks;
  return units / chunks * 16;
}

// M rows of x (fp32, row stride ldx) times one block over K rows i0..i1-1 (w: the block's
// first row), into part (row stride ldp)
// (its small loops are unrolled on request: without that, GCC kept the AVX2 build's
// accumulators on the stack, 2x slower)
template <int M>
void fp32_item(const float* w, const float* x, int64_t ldx, int64_t i0, int64_t i1, float* part,
               int64_t ldp) {
  constexpr int V = kBlock / Vec::L;
  Vec acc[M][V];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[m][v] = Vec::zero();
  const float* wr = w + i0 * kBlock;
  for (int64_t i = i0; i < i1; ++i, wr += kBlock) {
#pragma GCC unroll 4
    for (int c = 0; c < kBlock; c += 16) __builtin_prefetch(wr + kAhead * kBlock + c, 0, 3);
    Vec xb[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) xb[m] = Vec::set1(x[m * ldx + i]);
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const Vec wv = Vec::load(wr + v * Vec::L);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[m][v] = fma(wv, xb[m], acc[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[m][v].store(part + m * ldp + v * Vec::L);
}

#if defined(__AVX512F__)
inline bool cpu_has_bf16_dot() { return __builtin_cpu_supports("avx512bf16"); }

// bf16: x2 holds each row's values as (x[2p], x[2p+1]) pairs (Kp/2 words per row); a pair of
// weight rows of a block is 4 zmm of (w[2p][n], w[2p+1][n]), and vdpbf16ps adds both products
template <int M>
__attribute__((target("avx512bf16"))) void bf16_item(const uint16_t* w, const uint32_t* x2,
                                                     int64_t ldx2, int64_t p0, int64_t p1,
                                                     float* part, int64_t ldp) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
  const uint16_t* wr = w + p0 * 2 * kBlock;
  for (int64_t p = p0; p < p1; ++p, wr += 2 * kBlock) {
    for (int c = 0; c < 2 * kBlock; c += 32) __builtin_prefetch(wr + kAhead * kBlock + c, 0, 3);
    __m512bh xb[M];
    for (int m = 0; m < M; ++m)
      xb[m] = (__m512bh)_mm512_set1_epi32(static_cast<int>(x2[m * ldx2 + p]));
    for (int v = 0; v < 4; ++v) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + v * 32);
      for (int m = 0; m < M; ++m) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb[m], wv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(part + m * ldp + v * 16, acc[m][v]);
}
#endif

// f(integral_constant<M>) for a tile of m rows (1..kTileRows)
template <class F>
void by_rows(int64_t m, F&& f) {
  switch (m) {
#if defined(__AVX512F__)
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
#endif
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// every (block, K chunk) item over the threads (contiguous ranges: each thread streams one
// part of the buffer), and in each item every tile of rows: f(block, chunk, K rows i0..i1-1,
// the tile's first row, integral_constant<rows in the tile>); k_end: where K's rows end
template <class F>
void run_items(int64_t n_blocks, int64_t n_chunks, int64_t chunk, int64_t k_end, int64_t rows,
               F&& f) {
  at::parallel_for(0, n_blocks * n_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = it / n_chunks, c = it % n_chunks;
      const int64_t i0 = c * chunk, i1 = std::min(k_end, i0 + chunk);
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows)
        by_rows(std::min(kTileRows, rows - r0), [&](auto mr) { f(b, c, i0, i1, r0, mr); });
    }
  });
}

}  // namespace

bool packed_gemv_supports(at::ScalarType dtype) {
  if (dtype == at::kFloat) return kMaxRowsFp32 > 0;
#if defined(__AVX512F__)
  if (dtype == at::kBFloat16) return cpu_has_bf16_dot();
#endif
  return false;
}

int64_t packed_gemv_max_rows(at::ScalarType dtype) {
  if (!packed_gemv_supports(dtype)) return 0;
  return dtype == at::kFloat ? kMaxRowsFp32 : kMaxRowsBf16;
}

at::Tensor packed_gemv(at::Tensor x, int64_t weight_ptr, int64_t n, int64_t k_padded,
                       c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2, "packed_gemv: x must be [rows, K], got ", x.sizes());
  TORCH_CHECK(packed_gemv_supports(x.scalar_type()), "packed_gemv: ", x.scalar_type(),
              " is not computed by this build on this CPU");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(rows >= 1 && rows <= kCallRows, "packed_gemv: 1 to ", kCallRows, " rows, got ",
              rows);
  TORCH_CHECK(weight_ptr != 0 && n > 0 && k_padded >= k, "packed_gemv: bad weight geometry");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!bf16 || k_padded % 2 == 0, "packed_gemv: bf16 rows come in pairs");
  if (bias) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == x.scalar_type(),
                "packed_gemv: bias must be [N] in x's dtype");
  }
  x = x.contiguous();
  const int64_t n_blocks = (n + kBlock - 1) / kBlock, width = n_blocks * kBlock;
  const int64_t chunk = chunk_rows(n_blocks, k), n_chunks = (k + chunk - 1) / chunk;
  auto out = at::empty({rows, n}, x.options());
  // partial sums [chunk][row][width]: chunk 0's straight into out where that is fp32 of whole
  // blocks, the others in this thread's scratch (kept between calls: no allocation, no zeroing)
  const bool direct = !bf16 && n == width;
  thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>((n_chunks - direct) * rows * width);
  if (scratch.size() < need) scratch.resize(need);
  float* const S = scratch.data();
  float* const O = direct ? out.data_ptr<float>() : nullptr;
  auto part = [&](int64_t c) {
    return direct && c == 0 ? O : S + (c - direct) * rows * width;
  };
  if (!bf16) {
    const float* W = reinterpret_cast<const float*>(weight_ptr);
    const float* X = x.data_ptr<float>();
    run_items(n_blocks, n_chunks, chunk, k, rows, [&](int64_t b, int64_t c, int64_t i0,
                                                      int64_t i1, int64_t r0, auto mr) {
      fp32_item<decltype(mr)::value>(W + b * k_padded * kBlock, X + r0 * k, k, i0, i1,
                                     part(c) + r0 * width + b * kBlock, width);
    });
  }
#if defined(__AVX512F__)
  else {
    // x as bf16 pairs, zero-padded to Kp (an odd K's last pair)
    const int64_t pairs = k_padded / 2;
    std::vector<uint32_t> x2(static_cast<size_t>(rows * pairs), 0u);
    for (int64_t m = 0; m < rows; ++m)
      std::memcpy(reinterpret_cast<uint16_t*>(x2.data() + m * pairs),
                  x.data_ptr<at::BFloat16>() + m * k, k * sizeof(uint16_t));
    const uint16_t* W = reinterpret_cast<const uint16_t*>(weight_ptr);
    const int64_t kk = (k + 1) / 2 * 2;  // K rounded up to whole pairs
    run_items(n_blocks, n_chunks, chunk, kk, rows, [&](int64_t b, int64_t c, int64_t i0,
                                                       int64_t i1, int64_t r0, auto mr) {
      bf16_item<decltype(mr)::value>(W + b * k_padded * kBlock, x2.data() + r0 * pairs, pairs,
                                     i0 / 2, i1 / 2, part(c) + r0 * width + b * kBlock, width);
    });
  }
#endif
  // out = the chunks' sums in chunk order (+ bias), in x's dtype
  at::Tensor b32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* B = bias ? b32.data_ptr<float>() : nullptr;
  for (int64_t m = 0; m < rows; ++m) {
    float* s = part(0) + m * width;
    for (int64_t c = 1; c < n_chunks; ++c) {
      const float* t = part(c) + m * width;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) s[j] += t[j];
    }
    if (bias) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) s[j] += B[j];
    }
    if (bf16) {
      at::BFloat16* o = out.data_ptr<at::BFloat16>() + m * n;
      for (int64_t j = 0; j < n; ++j) o[j] = at::BFloat16(s[j]);
    } else if (!direct) {
      std::memcpy(out.data_ptr<float>() + m * n, s, n * sizeof(float));
    }
  }
  return out;
}
