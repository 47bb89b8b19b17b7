// Linear layers whose weights stay quantized in memory (octavo/model/quant/block_quant.py), computed
// directly from their blocks: each block of 32 weights is widened to fp32 in registers
// (w = q * scale + min for 4-bit, q * scale for 8-bit) and multiplied with fp32 activations, so
// no dequantized copy of a weight exists. The formats are GGUF's:
//   - kind 0, 4-bit: q uint8 [N, K/2], block b of row n in bytes 16b..16b+15, element j of the
//     block in the low nibble of byte j and element j+16 in its high nibble (GGUF Q4_0/Q4_1);
//     scale and min fp16 [N, K/group] (Q4_1: d and m; Q4_0: d and -8d; int4: a group's
//     (max - min) / 15 and min);
//   - kind 1, 8-bit: q int8 [N, K], scale fp16 [N, K/group] (GGUF Q8_0: group 32);
//   - kind 5, 5-bit (GGUF Q5_0): q uint8 [N, K/32 * 20], block b of row n in bytes
//     20b..20b+19: the 16 bytes of low nibbles as the 4-bit kind packs them, then 4 bytes whose
//     bit j (little-endian) is element j's fifth bit; scale fp16 [N, K/32]. A value x in 0..31
//     is the weight (x - 16) * scale: it is unpacked to that signed byte and computed as the
//     8-bit kind computes its bytes (so the same bits as the Q8_0 blocks it once became).
// `group` (a multiple of 32) is how many weights share a scale. Small batches (decode) run the
// register kernels below; block_dequantize widens rows for the large-batch path (prefill), which
// multiplies a few rows at a time through the GEMM library.
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec_traits.h"

namespace {

using octavo::Vec;
constexpr int L = Vec::L;
constexpr int NV = 32 / L;  // vectors per block of 32 weights

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  c10::Half v;
  v.x = h;
  return static_cast<float>(v);
#endif
}

inline float hsum(Vec a) {
  alignas(64) float t[L];
  a.store(t);
  float s = 0.f;
  for (int i = 0; i < L; ++i) s += t[i];
  return s;
}

// the 32 4-bit values of a block as NV vectors of fp32, in element order
inline void nibbles(const uint8_t* qs, Vec* w) {
#if defined(__AVX512F__)
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  w[0].v = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  w[1].v = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
#elif defined(__AVX2__)
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
  const __m256i b1 =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
  const __m256i m = _mm256_set1_epi32(15);
  w[0].v = _mm256_cvtepi32_ps(_mm256_and_si256(b0, m));
  w[1].v = _mm256_cvtepi32_ps(_mm256_and_si256(b1, m));
  w[2].v = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
  w[3].v = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
#else
  alignas(32) float t[32];
  for (int j = 0; j < 16; ++j) {
    t[j] = static_cast<float>(qs[j] & 15);
    t[j + 16] = static_cast<float>(qs[j] >> 4);
  }
  for (int j = 0; j < NV; ++j) w[j] = Vec::load(t + j * L);
#endif
}

// the 32 signed bytes of a block as NV vectors of fp32
inline void bytes(const int8_t* q, Vec* w) {
#if defined(__AVX512F__)
  for (int j = 0; j < 2; ++j)
    w[j].v = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j))));
#elif defined(__AVX2__)
  for (int j = 0; j < 4; ++j)
    w[j].v = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j))));
#else
  alignas(32) float t[32];
  for (int j = 0; j < 32; ++j) t[j] = static_cast<float>(q[j]);
  for (int j = 0; j < NV; ++j) w[j] = Vec::load(t + j * L);
#endif
}

// kind 5's block of 20 bytes -> its 32 values x - 16 as signed bytes, in element order
inline void fives(const uint8_t* blk, int8_t* out) {
  uint32_t high;
  std::memcpy(&high, blk + 16, 4);
  for (int j = 0; j < 16; ++j) {
    out[j] = static_cast<int8_t>((blk[j] & 15) + 16 * ((high >> j) & 1) - 16);
    out[j + 16] = static_cast<int8_t>((blk[j] >> 4) + 16 * ((high >> (j + 16)) & 1) - 16);
  }
}

