// Linear layers whose weights stay in GGUF's K-quant super-blocks (Q4_K, Q5_K, Q6_K: 256 weights
// each; octavo/model/quant/gguf_blocks.py, kquant.py), computed as llama.cpp computes them: each
// activation row is quantized per 256 to int8 (Q8K: one fp32 scale per 256 and the sums of every
// 16 quantized values, which the formats' mins and Q6_K's offset need), and each super-block's
// dot product is taken on integers (kquant_simd.h), then scaled in fp32. Super-block layouts in
// memory (kquant_repack.cpp at load; kquant.py is the reference; gguf-py's gguf.quants the
// file's), every format's 256 codes in lane order (kquant_codes.h: each 4-byte lane of a
// 32-code vector holds one sub-block's codes, and the SIMD paths take the activations permuted
// the same way, so the sub-block scales apply once per super-block):
//   Q4_K, 148 bytes: d fp16, dmin fp16, 8 scale bytes, 8 min bytes (the file's 12 bytes of 6-bit
//     values, unpacked at load), 128 bytes of nibbles; w = d * scale_s * q - dmin * min_s, 8
//     sub-blocks of 32.
//   Q5_K, 180 bytes: d, dmin, the 16 scale and min bytes, 32 bytes of fifth bits, then Q4_K's
//     128 bytes of nibbles.
//   Q6_K, 210 bytes: 128 bytes ql (low nibbles), 64 bytes qh (2 high bits), 16 int8 scales (one
//     per 16 weights), d fp16; w = d * scale_s * (q - 32).
// Paths (chosen at run time): in the AVX-512 build, AVX512-VNNI where the CPU has avx512_vnni,
// and from kAmxMinRows rows on, AMX tiles for whole tiles of 16 rows where it has amx-int8
// (kquant_amx.h); AVX2 (vpmaddubsw + vpmaddwd; also the AVX-512 build's path without VNNI);
// portable C++ (kquant_portable.h). Activations: kquant_q8k.h.
// Batch sizes: up to 7 rows (decode), each weight row against up to 8 activation rows
// (kquant_simd.h's rows_dot); from 8 rows on (prefill), whole groups of 8 rows go through
// kquant_tile.h's tiles, whose rows are interleaved per super-block, with the weights taken in
// L2-sized chunks, and give each row the same bits (the rows left over take rows_dot).
// kquant_dequantize widens rows to fp32 exactly as gguf-py does (the products are exact in fp32
// and each weight rounds once, so the operation order cannot change a bit).
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "kquant_codes.h"
#include "ops.h"

namespace {

constexpr int kQ4K = 2, kQ5K = 3, kQ6K = 4;
constexpr int64_t kBytes[5] = {0, 0, 148, 180, 210};
// A decode's one activation row streams its weights: each super-block asks for the bytes this
// far past it (the rows a thread takes are contiguous). In a standalone copy of the AVX2
// kernel, one thread over 53 MB of Q4_K / Q6_K rows: 11-12 GB/s without, 13-15 GB/s with
// (AMD EPYC); the hardware's own prefetcher does not run far enough ahead.
constexpr int64_t kStreamAhead = 4096;
// NR > 1 decode rows (kquant_simd.h) prefetch the rows this many groups of NR ahead
constexpr int64_t kAheadGroups = 2;

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // c10::Half converts in software outside ATen's own kernels
#else
  c10::Half v;
  v.x = h;
  return static_cast<float>(v);
#endif
}

#include "kquant_q8k.h"
#include "kquant_portable.h"

}  // namespace

#if defined(__AVX2__)
#define KQ_NS kq_avx2
#define KQ_VNNI 0
namespace {
#include "kquant_simd.h"
#include "kquant_tile.h"
}
#undef KQ_NS
#undef KQ_VNNI
#endif

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")
#define KQ_NS kq_vnni
#define KQ_VNNI 1
namespace {
#include "kquant_simd.h"
#include "kquant_tile.h"
#include "kquant_amx.h"
}
#undef KQ_NS
#undef KQ_VNNI
#pragma GCC pop_options
#endif

