// How many FMAs a core issues per second, 512-bit against 256-bit (12 independent chains, so
// the latency of 4 cycles does not bound them). On the Xeon with AMX measured here: 2.71 G
// 512-bit a second (one port, at a lower clock) against 7.28 G 256-bit (two ports).
//   gcc -O2 -march=native fma_ports.c -o fma_ports && ./fma_ports
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main() {
  __m512 a[12]; for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(i * 0.001f);
  __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(0.0001f);
  long n = 100000000; double t0 = now();
  for (long r = 0; r < n; ++r) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], x, y);
    asm volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]), "+v"(a[6]), "+v"(a[7]), "+v"(a[8]), "+v"(a[9]), "+v"(a[10]), "+v"(a[11]));
  }
  double t = now() - t0;
  printf("zmm fma: %.3f ns each -> %.2f G/s\n", t / (n * 12) * 1e9, n * 12 / t / 1e9);
  __m256 b[12]; for (int i = 0; i < 12; ++i) b[i] = _mm256_set1_ps(i * 0.001f);
  __m256 x2 = _mm256_set1_ps(0.999f), y2 = _mm256_set1_ps(0.0001f);
  t0 = now();
  for (long r = 0; r < n; ++r) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) b[i] = _mm256_fmadd_ps(b[i], x2, y2);
    asm volatile("" : "+v"(b[0]), "+v"(b[1]), "+v"(b[2]), "+v"(b[3]), "+v"(b[4]), "+v"(b[5]), "+v"(b[6]), "+v"(b[7]), "+v"(b[8]), "+v"(b[9]), "+v"(b[10]), "+v"(b[11]));
  }
  t = now() - t0;
  printf("ymm fma: %.3f ns each -> %.2f G/s\n", t / (n * 12) * 1e9, n * 12 / t / 1e9);
  float s = 0; for (int i = 0; i < 12; ++i) s += a[i][0] + b[i][0]; if (s == 1) printf("x");
}
