// Prefill-sized batches of K-quant layers on AMX (amx-int8: Intel's tile registers, where one
// tdpbssd takes 16 x 16 x 32 int8 products). Tiles of 16 activation rows (A: their quantized
// values in weight order, one sub-block per tile load, straight from the [M, K] rows) against
// 16 weight rows (B: each super-block's codes unpacked once per call into the layout tdpbssd
// reads, 4 codes of a sub-block per weight row and tile row) give every (activation row,
// weight row, sub-block) its int32 dot product; AVX-512 then takes the fp32 steps.
//
// The result is rows_dot<KIND, 1, 1>'s bit for bit: the sums are the same integers (exact in
// any order; Q6_K's codes enter as q - 32, so a sum holds the -32 * bsum_s offset rows_dot adds
// as an integer too), each (activation row, weight row) keeps the 8 fp32 lanes rows_dot keeps
// (lane j here is a vector over 16 weight rows), takes the same multiplies and fmadds on the
// same operands in super-block order, and hsum8's tree of adds. So a row gives the same
// bits whatever batch or path computes it (tests/model/quant/test_kquant.py checks the bits).
//
// Included by kquant_linear.cpp into kq_vnni after kquant_simd.h (q45_codes, q6_codes, load32).

namespace KQ_NS {

// sub-blocks per super-block (a tile load of A each) and their length in values
template <int KIND>
constexpr int kAmxSubs = KIND == kQ6K ? 16 : 8;
template <int KIND>
constexpr int kAmxSubLen = 256 / kAmxSubs<KIND>;
// a weight tile's bytes per super-block (B tiles of every sub-block), in every format
constexpr int64_t kAmxTileBytes = 4096;
// weight tiles of 16 rows a chunk unpacks at once: their codes (64 rows x K bytes) stay in L2
// while every tile of activation rows passes them
constexpr int kAmxTilesPerChunk = 4;

// tiles 0 and 1: int32 sums of 16 activation rows x 16 weight rows, in turn (a step's product
// need not wait for the step before to have stored its sums); 2 and 3: A, 16 rows of a
// sub-block's values, in turn; 4 and 5: B, a sub-block's codes of 16 weight rows, 4 per tile
// row, in turn
template <int KIND>
static void amx_configure() {
  amx::TileConfig c;
  for (int t = 0; t < 2; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  for (int t = 2; t < 4; ++t) c.colsb[t] = kAmxSubLen<KIND>, c.rows[t] = 16;
  for (int t = 4; t < 6; ++t) c.colsb[t] = 64, c.rows[t] = kAmxSubLen<KIND> / 4;
  amx::load_config(c);
}

// GCC 12's tile loads and stores do not tell the compiler they touch memory: this orders the
// plain stores and loads around them
static inline void amx_fence() { asm volatile("" : : : "memory"); }

// r[j] = lane j of rows 0..7 (an 8 x 8 transpose of 32-bit lanes)
static inline void transpose8(__m256i (&r)[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
  }
}

// `rows` (<= 64) weight rows from q, every super-block, into the chunk's tiles: B [tile][b] of
// kAmxTileBytes, sub-block s's B tile at s * kAmxSubLen * 16 (its tile row kk, 64 bytes, holds
// each weight row's codes 4 kk .. 4 kk + 3 of the sub-block); the scales S [tile][b][s][16 rows]
// (d * scale_s, q45_scales' / q6_scales' products) and Q4_K / Q5_K's MN [tile][b][8][16]
// (-dmin * min_s). Rows past `rows` are zero.
template <int KIND>
static void amx_unpack(const uint8_t* q, int64_t row_bytes, int64_t rows, int64_t nb, int8_t* B,
                       float* S, float* MN) {
  constexpr int SB = kAmxSubs<KIND>;
  alignas(64) uint8_t codes[16][8][32];  // one super-block of 16 rows, lane order
  for (int64_t t = 0; 16 * t < rows; ++t) {
    const int64_t rt = std::min<int64_t>(16, rows - 16 * t);
    for (int64_t b = 0; b < nb; ++b) {
      int8_t* Bt = B + (t * nb + b) * kAmxTileBytes;
      float* St = S + (t * nb + b) * SB * 16;
      float* Mt = MN + (t * nb + b) * 8 * 16;
      for (int64_t n = 0; n < 16; ++n) {
        if (n >= rt) {
          std::memset(codes[n], 0, sizeof codes[n]);
          for (int s = 0; s < SB; ++s) St[s * 16 + n] = 0.f;
          if (KIND != kQ6K)
            for (int s = 0; s < 8; ++s) Mt[s * 16 + n] = 0.f;
          continue;
        }
        const uint8_t* blk = q + (16 * t + n) * row_bytes + b * kBytes[KIND];
        __m256i* out = reinterpret_cast<__m256i*>(codes[n]);
        if (KIND == kQ6K) {
          const __m256i offset = _mm256_set1_epi8(32);
          for (int h = 0; h < 2; ++h) {
            const __m256i b1 = load32(blk + 64 * h), b2 = load32(blk + 64 * h + 32);
            const __m256i bh = load32(blk + 128 + 32 * h);
            for (int k = 0; k < 4; ++k)
              _mm256_store_si256(out + 4 * h + k, _mm256_sub_epi8(q6_codes(b1, b2, bh, k), offset));
          }
          const float d = half_to_float(blk + 208);
          for (int s = 0; s < 16; ++s)
            St[s * 16 + n] = d * static_cast<float>(static_cast<int8_t>(blk[192 + s]));
        } else {
          const __m256i hbits = KIND == kQ5K ? load32(blk + 20) : _mm256_setzero_si256();
          const uint8_t* qs = blk + (KIND == kQ4K ? 20 : 52);
          for (int j = 0; j < 4; ++j) {
            const __m256i bits = load32(qs + 32 * j);
            _mm256_store_si256(out + 2 * j, q45_codes<KIND>(bits, hbits, 2 * j));
            _mm256_store_si256(out + 2 * j + 1, q45_codes<KIND>(bits, hbits, 2 * j + 1));
          }
          const float d = half_to_float(blk), dmin = -half_to_float(blk + 2);
          for (int s = 0; s < 8; ++s) {
            St[s * 16 + n] = d * static_cast<float>(blk[4 + s]);
            Mt[s * 16 + n] = dmin * static_cast<float>(blk[12 + s]);
          }
        }
      }
      // vector v's lane j (4 codes of one sub-block) of each row -> that sub-block's B tile
      for (int v = 0; v < 8; ++v) {
        const int64_t kk = KIND == kQ6K ? v % 4 : v;
        const int64_t s0 = KIND == kQ6K ? 8 * (v / 4) : 0;
        for (int half = 0; half < 2; ++half) {
          __m256i r[8];
          for (int i = 0; i < 8; ++i) r[i] = load32(codes[8 * half + i][v]);
          transpose8(r);
          for (int j = 0; j < 8; ++j)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(
                                    Bt + (s0 + j) * kAmxSubLen<KIND> * 16 + kk * 64 + 32 * half),
                                r[j]);
        }
      }
    }
  }
}

// the activations' side of the fp32 steps, per row and super-block: dx, and for Q4_K / Q5_K
// bx [M][nb][8] (each sub-block's sum of 32 values times dx, rows_dot's q45_bx product)
struct AmxRows {
  const int8_t* q;  // [M, K], weight order
  int64_t K, nb;
  const float* dx;  // [M][nb]
  const float* bx;  // [M][nb][8], Q4_K / Q5_K
};

// one step's product (P: which set of tile registers) and its sums' store: the activation rows
// at a (16 rows, stride lda) against the weight tile at b (GCC's tile intrinsics paste their
// register numbers into the instruction: literals only)
#define KQ_AMX_STEP(P, C, A, B)                                                              \
  __attribute__((target("amx-tile,amx-int8"))) static inline void amx_dot##P(                \
      const int8_t* a, int64_t lda, const int8_t* b) {                                       \
    _tile_loadd(A, a, lda);                                                                  \
    _tile_loadd(B, b, 64);                                                                   \
    _tile_zero(C);                                                                           \
    _tile_dpbssd(C, A, B);                                                                   \
  }                                                                                          \
  __attribute__((target("amx-tile,amx-int8"))) static inline void amx_store##P(int32_t* c) { \
    _tile_stored(C, c, 64);                                                                  \
  }