namespace {

enum class Path { kPortable, kAvx2, kVnni };

Path kernel_path() {
#if defined(__AVX512F__)
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  if (vnni) return Path::kVnni;
#endif
#if defined(__AVX2__)
  return Path::kAvx2;
#else
  return Path::kPortable;
#endif
}

// whether this CPU has amx-int8 and Linux lets this process use the tile registers
bool cpu_has_amx_int8() {
#if defined(__AVX512F__)
  return __builtin_cpu_supports("amx-int8") && amx::tiles_permitted();
#else
  return false;
#endif
}
std::atomic<bool> amx_enabled{true};  // kquant_set_amx: the benchmarks' and tests' A/B
// from this many activation rows on, whole tiles of 16 take AMX (kquant_amx.h)
constexpr int64_t kAmxMinRows = 48;

// activation rows the AMX tiles take: whole tiles of 16, where the path and CPU run them
int64_t amx_rows(Path path, int64_t M) {
  if (path != Path::kVnni || M < kAmxMinRows || !amx_enabled.load() || !cpu_has_amx_int8())
    return 0;
  return M / 16 * 16;
}

// activation rows a thread takes at once where they are not grouped in tiles: their int8 rows
// stay in L2 while every weight row of the thread's range passes them
int64_t rows_per_pass(int64_t K) { return std::max<int64_t>(4, (192 * 1024 / K) / 4 * 4); }
// weight rows a thread takes at once (their bytes stay in L2) while each tile of 8 activation
// rows, in L1 at the models' K, passes them
constexpr int64_t kWeightChunk = 192 * 1024;
// above this K a tile's 8 activation rows (8 K bytes) leave the 32 KB L1, and a path with
// tile_rows > 1 takes several weight rows per read of them. Below it one row at a time was as
// fast or faster (the 512-bit VNNI tiles, one core, M = 512, K = 1536: two rows 228-245 G
// integer ops/s, one 233-259; at K = 8960 two rows run Q6_K at 197-213)
constexpr int64_t kTileL1 = 3072;

// weight rows a decode's one activation row takes at once on the VNNI path. With the codes in
// lane order (one vpdpbusd per 32 weights) four Q4_K rows streamed worse than two: Qwen2.5-
// Coder-1.5B's tg128, one thread, three alternated runs each: 13.4-14.3 tok/s with four rows
// and the next group prefetched, 16.5-18.0 with two rows and the group after next (HEAD
// before the lane order: 15.4-16.2). Q6_K at two rows was not clearly better (13.9-17.0
// against 14.4-17.0).
template <int KIND>
constexpr int kPairRows = KIND == kQ6K ? 1 : 2;

// the first `groups` groups of 8 rows through tile(row, g, out, bias), `tile_rows` weight rows
// at a time (then one at a time: tile1), the rest through
// dot(row, m0, m1, out, bias); one activation row (a decode's) through pair(row, out, bias),
// `rows` weight rows at a time, where the path has it (the same bits as dot)
template <int rows, int tile_rows, typename Dot, typename Tile, typename Tile1, typename Pair>
void run_rows(const uint8_t* q, int64_t row_bytes, const Q8K& X, int64_t M, int64_t groups,
              float* out, int64_t N, int64_t n0, int64_t n1, const float* bias, Dot&& dot,
              Tile&& tile, Tile1&& tile1, Pair&& pair) {
  static const float zeros[8] = {};
  const int64_t pass = rows_per_pass(X.K);
  if constexpr (rows > 1) {
    if (M == 1 && groups == 0) {
      int64_t n = n0;
      for (; n + rows <= n1; n += rows) pair(q + n * row_bytes, out + n, bias ? bias + n : nullptr);
      for (; n < n1; ++n) dot(q + n * row_bytes, 0, 1, out + n, bias ? bias[n] : 0.f);
      return;
    }
  }
  if (groups == 0) {  // decode-sized batches
    for (int64_t ms = 0; ms < M; ms += pass) {
      const int64_t me = std::min(M, ms + pass);
      for (int64_t n = n0; n < n1; ++n) dot(q + n * row_bytes, ms, me, out + n, bias ? bias[n] : 0.f);
    }
    return;
  }
  const int64_t chunk = std::max<int64_t>(16, kWeightChunk / row_bytes);
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = std::min(n1, c0 + chunk);
    for (int64_t g = 0; g < groups; ++g) {
      int64_t n = c0;
      if (X.K > kTileL1)
        for (; n + tile_rows <= c1; n += tile_rows)
        tile(q + n * row_bytes, g, out + 8 * g * N + n, bias ? bias + n : zeros);
      for (; n < c1; ++n) tile1(q + n * row_bytes, g, out + 8 * g * N + n, bias ? bias + n : zeros);
    }
    for (int64_t ms = 8 * groups; ms < M; ms += pass) {
      const int64_t me = std::min(M, ms + pass);
      for (int64_t n = c0; n < c1; ++n) dot(q + n * row_bytes, ms, me, out + n, bias ? bias[n] : 0.f);
    }
  }
}