#if defined(__AVX2__)
// the same in one register: byte j = element j. The 32 fifth bits become 32 bytes by
// broadcasting byte j / 8 of them to byte j and testing bit j % 8 there; a clear bit makes
// the low nibble negative (n | 0xF0 is n - 16 as a signed byte), a set one leaves it as is.
inline __m256i fives8(const uint8_t* blk) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
  const __m256i low = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                       _mm256_set1_epi8(0x0F));
  uint32_t high;
  std::memcpy(&high, blk + 16, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(high)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  const __m256i negative = _mm256_set1_epi8(static_cast<char>(0xF0));
  return _mm256_or_si256(low, _mm256_andnot_si256(set, negative));
}
#endif

// bytes a block of 32 weights takes in q, by kind
template <int KIND>
constexpr int64_t kBlockBytes = KIND == 0 ? 16 : KIND == 5 ? 20 : 32;

struct Weights {
  int kind;  // 0: 4-bit with min, 1: 8-bit, 5: 5-bit (Q5_0)
  int64_t K, group;
  const uint8_t* q;
  const uint16_t* scale;
  const uint16_t* mins;
  int group_shift;  // log2(group / 32)

  int64_t groups() const { return K / group; }
  template <int KIND>
  int64_t row_bytes() const { return K / 32 * kBlockBytes<KIND>; }
};

// Every weight is read from memory once per step, and a thread walks its rows in order: while
// it computes rows n.., the hardware is asked for rows n+8.. (measured on the embedded model,
// a whole decode step's linear layers: 5.4 ms without, 3.7 with; 4 and 16 rows ahead did worse)
constexpr int64_t kPrefetchRows = 8;

template <int KIND>
inline void prefetch_ahead(const Weights& W, int64_t n, int64_t b) {
  __builtin_prefetch(W.q + (n + kPrefetchRows) * W.row_bytes<KIND>() + b * kBlockBytes<KIND>,
                     0, 3);
}

// One activation row on int8 activations (idot1, a decode's batch of one) reads its weights
// faster when each row asks for the bytes kStreamAhead past the blocks it is about to
// compute, a line at a time, and tiles take 2 rows, not 4 (measured in a standalone copy of
// the kernel on a Q8_0 LM head of 262,144 x 640 at one thread, AMD EPYC, AVX2).
constexpr int64_t kStreamAhead = 4096;

// blocks b0..b0+cnt-1 of row n: the weight bytes kStreamAhead past them. (Asking for the
// scales ahead too made the same LM head 2.2x slower: the hardware streams them alone.)
template <int KIND>
inline void prefetch_stream(const Weights& W, int64_t n, int64_t b0, int64_t cnt) {
  const uint8_t* p = W.q + n * W.row_bytes<KIND>() + b0 * kBlockBytes<KIND> + kStreamAhead;
  for (int64_t l = 0; l < cnt * kBlockBytes<KIND>; l += 64) __builtin_prefetch(p + l, 0, 3);
}

// one weight row, group by group: set_group() reads the group's scale (and min), block()
// widens one of its blocks of 32
template <int KIND>
struct Row {
  const uint8_t* q;
  const uint16_t* scale;
  const uint16_t* mins;
  Vec s, mn;

  Row() = default;
  Row(const Weights& W, int64_t n)
      : q(W.q + n * W.row_bytes<KIND>()), scale(W.scale + n * W.groups()),
        mins(KIND == 0 ? W.mins + n * W.groups() : nullptr) {}

  inline void set_group(int64_t g) {
    s = Vec::set1(half_to_float(scale[g]));
    if (KIND == 0) mn = Vec::set1(half_to_float(mins[g]));
  }
  // block b (counted over the whole row)
  inline void block(int64_t b, Vec* w) const {
    if (KIND == 0) {
      nibbles(q + b * 16, w);
      for (int j = 0; j < NV; ++j) w[j] = fma(w[j], s, mn);
    } else if (KIND == 5) {
      alignas(32) int8_t x[32];
#if defined(__AVX2__)
      _mm256_store_si256(reinterpret_cast<__m256i*>(x), fives8(q + b * 20));
#else
      fives(q + b * 20, x);
#endif
      bytes(x, w);
      for (int j = 0; j < NV; ++j) w[j] = w[j] * s;
    } else {
      bytes(reinterpret_cast<const int8_t*>(q) + b * 32, w);
      for (int j = 0; j < NV; ++j) w[j] = w[j] * s;
    }
  }
};

