// y[M,N] = x[M,K] @ W for small M, with W pre-packed into column blocks: fp32 w[nb][K][bw], or
// bf16 w[nb][ceil(K/2)][bw][2] (the pairs k = 2p, 2p + 1 of one column side by side).
//
// Why: a decode step reads every weight once; with M = 1..64 rows the arithmetic is small and the
// cost should be the bytes. Each column block (bw = 16/32/48/64 columns) is one contiguous stream,
// read from memory once per call. Rows are taken in register tiles (up to 6 rows x 64 columns, or
// 8 x 48, in 24 zmm accumulators) that run over all of K with the block's columns in registers;
// further row tiles re-read the block from L2 (a block is 37-300 KB), while each pass prefetches a
// share of the next block into L2, so that the memory stream overlaps the arithmetic instead of
// alternating with it. XLA's general GEMM path instead repacks the whole weight on every call
// once M > 1.
//
// This one file is compiled four times (SJ_PART = main, avx512, avx2, scalar) and linked into one
// shared library, so each instruction-set path is built with its own -m flags and chosen at run
// time (see specjax/kernels/build.py). Part `main` holds the XLA FFI handlers, the ISA choice and
// the call's split over the thread pool (pool.h). bf16 runs `vdpbf16ps` where the CPU has
// AVX512-BF16 (functions with their own target attribute in part avx512), and the same arithmetic
// from fp32 FMAs on the AVX2 and scalar paths, so every path gives the same bits.
//
// Numerics, fp32: every output is a sequential fused multiply-add over k = 0..K-1 (the scalar path
// too, through std::fma), whatever M is and however the rows are tiled, so a row's result does not
// depend on which other rows share the call. bf16: each `vdpbf16ps` adds the products of one pair
// (k = 2p, 2p + 1; bf16 x bf16 is exact in fp32) to the fp32 accumulator, pairs in order, so again
// a row's result is fixed by its own inputs; the instruction treats denormal inputs and outputs as
// zero and rounds to nearest even.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.h"

// Rows per call of a block function; more rows are processed in groups of this many.
static constexpr long kMaxRows = 64;
// How far ahead a single-pass block (one register tile) prefetches its own weight stream.
static constexpr long kPrefetchBytes = 4096;

// out[rows][bw] (row stride ldo) = x[rows][K] (row stride ldx) @ w for one packed block; next: the
// block the caller takes after this one (prefetched into L2 during the passes), or null.
// fp32: x float, w [K][bw] float. bf16: x bf16 with K even (the caller pads), w [K/2][bw][2].
typedef void BlockFn(const void* x, long ldx, const void* w, long k, long bw, long rows,
                     float* out, long ldo, const void* next);

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
// Register budget (32 zmm): SV weight vectors + MT * SV accumulators (+ a broadcast); at most 8
// rows, so that the row pointers stay in general registers.
template <int SV> constexpr int max_rows() { return SV == 4 ? 6 : 8; }
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

// Prefetch plan of one pass: at iteration e, `lines` cache lines from pf + e * step.
struct Prefetch {
  const char* pf;
  long step, lines;
};

inline void prefetch(const Prefetch& p, long e, int hint_l2) {
  const char* a = p.pf + e * p.step;
  for (long l = 0; l < p.lines; ++l) {
    if (hint_l2) _mm_prefetch(a + 64 * l, _MM_HINT_T1);
    else _mm_prefetch(a + 64 * l, _MM_HINT_T0);
  }
}

