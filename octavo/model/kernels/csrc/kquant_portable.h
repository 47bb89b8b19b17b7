// K-quant super-blocks in plain C++: one super-block's codes and scales unpacked, the
// dequantization (gguf-py's values) and the portable build's dot products. Included by
// kquant_linear.cpp into its anonymous namespace (needs kBytes, half_to_float, Q8K).

// q: the 256 codes in lane order (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63, before Q6_K's -32);
// sc: the scale per 32 (Q4_K/Q5_K, 8) or per 16 (Q6_K, 16); mn: the mins per 32 (Q4_K/Q5_K)
template <int KIND>
inline void unpack_lanes(const uint8_t* blk, uint8_t* q, int* sc, int* mn) {
  if (KIND == kQ6K) {
    kquant::unpack_codes<KIND>(blk, q);
    for (int s = 0; s < 16; ++s) sc[s] = static_cast<int8_t>(blk[192 + s]);
    return;
  }
  for (int s = 0; s < 8; ++s) sc[s] = blk[4 + s], mn[s] = blk[12 + s];
  kquant::unpack_codes<KIND>(blk + 20, q);
}

// the codes in weight order
template <int KIND>
inline void unpack_block(const uint8_t* blk, uint8_t* q, int* sc, int* mn) {
  alignas(64) uint8_t lanes[256];
  unpack_lanes<KIND>(blk, lanes, sc, mn);
  for (int p = 0; p < 256; ++p) q[lane_weight(KIND, p)] = lanes[p];
}

template <int KIND>
void dequantize_block(const uint8_t* blk, float* out) {
  alignas(64) uint8_t q[256];
  int sc[16], mn[8];
  unpack_block<KIND>(blk, q, sc, mn);
  if (KIND == kQ6K) {
    const float d = half_to_float(blk + 208);
    for (int s = 0; s < 16; ++s) {
      const float ds = d * static_cast<float>(sc[s]);
      for (int l = 0; l < 16; ++l)
        out[16 * s + l] = ds * static_cast<float>(static_cast<int>(q[16 * s + l]) - 32);
    }
    return;
  }
  const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
  for (int s = 0; s < 8; ++s) {
    const float ds = d * static_cast<float>(sc[s]), dm = dmin * static_cast<float>(mn[s]);
    for (int l = 0; l < 32; ++l) out[32 * s + l] = ds * static_cast<float>(q[32 * s + l]) - dm;
  }
}

// portable: the same integer sums in plain loops, each super-block unpacked once for up to 16
// activation rows m0..m1-1
template <int KIND>
void rows_dot_portable(const uint8_t* row, const Q8K& X, int64_t m0, int64_t m1, float* out,
                       int64_t ldo, float bias) {
  alignas(64) uint8_t q[256];
  int sc[16], mn[8];
  float acc[16] = {};
  const int per = KIND == kQ6K ? 16 : 32;
  for (int64_t b = 0; b < X.nb; ++b) {
    const uint8_t* blk = row + b * kBytes[KIND];
    unpack_block<KIND>(blk, q, sc, mn);
    const float d = half_to_float(blk + (KIND == kQ6K ? 208 : 0));
    const float dmin = KIND == kQ6K ? 0.f : half_to_float(blk + 2);
    for (int64_t m = m0; m < m1; ++m) {
      const int8_t* xq = X.q + m * X.K + b * 256;
      const int16_t* bs = X.bsums + m * (X.K / 16) + b * 16;
      const float dx = X.d[m * X.nb + b];
      int32_t sumi = 0;
      for (int s = 0; s < 256 / per; ++s) {
        int32_t dot = 0;
        for (int l = 0; l < per; ++l) dot += q[s * per + l] * xq[s * per + l];
        if (KIND == kQ6K) dot -= 32 * bs[s];
        sumi += sc[s] * dot;
      }
      float& a = acc[m - m0];
      if (KIND == kQ6K) {
        a += d * dx * static_cast<float>(sumi);
      } else {
        int32_t summ = 0;
        for (int s = 0; s < 8; ++s) summ += mn[s] * (bs[2 * s] + bs[2 * s + 1]);
        a += d * dx * static_cast<float>(sumi) - dmin * dx * static_cast<float>(summ);
      }
    }
  }
  for (int64_t m = m0; m < m1; ++m) out[m * ldo] = acc[m - m0] + bias;
}
