// Decode-sized linear layers read straight from oneDNN's packed weights (linear.py's
// PackedLinear): up to about 16 rows a linear layer is a stream over its weights, and a call
// into oneDNN through torch costs more set-up than that stream needs (primitive lookup, memory
// descriptors, allocations: a tenth of a batch-1 step, BENCHMARKS.md section 8). This kernel
// reads the same buffer, so the weights stay in memory once.
//
// The layout (oneDNN's brgemm blocking for these shapes; linear.py checks it for every shape
// and dtype before a layer uses this kernel, and keeps oneDNN wherever it differs), in blocks
// of B outputs, B = 64 (AVX2, AVX-512, AVX-512 bf16) or 32 (bf16 where oneDNN uses AMX):
//   fp32: [ceil(N/B)][Kp][B]        weight (n, k) at ((n/B) * Kp + k) * B + n%B
//   bf16: [ceil(N/B)][Kp/2][B][2]   weight (n, k) at ((n/B) * Kp + k - k%2) * B + 2*(n%B) + k%2
// with Kp >= K (padding holds zeros). Each block of B outputs is a contiguous run of Kp rows of
// B weights: its outputs stay in registers while x's values are broadcast, one row at a time.
//
// Work items are (64 outputs: one block of 64 or two of 32, K chunk), each over every row of the
// step in register tiles of a few rows; the chunks are fixed by the shape alone (never by the
// thread count), and their partial sums are added in chunk order, so a row's result does not
// depend on the threads or on the other rows of the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "ops.h"
#include "vec_traits.h"

namespace {

using octavo::Vec;
constexpr int64_t kItem = 64;  // outputs per work item (one block of 64, or two of 32)
// the cache lines 16 rows ahead of a block's current row (4 KB of a 64-block in fp32) are
// requested from memory: measured 1.1-1.2x at 2-6 rows over the hardware prefetcher alone (AMD
// EPYC and Intel Xeon, AVX-512), and in bf16 and on AVX2 at every row count; but a step of one
// fp32 row on AVX-512 (the lightest loop: one load and one FMA per 64 bytes) streams faster on
// the hardware prefetcher alone: the same on the AMD EPYC, 1.2x on the Xeon (its linear layers
// 22 -> 27 GB/s, single-stream generation 1.15x; BENCHMARKS.md section 8)
constexpr int64_t kAhead = 16;
constexpr bool prefetch_fp32(int64_t rows) { return rows > 1 || Vec::L != 16; }

// rows computed together (a register tile): 6 rows x 4 zmm accumulators + 6 broadcasts + 1 load
// of 32 zmm; on AVX2 one row's 8 ymm accumulators (3 rows of 32 columns measured 1.1-1.4x
// slower). A step of more rows runs its rows tile by tile over the same work item, whose
// weights the first tile brought into L1/L2.
constexpr int64_t kTileRows = Vec::L == 16 ? 6 : 1;

// the most rows of a step the engine gives packed_gemv (packed_gemv_max_rows), measured against
// oneDNN on the embedded model's layers (BENCHMARKS.md section 8): AVX-512 fp32 1.1-1.3x up to
// 16 rows, 1.0-1.15x at 24-32, 0.98-1.1x at 64 (2 threads); bf16 1.1-1.5x up to 24 rows, 0.9x
// from 48; bf16 on AMX tiles against oneDNN's AMX kernels 1.07-1.13x at 16, 0.96-1.04x at 24
// (see amx_item); AVX2 (against oneDNN held to AVX2) 1.1-1.4x up to 16 rows, 0.9x at 24
#if defined(__AVX512F__)
constexpr int64_t kMaxRowsFp32 = 32, kMaxRowsBf16 = 24, kMaxRowsAmx = 16;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kMaxRowsFp32 = 16, kMaxRowsBf16 = 0, kMaxRowsAmx = 0;
#else
constexpr int64_t kMaxRowsFp32 = 0, kMaxRowsBf16 = 0, kMaxRowsAmx = 0;  // portable: all oneDNN
#endif
constexpr int64_t kCallRows = 64;  // the most rows one call takes

// The K chunks of a layer: one chunk where there are items enough to spread over the threads,
// else chunks of about 128 rows (a multiple of `unit` rows, dividing K's units evenly), so that
// a layer of a few blocks still keeps every thread busy. unit: 16 in fp32, 32 in bf16 (an AMX
// tile holds 32 rows of K; bf16 in blocks of 64 or of 32 is summed in the same chunks).
int64_t chunk_rows(int64_t n_items, int64_t k, int64_t unit) {
  const int64_t units = (k + unit - 1) / unit, per_chunk = 128 / unit;
  if (n_items >= 64 || units <= per_chunk) return units * unit;
  int64_t chunks = (units + per_chunk - 1) / per_chunk;
  while (units % chunks) ++chunks;
  return units / chunks * unit;
}

// M rows of x (fp32, row stride ldx) times one item of S blocks of B outputs over K rows
// i0..i1-1 (w: the item's first block, kp: a block's rows), into part (row stride ldp), with
// software prefetches where Ahead (prefetch_fp32)
// (its small loops are unrolled on request: without that, GCC kept the AVX2 build's
// accumulators on the stack, 2x slower)
template <int M, int B, int S, bool Ahead>
void fp32_item(const float* w, int64_t kp, const float* x, int64_t ldx, int64_t i0, int64_t i1,
               float* part, int64_t ldp) {
  constexpr int V = B / Vec::L;  // vectors per block row
  Vec acc[M][S * V];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < S * V; ++v) acc[m][v] = Vec::zero();
  const float* wr[S];
#pragma GCC unroll 2
  for (int s = 0; s < S; ++s) wr[s] = w + (s * kp + i0) * B;
  for (int64_t i = i0; i < i1; ++i) {
    if constexpr (Ahead) {
#pragma GCC unroll 2
      for (int s = 0; s < S; ++s)
#pragma GCC unroll 4
        for (int c = 0; c < B; c += 16) __builtin_prefetch(wr[s] + kAhead * B + c, 0, 3);
    }
    Vec xb[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) xb[m] = Vec::set1(x[m * ldx + i]);
#pragma GCC unroll 2
    for (int s = 0; s < S; ++s) {
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const Vec wv = Vec::load(wr[s] + v * Vec::L);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[m][s * V + v] = fma(wv, xb[m], acc[m][s * V + v]);
      }
      wr[s] += B;
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < S * V; ++v) acc[m][v].store(part + m * ldp + v * Vec::L);
}

