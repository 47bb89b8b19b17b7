// Paged attention for single-token decode on CPU.
//
// One work item per sequence (per part of its KV heads where the threads outnumber the
// sequences). It walks the sequence's block table once; each block holds
// [block_size, num_kv_heads, head_dim] contiguous K (and V) rows, so a block is one sequential
// read, and the next block is prefetched, a slice at a time, while this one is used (blocks sit
// anywhere in the pool, which the hardware prefetcher cannot guess; block_prefetch.h). Threads
// take sequences longest first as they free up. Softmax is online (flash-decoding style):
// per (KV head, query head of its group) a running max, a running sum and an fp32 accumulator,
// rescaled only when a block raises the max. The query heads of a GQA group share every K/V row
// they read. exp() is a vectorisable polynomial (about 1 ulp). Everything accumulates in fp32
// in a fixed order, so results do not depend on batch composition or thread count.
//
// Sliding-window layers: a sequence's table may start at its window's first block (first_pos
// gives the position of the table's first slot), and only keys at positions >= len - window are
// seen. Soft-capped layers (Gemma 2): each score s becomes cap * tanh(s / cap) before the softmax.
//
// Quantized pages (kv_rows.h): int8 or fp8 rows are widened in registers, unscaled, and each
// row's scale multiplies its dot product (K) or its softmax weight (V), so the step reads the
// cache's 8-bit bytes and nothing else; everything still accumulates in fp32. Their SIMD paths
// (decode_quant_avx2.h, decode_quant_avx512.h) widen each value once for its whole GQA group.
//
// Three builds of this file exist (cpu_ops.py): with AVX-512 (decode_avx512.h, 16 keys at a
// time), with AVX2 + FMA (decode_avx2.h, 8 keys at a time) and portable (the loops below).
#include <ATen/Parallel.h>

#include "block_prefetch.h"
#include "kv_rows.h"
#include "ops.h"
#include "vec_math.h"
#include "decode_avx2.h"
#include "decode_avx512.h"
#include "decode_quant_avx2.h"
#include "decode_quant_avx512.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using octavo::exp_approx;
using octavo::head_scale;
using octavo::kv_row;
using octavo::row_scale;
using octavo::store;

// HD: head_dim fixed at compile time (fully unrolled loops), or 0 for any head_dim.
// first_pos: null, or per sequence the position of its table's first slot.
// KV: how the cache's rows read (kv_rows.h); k_scales / v_scales: fp8's per-head scales.
template <typename T, typename KV, int64_t HD>
void decode_kernel(const T* q, const typename KV::S* k_cache, const typename KV::S* v_cache,
                   const int64_t* block_tables, const int64_t* context_lens,
                   const int64_t* first_pos, T* out, int64_t num_seqs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim_arg, int64_t block_size,
                   int64_t table_width, float scale, int64_t window, float softcap,
                   const float* k_scales, const float* v_scales) {
  using S = typename KV::S;
  const int64_t head_dim = HD ? HD : head_dim_arg;
  const int64_t hs = head_dim + KV::kExtra;  // elements between a slot's KV heads
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * hs;  // elements between slots in the cache
  const int64_t block_elems = block_size * row;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(S));
  // Sequences go to the threads longest first, each thread taking the next one when it is done
  // (a static split gave one thread 27% more keys than the other on `mixed`); which thread
  // computes a sequence changes nothing in its result.
  std::vector<int64_t> order(num_seqs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return context_lens[a] > context_lens[b];
  });
  // Fewer sequences than threads (one long sequence at batch 1): each sequence's KV heads are
  // split into up to threads / num_seqs parts, a work item each, so that no thread sits idle.
  // A query head's sums run in the same order either way: results do not change.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t parts = num_seqs >= threads ? 1
      : std::min<int64_t>(num_kv_heads, (threads + num_seqs - 1) / num_seqs);
  const int64_t part_kv = (num_kv_heads + parts - 1) / parts;  // KV heads per item
  const int64_t per_seq = (num_kv_heads + part_kv - 1) / part_kv;
  const int64_t items = num_seqs * per_seq;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // per query head: q (scaled), running max, running sum, accumulator; per block: scores
    std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim);
    std::vector<float> mx(num_heads), sum(num_heads), scores(num_heads * block_size);
    std::vector<float> kbuf(head_dim), vbuf(head_dim), khs(num_kv_heads), vhs(num_kv_heads);
    std::vector<float> work(KV::kQuant ? 272 * group : 0);  // the quantized SIMD paths' scratch
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t b = order[i / per_seq];
      // this item's KV heads kv0.. and their query heads h0..; K/V rows stay `row` apart
      const int64_t kv0 = (i % per_seq) * part_kv;
      const int64_t nkv = std::min(part_kv, num_kv_heads - kv0);
      const int64_t nh = nkv * group, h0 = kv0 * group;
      const S* kc = k_cache + kv0 * hs;
      const S* vc = v_cache + kv0 * hs;
      for (int64_t h = 0; h < nkv; ++h) {
        khs[h] = head_scale<KV>(k_scales, kv0 + h);
        vhs[h] = head_scale<KV>(v_scales, kv0 + h);
      }
      T* ob = out + (b * num_heads + h0) * head_dim;
      // keys are read from table slot lo to len (both relative to the table's first slot)
      const int64_t fp = first_pos ? first_pos[b] : 0;
      const int64_t len = context_lens[b] - fp;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t* table = block_tables + b * table_width;
      const T* qb = q + (b * num_heads + h0) * head_dim;
      for (int64_t i = 0; i < nh * head_dim; ++i) qf[i] = static_cast<float>(qb[i]) * scale;
