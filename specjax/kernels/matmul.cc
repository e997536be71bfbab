// y[M,N] = x[M,K] @ W for small M, with W pre-packed into column blocks: w[nb][K][bw].
//
// Why: a decode step reads every weight once; with M = 1..32 rows the arithmetic is small and the
// cost should be the bytes. Each column block (bw = 16/32/48/64 floats) is one contiguous stream
// of K * bw floats, read once per call while M rows of accumulators are updated from it. XLA's
// general GEMM path instead repacks the whole weight on every call once M > 1.
//
// This one file is compiled four times (SJ_PART = main, avx512, avx2, scalar) and linked into one
// shared library, so each instruction-set path is built with its own -m flags and chosen at run
// time (see specjax/kernels/build.py). Part `main` holds the XLA FFI handler, the ISA choice and
// a small persistent thread pool.
//
// Numerics: every output is a sequential fused multiply-add over k = 0..K-1 (the scalar path
// multiplies and adds), whatever M is and however the rows are tiled, so a row's result does not
// depend on which other rows share the call.

#include <algorithm>
#include <cstdint>
#include <cstring>

#define SJ_MAIN 0
#define SJ_AVX512 1
#define SJ_AVX2 2
#define SJ_SCALAR 3

#ifndef SJ_PART
#error "compile with -DSJ_PART=SJ_MAIN|SJ_AVX512|SJ_AVX2|SJ_SCALAR"
#endif

// Rows handled per pass over a block; more rows are processed in groups of this many.
static constexpr long kMaxRows = 32;
// A K-chunk of a block (kc * bw floats) is kept near this size so that several row tiles can
// re-read it from L1 (the first tile streams it from memory).
#ifndef SJ_CHUNK_BYTES
#define SJ_CHUNK_BYTES (16 * 1024)
#endif
static constexpr long kChunkBytes = SJ_CHUNK_BYTES;
// How far ahead a single-tile pass prefetches its weight stream (0: no software prefetch).
#ifndef SJ_PREFETCH_BYTES
#define SJ_PREFETCH_BYTES 4096
#endif
static constexpr long kPrefetchBytes = SJ_PREFETCH_BYTES;
#ifndef SJ_PF_HINT
#define SJ_PF_HINT _MM_HINT_T0
#endif
#ifndef SJ_PREFETCH_NEXT
#define SJ_PREFETCH_NEXT 1
#endif

// Computes buf[rows][bw] = x[rows][K] (row stride ldx) @ w[K][bw] for one packed block.
typedef void BlockFn(const float* x, long ldx, const float* w, long k, long bw, long rows,
                     float* buf);

#if SJ_PART == SJ_AVX512 || SJ_PART == SJ_AVX2
#include <immintrin.h>

#include <array>
#include <utility>

