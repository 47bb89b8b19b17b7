// The paged-prefill work item for bf16 on a CPU with AVX-512 bf16 dot products (avx512_bf16:
// Cooper Lake, Sapphire Rapids and later, AMD Zen 4 and later). vdpbf16ps multiplies pairs of
// bf16 values and adds both products to an fp32 lane, so each instruction does the work of
// two FMAs and the K/V rows are read as bf16, never widened:
//   - scores: a lane holds one row (query position x head), q^T is stored as pairs
//     (q[2i], q[2i+1]) per row, and a key's pair (k[2i], k[2i+1]), adjacent in the cache, is
//     broadcast: s[t][rows] += q.k over head_dim / 2 instructions; the scale multiplies the
//     sum (the fp32 path scales q instead);
//   - output: the tile's probabilities are rounded to bf16 and paired across two keys per
//     lane, (p[t][r], p[t+1][r]), against V packed the same way, (v[t][d], v[t+1][d]), once
//     per key tile: o^T[d][rows] += p.v over the tile's keys / 2 instructions.
// The softmax, its running max and sum, and the accumulators stay fp32 (prefill_tile.h).
// The AVX-512 build is compiled without avx512_bf16 (its flags must run on every AVX-512
// CPU), so this one function is compiled for it alone and called only where the CPU has it
// (cpu_has_bf16_dot); the shared pieces are always inlined into it.
#pragma once

#include "prefill_tile.h"

#include <cstdint>
#include <cstring>

namespace octavo::prefill {

#if defined(__AVX512F__)

inline bool cpu_has_bf16_dot() { return __builtin_cpu_supports("avx512bf16"); }

// two adjacent bf16 values as one 32-bit word: the operand pair of a bf16 dot product
OCTAVO_ALWAYS_INLINE uint32_t bf16_pair(const uint16_t* p) {
  uint32_t u;
  std::memcpy(&u, p, sizeof(u));
  return u;
}

// lanes (lo[i], hi[i]) of two vectors of 16 bf16 values as 16 pairs
OCTAVO_ALWAYS_INLINE __m512i interleave16(__m256i lo, __m256i hi) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

// q, the caches and out hold bf16 bits (c10::BFloat16)
__attribute__((target("avx512bf16"))) inline void run_item_bf16_dot(
    const Item& w, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
    const int64_t* tables, const int64_t* query_start, const int64_t* start_pos,
    c10::BFloat16* out, const Shape& s, Scratch& sc) {
  const Geometry g = geometry(w, tables, query_start, start_pos, s);
  const int64_t D = g.D, rp = g.rp, D2 = D / 2;
  init_rows(g, w, s, sc);
  uint32_t *q2 = sc.q2.data(), *v2 = sc.v2.data();
  float* ot = sc.ot.data();
  for (int64_t r = 0; r < rp; ++r) {
    const uint16_t* qr = query_row(w, g, q, s, r);
    for (int64_t i = 0; i < D2; ++i) q2[i * rp + r] = qr ? bf16_pair(qr + 2 * i) : 0u;
  }
  const Vec scale = Vec::set1(s.scale);
  const uint16_t* kp[KB];
  const uint16_t* vp[KB];
  for (int64_t k0 = g.k_begin; k0 < g.k_end; k0 += KB) {
    const int64_t n = std::min<int64_t>(KB, g.k_end - k0), pairs = (n + 1) / 2;
    for (int64_t t = 0; t < KB; ++t) {
      const int64_t off = t < n ? key_offset(g, s, w, k0 + t) : -1;
      kp[t] = off < 0 ? sc.zero16.data() : k_cache + off;
      vp[t] = off < 0 ? sc.zero16.data() : v_cache + off;
    }
    for (int64_t t2 = 0; t2 < pairs; ++t2) {  // v2[t2][d] = (v[2 t2][d], v[2 t2 + 1][d])
      const uint16_t *a = vp[2 * t2], *b = vp[2 * t2 + 1];
      uint32_t* dst = v2 + t2 * D;
      int64_t d = 0;
      for (; d + 16 <= D; d += 16)
        _mm512_storeu_si512(dst + d,
                            interleave16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d))));
      for (; d < D; ++d) dst[d] = a[d] | static_cast<uint32_t>(b[d]) << 16;
    }
    const bool masked = tile_masked(g, s, k0, n);
    for (int64_t vi = 0; vi < g.nvec; ++vi) {
      Vec sv[KB];
      for (int t = 0; t < KB; ++t) sv[t] = Vec::zero();
      for (int64_t i = 0; i < D2; ++i) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q2 + i * rp + vi * L);
#pragma GCC unroll 16
        for (int t = 0; t < KB; ++t)
          sv[t].v = _mm512_dpbf16_ps(sv[t].v, qv,
                                     (__m512bh)_mm512_set1_epi32(bf16_pair(kp[t] + 2 * i)));
      }
      for (int t = 0; t < KB; ++t) sv[t] = sv[t] * scale;
      const Vec f = softmax_tile(sv, n, k0, masked, vi, s, sc);
      __m512bh pp[KB / 2];  // (p[2 t2][r], p[2 t2 + 1][r]); keys past n have p = 0
      for (int64_t t2 = 0; t2 < pairs; ++t2)
        pp[t2] = (__m512bh)interleave16((__m256i)_mm512_cvtneps_pbh(sv[2 * t2].v),
                                        (__m256i)_mm512_cvtneps_pbh(sv[2 * t2 + 1].v));
      for (int64_t d0 = 0; d0 < D; d0 += DB) {
        Vec acc[DB];
        for (int j = 0; j < DB; ++j) acc[j] = Vec::load(ot + (d0 + j) * rp + vi * L) * f;
        for (int64_t t2 = 0; t2 < pairs; ++t2) {
#pragma GCC unroll 8
          for (int j = 0; j < DB; ++j)
            acc[j].v = _mm512_dpbf16_ps(acc[j].v, pp[t2],
                                        (__m512bh)_mm512_set1_epi32(v2[t2 * D + d0 + j]));
        }
        for (int j = 0; j < DB; ++j) acc[j].store(ot + (d0 + j) * rp + vi * L);
      }
    }
  }
  finish_rows(g, w, out, sc);
}

#else

inline bool cpu_has_bf16_dot() { return false; }

#endif

}  // namespace octavo::prefill