#if defined(OCTAVO_HAVE_AVX512_DECODE) || defined(OCTAVO_HAVE_AVX2_DECODE)
      if constexpr (HD != 0 && KV::kQuant) {
#ifdef OCTAVO_HAVE_AVX512_DECODE
        octavo::decode_seq_quant_avx512<T, KV, HD>(
#else
        octavo::decode_seq_quant_avx2<T, KV, HD>(
#endif
            qf.data(), kc, vc, table, lo, len, nh, nkv, row, block_size, softcap, khs.data(),
            vhs.data(), mx.data(), sum.data(), acc.data(), work.data(), ob);
        continue;
      } else if constexpr (HD != 0 && (std::is_same_v<T, float> ||
                                       std::is_same_v<T, c10::BFloat16>)) {
#ifdef OCTAVO_HAVE_AVX512_DECODE
        octavo::decode_seq_avx512<T, HD>(
#else
        octavo::decode_seq_avx2<T, HD>(
#endif
            qf.data(), kc, vc, table, lo, len, nh, nkv, row, block_size, softcap, mx.data(),
            sum.data(), acc.data(), ob);
        continue;
      }
#endif
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      const int64_t nblocks = (len + block_size - 1) / block_size;
      octavo::BlockPrefetch ahead(block_bytes, nh);  // a slice per head's softmax
      for (int64_t j = lo / block_size; j < nblocks; ++j) {
        const S* kb = kc + table[j] * block_elems;
        const S* vb = vc + table[j] * block_elems;
        if (j + 1 < nblocks)
          ahead.start(kc + table[j + 1] * block_elems, vc + table[j + 1] * block_elems);
        const int64_t t_lo = j == lo / block_size ? lo % block_size : 0;
        const int64_t n = std::min(block_size, len - j * block_size);
        // scores[head][t] = q_head . k_t
        for (int64_t t = t_lo; t < n; ++t) {
          for (int64_t h = 0; h < nkv; ++h) {
            const S* kq = kb + t * row + h * hs;
            const float* kr = kv_row<KV>(kq, kbuf.data(), head_dim);
            const float ks = row_scale<KV>(kq, head_dim, khs[h]);
            for (int64_t g = 0; g < group; ++g) {
              const int64_t head = h * group + g;
              const float* qh = qf.data() + head * head_dim;
              float s = 0.f;
#pragma omp simd reduction(+ : s)
              for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * kr[d];
              if constexpr (KV::kQuant) s *= ks;
              scores[head * block_size + t] = softcap > 0.f ? softcap * std::tanh(s / softcap) : s;
            }
          }
        }
        // online softmax: raise the running max, rescale, exponentiate this block's scores
        for (int64_t head = 0; head < nh; ++head) {
          ahead.some();
          float* sh = scores.data() + head * block_size;
          float m = mx[head];
          for (int64_t t = t_lo; t < n; ++t) m = sh[t] > m ? sh[t] : m;
          if (m > mx[head]) {
            const float f = exp_approx(mx[head] - m);  // 0 on the first block (-inf)
            float* ah = acc.data() + head * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ah[d] *= f;
            sum[head] *= f;
            mx[head] = m;
          }
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t t = t_lo; t < n; ++t) {
            sh[t] = exp_approx(sh[t] - m);
            s += sh[t];
          }
          sum[head] += s;
        }
        // acc[head] += p[head][t] * v_t
        for (int64_t t = t_lo; t < n; ++t) {
          for (int64_t h = 0; h < nkv; ++h) {
            const S* vq = vb + t * row + h * hs;
            const float* vr = kv_row<KV>(vq, vbuf.data(), head_dim);
            const float vs = row_scale<KV>(vq, head_dim, vhs[h]);
            for (int64_t g = 0; g < group; ++g) {
              const int64_t head = h * group + g;
              const float p = KV::kQuant ? scores[head * block_size + t] * vs
                                         : scores[head * block_size + t];
              float* ah = acc.data() + head * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * vr[d];
            }
          }
        }
      }
      for (int64_t head = 0; head < nh; ++head) {
        const float inv = 1.f / sum[head];
        for (int64_t d = 0; d < head_dim; ++d)
          store(ob + head * head_dim + d, acc[head * head_dim + d] * inv);
      }
    }
  });
}

}  // namespace

