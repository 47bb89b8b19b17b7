// Paged attention for every prefill chunk of a step in one call (prompts, chunked-prefill
// continuations, prefix-cache hits, speculative verification chunks): each chunk's queries
// attend to its sequence's keys read in place through its block table, causal inside the
// chunk, optionally within a sliding window and through a soft cap.
//
// Work item: (chunk, KV head, a tile of up to kQueryTile query positions). Its rows, every
// query head of the KV head's group at every position of the tile, sit in the lanes of fp32
// vectors, so one K or V element broadcast against a vector of rows is one FMA for L rows:
//   - scores: s[t][rows] += k[t][d] * q^T[d][rows], for KB keys at a time (KB vectors);
//   - online softmax over keys with rows in lanes: the max and the sum over keys are
//     element-wise across those KB vectors, never a horizontal reduction;
//   - output: o^T[d][rows] += v[t][d] * p[t][rows], DB output dims at a time.
// Only q is transposed (once per item) and o (once, at the end); K and V rows are read where
// they lie in the cache (bf16/fp16 rows are widened to fp32 once per key tile). Everything
// accumulates in fp32 in a fixed order, so a query's output does not depend on which other
// chunks or threads share the step. Items are handed out longest first to the threads.
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec_math.h"
#include "vec_traits.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using octavo::store;
using octavo::to_float;
using octavo::Vec;

constexpr int64_t kQueryTile = 16;
constexpr int L = Vec::L;
#if defined(__AVX512F__)
constexpr int KB = 16, DB = 8;  // 32 zmm registers: 16 scores + 8 outputs + a broadcast
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int KB = 8, DB = 4;  // 16 ymm registers
#else
constexpr int KB = 4, DB = 2;  // 16 xmm registers, two per 8-lane Vec
#endif

struct Item {
  int64_t chunk, kv_head, q0, nq, cost;
};

struct Shape {
  int64_t q_row_stride;  // elements between two rows of q (a view into the fused qkv buffer)
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_width;
  float scale;
  int64_t window;  // 0: none
  float softcap;   // 0: none
};

// Per-thread scratch, sized for the largest item.
struct Scratch {
  std::vector<float> qt, ot, m, l, pos, lo, kbuf, vbuf, zero, lanes;
  Scratch(int64_t rows_padded, int64_t head_dim)
      : qt(head_dim * rows_padded), ot(head_dim * rows_padded), m(rows_padded),
        l(rows_padded), pos(rows_padded), lo(rows_padded), kbuf(KB * head_dim),
        vbuf(KB * head_dim), zero(head_dim, 0.f), lanes(L) {}
};

