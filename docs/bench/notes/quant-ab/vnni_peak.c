// vpdpbusd's issue rate on this core: how many of them a cycle, with enough independent
// accumulators that no one waits on the one before it (its latency is 4 cycles here, so 256-bit
// registers need 8 chains or more to issue 2 a cycle). The count of chains matters: a loop whose
// accumulators live in memory (an array the compiler does not keep in registers) measures the
// store-to-load forwarding instead, about half the rate.
//
//   gcc -O2 -march=native docs/bench/notes/quant-ab/vnni_peak.c -o /tmp/vnni_peak && /tmp/vnni_peak
//
// Prints instructions a second for 1, 4, 8 and 12 chains on 256-bit and 512-bit registers, and
// the multiply-adds a second of the fastest (32 per 256-bit instruction, 64 per 512-bit).
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define N 120000000L
#define Y(i) "vpdpbusd %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define Z(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define YCLOB "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
              "xmm10", "xmm11", "xmm14", "xmm15"
#define ZCLOB "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
              "xmm10", "xmm11", "xmm30", "xmm31"

#define RUN(name, chains, body, clob, macs)                                       \
  do {                                                                            \
    const double t0 = now();                                                      \
    for (long i = 0; i < N / 12; ++i) __asm__ volatile(body ::: clob);            \
    const double rate = N / (now() - t0);                                         \
    printf("%-4s %2d chains: %5.2f G instructions/s, %6.1f G multiply-adds/s\n", \
           name, chains, rate / 1e9, rate * (macs) / 1e9);                         \
  } while (0)

int main(void) {
  RUN("ymm", 1, Y(0) Y(0) Y(0) Y(0) Y(0) Y(0) Y(0) Y(0) Y(0) Y(0) Y(0) Y(0), YCLOB, 32);
  RUN("ymm", 4, Y(0) Y(1) Y(2) Y(3) Y(0) Y(1) Y(2) Y(3) Y(0) Y(1) Y(2) Y(3), YCLOB, 32);
  RUN("ymm", 12, Y(0) Y(1) Y(2) Y(3) Y(4) Y(5) Y(6) Y(7) Y(8) Y(9) Y(10) Y(11), YCLOB, 32);
  RUN("zmm", 1, Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0) Z(0), ZCLOB, 64);
  RUN("zmm", 4, Z(0) Z(1) Z(2) Z(3) Z(0) Z(1) Z(2) Z(3) Z(0) Z(1) Z(2) Z(3), ZCLOB, 64);
  RUN("zmm", 12, Z(0) Z(1) Z(2) Z(3) Z(4) Z(5) Z(6) Z(7) Z(8) Z(9) Z(10) Z(11), ZCLOB, 64);
  return 0;
}
