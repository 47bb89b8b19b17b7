// Which 256-bit instructions share execution pipes: each test runs a block of independent
// instructions (inline asm, fixed registers, accumulating ones in 8 chains so their latency does
// not bound them) and prints cycles per block at the clock a chain of dependent adds measures.
// On the AVX2 EPYC (Zen 3) of BENCHMARKS.md section 17: 16 vpmaddubsw take 8 cycles, 16 FMAs 8,
// both together 12.4: the K-quant tiles' fp32 steps compete with their integer multiplies.
//   gcc -O2 avx2_ports.c -o avx2_ports && ./avx2_ports
#include <stdint.h>
#include <stdio.h>
#include <time.h>
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int8_t buf[4096] __attribute__((aligned(64)));
#define N 20000000L
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
  "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory"
#define RUN(name, body)                                                          \
  {                                                                              \
    double t0 = now();                                                           \
    for (long r = 0; r < N; ++r) asm volatile(body ::"r"(buf) : CLOBBER);        \
    double t = now() - t0;                                                       \
    printf("%-34s %6.2f cycles\n", name, t / N * clk);                           \
  }
#define X4(s) s s s s
#define MB4 "vpmaddubsw %%ymm14, %%ymm15, %%ymm0\n vpmaddubsw %%ymm14, %%ymm15, %%ymm1\n" \
            "vpmaddubsw %%ymm14, %%ymm15, %%ymm2\n vpmaddubsw %%ymm14, %%ymm15, %%ymm3\n"
#define MW4 "vpmaddwd %%ymm14, %%ymm15, %%ymm0\n vpmaddwd %%ymm14, %%ymm15, %%ymm1\n" \
            "vpmaddwd %%ymm14, %%ymm15, %%ymm2\n vpmaddwd %%ymm14, %%ymm15, %%ymm3\n"
#define FMA8 "vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n vfmadd231ps %%ymm14, %%ymm15, %%ymm7\n"   \
             "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n vfmadd231ps %%ymm14, %%ymm15, %%ymm9\n"   \
             "vfmadd231ps %%ymm14, %%ymm15, %%ymm10\n vfmadd231ps %%ymm14, %%ymm15, %%ymm11\n" \
             "vfmadd231ps %%ymm14, %%ymm15, %%ymm12\n vfmadd231ps %%ymm14, %%ymm15, %%ymm13\n"
#define CVT8 "vcvtdq2ps %%ymm14, %%ymm6\n vcvtdq2ps %%ymm14, %%ymm7\n vcvtdq2ps %%ymm14, %%ymm8\n" \
             "vcvtdq2ps %%ymm14, %%ymm9\n vcvtdq2ps %%ymm14, %%ymm10\n vcvtdq2ps %%ymm14, %%ymm11\n" \
             "vcvtdq2ps %%ymm14, %%ymm12\n vcvtdq2ps %%ymm14, %%ymm13\n"
#define ADDW8 "vpaddw %%ymm14, %%ymm15, %%ymm6\n vpaddw %%ymm14, %%ymm15, %%ymm7\n"   \
              "vpaddw %%ymm14, %%ymm15, %%ymm8\n vpaddw %%ymm14, %%ymm15, %%ymm9\n"   \
              "vpaddw %%ymm14, %%ymm15, %%ymm10\n vpaddw %%ymm14, %%ymm15, %%ymm11\n" \
              "vpaddw %%ymm14, %%ymm15, %%ymm12\n vpaddw %%ymm14, %%ymm15, %%ymm13\n"
int main(void) {
  long v = 0;
  double t0 = now();
  for (long r = 0; r < N * 10; ++r) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(v));
  const double clk = N * 40 / (now() - t0);
  printf("clock %.2f GHz (dependent adds)\n", clk / 1e9);
  RUN("16 vpmaddubsw", X4(MB4))
  RUN("16 vpmaddwd", X4(MW4))
  RUN("16 fma", FMA8 FMA8)
  RUN("16 cvtdq2ps", CVT8 CVT8)
  RUN("16 vpaddw", ADDW8 ADDW8)
  RUN("16 vpmaddubsw + 16 fma", X4(MB4) FMA8 FMA8)
  RUN("16 vpmaddubsw + 16 cvtdq2ps", X4(MB4) CVT8 CVT8)
  RUN("16 vpmaddubsw + 16 vpaddw", X4(MB4) ADDW8 ADDW8)
  RUN("16 fma + 16 cvtdq2ps", FMA8 FMA8 CVT8 CVT8)
  return 0;
}
