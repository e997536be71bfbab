// The instruction-set house every kernel library shares: the parts a source is compiled as, the
// CPU feature tests, the run-time choice of a path and the dispatch to it.
//
// build.py compiles each kernel source once per part (-DSJ_PART=SJ_MAIN | SJ_AVX512 | SJ_AVX2 |
// SJ_SCALAR, each with its own -m flags) and links the parts into one library. The vector and
// scalar parts each define a path's extern "C" functions, named <name>_avx512, <name>_avx2 and
// <name>_scalar; part main holds the FFI handler, the thread split and the choice:
//
//   SJ_PATHS(BlockFn, sj_block);                 // declares the three paths (scalar alone off x86)
//   SJ_ISA(SJ_CPU("avx512f"), SJ_CPU("avx2") && SJ_CPU("fma"))  // detect_isa(), g_isa
//   BlockFn* fn = SJ_PICK(sj_block);             // the path g_isa names
//
// The ISA codes are those library.py reads and forces: 0 scalar, 1 avx2, 2 avx512. A library
// starts on the best path its CPU runs (detect_isa) and tests force every one it can.

#pragma once

#define SJ_MAIN 0
#define SJ_AVX512 1
#define SJ_AVX2 2
#define SJ_SCALAR 3

#ifndef SJ_PART
#error "compile with -DSJ_PART=SJ_MAIN|SJ_AVX512|SJ_AVX2|SJ_SCALAR"
#endif

// In a vector or scalar part: the extern "C" name of this part's path of `name`
// (name##_avx512, name##_avx2 or name##_scalar), so a source that compiles one body into both
// vector parts defines it once: `extern "C" Fn SJ_PATH(sj_x); void SJ_PATH(sj_x)(...) {...}`.
#if SJ_PART == SJ_AVX512
#define SJ_PATH(name) name##_avx512
#elif SJ_PART == SJ_AVX2
#define SJ_PATH(name) name##_avx2
#elif SJ_PART == SJ_SCALAR
#define SJ_PATH(name) name##_scalar
#endif

#if SJ_PART == SJ_MAIN

#include <atomic>

namespace sj_isa {

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The best path whose conditions hold.
inline int best(bool avx512, bool avx2) { return avx512 ? kAvx512 : avx2 ? kAvx2 : kScalar; }

// The function of path `isa`.
template <class F>
F pick(int isa, F avx512, F avx2, F scalar) {
  return isa == kAvx512 ? avx512 : isa == kAvx2 ? avx2 : scalar;
}

}  // namespace sj_isa

#if defined(__x86_64__)
// Whether this CPU has `feature` (a name __builtin_cpu_supports knows: "avx512f", "fma", ...).
#define SJ_CPU(feature) (__builtin_cpu_init(), __builtin_cpu_supports(feature))
#define SJ_PATHS(Type, name) extern "C" Type name##_avx512, name##_avx2, name##_scalar
#define SJ_PICK(name) \
  sj_isa::pick(g_isa.load(std::memory_order_relaxed), name##_avx512, name##_avx2, name##_scalar)
#else  // only the portable path is built elsewhere
#define SJ_CPU(feature) false
#define SJ_PATHS(Type, name) extern "C" Type name##_scalar
#define SJ_PICK(name) name##_scalar
#endif

// In a library's (anonymous) namespace: the ISA codes, detect_isa() (the best path this CPU runs:
// avx512 where `avx512` holds, else avx2 where `avx2` holds, else scalar) and g_isa (the path in
// use, starting at the best; library.py forces another through <prefix>_set_isa).
#define SJ_ISA(avx512, avx2)                                 \
  using sj_isa::kScalar;                                     \
  using sj_isa::kAvx2;                                       \
  using sj_isa::kAvx512;                                     \
  int detect_isa() { return sj_isa::best(avx512, avx2); }    \
  std::atomic<int> g_isa{detect_isa()};

#endif  // SJ_PART == SJ_MAIN
