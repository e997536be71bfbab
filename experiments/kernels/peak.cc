// This core's arithmetic ceilings for the matmul kernel's two inner instructions: fp32 FMA
// (vfmadd231ps zmm) and bf16 pair dot (vdpbf16ps zmm), each as 24 independent accumulator
// chains in registers (no memory traffic), timed by the thread's CPU time (a loaded machine's
// other processes are left out). FLOP: 2 per fp32 lane per FMA, 4 per lane per vdpbf16ps.
// Then the memory's read bandwidth: 1 and 2 threads summing a buffer far larger than the caches
// (512 MiB) and one the size of a decode step's weights here (96 MiB: SmolLM2's Q4_1 / Q8_0
// blocks), wall time, best of 7: the floor under a memory-bound one-token forward.
//
//   g++ -O3 -mavx512f -mavx512bf16 -pthread experiments/kernels/peak.cc -o /tmp/peak && /tmp/peak
// (run.py --peak does this).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>
#include <vector>

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

static void sum_range(const float* a, long n, float* out) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (long i = 0; i < n; i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_load_ps(a + i));
    s1 = _mm512_add_ps(s1, _mm512_load_ps(a + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_load_ps(a + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_load_ps(a + i + 48));
  }
  *out = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

double read_gbs(long mib, int threads) {
  const long n = mib * (1L << 20) / 4, per = n / threads;
  float* a = static_cast<float*>(std::aligned_alloc(64, n * 4));
  std::memset(a, 0, n * 4);
  double best = 0;
  std::vector<float> out(threads);
  for (int rep = 0; rep < 7; ++rep) {
    const auto t = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int i = 1; i < threads; ++i) pool.emplace_back(sum_range, a + i * per, per, &out[i]);
    sum_range(a, per, &out[0]);
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    best = std::max(best, n * 4.0 / s / 1e9);
  }
  if (out[0] == 12345.f) std::printf("-");
  std::free(a);
  return best;
}

int main() {
  double f32 = 0, bf16 = 0;
  for (int rep = 0; rep < 7; ++rep) {  // best of 7: the runs a busy core interrupted least
    f32 = std::max(f32, gflops<false>(2000000));
    bf16 = std::max(bf16, gflops<true>(2000000));
  }
  std::printf("one core, CPU time, best of 7: fp32 FMA %.0f GFLOP/s, vdpbf16ps %.0f GFLOP/s\n",
              f32, bf16);
  for (long mib : {512L, 96L})
    std::printf("memory read, %ld MiB, wall time, best of 7: 1 thread %.1f GB/s, 2 threads %.1f "
                "GB/s\n", mib, read_gbs(mib, 1), read_gbs(mib, 2));
}