// out[MT][SV*W] = x[MT][k] @ w[k][SV*W] (w row stride ldw), all of k in registers.
template <int SV, int MT, int PF>
void tile(const float* __restrict x, long ldx, const float* __restrict w, long ldw, long k,
          float* __restrict out, long ldo, bool acc, Prefetch pf) {
  typename V::T c[MT][SV];
  const float* xr[MT];
  for (int m = 0; m < MT; ++m) {
    xr[m] = x + m * ldx;
    for (int v = 0; v < SV; ++v) c[m][v] = acc ? V::load(out + m * ldo + v * V::W) : V::zero();
  }
  for (long e = 0; e < k; ++e) {
    if constexpr (PF != 0) prefetch(pf, e, PF == 2);
    typename V::T b[SV];
    for (int v = 0; v < SV; ++v) b[v] = V::load(w + e * ldw + v * V::W);
    for (int m = 0; m < MT; ++m) {
      typename V::T a = V::bcast(xr[m] + e);
      for (int v = 0; v < SV; ++v) c[m][v] = V::fma(a, b[v], c[m][v]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < SV; ++v) V::store(out + m * ldo + v * V::W, c[m][v]);
}

typedef void TileFn(const float*, long, const float*, long, long, float*, long, bool,
                    Prefetch);

template <int SV, int PF, int... Ms>
constexpr std::array<TileFn*, sizeof...(Ms)> tiles(std::integer_sequence<int, Ms...>) {
  return {&tile<SV, Ms + 1, PF>...};
}

// When several row tiles (or strips) re-read a block, K is taken in chunks of at most this many k
// (pairs for bf16), so that one chunk of the block and the call's rows of x for it stay in L2
// together (K = 1536 at 64 rows: 3 chunks).
static constexpr long kChunkK = 640;

// The passes over one block: per K-chunk, per strip of columns, row tiles of balanced sizes (64
// rows with 6-row tiles: 9 x 6 + 2 x 5). run(s, r, mt, e0, n, kind, pf) runs one tile: strip s,
// rows r..r+mt, k e0..e0+n (accumulating onto the output when e0 > 0), prefetch plan pf of kind 0
// (none), 1 (its own stream, into L1) or 2 (the next block, into L2).
template <int MR, typename Run>
void passes(long rows, long strips, long k, long row_bytes, const void* w, const void* next,
            Run run) {
  const long nt = (rows + MR - 1) / MR;
  if (nt * strips == 1) {  // one register tile: stream the block once, prefetching a little ahead
    const long ahead = std::max<long>(1, kPrefetchBytes / row_bytes);
    run(0, 0, rows, 0, k, 1,
        Prefetch{static_cast<const char*>(w) + ahead * row_bytes, row_bytes, row_bytes / 64});
    return;
  }
  // Each pass prefetches its share of the next block into L2, spread over its k iterations.
  const long nc = (k + kChunkK - 1) / kChunkK;
  const long npass = nt * strips * nc;
  const long kc = (k + nc - 1) / nc;
  const long share = (k * row_bytes + npass - 1) / npass;
  const long step = (share + kc - 1) / kc;
  const long lines = next ? (step + 63) / 64 : 0;
  long p = 0;
  for (long e0 = 0; e0 < k; e0 += kc) {
    const long n = std::min(kc, k - e0);
    for (long s = 0; s < strips; ++s) {
      for (long t = 0, r = 0; t < nt; ++t, ++p) {
        const long mt = rows / nt + (t < rows % nt);
        const char* pf = next ? static_cast<const char*>(next) + p * share : nullptr;
        run(s, r, mt, e0, n, lines ? 2 : 0, Prefetch{pf, step, lines});
        r += mt;
      }
    }
  }
}

template <int SV>
void block_f32(const void* xv, long ldx, const void* wv, long k, long bw, long rows, float* out,
               long ldo, const void* next) {
  constexpr int MR = max_rows<SV>();
  static constexpr auto plain = tiles<SV, 0>(std::make_integer_sequence<int, MR>{});
  static constexpr auto own = tiles<SV, 1>(std::make_integer_sequence<int, MR>{});
  static constexpr auto ahead = tiles<SV, 2>(std::make_integer_sequence<int, MR>{});
  const float* x = static_cast<const float*>(xv);
  const float* w = static_cast<const float*>(wv);
  constexpr long strip = SV * V::W;
  passes<MR>(rows, bw / strip, k, bw * 4, w, next,
             [&](long s, long r, long mt, long e0, long n, int kind, Prefetch pf) {
               const auto& table = kind == 0 ? plain : kind == 1 ? own : ahead;
               table[mt - 1](x + r * ldx + e0, ldx, w + e0 * bw + s * strip, bw, n,
                             out + r * ldo + s * strip, ldo, e0 > 0, pf);
             });
}

#if SJ_PART == SJ_AVX512
// ----------------------------------------------------------------------------- bf16 (AVX512-BF16)

#define SJ_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// out[MT][SV*16] = x[MT][2*k2] @ w[k2][SV*16][2]; one vdpbf16ps per pair, row and vector.
template <int SV, int MT, int PF>
SJ_BF16 void tile_bf16(const uint16_t* __restrict x, long ldx, const uint16_t* __restrict w,
                       long ldw, long k2, float* __restrict out, long ldo, bool acc,
                       Prefetch pf) {
  __m512 c[MT][SV];
  const uint16_t* xr[MT];
  for (int m = 0; m < MT; ++m) {
    xr[m] = x + m * ldx;
    for (int v = 0; v < SV; ++v)
      c[m][v] = acc ? _mm512_loadu_ps(out + m * ldo + v * 16) : _mm512_setzero_ps();
  }
  for (long e = 0; e < k2; ++e) {
    if constexpr (PF != 0) prefetch(pf, e, PF == 2);
    __m512bh b[SV];
    for (int v = 0; v < SV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(w + e * ldw + v * 32);
    for (int m = 0; m < MT; ++m) {
      int32_t pair;
      std::memcpy(&pair, xr[m] + 2 * e, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < SV; ++v) c[m][v] = _mm512_dpbf16_ps(c[m][v], a, b[v]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < SV; ++v) _mm512_storeu_ps(out + m * ldo + v * 16, c[m][v]);
}

typedef void TileBf16Fn(const uint16_t*, long, const uint16_t*, long, long, float*, long, bool,
                        Prefetch);

template <int SV, int PF, int... Ms>
constexpr std::array<TileBf16Fn*, sizeof...(Ms)> tiles_bf16(std::integer_sequence<int, Ms...>) {
  return {&tile_bf16<SV, Ms + 1, PF>...};
}

template <int SV>
void block_bf16(const void* xv, long ldx, const void* wv, long k, long bw, long rows, float* out,
                long ldo, const void* next) {
  constexpr int MR = max_rows<SV>();
  static constexpr auto plain = tiles_bf16<SV, 0>(std::make_integer_sequence<int, MR>{});
  static constexpr auto own = tiles_bf16<SV, 1>(std::make_integer_sequence<int, MR>{});
  static constexpr auto ahead = tiles_bf16<SV, 2>(std::make_integer_sequence<int, MR>{});
  const uint16_t* x = static_cast<const uint16_t*>(xv);
  const uint16_t* w = static_cast<const uint16_t*>(wv);
  const long k2 = k / 2;
  passes<MR>(rows, 1, k2, bw * 4, w, next,
             [&](long, long r, long mt, long e0, long n, int kind, Prefetch pf) {
               const auto& table = kind == 0 ? plain : kind == 1 ? own : ahead;
               table[mt - 1](x + r * ldx + 2 * e0, ldx, w + e0 * 2 * bw, 2 * bw, n,
                             out + r * ldo, ldo, e0 > 0, pf);
             });
}
#endif

#if SJ_PART == SJ_AVX2
// ----------------------------------------------------------------------------- bf16, emulated

// vdpbf16ps's arithmetic from fp32 FMAs, for CPUs without AVX512-BF16 (and the tests, which run
// every path): per pair, acc = fma(x_odd, w_odd, acc), then acc = fma(x_even, w_even, acc). Each
// product is exact in fp32, so each step rounds once, as the instruction's two accumulations do;
// MXCSR's DAZ and FTZ give its denormals-as-zero inputs and flushed outputs, round to nearest.
struct FlushDenormals {
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr((saved & ~0x6000u) | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// out[MT][16] = x[MT][2*k2] @ w[k2][16][2] (w row stride ldw uint16s): 2 weight vectors per half
// of the pair, 2 accumulators per row (MT <= 4: 8 + 4 + 2 broadcasts of 16 ymm).
template <int MT>
void tile_bf16_fma(const uint16_t* __restrict x, long ldx, const uint16_t* __restrict w, long ldw,
                   long k2, float* __restrict out, long ldo, bool acc) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 c[MT][2];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < 2; ++v)
      c[m][v] = acc ? _mm256_loadu_ps(out + m * ldo + v * 8) : _mm256_setzero_ps();
  for (long e = 0; e < k2; ++e) {
    __m256 odd[2], even[2];
    for (int v = 0; v < 2; ++v) {  // 8 columns' pairs: bf16 k = 2p in the low half of each dword
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + e * ldw + v * 16));
      odd[v] = _mm256_castsi256_ps(_mm256_and_si256(d, high));
      even[v] = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
    }
    for (int m = 0; m < MT; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * e, 4);
      const __m256 ao = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(pair & 0xffff0000u)));
      const __m256 ae = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(pair << 16)));
      for (int v = 0; v < 2; ++v) {
        c[m][v] = _mm256_fmadd_ps(ao, odd[v], c[m][v]);
        c[m][v] = _mm256_fmadd_ps(ae, even[v], c[m][v]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(out + m * ldo + v * 8, c[m][v]);
}

typedef void TileBf16FmaFn(const uint16_t*, long, const uint16_t*, long, long, float*, long, bool);
constexpr TileBf16FmaFn* kTilesBf16Fma[4] = {&tile_bf16_fma<1>, &tile_bf16_fma<2>,
                                             &tile_bf16_fma<3>, &tile_bf16_fma<4>};

void block_bf16_fma(const void* xv, long ldx, const void* wv, long k, long bw, long rows,
                    float* out, long ldo, const void* next) {
  const FlushDenormals flush;
  const uint16_t* x = static_cast<const uint16_t*>(xv);
  const uint16_t* w = static_cast<const uint16_t*>(wv);
  passes<4>(rows, bw / 16, k / 2, bw * 4, w, next,
            [&](long s, long r, long mt, long e0, long n, int, Prefetch) {
              kTilesBf16Fma[mt - 1](x + r * ldx + 2 * e0, ldx, w + e0 * 2 * bw + s * 32, 2 * bw,
                                    n, out + r * ldo + s * 16, ldo, e0 > 0);
            });
}
#endif

}  // namespace

#if SJ_PART == SJ_AVX512
extern "C" void sj_block_avx512(const void* x, long ldx, const void* w, long k, long bw,
                                long rows, float* out, long ldo, const void* next) {
  switch (bw) {
    case 64: return block_f32<4>(x, ldx, w, k, bw, rows, out, ldo, next);
    case 48: return block_f32<3>(x, ldx, w, k, bw, rows, out, ldo, next);
    case 32: return block_f32<2>(x, ldx, w, k, bw, rows, out, ldo, next);
    default: return block_f32<1>(x, ldx, w, k, bw, rows, out, ldo, next);
  }
}

extern "C" void sj_block_bf16(const void* x, long ldx, const void* w, long k, long bw, long rows,
                              float* out, long ldo, const void* next) {
  switch (bw) {
    case 64: return block_bf16<4>(x, ldx, w, k, bw, rows, out, ldo, next);
    case 48: return block_bf16<3>(x, ldx, w, k, bw, rows, out, ldo, next);
    case 32: return block_bf16<2>(x, ldx, w, k, bw, rows, out, ldo, next);
    default: return block_bf16<1>(x, ldx, w, k, bw, rows, out, ldo, next);
  }
}
#else
extern "C" void sj_block_avx2(const void* x, long ldx, const void* w, long k, long bw, long rows,
                              float* out, long ldo, const void* next) {
  block_f32<2>(x, ldx, w, k, bw, rows, out, ldo, next);  // bw is a multiple of 16
}

extern "C" void sj_block_bf16_avx2(const void* x, long ldx, const void* w, long k, long bw,
                                   long rows, float* out, long ldo, const void* next) {
  block_bf16_fma(x, ldx, w, k, bw, rows, out, ldo, next);
}
#endif

#elif SJ_PART == SJ_SCALAR

// Portable reference path: plain loops with the vector paths' arithmetic, one fma per k in order
// (std::fma rounds once, as vfmadd does), so every path gives the same bits.
extern "C" void sj_block_scalar(const void* xv, long ldx, const void* wv, long k, long bw,
                                long rows, float* buf, long ldo, const void*) {
  const float* x = static_cast<const float*>(xv);
  const float* w = static_cast<const float*>(wv);
  for (long m = 0; m < rows; ++m) {
    float* out = buf + m * ldo;
    for (long j = 0; j < bw; ++j) out[j] = 0.0f;
    for (long e = 0; e < k; ++e) {
      const float a = x[m * ldx + e];
      const float* wr = w + e * bw;
      for (long j = 0; j < bw; ++j) out[j] = std::fma(a, wr[j], out[j]);
    }
  }
}

// bf16 as vdpbf16ps computes it (see the AVX2 part): the pair's odd product, then its even one,
// each a once-rounded fma, with denormal inputs read as zero and denormal results flushed.
static inline float flush(float f) { return std::fabs(f) < FLT_MIN ? std::copysign(0.0f, f) : f; }

static inline float from_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return flush(f);
}