// rows m0..m1-1 of one weight row through row_dot<KIND, 8 / 4 / 3 / 2 / 1>
#define KQ_ROWS(NS)                                                                          \
  [&](const uint8_t* row, int64_t ms, int64_t me, float* o, float bn) {                      \
    int64_t m = ms;                                                                          \
    for (; m + 8 <= me; m += 8) NS::row_dot<KIND, 8>(row, X, m, o + m * N, N, bn);            \
    for (; m + 4 <= me; m += 4) NS::row_dot<KIND, 4>(row, X, m, o + m * N, N, bn);            \
    switch (me - m) {                                                                        \
      case 3: NS::row_dot<KIND, 3>(row, X, m, o + m * N, N, bn); break;                      \
      case 2: NS::row_dot<KIND, 2>(row, X, m, o + m * N, N, bn); break;                      \
      case 1: NS::row_dot<KIND, 1>(row, X, m, o + m * N, N, bn); break;                      \
      default: break;                                                                        \
    }                                                                                        \
  }
#define KQ_TILE(NS, NR) \
  [&](const uint8_t* row, int64_t g, float* o, const float* bn) { NS::tile_dot<KIND, NR>(row, row_bytes, *T, g, o, N, bn); }
#define KQ_PAIR(NS) \
  [&](const uint8_t* row, float* o, const float* bn) { NS::rows_dot<KIND, kPairRows<KIND>, 1>(row, row_bytes, X, 0, o, N, bn); }

template <int KIND>
void linear_rows(Path path, const uint8_t* q, int64_t row_bytes, const Q8K& X, const Q8KTile* T,
                 int64_t M, float* out, int64_t N, int64_t n0, int64_t n1, const float* bias) {
  [[maybe_unused]] const int64_t groups = T ? M / 8 : 0;  // the portable build has no tiles
  switch (path) {
#if defined(__AVX512F__)
    case Path::kVnni:
      run_rows<kPairRows<KIND>, 2>(q, row_bytes, X, M, groups, out, N, n0, n1, bias, KQ_ROWS(kq_vnni),
                                   KQ_TILE(kq_vnni, 2), KQ_TILE(kq_vnni, 1), KQ_PAIR(kq_vnni));
      return;
#endif
#if defined(__AVX2__)
    case Path::kAvx2:
      // one row at a time: AVX2's 16 registers hold one row's 8 sums, and several decode rows
      // were not measured on an AVX2 CPU
      run_rows<1, 1>(q, row_bytes, X, M, groups, out, N, n0, n1, bias, KQ_ROWS(kq_avx2),
                     KQ_TILE(kq_avx2, 1), KQ_TILE(kq_avx2, 1), nullptr);
      return;
#endif
    default:
      run_rows<1, 1>(q, row_bytes, X, M, 0, out, N, n0, n1, bias,
               [&](const uint8_t* row, int64_t ms, int64_t me, float* o, float bn) {
                 for (int64_t m = ms; m < me; m += 16)
                   rows_dot_portable<KIND>(row, X, m, std::min(me, m + 16), o, N, bn);
               },
               [](const uint8_t*, int64_t, float*, const float*) {},
               [](const uint8_t*, int64_t, float*, const float*) {}, nullptr);
  }
}
#undef KQ_ROWS
#undef KQ_TILE
#undef KQ_PAIR

