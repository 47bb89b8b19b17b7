// One step of kquant_amx.h's loop, alone: an AMX product of 16 activation rows x 16 weight
// rows over one sub-block of 32 (tdpbssd), then (mode 1) its tile store, then (mode 2) the
// fp32 steps of Q4_K on the stored sums in 512-bit registers (16 rows: cvt, mul by dx, fmadd
// of the mins, fmadd of the scales), with the data in L1. Prints ns per step for each mode.
//   gcc -O2 -march=native amx_step.c -o amx_step && ./amx_step
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <string.h>
#include <time.h>
struct cfg { uint8_t palette, start_row, res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define K 1536
static int8_t A[16 * K] __attribute__((aligned(64)));
static int8_t Bw[6 * 4096] __attribute__((aligned(64)));
static int32_t C[2][16][16] __attribute__((aligned(64)));
static float dx[16 * 6], bx[16*6*8], S[6*8*16], MN[6*8*16];
__attribute__((target("amx-tile,amx-int8,avx512f"), noinline))
double run(int mode, long reps) {
  __m512 acc[16]; for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
  double t0 = now();
  for (long r = 0; r < reps; ++r) {
    for (int j = 0; j < 8; ++j) {
      for (int b = 0; b < 6; ++b) {
        const int i = b;
        const int8_t* a = A + b * 256 + j * 32; const int8_t* w = Bw + b * 4096 + j * 512;
        asm volatile("" ::: "memory");
        if (i & 1) { _tile_loadd(3, a, K); _tile_loadd(5, w, 64); _tile_zero(1); _tile_dpbssd(1, 3, 5); }
        else { _tile_loadd(2, a, K); _tile_loadd(4, w, 64); _tile_zero(0); _tile_dpbssd(0, 2, 4); }
        if (mode >= 1) { if (i & 1) _tile_stored(1, C[1], 64); else _tile_stored(0, C[0], 64); }
        asm volatile("" ::: "memory");
        if (mode >= 2) {
          const int32_t (*c)[16] = C[(i + 1) & 1];  // the other buffer (stored a step before)
          const __m512 sc = _mm512_load_ps(S + (b * 8 + j) * 16), mn = _mm512_load_ps(MN + (b * 8 + j) * 16);
          for (int m = 0; m < 16; ++m) {
            const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[m])), _mm512_set1_ps(dx[m * 6 + b]));
            acc[m] = _mm512_fmadd_ps(sc, v, _mm512_fmadd_ps(mn, _mm512_set1_ps(bx[(m * 6 + b) * 8 + j]), acc[m]));
          }
        }
      }
    }
  }
  double t = now() - t0;
  float s = 0; for (int m = 0; m < 16; ++m) s += _mm512_reduce_add_ps(acc[m]);
  if (s == 12345) printf("x");
  return t / (reps * 48) * 1e9;
}
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  struct cfg c; memset(&c, 0, sizeof c); c.palette = 1;
  for (int t = 0; t < 2; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  for (int t = 2; t < 4; ++t) c.colsb[t] = 32, c.rows[t] = 16;
  for (int t = 4; t < 6; ++t) c.colsb[t] = 64, c.rows[t] = 8;
  asm volatile("ldtilecfg %0" :: "m"(c) : "memory");
  for (int mode = 0; mode < 3; ++mode) printf("mode %d: %.1f ns/step\n", mode, run(mode, 200000));
  _tile_release();
}