KQ_AMX_STEP(0, 0, 2, 4)
KQ_AMX_STEP(1, 1, 3, 5)
#undef KQ_AMX_STEP

// activation rows m0..m1-1 (whole tiles of 16) against a chunk's `tiles` weight tiles (its
// first `rows` weight rows valid): out[m * ldo + n] (+ bias[n]), n < rows. For each weight tile
// and lane j the 16 rows' accumulators stay in registers through every super-block (the lanes
// are independent, so taking lane after lane keeps each lane's operations in their order).
// A step is one sub-block's product (Q6_K: lane j's sub-blocks j and 8 + j of each super-block
// in turn), software-pipelined: step i's product is issued, step i - 1's sums are stored, and
// step i - 2's fp32 steps run on sums stored a step before (a tile store's data reach the
// vector loads late, and waiting for them bounded the loop).
template <int KIND>
__attribute__((target("amx-tile,amx-int8"))) static void amx_chunk(
    const AmxRows& X, int64_t m0, int64_t m1, const int8_t* B, const float* S, const float* MN,
    int tiles, int64_t rows, float* out, int64_t ldo, const float* bias) {
  constexpr int SB = kAmxSubs<KIND>, H = KIND == kQ6K ? 2 : 1;
  const int64_t nb = X.nb, steps = nb * H;
  alignas(64) int32_t C[2][16][16];
  alignas(64) float lanes[8][16][16];  // one weight tile's accumulators: [lane][row][weight row]
  for (int64_t mt = m0; mt < m1; mt += 16) {
    const int8_t* xt = X.q + mt * X.K;
    const float* dxt = X.dx + mt * nb;
    for (int t = 0; t < tiles; ++t) {
      const int8_t* Bt = B + t * nb * kAmxTileBytes;
      for (int j = 0; j < 8; ++j) {
        __m512 acc[16];
        for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
        auto issue = [&](int64_t i) {  // step i: super-block i / H, sub-block j + 8 (i % H)
          const int64_t b = i / H, s = j + 8 * (i % H);
          const int8_t* a = xt + b * 256 + s * kAmxSubLen<KIND>;
          const int8_t* w = Bt + b * kAmxTileBytes + s * kAmxSubLen<KIND> * 16;
          amx_fence();
          if (i % 2) amx_dot1(a, X.K, w); else amx_dot0(a, X.K, w);
        };
        for (int64_t i = 0; i < steps + 2; ++i) {
          if (i < steps) issue(i);
          if (i >= 1 && i <= steps) {
            if ((i - 1) % 2) amx_store1(&C[1][0][0]); else amx_store0(&C[0][0][0]);
          }
          amx_fence();
          if (i < 2) continue;
          const int64_t p = i - 2, b = p / H, s = j + 8 * (p % H);
          const int32_t(*c)[16] = C[p % 2];
          const __m512 sc = _mm512_load_ps(S + ((t * nb + b) * SB + s) * 16);
          const float* dxb = dxt + b;
          if (KIND == kQ6K) {
            for (int m = 0; m < 16; ++m) {
              const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[m])),
                                             _mm512_set1_ps(dxb[m * nb]));
              acc[m] = _mm512_fmadd_ps(sc, v, acc[m]);
            }
          } else {
            const __m512 mn = _mm512_load_ps(MN + ((t * nb + b) * 8 + s) * 16);
            const float* bxb = X.bx + (mt * nb + b) * 8 + s;
            for (int m = 0; m < 16; ++m) {
              const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[m])),
                                             _mm512_set1_ps(dxb[m * nb]));
              const __m512 a = _mm512_fmadd_ps(mn, _mm512_set1_ps(bxb[m * nb * 8]), acc[m]);
              acc[m] = _mm512_fmadd_ps(sc, v, a);
            }
          }
        }
        for (int m = 0; m < 16; ++m) _mm512_store_ps(lanes[j][m], acc[m]);
      }
      // hsum8's tree over the lanes, then the bias
      const int64_t n0 = 16 * t, valid = std::min<int64_t>(16, rows - n0);
      const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
      const __m512 bn = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
      for (int m = 0; m < 16; ++m) {
        const __m512 s0 = _mm512_add_ps(_mm512_load_ps(lanes[0][m]), _mm512_load_ps(lanes[4][m]));
        const __m512 s1 = _mm512_add_ps(_mm512_load_ps(lanes[1][m]), _mm512_load_ps(lanes[5][m]));
        const __m512 s2 = _mm512_add_ps(_mm512_load_ps(lanes[2][m]), _mm512_load_ps(lanes[6][m]));
        const __m512 s3 = _mm512_add_ps(_mm512_load_ps(lanes[3][m]), _mm512_load_ps(lanes[7][m]));
        const __m512 r = _mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3));
        _mm512_mask_storeu_ps(out + (mt + m) * ldo + n0, keep, _mm512_add_ps(r, bn));
      }
    }
  }
}