template <typename T>
void run_item(const Item& w, const T* q, const T* k_cache, const T* v_cache,
              const int64_t* tables, const int64_t* query_start, const int64_t* start_pos,
              T* out, const Shape& s, Scratch& sc) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t D = s.head_dim, H = s.num_heads, group = H / s.num_kv_heads;
  const int64_t rows = w.nq * group, nvec = (rows + L - 1) / L, rp = nvec * L;
  const int64_t row0 = query_start[w.chunk] + w.q0;  // the tile's first row in q and out
  const int64_t p_first = start_pos[w.chunk] + w.q0, p_last = p_first + w.nq - 1;
  const int64_t* table = tables + w.chunk * s.table_width;
  float *qt = sc.qt.data(), *ot = sc.ot.data(), *m = sc.m.data(), *l = sc.l.data();
  // rows r = i * group + g: position p_first + i, query head kv_head * group + g
  for (int64_t r = 0; r < rp; ++r) {
    const int64_t i = std::min(r / group, w.nq - 1);  // padding lanes repeat the last position
    sc.pos[r] = static_cast<float>(p_first + i);
    sc.lo[r] = s.window > 0 ? static_cast<float>(p_first + i - s.window + 1) : -1.f;
    m[r] = neg_inf;
    l[r] = 0.f;
    const T* qr = r < rows ? q + (row0 + i) * s.q_row_stride + (w.kv_head * group + r % group) * D
                           : nullptr;
    for (int64_t d = 0; d < D; ++d) {
      qt[d * rp + r] = qr ? to_float(qr[d]) * s.scale : 0.f;
      ot[d * rp + r] = 0.f;
    }
  }
  const int64_t k_begin = s.window > 0 ? std::max<int64_t>(0, p_first - s.window + 1) : 0;
  const int64_t k_end = p_last + 1;
  const int64_t row_stride = s.num_kv_heads * D;  // elements between two slots of a block
  const float* kp[KB];
  const float* vp[KB];
  for (int64_t k0 = k_begin; k0 < k_end; k0 += KB) {
    const int64_t n = std::min<int64_t>(KB, k_end - k0);
    for (int64_t t = 0; t < KB; ++t) {
      if (t >= n) {
        kp[t] = vp[t] = sc.zero.data();
        continue;
      }
      const int64_t pos = k0 + t;
      const int64_t slot = table[pos / s.block_size] * s.block_size + pos % s.block_size;
      const T* kr = k_cache + slot * row_stride + w.kv_head * D;
      const T* vr = v_cache + slot * row_stride + w.kv_head * D;
      if constexpr (std::is_same_v<T, float>) {
        kp[t] = kr;
        vp[t] = vr;
      } else {
        float* kb = sc.kbuf.data() + t * D;
        float* vb = sc.vbuf.data() + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kb[d] = to_float(kr[d]);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vb[d] = to_float(vr[d]);
        kp[t] = kb;
        vp[t] = vb;
      }
    }
    // keys past the diagonal or before the window's start: some lanes must be masked
    const bool masked = k0 + n - 1 > p_first || (s.window > 0 && k0 < p_last - s.window + 1);
    for (int64_t v = 0; v < nvec; ++v) {
      Vec sv[KB];
      for (int t = 0; t < KB; ++t) sv[t] = Vec::zero();
      for (int64_t d = 0; d < D; ++d) {
        const Vec qv = Vec::load(qt + d * rp + v * L);
#pragma GCC unroll 16
        for (int t = 0; t < KB; ++t) sv[t] = fma(Vec::set1(kp[t][d]), qv, sv[t]);
      }
      if (s.softcap > 0.f) {
        for (int t = 0; t < n; ++t) {
          sv[t].store(sc.lanes.data());
          for (int j = 0; j < L; ++j)
            sc.lanes[j] = s.softcap * std::tanh(sc.lanes[j] / s.softcap);
          sv[t] = Vec::load(sc.lanes.data());
        }
      }
      if (masked) {
        const Vec lo = Vec::load(sc.lo.data() + v * L), hi = Vec::load(sc.pos.data() + v * L);
        for (int t = 0; t < n; ++t)
          sv[t] = keep_between(sv[t], Vec::set1(static_cast<float>(k0 + t)), lo, hi);
      }
      for (int t = static_cast<int>(n); t < KB; ++t) sv[t] = Vec::set1(neg_inf);
      Vec mx = sv[0];
      for (int t = 1; t < KB; ++t) mx = max(mx, sv[t]);
      const Vec m_old = Vec::load(m + v * L), m_new = max(m_old, mx);
      const Vec f = exp(m_old - m_new);  // 0 while a lane has seen no key (-inf - -inf: NaN)
      Vec sum = Vec::zero();
      for (int t = 0; t < KB; ++t) {
        sv[t] = exp(sv[t] - m_new);  // masked keys: 0
        sum = sum + sv[t];
      }
      m_new.store(m + v * L);
      fma(Vec::load(l + v * L), f, sum).store(l + v * L);
      for (int64_t d0 = 0; d0 < D; d0 += DB) {
        Vec acc[DB];
        for (int j = 0; j < DB; ++j) acc[j] = Vec::load(ot + (d0 + j) * rp + v * L) * f;
        for (int t = 0; t < n; ++t) {
#pragma GCC unroll 8
          for (int j = 0; j < DB; ++j) acc[j] = fma(Vec::set1(vp[t][d0 + j]), sv[t], acc[j]);
        }
        for (int j = 0; j < DB; ++j) acc[j].store(ot + (d0 + j) * rp + v * L);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / l[r];  // every query sees at least its own key
    T* o = out + ((row0 + r / group) * H + w.kv_head * group + r % group) * D;
    for (int64_t d = 0; d < D; ++d) store(o + d, ot[d * rp + r] * inv);
  }
}

}  // namespace

at::Tensor paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor block_tables, at::Tensor query_start, at::Tensor start_pos,
                         double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [T,H,D], cache [NB,BS,KVH,D] expected");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "q's heads and the caches must be contiguous (q's rows may be strided)");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the cache must have one dtype");
  block_tables = block_tables.to(at::kLong).contiguous();
  query_start = query_start.to(at::kLong).contiguous();
  start_pos = start_pos.to(at::kLong).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), C = start_pos.size(0);
  TORCH_CHECK(H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(k_cache.size(3) == D, "cache head_dim differs from q's");
  TORCH_CHECK(D % DB == 0, "head_dim must be a multiple of ", DB);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == C && query_start.size(0) == C + 1,
              "one block table, one start position and query_start[C+1] per chunk expected");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* sp = start_pos.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[C] == T, "query_start must run from 0 to q's rows");
  std::vector<Item> items;
  const int64_t group = H / KVH;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t qlen = qs[c + 1] - qs[c];
    TORCH_CHECK(qlen >= 0 && sp[c] >= 0, "chunk ", c, ": bad query range or start position");
    TORCH_CHECK((sp[c] + qlen + BS - 1) / BS <= block_tables.size(1),
                "chunk ", c, ": its block table is shorter than its context");
    for (int64_t q0 = 0; q0 < qlen; q0 += kQueryTile) {
      const int64_t nq = std::min(kQueryTile, qlen - q0), last = sp[c] + q0 + nq;
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, sp[c] + q0 - window + 1) : 0;
      for (int64_t h = 0; h < KVH; ++h) items.push_back({c, h, q0, nq, nq * (last - first_key)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  auto out = at::empty({T, H, D}, q.options());
  const Shape shape{q.stride(0), H, KVH, D, BS, block_tables.size(1), static_cast<float>(scale), window,
                    static_cast<float>(softcap)};
  const int64_t rows_padded = (kQueryTile * group + L - 1) / L * L;
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::atomic<int64_t> next{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      Scratch sc(rows_padded, D);
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1))
        run_item<scalar_t>(items[i], qp, kc, vc, bt, qs, sp, op, shape, sc);
    });
  });
  return out;
}
