// This core's arithmetic ceilings for the kernels' inner instructions: fp32 FMA (vfmadd231ps
// zmm), bf16 pair dot (vdpbf16ps zmm) and the int8 dot (vpdpbusd zmm, qdot.cc), each as 24
// independent accumulator chains in registers (no memory traffic), timed by the thread's CPU time
// (a loaded machine's other processes are left out). FLOP: 2 per fp32 lane per FMA, 4 per lane
// per vdpbf16ps; integer ops: 8 per lane per vpdpbusd (4 products, 4 adds).
//
// Then qdot.cc's instruction mix on registers alone: per row and 32-k block, 8 vpdpbusd and the
// float epilogue (convert, multiply, two FMAs; Q4_1), 8 rows at a time, as the kernel's AVX-512
// tile does it; reported as vpdpbusd per ns beside the bare instruction's rate, so the ratio is
// how much of the ceiling the epilogue leaves.
//
//   g++ -O3 -mavx512f -mavx512bw -mavx512vnni -mavx512bf16 experiments/kernels/peak.cc \
//     -o /tmp/peak && /tmp/peak
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

// vpdpbusd per ns: 24 independent chains.
double dpbusd_rate(long iters) {
  __m512i c[24];
  for (int i = 0; i < 24; ++i) c[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  const double t = now();
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < 24; ++j)  // (as asm: GCC folds the chains' integer sums into one chain)
      asm volatile("vpdpbusd %2, %1, %0" : "+v"(c[j]) : "v"(a), "v"(b));
  }
  const double s = now() - t;
  __m512i sum = c[0];
  for (int j = 1; j < 24; ++j) sum = _mm512_add_epi32(sum, c[j]);
  if (_mm512_reduce_add_epi32(sum) == 12345) std::printf("-");
  return iters * 24.0 / s / 1e9;
}

// vpdpbusd per ns inside qdot.cc's mix: 8 rows, per row 8 vpdpbusd on two chains, their sum,
// a convert and the Q4_1 epilogue (d * dx, then two FMAs), the weights' vectors in registers.
double mix_rate(long iters) {
  constexpr int R = 8;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512i q[8];
  for (int c = 0; c < 8; ++c) q[c] = _mm512_set1_epi8(char(c + 1));
  __m512 d = _mm512_set1_ps(1e-3f), mn = _mm512_set1_ps(-1e-3f);
  alignas(64) int32_t xb[R][8];
  alignas(64) float dx[R], dxs[R];
  for (int r = 0; r < R; ++r) {
    dx[r] = 1e-3f * (r + 1);
    dxs[r] = -dx[r];
    for (int c = 0; c < 8; ++c) xb[r][c] = 0x01020304 * (r + c + 1);
  }
  const double t = now();
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        s0 = _mm512_dpbusd_epi32(s0, q[c], _mm512_set1_epi32(xb[r][c]));
        s1 = _mm512_dpbusd_epi32(s1, q[c + 1], _mm512_set1_epi32(xb[r][c + 1]));
      }
      const __m512 is = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[r])), is, acc[r]);
      acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(dxs[r]), acc[r]);
    }
    asm volatile("" : "+v"(d), "+v"(mn));
    asm volatile("" ::: "memory");
  }
  const double s = now() - t;
  __m512 sum = acc[0];
  for (int r = 1; r < R; ++r) sum = _mm512_add_ps(sum, acc[r]);
  if (_mm512_reduce_add_ps(sum) == 12345.f) std::printf("-");
  return iters * R * 8.0 / s / 1e9;
}

int main() {
  double f32 = 0, bf16 = 0, vnni = 0, mix = 0;
  for (int rep = 0; rep < 7; ++rep) {  // best of 7: the runs a busy core interrupted least
    f32 = std::max(f32, gflops<false>(2000000));
    bf16 = std::max(bf16, gflops<true>(2000000));
    vnni = std::max(vnni, dpbusd_rate(2000000));
    mix = std::max(mix, mix_rate(1000000));
  }
  std::printf("one core, CPU time, best of 7: fp32 FMA %.0f GFLOP/s, vdpbf16ps %.0f GFLOP/s\n",
              f32, bf16);
  std::printf("vpdpbusd: %.2f per ns bare (%.0f int8 GOP/s); %.2f per ns in qdot.cc's mix "
              "(%.0f%% of bare)\n", vnni, vnni * 16 * 8, mix, 100 * mix / vnni);
}