#if defined(__AVX512F__)
inline bool cpu_has_bf16_dot() { return __builtin_cpu_supports("avx512bf16"); }

// bf16: x2 holds each row's values as (x[2p], x[2p+1]) pairs (Kp/2 words per row); a pair of
// weight rows of a block is B/16 zmm of (w[2p][n], w[2p+1][n]), and vdpbf16ps adds both products
template <int M, int B, int S>
__attribute__((target("avx512bf16"))) void bf16_item(const uint16_t* w, int64_t kp,
                                                     const uint32_t* x2, int64_t ldx2, int64_t p0,
                                                     int64_t p1, float* part, int64_t ldp) {
  constexpr int V = B / 16;  // zmm per pair of block rows
  __m512 acc[M][S * V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < S * V; ++v) acc[m][v] = _mm512_setzero_ps();
  const uint16_t* wr[S];
  for (int s = 0; s < S; ++s) wr[s] = w + (s * kp + 2 * p0) * B;
  for (int64_t p = p0; p < p1; ++p) {
    for (int s = 0; s < S; ++s)
      for (int c = 0; c < 2 * B; c += 32) __builtin_prefetch(wr[s] + kAhead * B + c, 0, 3);
    __m512bh xb[M];
    for (int m = 0; m < M; ++m)
      xb[m] = (__m512bh)_mm512_set1_epi32(static_cast<int>(x2[m * ldx2 + p]));
    for (int s = 0; s < S; ++s) {
      for (int v = 0; v < V; ++v) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr[s] + v * 32);
        for (int m = 0; m < M; ++m)
          acc[m][s * V + v] = _mm512_dpbf16_ps(acc[m][s * V + v], xb[m], wv);
      }
      wr[s] += 2 * B;
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < S * V; ++v) _mm512_storeu_ps(part + m * ldp + v * 16, acc[m][v]);
}