namespace {

#if SJ_PART == SJ_AVX512
struct V {
  using T = __m512;
  static constexpr int W = 16;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T bcast(const float* p) { return _mm512_set1_ps(*p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T zero() { return _mm512_setzero_ps(); }
};
// Register budget (32 zmm): SV weight vectors + MT * SV accumulators.
template <int SV> constexpr int max_rows() { return SV == 4 ? 6 : SV == 3 ? 8 : SV == 2 ? 12 : 24; }
#else
struct V {
  using T = __m256;
  static constexpr int W = 8;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T zero() { return _mm256_setzero_ps(); }
};
// 16 ymm: 2 weight vectors + 6 * 2 accumulators + 1 broadcast.
template <int SV> constexpr int max_rows() { return 6; }
#endif

// acc[MT][SV*W] (+)= x[MT][kc] @ w[kc][SV*W]; w has row stride ldw, acc row stride lda.
// With PF, iteration e also prefetches pf_lines cache lines at pf + e * ldw: the weight stream a
// little ahead, or the next K-chunk while this one is re-read from L1 by the other row tiles, so
// memory traffic overlaps arithmetic instead of alternating with it.
template <int SV, int MT, bool PF>
void tile(const float* __restrict x, long ldx, const float* __restrict w, long ldw, long kc,
          float* __restrict acc, long lda, bool accumulate, const float* pf, long pf_lines) {
  typename V::T c[MT][SV];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < SV; ++v)
      c[m][v] = accumulate ? V::load(acc + m * lda + v * V::W) : V::zero();
  for (long e = 0; e < kc; ++e) {
    if constexpr (PF)
      for (long l = 0; l < pf_lines; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(pf + e * ldw) + 64 * l, SJ_PF_HINT);
    typename V::T b[SV];
    for (int v = 0; v < SV; ++v) b[v] = V::load(w + e * ldw + v * V::W);
    for (int m = 0; m < MT; ++m) {
      typename V::T a = V::bcast(x + m * ldx + e);
      for (int v = 0; v < SV; ++v) c[m][v] = V::fma(a, b[v], c[m][v]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < SV; ++v) V::store(acc + m * lda + v * V::W, c[m][v]);
}

typedef void TileFn(const float*, long, const float*, long, long, float*, long, bool, const float*,
                    long);

template <int SV, bool PF, int... Ms>
constexpr std::array<TileFn*, sizeof...(Ms)> tiles(std::integer_sequence<int, Ms...>) {
  return {&tile<SV, Ms + 1, PF>...};
}

// Strip = SV vectors of columns, processed for all rows (tiles of up to MT rows) per K-chunk.
template <int SV>
void block_strips(const float* x, long ldx, const float* w, long k, long bw, long rows,
                  float* buf) {
  constexpr int MT = max_rows<SV>();
  static constexpr auto plain = tiles<SV, false>(std::make_integer_sequence<int, MT>{});
  static constexpr auto fetch = tiles<SV, true>(std::make_integer_sequence<int, MT>{});
  constexpr long strip = SV * V::W;
  const long nstrips = bw / strip;
  const long lines = bw * 4 / 64;  // cache lines per packed row
  if (rows <= MT && nstrips == 1) {  // one register tile: stream the whole block once
    const long ahead = std::max<long>(1, kPrefetchBytes / (bw * 4));
    (kPrefetchBytes > 0 ? fetch : plain)[rows - 1](x, ldx, w, bw, k, buf, bw, false,
                                                   w + ahead * bw, lines);
    return;
  }
  const long kc = std::max<long>(8, kChunkBytes / (bw * 4));
  for (long e0 = 0; e0 < k; e0 += kc) {
    const long n = std::min(kc, k - e0);
    // The chunk after this one (the next block's first rows after the last chunk: blocks are
    // contiguous) is prefetched by the first tile; the others re-read this chunk from L1.
    const float* next = w + (e0 + n + (SJ_PREFETCH_NEXT - 1) * kc) * bw;
    for (long s = 0; s < nstrips; ++s)
      for (long r = 0; r < rows; r += MT) {
        const long mt = std::min<long>(MT, rows - r);
        const bool first = s == 0 && r == 0 && SJ_PREFETCH_NEXT;
        (first ? fetch : plain)[mt - 1](x + r * ldx + e0, ldx, w + e0 * bw + s * strip, bw, n,
                                        buf + r * bw + s * strip, bw, e0 > 0, next, lines);
      }
  }
}

}  // namespace

#if SJ_PART == SJ_AVX512
extern "C" void sj_block_avx512(const float* x, long ldx, const float* w, long k, long bw,
                                long rows, float* buf) {
  switch (bw) {
    case 64: return block_strips<4>(x, ldx, w, k, bw, rows, buf);
    case 48: return block_strips<3>(x, ldx, w, k, bw, rows, buf);
    case 32: return block_strips<2>(x, ldx, w, k, bw, rows, buf);
    default: return block_strips<1>(x, ldx, w, k, bw, rows, buf);
  }
}
#else
extern "C" void sj_block_avx2(const float* x, long ldx, const float* w, long k, long bw, long rows,
                              float* buf) {
  block_strips<2>(x, ldx, w, k, bw, rows, buf);  // bw is a multiple of 16
}
#endif

#elif SJ_PART == SJ_SCALAR

// Portable reference path: plain loops (the compiler may vectorise them for the baseline ISA).
extern "C" void sj_block_scalar(const float* x, long ldx, const float* w, long k, long bw,
                                long rows, float* buf) {
  for (long m = 0; m < rows; ++m) {
    float* out = buf + m * bw;
    for (long j = 0; j < bw; ++j) out[j] = 0.0f;
    for (long e = 0; e < k; ++e) {
      const float a = x[m * ldx + e];
      const float* wr = w + e * bw;
      for (long j = 0; j < bw; ++j) out[j] += a * wr[j];
    }
  }
}

#elif SJ_PART == SJ_MAIN

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
extern "C" BlockFn sj_block_avx512, sj_block_avx2, sj_block_scalar;
#else  // only the portable path is built elsewhere
extern "C" BlockFn sj_block_scalar;
#define sj_block_avx512 sj_block_scalar
#define sj_block_avx2 sj_block_scalar
#endif

namespace ffi = xla::ffi;

namespace {

// ----------------------------------------------------------------------------- ISA choice

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int detect_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

std::atomic<int> g_isa{detect_isa()};

BlockFn* block_fn() {
  switch (g_isa.load(std::memory_order_relaxed)) {
    case kAvx512: return sj_block_avx512;
    case kAvx2: return sj_block_avx2;
    default: return sj_block_scalar;
  }
}

// ----------------------------------------------------------------------------- one call

struct Job {
  const float* x;  // [m, k]
  const float* w;  // [nb, k, bw]
  float* y;        // [m, n]
  long m, k, n, bw, nb;
  long blocks_per_chunk, nchunks;
  BlockFn* fn;
};

void run_blocks(const Job& j, long b0, long b1) {
  alignas(64) float buf[kMaxRows * 64];
  for (long b = b0; b < b1; ++b) {
    const float* wb = j.w + b * j.k * j.bw;
    const long col = b * j.bw;
    const long ncols = std::min(j.bw, j.n - col);
    for (long r0 = 0; r0 < j.m; r0 += kMaxRows) {
      const long rows = std::min(kMaxRows, j.m - r0);
      j.fn(j.x + r0 * j.k, j.k, wb, j.k, j.bw, rows, buf);
      for (long r = 0; r < rows; ++r)
        std::memcpy(j.y + (r0 + r) * j.n + col, buf + r * j.bw, ncols * sizeof(float));
    }
  }
}

void run_chunk(const Job& j, long c) {
  const long b0 = c * j.blocks_per_chunk;
  run_blocks(j, b0, std::min(j.nb, b0 + j.blocks_per_chunk));
}

// ----------------------------------------------------------------------------- thread pool
//
// Persistent workers (created once, on the first threaded call) share each call's chunks with the
// calling thread through an atomic counter: whoever is free claims the next chunk, so a worker
// that is slow to wake (or a core busy with another process) costs balance, never correctness;
// the caller only waits for chunks a worker has already claimed. A second concurrent caller finds
// the pool busy and runs its call alone. Workers spin briefly between calls (a forward issues its
// matmuls microseconds apart), then sleep on a futex. Nothing is allocated per call.

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, nullptr, nullptr, 0);
}

struct Pool {
  std::atomic<uint32_t> gen{0};     // bumped to publish a job (futex word)
  std::atomic<uint32_t> closed{0};  // = gen once the caller has stopped taking chunks
  std::atomic<long> next{0};        // next chunk to claim
  std::atomic<int> active{0};       // workers inside a job
  std::atomic<int> sleepers{0};
  std::atomic<bool> busy{false};
  int threads = 1;                  // including the caller
  std::atomic<long> spin_us{200};
  Job job;