// Walks weight rows n0..n0+NR-1 block by block, widening each block (w: NV vectors) for
// f(r, b, w).
template <int KIND, int NR, typename F>
inline void for_each_block(const Weights& W, int64_t n0, F&& f) {
  Row<KIND> rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = Row<KIND>(W, n0 + r);
  const int64_t per_group = W.group / 32;
  for (int64_t g = 0; g < W.groups(); ++g) {
    for (int r = 0; r < NR; ++r) rows[r].set_group(g);
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      for (int r = 0; r < NR; ++r) {
        Vec w[NV];
        prefetch_ahead<KIND>(W, n0 + r, b);
        rows[r].block(b, w);
        f(r, b, w);
      }
    }
  }
}

// One activation row against NR weight rows n0..n0+NR-1: every (row, vector) pair has its own
// accumulator, so no FMA waits on the one before it.
template <int KIND, int NR>
void dot_m1(const Weights& W, int64_t n0, const float* x, float* out, const float* bias) {
  Vec acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = Vec::zero();
  for_each_block<KIND, NR>(W, n0, [&](int r, int64_t b, const Vec* w) {
    for (int j = 0; j < NV; ++j) acc[r][j] = fma(w[j], Vec::load(x + b * 32 + j * L), acc[r][j]);
  });
  for (int r = 0; r < NR; ++r) {
    Vec s = acc[r][0];
    for (int j = 1; j < NV; ++j) s = s + acc[r][j];
    out[r] = hsum(s) + (bias != nullptr ? bias[n0 + r] : 0.f);
  }
}

// MT activation rows (stride K) against NR weight rows: each block is widened once for all MT.
template <int KIND, int NR, int MT>
void dot_mt(const Weights& W, int64_t n0, const float* x, float* out, int64_t ldo,
            const float* bias) {
  Vec acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = Vec::zero();
  for_each_block<KIND, NR>(W, n0, [&](int r, int64_t b, const Vec* w) {
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NV; ++j)
        acc[r][m] = fma(w[j], Vec::load(x + m * W.K + b * 32 + j * L), acc[r][m]);
  });
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m)
      out[m * ldo + r] = hsum(acc[r][m]) + (bias != nullptr ? bias[n0 + r] : 0.f);
}

#if defined(__AVX512F__)
constexpr int kRowsM1 = 4, kRowsMT = 2, kMT = 8;
#else
constexpr int kRowsM1 = 2, kRowsMT = 1, kMT = 4;
#endif

// rows [m0, m0 + mt) of x against weight rows [n_begin, n_end)
template <int KIND>
void run_rows(const Weights& W, const float* x, int64_t mt, float* out, int64_t N,
              int64_t n_begin, int64_t n_end, const float* bias) {
  int64_t n = n_begin;
  if (mt == 1) {
    for (; n + kRowsM1 <= n_end; n += kRowsM1) dot_m1<KIND, kRowsM1>(W, n, x, out + n, bias);
    for (; n < n_end; ++n) dot_m1<KIND, 1>(W, n, x, out + n, bias);
    return;
  }
  for (; n + kRowsMT <= n_end; n += kRowsMT) {
    int64_t m = 0;
    for (; m + kMT <= mt; m += kMT)
      dot_mt<KIND, kRowsMT, kMT>(W, n, x + m * W.K, out + m * N + n, N, bias);
    for (; m + 2 <= mt; m += 2) dot_mt<KIND, kRowsMT, 2>(W, n, x + m * W.K, out + m * N + n, N, bias);
    for (; m < mt; ++m) dot_m1<KIND, kRowsMT>(W, n, x + m * W.K, out + m * N + n, bias);
  }
  for (; n < n_end; ++n)
    for (int64_t m = 0; m < mt; ++m) dot_m1<KIND, 1>(W, n, x + m * W.K, out + m * N + n, bias);
}