// the first n - n % 16 of n floats to bf16 (vcvtneps2bf16: nearest even); returns how many
__attribute__((target("avx512bf16"))) int64_t to_bf16_avx512(const float* s, at::BFloat16* o,
                                                              int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j)));
  return j;
}

// AMX (bf16 where oneDNN packs blocks of 32 outputs for its own AMX kernels): a tile of up to
// 16 rows of x (32 bf16 of K each) times a tile of 16 pairs of K rows x 16 outputs of a block,
// the outputs' sums in fp32 tiles. Where it runs it takes every row count (from 1): its sums
// differ from vdpbf16ps's in the last bit now and then, and a row's result must not depend on
// how many rows its step has. Measured on the embedded model's layers (Xeon with AMX, 1 thread,
// BENCHMARKS.md section 8): 1.3x oneDNN at 1-4 rows, 1.1x at 16, 1.0x at 24-32, 0.6x at 64;
// 0.94x bf16_item at 1 row, 1.4x at 8, 2.6x at 24.
// whether this CPU runs AMX bf16 and Linux lets this process use its tile registers
bool cpu_has_amx() { return __builtin_cpu_supports("amx-bf16") && amx::tiles_permitted(); }
std::atomic<bool> amx_enabled{true};  // packed_gemv_set_amx: the benchmarks' and tests' A/B
constexpr int64_t kAmxAhead = 32;            // pairs of K rows prefetched ahead

// tiles 0-3: sums of the item's (up to) 4 x 16 outputs for `rows` rows of x; 4: those rows of
// x; 5: weights (16 pairs of K rows); every tile row 64 bytes
void amx_configure(int rows) {
  amx::TileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.colsb[t] = 64, cfg.rows[t] = t == 5 ? 16 : rows;
  amx::load_config(cfg);
}

// a thread's tiles, configured for `rows` rows of x while it lives, released after
struct AmxTiles {
  explicit AmxTiles(int rows) { amx_configure(rows); }
  ~AmxTiles() { amx::release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

// a tile of rows of x (bf16, row stride ldx elements, K zero-padded to Kp) times one item of S
// blocks of 32 outputs over pairs p0..p1-1 (multiples of 16), into part (row stride ldp)
// (GCC 12's tileloadd does not tell the compiler it reads memory: x and w are written before
// the parallel region that calls this, never inside it)
template <int S>
__attribute__((target("amx-tile,amx-bf16"))) void amx_item(const uint16_t* w, int64_t kp,
                                                          const uint16_t* x, int64_t ldx,
                                                          int64_t p0, int64_t p1, float* part,
                                                          int64_t ldp) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (S == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* w0 = w + p0 * 64;  // a pair of K rows of a block: 32 outputs x 2
  const uint16_t* w1 = w0 + kp * 32;
  for (int64_t p = p0; p < p1; p += 16, w0 += 16 * 64, w1 += 16 * 64) {
    // the 2 KB of each block kAmxAhead pairs ahead
    for (int c = 0; c < 16 * 64; c += 32) {
      __builtin_prefetch(w0 + kAmxAhead * 64 + c, 0, 3);
      if constexpr (S == 2) __builtin_prefetch(w1 + kAmxAhead * 64 + c, 0, 3);
    }
    _tile_loadd(4, x + 2 * p, ldx * 2);
    _tile_loadd(5, w0, 128);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, w0 + 32, 128);
    _tile_dpbf16ps(1, 4, 5);
    if constexpr (S == 2) {
      _tile_loadd(5, w1, 128);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, w1 + 32, 128);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, part, ldp * 4);
  _tile_stored(1, part + 16, ldp * 4);
  if constexpr (S == 2) {
    _tile_stored(2, part + 32, ldp * 4);
    _tile_stored(3, part + 48, ldp * 4);
  }
}
#endif

// n floats to bf16, rounded to nearest even as at::BFloat16 does
void to_bf16(const float* s, at::BFloat16* o, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if (cpu_has_bf16_dot()) j = to_bf16_avx512(s, o, n);
#endif
  for (; j < n; ++j) o[j] = at::BFloat16(s[j]);
}

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

// f(integral_constant<B>, integral_constant<S>) for an item of S blocks of B outputs, where
// `left` blocks of the layer are left from the item's first (an odd count of 32s ends in one)
template <class F>
void by_blocks(int64_t block, int64_t left, F&& f) {
  if (block == 64) {
    f(std::integral_constant<int, 64>{}, std::integral_constant<int, 1>{});
  } else if (left >= 2) {
    f(std::integral_constant<int, 32>{}, std::integral_constant<int, 2>{});
  } else {
    f(std::integral_constant<int, 32>{}, std::integral_constant<int, 1>{});
  }
}

struct NoSetup {
  int operator()() const { return 0; }
};

// every (64 outputs, K chunk) item over the threads (contiguous ranges: each thread streams one
// part of the buffer): f(item, chunk, K rows i0..i1-1); k_end: where K's rows end; setup():
// what each thread holds while it runs its items (AMX: its tile configuration)
template <class F, class Setup = NoSetup>
void for_items(int64_t n_items, int64_t n_chunks, int64_t chunk, int64_t k_end, F&& f,
               Setup setup = {}) {
  at::parallel_for(0, n_items * n_chunks, 1, [&](int64_t begin, int64_t end) {
    [[maybe_unused]] const auto held = setup();
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = it / n_chunks, c = it % n_chunks;
      const int64_t i0 = c * chunk;
      f(b, c, i0, std::min(k_end, i0 + chunk));
    }
  });
}