// f(kind) with the kind as a compile-time constant
template <typename F>
void with_kind(int64_t kind, F&& f) {
  if (kind == kQ4K)
    f(std::integral_constant<int, kQ4K>{});
  else if (kind == kQ5K)
    f(std::integral_constant<int, kQ5K>{});
  else
    f(std::integral_constant<int, kQ6K>{});
}

// the weights' K from q [N, K / 256 * bytes]
int64_t check_kquant(int64_t kind, const at::Tensor& q) {
  TORCH_CHECK(kind == kQ4K || kind == kQ5K || kind == kQ6K,
              "kind must be 2 (Q4_K), 3 (Q5_K) or 4 (Q6_K)");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kByte,
              "q must be a contiguous uint8 [N, bytes] tensor");
  TORCH_CHECK(q.size(1) % kBytes[kind] == 0, "q's rows (", q.size(1),
              " bytes) are not whole super-blocks of ", kBytes[kind], " bytes");
  return q.size(1) / kBytes[kind] * 256;
}

}  // namespace

std::string kquant_kernel() {
  switch (kernel_path()) {
    case Path::kVnni: return amx_rows(Path::kVnni, kAmxMinRows) ? "avx512_vnni+amx_int8" : "avx512_vnni";
    case Path::kAvx2: return "avx2";
    default: return "portable";
  }
}

bool kquant_has_amx() { return kernel_path() == Path::kVnni && cpu_has_amx_int8(); }

bool kquant_set_amx(bool enabled) { return amx_enabled.exchange(enabled); }

namespace {

// x [M, K] quantized per 256 (quantize_row; lanes as there, rows before weight_rows in weight
// order)
std::vector<at::Tensor> quantize_x(const at::Tensor& x, int lanes, int64_t weight_rows = 0) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 256 == 0, "x must be [M, K] with K a multiple of 256");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  auto q = at::empty({M, K}, xf.options().dtype(at::kChar));
  auto d = at::empty({M, K / 256}, xf.options());
  auto bsums = at::empty({M, K / 16}, xf.options().dtype(at::kShort));
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(xf.data_ptr<float>() + m * K, K, q.data_ptr<int8_t>() + m * K,
                   d.data_ptr<float>() + m * (K / 256), bsums.data_ptr<int16_t>() + m * (K / 16),
                   m < weight_rows ? 0 : lanes);
  });
  return {q, d, bsums};
}

}  // namespace

std::vector<at::Tensor> kquant_quantize_x(at::Tensor x) { return quantize_x(x, 0); }

at::Tensor kquant_linear(at::Tensor x, int64_t kind, at::Tensor q,
                         c10::optional<at::Tensor> bias) {
  const int64_t K = check_kquant(kind, q), N = q.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bias must be [N]");
  }
  const Path path = kernel_path();
  const int64_t MA = amx_rows(path, x.size(0));
  // the SIMD kernels take the activations in lane order, the portable loops and the AMX tiles
  // (the first MA rows) in weight order
  const auto xq = quantize_x(x, path == Path::kPortable ? 0 : static_cast<int>(kind), MA);
  auto out = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  Q8K X{K, K / 256, xq[0].data_ptr<int8_t>(), xq[1].data_ptr<float>(),
        xq[2].data_ptr<int16_t>()};
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const int64_t row_bytes = q.size(1);
  float* op = out.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#if defined(__AVX512F__)
  if (MA > 0) {
    const int64_t nb = X.nb;
    at::Tensor bx;
    if (kind != kQ6K) {  // each sub-block's sum of 32 times dx, as the tiles' bx
      bx = at::empty({MA * nb * 8}, xq[1].options());
      float* bxp = bx.data_ptr<float>();
      for (int64_t i = 0; i < MA * nb; ++i)
        for (int64_t j = 0; j < 8; ++j)
          bxp[i * 8 + j] =
              static_cast<float>(X.bsums[i * 16 + 2 * j] + X.bsums[i * 16 + 2 * j + 1]) * X.d[i];
    }
    const kq_vnni::AmxRows A{X.q, K, nb, X.d, bx.defined() ? bx.data_ptr<float>() : nullptr};
    constexpr int64_t chunk = 16 * kq_vnni::kAmxTilesPerChunk;
    at::parallel_for(0, (N + chunk - 1) / chunk, 1, [&](int64_t c0, int64_t c1) {
      with_kind(kind, [&](auto k) {
        kq_vnni::amx_rows<decltype(k)::value>(qp, row_bytes, A, MA, op, N, c0 * chunk,
                                              std::min(N, c1 * chunk), bp);
      });
    });
    // the rows left (fewer than 16) take the paths below
    X.q += MA * K, X.d += MA * nb, X.bsums += MA * (K / 16), op += MA * N;
  }