template <int KIND>
void widen_row(const Weights& W, int64_t n, float* out) {
  for_each_block<KIND, 1>(W, n, [&](int, int64_t b, const Vec* w) {
    for (int j = 0; j < NV; ++j) w[j].store(out + b * 32 + j * L);
  });
}

#include "block_idot.h"  // the register kernels on int8 activations (idot, idot1)

template <int KIND>
void irun_rows(const Weights& W, const QuantX& X, int64_t M, float* out, int64_t N,
               int64_t n_begin, int64_t n_end, const float* bias) {
  int64_t n = n_begin;
#if defined(OCTAVO_IDOT1)
  if (M == 1) {
#if !defined(__AVX512F__)
    for (; n + 2 <= n_end; n += 2) idot1<KIND, 2>(W, n, X, out + n, bias);
#endif
    // the AVX-512 build's idot1 one weight row at a time: two rows read a Q8_0 LM head of
    // 262,144 x 640 from memory at 11-12 GB/s on an AVX512-VNNI EPYC, one row at 18
#if defined(__AVX512F__)
    if (KIND == 5 && W.group == 32) {  // the unsigned 5-bit codes (block_row1.h)
      std::vector<__m512i> c5(std::max<int64_t>(1, X.nb / 2));
      fives_offsets(X, c5.data());
      for (; n < n_end; ++n) idot1<KIND, 1>(W, n, X, out + n, bias, c5.data());
      return;
    }
#endif
    for (; n < n_end; ++n) idot1<KIND, 1>(W, n, X, out + n, bias);
    return;
  }
#endif
  for (; n + kIRows <= n_end; n += kIRows) {
    int64_t m = 0;
    for (; m + kIMT <= M; m += kIMT)
      idot<KIND, kIRows, kIMT>(W, n, X, m, out + m * N + n, N, bias);
    for (; m < M; ++m) idot<KIND, kIRows, 1>(W, n, X, m, out + m * N + n, N, bias);
  }
  for (; n < n_end; ++n)
    for (int64_t m = 0; m < M; ++m) idot<KIND, 1, 1>(W, n, X, m, out + m * N + n, N, bias);
}

// f(kind) with the weights' kind as a compile-time constant (std::integral_constant)
template <typename F>
void with_kind(const Weights& W, F&& f) {
  if (W.kind == 0)
    f(std::integral_constant<int, 0>{});
  else if (W.kind == 5)
    f(std::integral_constant<int, 5>{});
  else
    f(std::integral_constant<int, 1>{});
}

// the N weight rows split between threads in runs of whole kernel tiles (8 rows):
// f(kind, n_begin, n_end)
template <typename F>
void split_rows(const Weights& W, int64_t N, F&& f) {
  at::parallel_for(0, (N + 7) / 8, 4, [&](int64_t begin, int64_t end) {
    with_kind(W, [&](auto kind) { f(kind, begin * 8, std::min(end * 8, N)); });
  });
}

// prefill-sized batches on int8 activations: integer tiles, 16 weight rows per vpdpbusd
// (AVX-512 VNNI) or 8 per vpmaddubsw (AVX2)
#if defined(__AVX2__)
// the 32 values of weight row n's block b as signed bytes, in element order: the 4-bit kind's
// codes 0..15 (its min apart), the 5-bit kind's x - 16, the 8-bit kind's bytes (the tiles'
// unpack)
template <int KIND>
inline void block_values(const Weights& W, int64_t n, int64_t b, int8_t* w) {
  if (KIND == 0) {
    const uint8_t* qs = W.q + n * (W.K / 2) + b * 16;
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<int8_t>(qs[j] & 15);
      w[j + 16] = static_cast<int8_t>(qs[j] >> 4);
    }
  } else if (KIND == 5) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w),
                        fives8(W.q + n * W.row_bytes<5>() + b * 20));
  } else {
    std::memcpy(w, W.q + n * W.K + b * 32, 32);
  }
}

