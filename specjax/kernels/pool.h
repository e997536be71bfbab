// A small persistent thread pool that shares one call's chunks between the caller and its workers.
//
// Generic (a chunk function and a context), so every kernel library shares the logic: persistent
// workers (created on the first threaded call) and the calling thread each own a contiguous run of
// the call's chunks and take them in order from its front, so each thread streams one contiguous
// stretch of a weight (a hardware prefetcher follows it; chunks handed out in turn from one counter
// made every thread's stream jump at every chunk, and contended one cache line: 7% of a W4A8
// forward). A thread that runs out takes chunks from the back of another's run, so a worker that is
// slow to wake (or a core busy with another process) costs balance, never correctness; the caller
// only waits for chunks a worker has already claimed. A second concurrent caller finds the pool
// busy and runs its call alone. Workers spin briefly between calls (a forward issues its products
// microseconds apart), then sleep on a futex. Nothing is allocated per call. Include it from one
// translation unit of a library (it defines its globals).

#pragma once

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace sj_pool {

// Runs chunk c of a call described by ctx.
typedef void ChunkFn(const void* ctx, long c);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline long futex(std::atomic<uint32_t>* addr, int op, uint32_t val) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, nullptr, nullptr, 0);
}

constexpr int kMaxThreads = 64;

// One thread's run of chunks [lo, hi) as one word (lo in the low 32 bits): its owner takes lo,
// others take hi - 1, each by compare-and-swap, so every chunk is taken exactly once.
struct alignas(64) Run {
  std::atomic<uint64_t> v{0};

  static uint64_t of(uint32_t lo, uint32_t hi) { return lo | (uint64_t(hi) << 32); }

  // The chunk taken from the front (own) or the back, or -1 if the run is empty.
  long take(bool front) {
    uint64_t cur = v.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t lo = uint32_t(cur), hi = uint32_t(cur >> 32);
      if (lo >= hi) return -1;
      const uint64_t want = front ? of(lo + 1, hi) : of(lo, hi - 1);
      if (v.compare_exchange_weak(cur, want, std::memory_order_relaxed)) return front ? lo : hi - 1;
    }
  }
};

struct Pool {
  std::atomic<uint32_t> gen{0};     // bumped to publish a job (futex word)
  std::atomic<uint32_t> closed{0};  // = gen once the caller has stopped taking chunks
  Run runs[kMaxThreads];            // each thread's chunks (thread 0: the caller)
  std::atomic<int> active{0};       // workers inside a job
  std::atomic<int> sleepers{0};
  std::atomic<bool> busy{false};
  int threads = 1;                  // including the caller
  std::atomic<long> spin_us{200};
  ChunkFn* fn = nullptr;
  const void* ctx = nullptr;

  // Thread `self` runs its own chunks in order, then the others' from their backs.
  void claim_all(int self) {
    for (long c; (c = runs[self].take(true)) >= 0;) fn(ctx, c);
    for (int i = 1; i < threads; ++i)
      for (long c; (c = runs[(self + i) % threads].take(false)) >= 0;) fn(ctx, c);
  }

  void worker(int self) {
    uint32_t seen = gen.load();
    for (;;) {
      wait_for_job(seen);
      active.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t g = gen.load(std::memory_order_seq_cst);
      if (closed.load(std::memory_order_seq_cst) != g) claim_all(self);
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

  // Runs chunks 0..n-1 of fn(ctx, .), on the workers too unless the pool is busy or single.
  void run(ChunkFn* f, const void* c, long n) {
    if (threads <= 1 || n <= 1 || n > INT32_MAX ||
        busy.exchange(true, std::memory_order_acquire)) {
      for (long i = 0; i < n; ++i) f(c, i);
      return;
    }
    fn = f;
    ctx = c;
    for (int t = 0; t < threads; ++t)
      runs[t].v.store(Run::of(uint32_t(n * t / threads), uint32_t(n * (t + 1) / threads)),
                      std::memory_order_relaxed);
    const uint32_t g = gen.load(std::memory_order_relaxed) + 1;
    gen.store(g, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) futex(&gen, FUTEX_WAKE_PRIVATE, INT_MAX);
    claim_all(0);
    closed.store(g, std::memory_order_seq_cst);
    while (active.load(std::memory_order_seq_cst) != 0) cpu_relax();
    busy.store(false, std::memory_order_release);
  }
};

// $SPECJAX_KERNEL_THREADS, else min(cores available to this process, 4): memory bandwidth
// saturates long before many cores.
inline int default_threads() {
  if (const char* s = std::getenv("SPECJAX_KERNEL_THREADS")) {
    int n = std::atoi(s);
    if (n >= 1) return std::min(n, kMaxThreads);
  }
  cpu_set_t set;
  int n = 1;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
  return std::max(1, std::min(n, 4));
}

inline Pool g_pool;
inline std::once_flag g_pool_once;

inline Pool& pool() {
  std::call_once(g_pool_once, [] {
    g_pool.threads = default_threads();
    if (const char* s = std::getenv("SPECJAX_KERNEL_SPIN_US")) g_pool.spin_us = std::atol(s);
    for (int i = 1; i < g_pool.threads; ++i) std::thread([i] { g_pool.worker(i); }).detach();
  });
  return g_pool;
}

// Runs run(i0, i1) over the items [0, n) of one call (a product's column groups or blocks). A
// call whose `work` (the caller's measure of the bytes it reads) is below `threshold` runs in one
// piece on this thread; a larger one in chunks on the pool, about 8 per thread, which balance a
// core that other processes share (never less than one item a chunk). Which thread computes an
// item never changes its numbers.
template <class F>
void split(long n, long work, long threshold, F&& run) {
  Pool& p = pool();
  if (work < threshold || p.threads <= 1) {
    run(0L, n);
    return;
  }
  struct Call {
    F* run;
    long n, per;
  };
  const Call c{&run, n, std::max<long>(1, n / (p.threads * 8))};
  p.run([](const void* ctx, long i) {
          const Call& c = *static_cast<const Call*>(ctx);
          const long i0 = i * c.per;
          (*c.run)(i0, std::min(c.n, i0 + c.per));
        },
        &c, (n + c.per - 1) / c.per);
}

}  // namespace sj_pool