#endif
  const int64_t M = x.size(0) - MA;
  at::Tensor tq, td, tt;
  Q8KTile tile{};
  const int64_t groups = path == Path::kPortable ? 0 : M / 8;
  if (groups > 0) {
    const int64_t nb = X.nb;
    tq = at::empty({groups * nb * 8 * 256}, xq[0].options());
    td = at::empty({groups * nb * 64}, xq[1].options());
    tt = at::empty({groups * nb * (kind == kQ6K ? 128 : 64)},
                   xq[1].options().dtype(kind == kQ6K ? at::kInt : at::kFloat));
    int8_t* tqp = tq.data_ptr<int8_t>();
    float* tdp = td.data_ptr<float>();
    float* bxp = kind == kQ6K ? nullptr : tt.data_ptr<float>();
    int32_t* offp = kind == kQ6K ? tt.data_ptr<int32_t>() : nullptr;
    const bool vector_major = path == Path::kVnni;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t at = g * nb + b;
          for (int64_t m = 0; m < 8; ++m) {
            const int64_t r = 8 * g + m;
            if (vector_major)
              for (int64_t v = 0; v < 8; ++v)
                std::memcpy(tqp + at * 2048 + v * 256 + m * 32, X.q + r * K + b * 256 + v * 32, 32);
            else
              std::memcpy(tqp + at * 2048 + m * 256, X.q + r * K + b * 256, 256);
            const float dx = X.d[r * nb + b];
            for (int64_t i = 0; i < 8; ++i) tdp[at * 64 + m * 8 + i] = dx;
            const int16_t* bs = X.bsums + r * (K / 16) + b * 16;
            if (offp && vector_major)
              for (int64_t i = 0; i < 16; ++i) offp[at * 128 + (i / 8) * 64 + m * 8 + i % 8] = -32 * bs[i];
            else if (offp)
              q6_pair_offsets(X.q + r * K + b * 256, reinterpret_cast<int16_t*>(offp + at * 128) + m * 32);
            else
              for (int64_t i = 0; i < 8; ++i)
                bxp[at * 64 + m * 8 + i] = static_cast<float>(bs[2 * i] + bs[2 * i + 1]) * dx;
          }
        }
    });
    tile = Q8KTile{nb, tqp, tdp, bxp, offp};
  }
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    with_kind(kind, [&](auto k) {
      linear_rows<decltype(k)::value>(path, qp, row_bytes, X, groups > 0 ? &tile : nullptr, M,
                                      op, N, n0, n1, bp);
    });
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor kquant_dequantize(int64_t kind, at::Tensor q, int64_t row_begin, int64_t row_end,
                             c10::optional<at::Tensor> out) {
  const int64_t K = check_kquant(kind, q);
  TORCH_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= q.size(0),
              "rows out of range");
  const int64_t rows = row_end - row_begin;
  at::Tensor o;
  if (out.has_value()) {
    TORCH_CHECK(out->scalar_type() == at::kFloat && out->is_contiguous() &&
                    out->numel() >= rows * K, "out must be a contiguous float32 buffer");
    o = out->view(-1).narrow(0, 0, rows * K).view({rows, K});
  } else {
    o = at::empty({rows, K}, q.options().dtype(at::kFloat));
  }
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const int64_t row_bytes = q.size(1);
  float* op = o.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    with_kind(kind, [&](auto k) {
      constexpr int KIND = decltype(k)::value;
      for (int64_t r = begin; r < end; ++r)
        for (int64_t b = 0; b < K / 256; ++b)
          dequantize_block<KIND>(qp + (row_begin + r) * row_bytes + b * kBytes[KIND],
                                 op + r * K + b * 256);
    });
  });
  return o;
}