// the tiles' unpack: weight rows [n0, n0 + rows) in groups of LANES, one row per int32 lane:
// per group and block 8 vectors of 4 * LANES bytes (vector v: bytes 4v..4v+3 of each row's
// block), and per lane the block's scale and the 4-bit kind's min; rows past the end zero.
// each(w, at) sees a block's block_values first, and may change them (the tile's operand) or
// note per-lane terms at index `at`.
template <int KIND, int LANES, typename Each>
void unpack_lanes(const Weights& W, int64_t n0, int64_t rows, uint8_t* q, float* dw, float* mw,
                  Each&& each) {
  const int64_t nb = W.K / 32, groups = (rows + LANES - 1) / LANES;
  std::memset(q, 0, groups * nb * 32 * LANES);
  std::memset(dw, 0, groups * nb * LANES * sizeof(float));
  if (KIND == 0) std::memset(mw, 0, groups * nb * LANES * sizeof(float));
  alignas(32) int8_t w[32];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = n0 + r, g = r / LANES, lane = r % LANES;
    for (int64_t b = 0; b < nb; ++b) {
      block_values<KIND>(W, n, b, w);
      const int64_t at = (g * nb + b) * LANES + lane;
      each(w, at);
      uint8_t* dst = q + (g * nb + b) * 32 * LANES + 4 * lane;
      for (int v = 0; v < 8; ++v) std::memcpy(dst + 4 * LANES * v, w + 4 * v, 4);
      dw[at] = half_to_float(W.scale[n * nb + b]);
      if (KIND == 0) mw[at] = half_to_float(W.mins[n * nb + b]);
    }
  }
}
#endif

#if defined(__AVX512F__)
#include "block_tile.h"
#define BLOCK_TILE_AVX2_NS tiles_avx2
#include "block_tile_avx2.h"
#undef BLOCK_TILE_AVX2_NS

// the AVX-512 build's tiles: the 512-bit VNNI ones where the CPU has avx512_vnni (and
// block_tiles_set_vnni has not turned them off), else the AVX2 ones
namespace tiles {

static_assert(tiles_vnni::kMinRows == tiles_avx2::kMinRows);
constexpr int64_t kMinRows = tiles_vnni::kMinRows;
std::atomic<bool> vnni_enabled{true};  // block_tiles_set_vnni: the benchmarks' and tests' A/B

bool vnni() { return vnni_enabled.load() && tiles_vnni::available(); }
bool available() { return true; }

void run(const Weights& W, const float* x, int64_t M, int64_t N, float* out, const float* bias) {
  if (vnni())
    tiles_vnni::run(W, x, M, N, out, bias);
  else
    tiles_avx2::run(W, x, M, N, out, bias);
}

}  // namespace tiles
#elif defined(__AVX2__)
#define BLOCK_TILE_AVX2_NS tiles
#include "block_tile_avx2.h"
#undef BLOCK_TILE_AVX2_NS
#endif

Weights check_weights(int64_t kind, const at::Tensor& q, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& mins, int64_t group) {
  TORCH_CHECK(kind == 0 || kind == 1 || kind == 5,
              "kind must be 0 (4-bit), 1 (8-bit) or 5 (5-bit)");
  TORCH_CHECK(group >= 32 && (group & (group - 1)) == 0, "group must be 32, 64, 128, ...");
  int shift = 0;
  while ((32 << shift) < group) ++shift;
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "q must be a contiguous [N, bytes] tensor");
  const int64_t N = q.size(0);
  TORCH_CHECK(kind != 5 || (q.size(1) % 20 == 0 && group == 32),
              "5-bit q must be [N, K/32 * 20] bytes, one scale per block of 32");
  const int64_t K = kind == 0 ? 2 * q.size(1) : kind == 5 ? q.size(1) / 20 * 32 : q.size(1);
  TORCH_CHECK(q.scalar_type() == (kind == 1 ? at::kChar : at::kByte),
              kind == 1 ? "8-bit q must be int8" : kind == 0 ? "4-bit q must be uint8"
                                                             : "5-bit q must be uint8");
  TORCH_CHECK(K % group == 0, "K (", K, ") must be a multiple of group (", group, ")");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() &&
                  scale.numel() == N * (K / group), "scale must be float16 [N, K/group]");
  const uint16_t* mp = nullptr;
  if (kind == 0) {
    TORCH_CHECK(mins.has_value() && mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                    mins->numel() == N * (K / group), "4-bit weights need float16 mins [N, K/group]");
    mp = reinterpret_cast<const uint16_t*>(mins->data_ptr());
  }
  return Weights{static_cast<int>(kind), K, group, reinterpret_cast<const uint8_t*>(q.data_ptr()),
                 reinterpret_cast<const uint16_t*>(scale.data_ptr()), mp, shift};
}

}  // namespace