namespace {

// every head_dim this kernel is compiled for, then the generic one
template <typename T, typename KV>
auto decode_for(int64_t D) {
  return D == 64    ? decode_kernel<T, KV, 64>
         : D == 128 ? decode_kernel<T, KV, 128>
         : D == 256 ? decode_kernel<T, KV, 256>  // Gemma 2/3
                    : decode_kernel<T, KV, 0>;
}

}  // namespace

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor context_lens, double scale,
                           c10::optional<at::Tensor> first_pos, int64_t window,
                           double softcap, c10::optional<at::Tensor> k_scale,
                           c10::optional<at::Tensor> v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [B,H,D], cache [NB,BS,KVH,D] expected");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "contiguous tensors expected");
  const KVCacheFormat fmt = kv_cache_format(q, k_cache, v_cache, k_scale, v_scale);
  block_tables = block_tables.to(at::kLong).contiguous();
  context_lens = context_lens.to(at::kLong).contiguous();
  auto out = at::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B,
              "one block table and one context length per sequence expected");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  at::Tensor fp;
  if (first_pos.has_value()) {
    fp = first_pos->to(at::kLong).contiguous();
    TORCH_CHECK(fp.dim() == 1 && fp.size(0) == B, "one first position per sequence expected");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto kernel, const auto* kc, const auto* vc) {
      kernel(q.data_ptr<scalar_t>(), kc, vc, block_tables.data_ptr<int64_t>(),
             context_lens.data_ptr<int64_t>(), fp.defined() ? fp.data_ptr<int64_t>() : nullptr,
             out.data_ptr<scalar_t>(), B, H, KVH, D, BS, block_tables.size(1),
             static_cast<float>(scale), window, static_cast<float>(softcap), fmt.k_scales,
             fmt.v_scales);
    };
    const auto* kb = static_cast<const uint8_t*>(k_cache.data_ptr());
    const auto* vb = static_cast<const uint8_t*>(v_cache.data_ptr());
    switch (fmt.kind) {
      case KVKind::kInt8:
        run(decode_for<scalar_t, octavo::Int8KV>(D), reinterpret_cast<const int8_t*>(kb),
            reinterpret_cast<const int8_t*>(vb));
        break;
      case KVKind::kFp8E4M3:
        run(decode_for<scalar_t, octavo::Fp8E4M3KV>(D), kb, vb);
        break;
      case KVKind::kFp8E5M2:
        run(decode_for<scalar_t, octavo::Fp8E5M2KV>(D), kb, vb);
        break;
      default:
        run(decode_for<scalar_t, octavo::PlainKV<scalar_t>>(D), k_cache.data_ptr<scalar_t>(),
            v_cache.data_ptr<scalar_t>());
    }
  });
  return out;
}

std::string compiled_isa() {
#if defined(OCTAVO_HAVE_AVX512_DECODE)
  return "avx512";
#elif defined(OCTAVO_HAVE_AVX2_DECODE)
  return "avx2";
#else
  return "portable";
#endif
}
