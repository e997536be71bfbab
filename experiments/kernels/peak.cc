// This core's arithmetic ceilings for the matmul kernel's two inner instructions: fp32 FMA
// (vfmadd231ps zmm) and bf16 pair dot (vdpbf16ps zmm), each as 24 independent accumulator
// chains in registers (no memory traffic), timed by the thread's CPU time (a loaded machine's
// other processes are left out). FLOP: 2 per fp32 lane per FMA, 4 per lane per vdpbf16ps.
//
//   g++ -O3 -mavx512f -mavx512bf16 experiments/kernels/peak.cc -o /tmp/peak && /tmp/peak
// (run.py --peak does this).
#include <immintrin.h>

#include <algorithm>
#include <cstdio>
#include <ctime>

static double now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

template <bool BF16>
double gflops(long iters) {
  __m512 c[24];
  for (int i = 0; i < 24; ++i) c[i] = _mm512_set1_ps(i * 1e-3f);
  __m512 a = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(0.9999999f);
  const double t = now();
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < 24; ++j) {
      if constexpr (BF16) c[j] = _mm512_dpbf16_ps(c[j], (__m512bh)a, (__m512bh)b);
      else c[j] = _mm512_fmadd_ps(a, c[j], b);
    }
    asm volatile("" : "+v"(a));
  }
  const double s = now() - t;
  __m512 sum = c[0];
  for (int j = 1; j < 24; ++j) sum = _mm512_add_ps(sum, c[j]);
  float o[16];
  _mm512_storeu_ps(o, sum);
  if (o[0] == 12345.f) std::printf("-");  // keep the chains alive
  return iters * 24.0 * 16 * (BF16 ? 4 : 2) / s / 1e9;
}

int main() {
  double f32 = 0, bf16 = 0;
  for (int rep = 0; rep < 7; ++rep) {  // best of 7: the runs a busy core interrupted least
    f32 = std::max(f32, gflops<false>(2000000));
    bf16 = std::max(bf16, gflops<true>(2000000));
  }
  std::printf("one core, CPU time, best of 7: fp32 FMA %.0f GFLOP/s, vdpbf16ps %.0f GFLOP/s\n",
              f32, bf16);
}
