// The face every kernel library shows, included by its part main: one XLA FFI handler shape and
// the C entry points library.py reads through ctypes.
//
// A handler checks its buffers first (a function returning a message that names the target and
// what it expected, or "" when they agree: sj_ffi::invalid turns it into XLA's error), then runs.
// A product y[M,N] over K runs through sj_ffi::product: an empty output needs nothing, K = 0 gives
// zeros, anything else is the kernel's call. SJ_PRODUCT_HANDLER binds such a handler: x [M,K],
// the packed weight, y float32 [M,N], then any attributes. x and y may carry several leading
// dimensions (x [B,T,K], y [B,T,N]: rows() reads M as their product), so a model passes its
// activations as they are: a reshape around every call makes XLA's simplifier move reshapes
// through the residual stream one operation per pass and stop at its iteration limit.

#pragma once

#include <cstring>
#include <string>

#include "isa.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sj_ffi {

inline ffi::Error invalid(const std::string& message) {
  return ffi::Error::InvalidArgument(message);
}

// M of an operand [..., last]: the product of its leading dimensions; -1 unless it has at least
// two dimensions and its leading dimensions are those of `other` (x's and y's must agree).
inline long rows(ffi::Span<const int64_t> d, ffi::Span<const int64_t> other) {
  if (d.size() < 2 || other.size() != d.size()) return -1;
  long m = 1;
  for (size_t i = 0; i + 1 < d.size(); ++i) {
    if (d[i] != other[i]) return -1;
    m *= d[i];
  }
  return m;
}

inline long last(ffi::Span<const int64_t> d) { return d[d.size() - 1]; }

template <class Run>
ffi::Error product(float* y, long m, long k, long n, Run run) {
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(y, 0, m * n * sizeof(float));
    return ffi::Error::Success();
  }
  run();
  return ffi::Error::Success();
}

}  // namespace sj_ffi

#define SJ_PRODUCT_HANDLER(symbol, fn, XType, WType, ...)                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, fn,                                            \
                                ffi::Ffi::Bind()                                       \
                                    .Arg<ffi::Buffer<XType>>()                         \
                                    .Arg<ffi::Buffer<WType>>()                         \
                                    .Ret<ffi::Buffer<ffi::F32>>() __VA_ARGS__)

// The C entry points every library exports beside its handler: <prefix>_isa, the path in use
// (isa.h's codes); <prefix>_detected_isa, the best one this CPU runs (what _isa starts as);
// <prefix>_set_isa, which forces a path (tests run every path on one machine), refuses one the
// CPU lacks and returns the path in use afterwards; <prefix>_threads, the size of the library's
// pool. Use inside extern "C", after SJ_ISA.
#define SJ_EXPORT __attribute__((visibility("default")))
#define SJ_LIBRARY_EXPORTS(prefix)                                     \
  SJ_EXPORT int prefix##_isa() { return g_isa.load(); }                \
  SJ_EXPORT int prefix##_detected_isa() { return detect_isa(); }       \
  SJ_EXPORT int prefix##_set_isa(int isa) {                            \
    if (isa >= kScalar && isa <= detect_isa()) g_isa.store(isa);       \
    return g_isa.load();                                               \
  }                                                                    \
  SJ_EXPORT int prefix##_threads() { return sj_pool::pool().threads; }