at::Tensor block_linear(at::Tensor x, int64_t kind, at::Tensor q, at::Tensor scale,
                        c10::optional<at::Tensor> mins, int64_t group,
                        c10::optional<at::Tensor> bias, bool int8_activations) {
  const Weights W = check_weights(kind, q, scale, mins, group);
  const int64_t N = q.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == W.K, "x must be [M, ", W.K, "]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bias must be [N]");
  }
  const int64_t M = xf.size(0);
  auto out = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#if defined(__AVX2__)
  if (int8_activations && W.group == 32 && M >= tiles::kMinRows && tiles::available()) {
    tiles::run(W, xp, M, N, op, bp);
    return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
  }
#endif
  if (int8_activations) {
    const int64_t nb = W.K / 32, nb_pad = (nb + 7) / 8 * 8;
    auto xq = at::empty({M, W.K}, xf.options().dtype(at::kChar));
    auto xd = at::zeros({2, M, nb_pad}, xf.options());
    QuantX X{W.K, nb, nb_pad, xq.data_ptr<int8_t>(), xd.data_ptr<float>(),
             xd.data_ptr<float>() + M * nb_pad};
    for (int64_t m = 0; m < M; ++m)
      quantize_x(xp + m * W.K, W.K, xq.data_ptr<int8_t>() + m * W.K,
                 xd.data_ptr<float>() + m * nb_pad, xd.data_ptr<float>() + (M + m) * nb_pad);
    split_rows(W, N, [&](auto kind, int64_t n_begin, int64_t n_end) {
      irun_rows<decltype(kind)::value>(W, X, M, op, N, n_begin, n_end, bp);
    });
  } else {
    split_rows(W, N, [&](auto kind, int64_t n_begin, int64_t n_end) {
      run_rows<decltype(kind)::value>(W, xp, M, op, N, n_begin, n_end, bp);
    });
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

bool block_int8_tiles() {
#if defined(__AVX2__)
  return tiles::available();
#else
  return false;
#endif
}

std::string block_tiles_path() {
#if defined(__AVX512F__)
  return tiles::vnni() ? "avx512_vnni" : "avx2";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "none";
#endif
}

bool block_tiles_set_vnni(bool enabled) {
#if defined(__AVX512F__)
  return tiles::vnni_enabled.exchange(enabled);
#else
  (void)enabled;
  return false;
#endif
}

at::Tensor block_dequantize(int64_t kind, at::Tensor q, at::Tensor scale,
                            c10::optional<at::Tensor> mins, int64_t group, int64_t row_begin,
                            int64_t row_end, c10::optional<at::Tensor> out) {
  const Weights W = check_weights(kind, q, scale, mins, group);
  TORCH_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= q.size(0),
              "rows out of range");
  const int64_t rows = row_end - row_begin;
  at::Tensor o;
  if (out.has_value()) {
    TORCH_CHECK(out->scalar_type() == at::kFloat && out->is_contiguous() &&
                    out->numel() >= rows * W.K, "out must be a contiguous float32 buffer");
    o = out->view(-1).narrow(0, 0, rows * W.K).view({rows, W.K});
  } else {
    o = at::empty({rows, W.K}, q.options().dtype(at::kFloat));
  }
  float* op = o.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    with_kind(W, [&](auto kind) {
      for (int64_t r = begin; r < end; ++r)
        widen_row<decltype(kind)::value>(W, row_begin + r, op + r * W.K);
    });
  });
  return o;
}