// for_items, and in each item every register tile of rows: f(item, chunk, K rows i0..i1-1,
// the tile's first row, integral_constant<rows in the tile>)
template <class F>
void run_items(int64_t n_items, int64_t n_chunks, int64_t chunk, int64_t k_end, int64_t rows,
               F&& f) {
  for_items(n_items, n_chunks, chunk, k_end, [&](int64_t b, int64_t c, int64_t i0, int64_t i1) {
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows)
      by_rows(std::min(kTileRows, rows - r0), [&](auto mr) { f(b, c, i0, i1, r0, mr); });
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

bool packed_gemv_has_amx() {
#if defined(__AVX512F__)
  return cpu_has_amx();
#else
  return false;
#endif
}

bool packed_gemv_set_amx(bool enabled) {
#if defined(__AVX512F__)
  return amx_enabled.exchange(enabled);
#else
  return false;
#endif
}

int64_t packed_gemv_max_rows(at::ScalarType dtype, int64_t block) {
  if (!packed_gemv_supports(dtype)) return 0;
  if (dtype == at::kFloat) return kMaxRowsFp32;
  return block == 32 && packed_gemv_has_amx() ? kMaxRowsAmx : kMaxRowsBf16;
}

at::Tensor packed_gemv(at::Tensor x, int64_t weight_ptr, int64_t n, int64_t k_padded,
                       c10::optional<at::Tensor> bias, int64_t block) {
  TORCH_CHECK(x.dim() == 2, "packed_gemv: x must be [rows, K], got ", x.sizes());
  TORCH_CHECK(packed_gemv_supports(x.scalar_type()), "packed_gemv: ", x.scalar_type(),
              " is not computed by this build on this CPU");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(rows >= 1 && rows <= kCallRows, "packed_gemv: 1 to ", kCallRows, " rows, got ",
              rows);
  TORCH_CHECK(weight_ptr != 0 && n > 0 && k_padded >= k, "packed_gemv: bad weight geometry");
  TORCH_CHECK(block == 64 || block == 32, "packed_gemv: blocks of 64 or 32 outputs, got ", block);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!bf16 || k_padded % 2 == 0, "packed_gemv: bf16 rows come in pairs");
  if (bias) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == x.scalar_type(),
                "packed_gemv: bias must be [N] in x's dtype");
  }
  x = x.contiguous();
  const int64_t n_blocks = (n + block - 1) / block, width = n_blocks * block;
  const int64_t per_item = kItem / block, n_items = (n_blocks + per_item - 1) / per_item;
#if defined(__AVX512F__)
  // blocks of 32 in bf16: oneDNN's AMX layout, whose K is padded to whole tiles of 32
  const bool amx = bf16 && block == 32 && k_padded % 32 == 0 && cpu_has_amx() &&
                   amx_enabled.load(std::memory_order_relaxed);
#else
  const bool amx = false;
