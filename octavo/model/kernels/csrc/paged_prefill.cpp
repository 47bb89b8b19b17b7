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
// they lie in the cache (bf16/fp16 rows are widened to fp32 once per key tile; on a CPU with
// AVX-512 bf16 dot products, bf16 takes prefill_bf16_dot.h's item instead; quantized int8 /
// fp8 rows, kv_rows.h, are dequantized into the same per-tile buffers, scale applied, so the
// tile's inner loops are the fp32 ones and no copy of the cache is made). Everything
// accumulates in fp32 in a fixed order, so a query's output does not depend on which other
// chunks or threads share the step. Items are handed out longest first to the threads.
#include <ATen/Parallel.h>

#include "kv_rows.h"
#include "ops.h"
#include "prefill_bf16_dot.h"
#include "prefill_tile.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace octavo::prefill;
using octavo::to_float;
using octavo::Vec;

// KV: how the cache's rows read (kv_rows.h); k_scales / v_scales: fp8's per-head scales
template <typename T, typename KV>
void run_item(const Item& w, const T* q, const typename KV::S* k_cache,
              const typename KV::S* v_cache, const int64_t* tables, const int64_t* query_start,
              const int64_t* start_pos, T* out, const Shape& s, Scratch& sc,
              const float* k_scales, const float* v_scales) {
  using S = typename KV::S;
  const float khs = octavo::head_scale<KV>(k_scales, w.kv_head);
  const float vhs = octavo::head_scale<KV>(v_scales, w.kv_head);
  const Geometry g = geometry(w, tables, query_start, start_pos, s);
  const int64_t D = g.D, rp = g.rp;
  init_rows(g, w, s, sc);
  float *qt = sc.qt.data(), *ot = sc.ot.data();
  for (int64_t r = 0; r < rp; ++r) {
    const T* qr = query_row(w, g, q, s, r);
    for (int64_t d = 0; d < D; ++d) qt[d * rp + r] = qr ? to_float(qr[d]) * s.scale : 0.f;
  }
  const float* kp[KB];
  const float* vp[KB];
  for (int64_t k0 = g.k_begin; k0 < g.k_end; k0 += KB) {
    const int64_t n = std::min<int64_t>(KB, g.k_end - k0);
    for (int64_t t = 0; t < KB; ++t) {
      if (t >= n) {
        kp[t] = vp[t] = sc.zero.data();
        continue;
      }
      const int64_t off = key_offset(g, s, w, k0 + t);
      const S* kr = k_cache + off;
      const S* vr = v_cache + off;
      if constexpr (std::is_same_v<S, float>) {
        kp[t] = kr;
        vp[t] = vr;
      } else if constexpr (KV::kQuant) {
        float* kb = sc.kbuf.data() + t * D;
        float* vb = sc.vbuf.data() + t * D;
        const float ks = octavo::row_scale<KV>(kr, D, khs);
        const float vs = octavo::row_scale<KV>(vr, D, vhs);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kb[d] = octavo::kv_value<KV>(kr[d]) * ks;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vb[d] = octavo::kv_value<KV>(vr[d]) * vs;
        kp[t] = kb;
        vp[t] = vb;
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
    const bool masked = tile_masked(g, s, k0, n);
    for (int64_t v = 0; v < g.nvec; ++v) {
      Vec dots[KB], sv[KB];  // the sums stay in registers; sv, whose address the softmax
                             // takes, would be stored back at every d
      for (int t = 0; t < KB; ++t) dots[t] = Vec::zero();
      for (int64_t d = 0; d < D; ++d) {
        const Vec qv = Vec::load(qt + d * rp + v * L);
#pragma GCC unroll 16
        for (int t = 0; t < KB; ++t) dots[t] = fma(Vec::set1(kp[t][d]), qv, dots[t]);
      }
      for (int t = 0; t < KB; ++t) sv[t] = dots[t];
      const Vec f = softmax_tile(sv, n, k0, masked, v, s, sc);
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
  finish_rows(g, w, out, sc);
}

// every item through `run`, handed out in order (longest first) to the threads as they free up
template <typename F>
void run_items(const std::vector<Item>& items, int64_t rows_padded, int64_t head_dim, F&& run) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch sc(rows_padded, head_dim);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) run(items[i], sc);
  });
}

}  // namespace

at::Tensor paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor block_tables, at::Tensor query_start, at::Tensor start_pos,
                         double scale, int64_t window, double softcap, bool bf16_dot,
                         c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [T,H,D], cache [NB,BS,KVH,D] expected");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "q's heads and the caches must be contiguous (q's rows may be strided)");
  const KVCacheFormat fmt = kv_cache_format(q, k_cache, v_cache, k_scale, v_scale);
  block_tables = block_tables.to(at::kLong).contiguous();
  query_start = query_start.to(at::kLong).contiguous();
  start_pos = start_pos.to(at::kLong).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), C = start_pos.size(0);
  TORCH_CHECK(H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
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
                    static_cast<float>(softcap), k_cache.size(3)};
  const int64_t rows_padded = (kQueryTile * group + L - 1) / L * L;
#if defined(__AVX512F__)
  if (bf16_dot && fmt.kind == KVKind::kPlain && q.scalar_type() == at::kBFloat16 &&
      cpu_has_bf16_dot()) {
    const auto bits = [](const at::Tensor& t) {
      return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
    };
    const uint16_t *qp = bits(q), *kc = bits(k_cache), *vc = bits(v_cache);
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    run_items(items, rows_padded, D, [&](const Item& w, Scratch& sc) {
      run_item_bf16_dot(w, qp, kc, vc, bt, qs, sp, op, shape, sc);
    });
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    auto run = [&](auto kv, const auto* kc, const auto* vc) {
      using KV = decltype(kv);
      run_items(items, rows_padded, D, [&](const Item& w, Scratch& sc) {
        run_item<scalar_t, KV>(w, qp, kc, vc, bt, qs, sp, op, shape, sc, fmt.k_scales,
                               fmt.v_scales);
      });
    };
    const auto* kb = static_cast<const uint8_t*>(k_cache.data_ptr());
    const auto* vb = static_cast<const uint8_t*>(v_cache.data_ptr());
    switch (fmt.kind) {
      case KVKind::kInt8:
        run(octavo::Int8KV{}, reinterpret_cast<const int8_t*>(kb),
            reinterpret_cast<const int8_t*>(vb));
        break;
      case KVKind::kFp8E4M3: run(octavo::Fp8E4M3KV{}, kb, vb); break;
      case KVKind::kFp8E5M2: run(octavo::Fp8E5M2KV{}, kb, vb); break;
      default:
        run(octavo::PlainKV<scalar_t>{}, k_cache.data_ptr<scalar_t>(),
            v_cache.data_ptr<scalar_t>());
    }
  });
  return out;
}

bool prefill_bf16_dot() { return cpu_has_bf16_dot(); }
