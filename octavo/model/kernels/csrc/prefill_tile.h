// The pieces of a paged-prefill work item that every flavour of its inner loops shares
// (paged_prefill.cpp: fp32 FMAs; prefill_bf16_dot.h: AVX-512 bf16 dot products): the item's
// geometry, its rows' positions and softmax state, the key slots, the online softmax of one
// key tile and the final normalisation. They are always inlined, so the same code runs inside
// a function compiled for a wider target (the bf16-dot item) as inside the plain one.
#pragma once

#include "vec_math.h"
#include "vec_traits.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#define OCTAVO_ALWAYS_INLINE inline __attribute__((always_inline))

namespace octavo::prefill {

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
  int64_t head_stride;  // elements between a slot's KV heads: head_dim, + 4 for int8 rows
};

// Per-thread scratch, sized for the largest item. qt/ot: q^T and o^T, [head_dim][rows]; kbuf,
// vbuf: one key tile's K and V rows widened to fp32. For bf16 dot products (prefill_bf16_dot.h)
// q2 and v2 hold bf16 pairs in 32-bit words: q^T [head_dim/2][rows] and a key tile's V in pairs
// of keys [KB/2][head_dim]; zero16: a row of bf16 zeros.
struct Scratch {
  std::vector<float> qt, ot, m, l, pos, lo, kbuf, vbuf, zero, lanes;
  std::vector<uint32_t> q2, v2;
  std::vector<uint16_t> zero16;
  Scratch(int64_t rows_padded, int64_t head_dim)
      : qt(head_dim * rows_padded), ot(head_dim * rows_padded), m(rows_padded),
        l(rows_padded), pos(rows_padded), lo(rows_padded), kbuf(KB * head_dim),
        vbuf(KB * head_dim), zero(head_dim, 0.f), lanes(L), q2(head_dim / 2 * rows_padded),
        v2(KB / 2 * head_dim), zero16(head_dim, 0) {}
};

// Where an item's rows are: row r = i * group + g is position p_first + i, query head
// kv_head * group + g; rows are padded to rp (whole vectors) by repeating the last position.
struct Geometry {
  int64_t D, H, group, rows, nvec, rp, row0, p_first, p_last, k_begin, k_end, row_stride;
  const int64_t* table;
};

OCTAVO_ALWAYS_INLINE Geometry geometry(const Item& w, const int64_t* tables,
                                       const int64_t* query_start, const int64_t* start_pos,
                                       const Shape& s) {
  Geometry g;
  g.D = s.head_dim;
  g.H = s.num_heads;
  g.group = g.H / s.num_kv_heads;
  g.rows = w.nq * g.group;
  g.nvec = (g.rows + L - 1) / L;
  g.rp = g.nvec * L;
  g.row0 = query_start[w.chunk] + w.q0;  // the tile's first row in q and out
  g.p_first = start_pos[w.chunk] + w.q0;
  g.p_last = g.p_first + w.nq - 1;
  g.k_begin = s.window > 0 ? std::max<int64_t>(0, g.p_first - s.window + 1) : 0;
  g.k_end = g.p_last + 1;
  g.row_stride = s.num_kv_heads * s.head_stride;  // elements between two slots of a block
  g.table = tables + w.chunk * s.table_width;
  return g;
}

// row r's query vector in q (nullptr for a padding row)
template <typename T>
OCTAVO_ALWAYS_INLINE const T* query_row(const Item& w, const Geometry& g, const T* q,
                                        const Shape& s, int64_t r) {
  if (r >= g.rows) return nullptr;
  return q + (g.row0 + r / g.group) * s.q_row_stride + (w.kv_head * g.group + r % g.group) * g.D;
}

// every row's position, window start and softmax state; o^T zeroed
OCTAVO_ALWAYS_INLINE void init_rows(const Geometry& g, const Item& w, const Shape& s,
                                    Scratch& sc) {
  for (int64_t r = 0; r < g.rp; ++r) {
    const int64_t i = std::min(r / g.group, w.nq - 1);
    sc.pos[r] = static_cast<float>(g.p_first + i);
    sc.lo[r] = s.window > 0 ? static_cast<float>(g.p_first + i - s.window + 1) : -1.f;
    sc.m[r] = -std::numeric_limits<float>::infinity();
    sc.l[r] = 0.f;
  }
  std::fill(sc.ot.begin(), sc.ot.begin() + g.D * g.rp, 0.f);
}

// the element offset of key position `pos`'s row (this item's KV head) in the cache
OCTAVO_ALWAYS_INLINE int64_t key_offset(const Geometry& g, const Shape& s, const Item& w,
                                        int64_t pos) {
  const int64_t slot = g.table[pos / s.block_size] * s.block_size + pos % s.block_size;
  return slot * g.row_stride + w.kv_head * s.head_stride;
}

// keys past the diagonal or before the window's start: some lanes of the tile must be masked
OCTAVO_ALWAYS_INLINE bool tile_masked(const Geometry& g, const Shape& s, int64_t k0, int64_t n) {
  return k0 + n - 1 > g.p_first || (s.window > 0 && k0 < g.p_last - s.window + 1);
}

// One key tile's scores (keys k0..k0+n-1 in sv[0..n), for the rows of vector v) become the
// tile's probabilities under the running max; the running max and sum are updated, and the
// factor the rows' output so far must be scaled by is returned. Keys n..KB-1 get 0.
OCTAVO_ALWAYS_INLINE Vec softmax_tile(Vec (&sv)[KB], int64_t n, int64_t k0, bool masked,
                                      int64_t v, const Shape& s, Scratch& sc) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (s.softcap > 0.f) {
    for (int t = 0; t < n; ++t) {
      sv[t].store(sc.lanes.data());
      for (int j = 0; j < L; ++j) sc.lanes[j] = s.softcap * std::tanh(sc.lanes[j] / s.softcap);
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
  float* m = sc.m.data() + v * L;
  float* l = sc.l.data() + v * L;
  const Vec m_old = Vec::load(m), m_new = max(m_old, mx);
  const Vec f = exp(m_old - m_new);  // 0 while a lane has seen no key (-inf - -inf: NaN)
  Vec sum = Vec::zero();
  for (int t = 0; t < KB; ++t) {
    sv[t] = exp(sv[t] - m_new);  // masked keys: 0
    sum = sum + sv[t];
  }
  m_new.store(m);
  fma(Vec::load(l), f, sum).store(l);
  return f;
}

// o = o^T transposed back and divided by the rows' sums
template <typename T>
OCTAVO_ALWAYS_INLINE void finish_rows(const Geometry& g, const Item& w, T* out,
                                      const Scratch& sc) {
  for (int64_t r = 0; r < g.rows; ++r) {
    const float inv = 1.f / sc.l[r];  // every query sees at least its own key
    T* o = out + ((g.row0 + r / g.group) * g.H + w.kv_head * g.group + r % g.group) * g.D;
    for (int64_t d = 0; d < g.D; ++d) store(o + d, sc.ot[d * g.rp + r] * inv);
  }
}

}  // namespace octavo::prefill