  void claim_all(const Job& j) {
    for (;;) {
      const long c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= j.nchunks) return;
      run_chunk(j, c);
    }
  }

  void worker() {
    uint32_t seen = gen.load();
    for (;;) {
      wait_for_job(seen);
      active.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t g = gen.load(std::memory_order_seq_cst);
      if (closed.load(std::memory_order_seq_cst) != g) claim_all(job);
      seen = g;
      active.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void wait_for_job(uint32_t seen) {
    auto start = std::chrono::steady_clock::now();
    for (int i = 0;; ++i) {
      if (gen.load(std::memory_order_acquire) != seen) return;
      cpu_relax();
      if ((i & 255) == 255) {
        if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us)) break;
        sched_yield();  // let other runnable threads on this core go first
      }
    }
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    while (gen.load(std::memory_order_seq_cst) == seen) futex(&gen, FUTEX_WAIT_PRIVATE, seen);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }

  void run(const Job& j) {
    if (threads <= 1 || j.nchunks <= 1 || busy.exchange(true, std::memory_order_acquire)) {
      for (long c = 0; c < j.nchunks; ++c) run_chunk(j, c);
      return;
    }
    job = j;
    next.store(0, std::memory_order_relaxed);
    const uint32_t g = gen.load(std::memory_order_relaxed) + 1;
    gen.store(g, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) futex(&gen, FUTEX_WAKE_PRIVATE, INT_MAX);
    claim_all(j);
    closed.store(g, std::memory_order_seq_cst);
    while (active.load(std::memory_order_seq_cst) != 0) cpu_relax();
    busy.store(false, std::memory_order_release);
  }
};

int default_threads() {
  if (const char* s = std::getenv("SPECJAX_KERNEL_THREADS")) {
    int n = std::atoi(s);
    if (n >= 1) return std::min(n, 64);
  }
  cpu_set_t set;
  int n = 1;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
  return std::max(1, std::min(n, 4));  // memory bandwidth saturates long before many cores
}

Pool g_pool;
std::once_flag g_pool_once;

Pool& pool() {
  std::call_once(g_pool_once, [] {
    g_pool.threads = default_threads();
    if (const char* s = std::getenv("SPECJAX_KERNEL_SPIN_US")) g_pool.spin_us = std::atol(s);
    for (int i = 1; i < g_pool.threads; ++i) std::thread([] { g_pool.worker(); }).detach();
  });
  return g_pool;
}

// Below this many weight bytes a call is not worth waking another thread for.
constexpr long kThreadedBytes = 256 * 1024;

void dense(const float* x, const float* w, float* y, long m, long k, long n, long bw, long nb) {
  Job j{x, w, y, m, k, n, bw, nb, 1, nb, block_fn()};
  const long bytes = nb * k * bw * 4;
  Pool& p = pool();
  if (bytes >= kThreadedBytes && p.threads > 1) {
    j.blocks_per_chunk = std::max<long>(1, nb / (p.threads * 8));
    j.nchunks = (nb + j.blocks_per_chunk - 1) / j.blocks_per_chunk;
    p.run(j);
  } else {
    run_blocks(j, 0, nb);
  }
}

// ----------------------------------------------------------------------------- XLA FFI

ffi::Error DenseF32(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("specjax_dense_f32: expected x[M,K], w[nb,K,bw], y[M,N]");
  const long m = xd[0], k = xd[1], nb = wd[0], bw = wd[2], n = yd[1];
  if (wd[1] != k || yd[0] != m)
    return ffi::Error::InvalidArgument("specjax_dense_f32: K or M mismatch");
  if (bw % 16 != 0 || bw < 16 || bw > 64 || n > nb * bw || n <= (nb - 1) * bw)
    return ffi::Error::InvalidArgument("specjax_dense_f32: bad packed block layout");
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(y->typed_data(), 0, m * n * sizeof(float));
    return ffi::Error::Success();
  }
  dense(x.typed_data(), w.typed_data(), y->typed_data(), m, k, n, bw, nb);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxDenseF32, DenseF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// ----------------------------------------------------------------------------- ctypes API

#define SJ_EXPORT __attribute__((visibility("default")))

extern "C" {

// The instruction set in use: 0 scalar, 1 avx2+fma, 2 avx512f.
SJ_EXPORT int specjax_kernel_isa() { return g_isa.load(); }

// The best instruction set this CPU supports (what specjax_kernel_isa starts as).
SJ_EXPORT int specjax_kernel_detected_isa() { return detect_isa(); }

// Forces a path (tests run every path on one machine); refuses one the CPU lacks. Returns the
// path in use afterwards.
SJ_EXPORT int specjax_kernel_set_isa(int isa) {
  if (isa >= kScalar && isa <= detect_isa()) g_isa.store(isa);
  return g_isa.load();
}

SJ_EXPORT int specjax_kernel_threads() { return pool().threads; }

// How long idle workers spin before sleeping (tuning; default 200 or $SPECJAX_KERNEL_SPIN_US).
SJ_EXPORT void specjax_kernel_set_spin_us(long us) { pool().spin_us = us; }

// y = x @ w on host pointers, outside XLA (the build's smoke test).
SJ_EXPORT void specjax_dense_f32(const float* x, const float* w, float* y, long m, long k, long n, long bw) {
  dense(x, w, y, m, k, n, bw, (n + bw - 1) / bw);
}

}  // extern "C"

#endif