// rows m0..m1-1 (whole tiles of 16) of X against weight rows n0..n1-1 of q: out[m * N + n]
template <int KIND>
static void amx_rows(const uint8_t* q, int64_t row_bytes, const AmxRows& X, int64_t M16,
                     float* out, int64_t N, int64_t n0, int64_t n1, const float* bias) {
  constexpr int64_t chunk = 16 * kAmxTilesPerChunk;
  const int64_t nb = X.nb;
  // the chunk's unpacked weights, written before they are read (not zeroed)
  constexpr int64_t T = kAmxTilesPerChunk;
  const auto Bv = std::make_unique_for_overwrite<int8_t[]>(T * nb * kAmxTileBytes + 64);
  const auto Sv = std::make_unique_for_overwrite<float[]>(T * nb * kAmxSubs<KIND> * 16 + 16);
  const auto Mv = std::make_unique_for_overwrite<float[]>(T * nb * 8 * 16 + 16);
  auto aligned = [](auto* p) {  // to 64 bytes (the buffers leave room)
    return reinterpret_cast<decltype(p)>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  };
  int8_t* B = aligned(Bv.get());
  float* S = aligned(Sv.get());
  float* MN = aligned(Mv.get());
  amx_configure<KIND>();
  for (int64_t c = n0; c < n1; c += chunk) {
    const int64_t rows = std::min(chunk, n1 - c);
    amx_unpack<KIND>(q + c * row_bytes, row_bytes, rows, nb, B, S, MN);
    amx_chunk<KIND>(X, 0, M16, B, S, MN, static_cast<int>((rows + 15) / 16), rows, out + c, N,
                    bias ? bias + c : nullptr);
  }
  amx::release();
}

}  // namespace KQ_NS