extern "C" void sj_block_bf16_scalar(const void* xv, long ldx, const void* wv, long k, long bw,
                                     long rows, float* buf, long ldo, const void*) {
  const uint16_t* x = static_cast<const uint16_t*>(xv);
  const uint16_t* w = static_cast<const uint16_t*>(wv);
  for (long m = 0; m < rows; ++m) {
    float* out = buf + m * ldo;
    for (long j = 0; j < bw; ++j) out[j] = 0.0f;
    for (long e = 0; e < k / 2; ++e) {
      const float ao = from_bf16(x[m * ldx + 2 * e + 1]), ae = from_bf16(x[m * ldx + 2 * e]);
      const uint16_t* wr = w + e * 2 * bw;
      for (long j = 0; j < bw; ++j) {
        out[j] = flush(std::fma(ao, from_bf16(wr[2 * j + 1]), out[j]));
        out[j] = flush(std::fma(ae, from_bf16(wr[2 * j]), out[j]));
      }
    }
  }
}

#elif SJ_PART == SJ_MAIN

#include <string>
#include <vector>

#include "handler.h"

SJ_PATHS(BlockFn, sj_block);
extern "C" BlockFn sj_block_bf16_scalar;
#if defined(__x86_64__)
extern "C" BlockFn sj_block_bf16, sj_block_bf16_avx2;
#else
#define sj_block_bf16 nullptr
#define sj_block_bf16_avx2 sj_block_bf16_scalar
#endif

