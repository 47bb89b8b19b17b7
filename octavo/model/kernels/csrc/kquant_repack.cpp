// GGUF K-quant super-blocks from the file's layout to octavo's in memory (kquant.py's repack,
// which this computes byte for byte, many times faster): Q4_K / Q5_K with the 12 bytes of 6-bit
// scales and mins unpacked to 8 + 8 bytes (llama.cpp's get_scale_min_k4), and every format's codes
// in lane order (kquant_codes.h).
#include <ATen/Parallel.h>

#include <cstring>

#include "kquant_codes.h"
#include "ops.h"

namespace {

using kquant::kQ4K;
using kquant::kQ5K;
using kquant::kQ6K;

constexpr int64_t kFileBytes[5] = {0, 0, 144, 176, 210};
constexpr int64_t kMemBytes[5] = {0, 0, 148, 180, 210};

// lane_weight as a table
template <int KIND>
struct LaneOrder {
  uint8_t w[256];
  constexpr LaneOrder() : w() {
    for (int p = 0; p < 256; ++p) w[p] = static_cast<uint8_t>(kquant::lane_weight(KIND, p));
  }
};

template <int KIND>
void repack_block(const uint8_t* in, uint8_t* out) {
  const uint8_t* codes = in;
  uint8_t* to = out;
  if (KIND == kQ6K) {
    std::memcpy(out + 192, in + 192, 18);  // scales, d
  } else {
    std::memcpy(out, in, 4);  // d, dmin
    const uint8_t* s = in + 4;
    for (int j = 0; j < 8; ++j) {
      out[4 + j] = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      out[12 + j] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    codes = in + 16;
    to = out + 20;
  }
  if (KIND != kQ6K) {  // directly: lane j of vector v = 2 t + (nibble) holds code 32 j + 4 v + b
    const uint8_t* nib = codes + (KIND == kQ5K ? 32 : 0);
    uint8_t* o = to + (KIND == kQ5K ? 32 : 0);
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < 8; ++j) {
        const uint8_t* src = nib + 32 * (j / 2) + 8 * t;
        const int sh = 4 * (j % 2);
        for (int b = 0; b < 4; ++b)
          o[32 * t + 4 * j + b] =
              static_cast<uint8_t>(((src[b] >> sh) & 15) | (((src[4 + b] >> sh) & 15) << 4));
      }
    if (KIND == kQ5K)  // bit v of byte 4 j + b: the fifth bit of code 32 j + 4 v + b
      for (int l = 0; l < 32; ++l) {
        int bits = 0;
        for (int v = 0; v < 8; ++v) bits |= ((codes[4 * v + l % 4] >> (l / 4)) & 1) << v;
        to[l] = static_cast<uint8_t>(bits);
      }
    return;
  }
  alignas(64) uint8_t w[256], lanes[256];
  kquant::unpack_codes<KIND>(codes, w);
  static constexpr LaneOrder<KIND> order;
  for (int p = 0; p < 256; ++p) lanes[p] = w[order.w[p]];
  kquant::pack_codes<KIND>(lanes, to);
}

}  // namespace

at::Tensor kquant_repack(int64_t kind, at::Tensor raw) {
  TORCH_CHECK(kind == kQ4K || kind == kQ5K || kind == kQ6K,
              "kind must be 2 (Q4_K), 3 (Q5_K) or 4 (Q6_K)");
  TORCH_CHECK(raw.dim() == 2 && raw.is_contiguous() && raw.scalar_type() == at::kByte,
              "raw must be a contiguous uint8 [N, bytes] tensor");
  TORCH_CHECK(raw.size(1) % kFileBytes[kind] == 0, "raw's rows (", raw.size(1),
              " bytes) are not whole super-blocks of ", kFileBytes[kind], " bytes");
  const int64_t n = raw.size(0), nb = raw.size(1) / kFileBytes[kind];
  auto out = at::empty({n, nb * kMemBytes[kind]}, raw.options());
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, n * nb, 4096, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (kind == kQ4K)
        repack_block<kQ4K>(in + b * kFileBytes[kQ4K], o + b * kMemBytes[kQ4K]);
      else if (kind == kQ5K)
        repack_block<kQ5K>(in + b * kFileBytes[kQ5K], o + b * kMemBytes[kQ5K]);
      else
        repack_block<kQ6K>(in + b * kFileBytes[kQ6K], o + b * kMemBytes[kQ6K]);
    }
  });
  return out;
}