#endif
  const int64_t chunk = chunk_rows(n_items, k, bf16 ? 32 : 16);
  const int64_t n_chunks = (k + chunk - 1) / chunk;
  // AMX: tiles of mt rows (at most 16, as even as can be), x zero-padded to prows
  const int64_t mt = amx ? (rows + (rows + 15) / 16 - 1) / ((rows + 15) / 16) : rows;
  const int64_t prows = amx ? (rows + mt - 1) / mt * mt : rows;
  auto out = at::empty({rows, n}, x.options());
  // partial sums [chunk][row][width]: chunk 0's straight into out where that is fp32 of whole
  // blocks, the others in this thread's scratch (kept between calls: no allocation, no zeroing)
  const bool direct = !bf16 && n == width;
  thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>((n_chunks - direct) * prows * width);
  if (scratch.size() < need) scratch.resize(need);
  float* const S = scratch.data();
  float* const O = direct ? out.data_ptr<float>() : nullptr;
  auto part = [&](int64_t c) {
    return direct && c == 0 ? O : S + (c - direct) * prows * width;
  };
  if (!bf16) {
    const float* W = reinterpret_cast<const float*>(weight_ptr);
    const float* X = x.data_ptr<float>();
    auto fp32 = [&](auto ahead) {
      run_items(n_items, n_chunks, chunk, k, rows, [&](int64_t it, int64_t c, int64_t i0,
                                                       int64_t i1, int64_t r0, auto mr) {
        by_blocks(block, n_blocks - it * per_item, [&](auto bw, auto sb) {
          fp32_item<decltype(mr)::value, decltype(bw)::value, decltype(sb)::value,
                    decltype(ahead)::value>(W + it * per_item * k_padded * block, k_padded,
                                            X + r0 * k, k, i0, i1,
                                            part(c) + r0 * width + it * kItem, width);
        });
      });
    };
    if (prefetch_fp32(rows)) {
      fp32(std::true_type{});
    } else {
      fp32(std::false_type{});
    }
  }
#if defined(__AVX512F__)
  else {
    // x as bf16 pairs, zero-padded to Kp (an odd K's last pair) and, for AMX, to whole tiles
    // of 16 rows
    const int64_t pairs = k_padded / 2;
    std::vector<uint32_t> x2(static_cast<size_t>(prows * pairs), 0u);
    for (int64_t m = 0; m < rows; ++m)
      std::memcpy(reinterpret_cast<uint16_t*>(x2.data() + m * pairs),
                  x.data_ptr<at::BFloat16>() + m * k, k * sizeof(uint16_t));
    const uint16_t* W = reinterpret_cast<const uint16_t*>(weight_ptr);
    if (amx) {
      const int64_t k_end = (k + 31) / 32 * 32;  // K in whole tiles (Kp's padding is zeros)
      const uint16_t* X2 = reinterpret_cast<const uint16_t*>(x2.data());
      for_items(
          n_items, n_chunks, chunk, k_end,
          [&](int64_t b, int64_t c, int64_t i0, int64_t i1) {
            by_blocks(block, n_blocks - b * per_item, [&](auto, auto sb) {
              for (int64_t r0 = 0; r0 < prows; r0 += mt)
                amx_item<decltype(sb)::value>(W + b * per_item * k_padded * block, k_padded,
                                              X2 + r0 * k_padded, k_padded, i0 / 2, i1 / 2,
                                              part(c) + r0 * width + b * kItem, width);
            });
          },
          [&] { return AmxTiles(static_cast<int>(mt)); });
    } else {
      const int64_t kk = (k + 1) / 2 * 2;  // K rounded up to whole pairs
      run_items(n_items, n_chunks, chunk, kk, rows, [&](int64_t it, int64_t c, int64_t i0,
                                                        int64_t i1, int64_t r0, auto mr) {
        by_blocks(block, n_blocks - it * per_item, [&](auto bw, auto sb) {
          bf16_item<decltype(mr)::value, decltype(bw)::value, decltype(sb)::value>(
              W + it * per_item * k_padded * block, k_padded, x2.data() + r0 * pairs, pairs,
              i0 / 2, i1 / 2, part(c) + r0 * width + it * kItem, width);
        });
      });
    }
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
      to_bf16(s, out.data_ptr<at::BFloat16>() + m * n, n);
    } else if (!direct) {
      std::memcpy(out.data_ptr<float>() + m * n, s, n * sizeof(float));
    }
  }
  return out;
}