namespace {

// ----------------------------------------------------------------------------- ISA choice

// The isa codes: 0 scalar, 1 avx2+fma, 2 avx512f.
SJ_ISA(SJ_CPU("avx512f"), SJ_CPU("avx2") && SJ_CPU("fma"))

bool detect_bf16() {
  return SJ_CPU("avx512f") && SJ_CPU("avx512bw") && SJ_CPU("avx512vl") && SJ_CPU("avx512bf16");
}

BlockFn* block_fn() { return SJ_PICK(sj_block); }

// bf16: vdpbf16ps on the AVX-512 path of a CPU with AVX512-BF16; its arithmetic from fp32 FMAs on
// the AVX2 path (and the AVX-512 path of a CPU without the instruction); plain loops on scalar.
BlockFn* bf16_fn() {
  const int isa = g_isa.load(std::memory_order_relaxed);
  if (isa == kAvx512 && detect_bf16()) return sj_block_bf16;
  return isa == kScalar ? sj_block_bf16_scalar : sj_block_bf16_avx2;
}

// ----------------------------------------------------------------------------- one call

struct Job {
  const char* x;  // [m, k] (row stride ldx elements of esize bytes)
  const char* w;  // [nb, block_bytes]
  float* y;       // [m, n]
  long m, k, n, bw, nb, ldx, esize, block_bytes;
  BlockFn* fn;
};

void run_blocks(const Job& j, long b0, long b1) {
  alignas(64) float buf[kMaxRows * 64];  // the last block's rows when it runs past N
  for (long b = b0; b < b1; ++b) {
    const char* wb = j.w + b * j.block_bytes;
    const char* next = b + 1 < j.nb ? wb + j.block_bytes : nullptr;
    const long col = b * j.bw;
    const long ncols = std::min(j.bw, j.n - col);
    for (long r0 = 0; r0 < j.m; r0 += kMaxRows) {
      const long rows = std::min(kMaxRows, j.m - r0);
      const char* x = j.x + r0 * j.ldx * j.esize;
      if (ncols == j.bw) {
        j.fn(x, j.ldx, wb, j.k, j.bw, rows, j.y + r0 * j.n + col, j.n, next);
        continue;
      }
      j.fn(x, j.ldx, wb, j.k, j.bw, rows, buf, j.bw, next);
      for (long r = 0; r < rows; ++r)
        std::memcpy(j.y + (r0 + r) * j.n + col, buf + r * j.bw, ncols * sizeof(float));
    }
  }
}

// Below this much work (weight bytes, times the row tiles that re-read them) a call is not worth
// waking another thread for.
constexpr long kThreadedBytes = 256 * 1024;

void run(const Job& j) {
  sj_pool::split(j.nb, j.nb * j.block_bytes * ((j.m + 5) / 6), kThreadedBytes,
                 [&](long b0, long b1) { run_blocks(j, b0, b1); });
}

void dense_f32(const float* x, const float* w, float* y, long m, long k, long n, long bw,
               long nb) {
  Job j{reinterpret_cast<const char*>(x), reinterpret_cast<const char*>(w), y, m, k, n, bw, nb,
        k, 4, k * bw * 4, block_fn()};
  run(j);
}

// x bf16 [m, k] (k odd: copied with a zero column, so every row holds whole pairs).
void dense_bf16(const uint16_t* x, const uint16_t* w, float* y, long m, long k, long n, long bw,
                long nb) {
  const long k2 = (k + 1) / 2;
  static thread_local std::vector<uint16_t> padded;
  if (k % 2) {
    padded.assign(m * 2 * k2, 0);
    for (long r = 0; r < m; ++r) std::memcpy(&padded[r * 2 * k2], x + r * k, k * 2);
    x = padded.data();
  }
  Job j{reinterpret_cast<const char*>(x), reinterpret_cast<const char*>(w), y, m, 2 * k2, n, bw,
        nb, 2 * k2, 2, k2 * bw * 4, bf16_fn()};
  run(j);
}

// ----------------------------------------------------------------------------- XLA FFI

// Checks x[...,K], w[nb, kw, bw * pack], y[...,N] (M: the product of the leading dimensions, the
// same for x and y) against the packed layout (kw = K, or ceil(K/2) pairs for bf16); returns an
// error message, or "" if they agree.
std::string check(const char* name, ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd,
                  ffi::Span<const int64_t> yd, long pack) {
  if (sj_ffi::rows(xd, yd) < 0 || wd.size() != 3)
    return std::string(name) + ": expected x[...,K], w[nb,K,bw], y[...,N]";
  const long k = sj_ffi::last(xd), nb = wd[0], bw = wd[2] / pack, n = sj_ffi::last(yd);
  if (wd[1] != (k + pack - 1) / pack) return std::string(name) + ": K mismatch";
  if (wd[2] % pack || bw % 16 != 0 || bw < 16 || bw > 64 || n > nb * bw || n <= (nb - 1) * bw)
    return std::string(name) + ": bad packed block layout";
  return "";
}

ffi::Error DenseF32(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  std::string err = check("specjax_dense_f32", x.dimensions(), w.dimensions(), y->dimensions(), 1);
  if (!err.empty()) return sj_ffi::invalid(err);
  const long m = sj_ffi::rows(x.dimensions(), y->dimensions()), k = sj_ffi::last(x.dimensions()),
             n = sj_ffi::last(y->dimensions());
  return sj_ffi::product(y->typed_data(), m, k, n, [&] {
    dense_f32(x.typed_data(), w.typed_data(), y->typed_data(), m, k, n, w.dimensions()[2],
              w.dimensions()[0]);
  });
}

ffi::Error DenseBF16(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  std::string err = check("specjax_dense_bf16", x.dimensions(), w.dimensions(), y->dimensions(), 2);
  if (!err.empty()) return sj_ffi::invalid(err);
  const long m = sj_ffi::rows(x.dimensions(), y->dimensions()), k = sj_ffi::last(x.dimensions()),
             n = sj_ffi::last(y->dimensions());
  return sj_ffi::product(y->typed_data(), m, k, n, [&] {
    dense_bf16(reinterpret_cast<const uint16_t*>(x.untyped_data()),
               reinterpret_cast<const uint16_t*>(w.untyped_data()), y->typed_data(), m, k, n,
               w.dimensions()[2] / 2, w.dimensions()[0]);
  });
}

}  // namespace

