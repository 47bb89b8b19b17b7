// The codes of GGUF's K-quant super-blocks (Q4_K, Q5_K, Q6_K), as the file packs them and in the
// lane order octavo keeps in memory (octavo/model/quant/kquant.py says why). Shared by
// kquant_linear.cpp (the portable dot, dequantization) and kquant_repack.cpp (the layout at load).
//
// The packing (the same bytes in the file and in memory; only the order of the codes differs):
//   Q4_K: 128 bytes, byte 32 i + l holds codes 64 i + l (low nibble) and 64 i + 32 + l (high)
//   Q5_K: 32 bytes of fifth bits (bit s of byte l: code 32 s + l), then Q4_K's 128 bytes
//   Q6_K: 128 bytes ql, 64 bytes qh: for half h, code 128 h + 32 g + l has the low 4 bits in
//         ql[64 h + 32 (g % 2) + l] (nibble g / 2) and the high 2 in qh[32 h + l] (bits 2 g)
#pragma once

#include <cstdint>

namespace kquant {

constexpr int kQ4K = 2, kQ5K = 3, kQ6K = 4;

// the weight (index in its super-block) whose code sits at position p = 32 v + 4 j + b of the
// lane order (kquant.py's LANE_ORDER): Q4_K / Q5_K lane j holds sub-block j of 32; Q6_K's
// vectors 0-3 sub-blocks j, 4-7 sub-blocks 8 + j, of 16
constexpr int lane_weight(int kind, int p) {
  const int v = p / 32, j = p % 32 / 4, b = p % 4;
  return kind == kQ6K ? 128 * (v / 4) + 16 * j + 4 * (v % 4) + b : 32 * j + 4 * v + b;
}

// the packed code bytes -> the 256 codes in the order they are packed
template <int KIND>
inline void unpack_codes(const uint8_t* c, uint8_t* q) {
  if (KIND == kQ6K) {
    const uint8_t* ql = c;
    const uint8_t* qh = c + 128;
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const int hb = qh[32 * h + l];
        uint8_t* o = q + 128 * h + l;
        o[0] = (ql[64 * h + l] & 15) | ((hb & 3) << 4);
        o[32] = (ql[64 * h + 32 + l] & 15) | (((hb >> 2) & 3) << 4);
        o[64] = (ql[64 * h + l] >> 4) | (((hb >> 4) & 3) << 4);
        o[96] = (ql[64 * h + 32 + l] >> 4) | (((hb >> 6) & 3) << 4);
      }
    return;
  }
  const uint8_t* qs = c + (KIND == kQ5K ? 32 : 0);
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = qs[32 * j + l] & 15;
      q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
    }
  if (KIND == kQ5K)
    for (int s = 0; s < 8; ++s)
      for (int l = 0; l < 32; ++l) q[32 * s + l] |= ((c[l] >> s) & 1) << 4;
}

// unpack_codes' inverse
template <int KIND>
inline void pack_codes(const uint8_t* q, uint8_t* c) {
  if (KIND == kQ6K) {
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t* g = q + 128 * h + l;
        c[64 * h + l] = (g[0] & 15) | ((g[64] & 15) << 4);
        c[64 * h + 32 + l] = (g[32] & 15) | ((g[96] & 15) << 4);
        c[128 + 32 * h + l] = (g[0] >> 4) | ((g[32] >> 4) << 2) | ((g[64] >> 4) << 4) | ((g[96] >> 4) << 6);
      }
    return;
  }
  uint8_t* qs = c + (KIND == kQ5K ? 32 : 0);
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l)
      qs[32 * j + l] = (q[64 * j + l] & 15) | ((q[64 * j + 32 + l] & 15) << 4);
  if (KIND == kQ5K)
    for (int l = 0; l < 32; ++l) {
      int bits = 0;
      for (int s = 0; s < 8; ++s) bits |= ((q[32 * s + l] >> 4) & 1) << s;
      c[l] = static_cast<uint8_t>(bits);
    }
}

}  // namespace kquant