SJ_PRODUCT_HANDLER(SpecjaxDenseF32, DenseF32, ffi::F32, ffi::F32);
SJ_PRODUCT_HANDLER(SpecjaxDenseBF16, DenseBF16, ffi::BF16, ffi::BF16);

// ----------------------------------------------------------------------------- ctypes API

extern "C" {

SJ_LIBRARY_EXPORTS(specjax_kernel)

// Whether this CPU has vdpbf16ps (AVX-512 F/BW/VL and BF16); every path computes its arithmetic.
SJ_EXPORT int specjax_kernel_detected_bf16() { return detect_bf16(); }

// How long idle workers spin before sleeping (tuning; default 200 or $SPECJAX_KERNEL_SPIN_US).
SJ_EXPORT void specjax_kernel_set_spin_us(long us) { sj_pool::pool().spin_us = us; }

// y = x @ w on host pointers, outside XLA (the build's smoke test, benchmarks).
SJ_EXPORT void specjax_dense_f32(const float* x, const float* w, float* y, long m, long k, long n,
                                 long bw) {
  dense_f32(x, w, y, m, k, n, bw, (n + bw - 1) / bw);
}

// The same for bf16 x [m, k] and bf16 w [nb, ceil(k/2), bw, 2], on the path in use.
SJ_EXPORT void specjax_dense_bf16(const uint16_t* x, const uint16_t* w, float* y, long m, long k,
                                  long n, long bw) {
  dense_bf16(x, w, y, m, k, n, bw, (n + bw - 1) / bw);
}

}  // extern "C"

#endif
