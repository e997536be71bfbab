// y[M,N] = x[M,K] @ W for W [K,N] stored as Q4_1 blocks (32 k per block: 4-bit q, fp32 scale d
// and min m per block and output) or Q8_0 blocks (below), with the activations quantized to int8
// per 32-block: llama.cpp's Q4_1 x Q8_1 integer dot product.
//
// The arithmetic, per row m, per block b along K (x's 32 values x_i of that block):
//
//   amax = max |x_i|;  inv = amax > 0 ? 127 / amax : 0;  xq_i = rint(x_i * inv) clipped to +-127
//   dx = amax / 127;   sx = sum xq_i                     (fp32, round-half-even, int32)
//   y[m,n] = sum_b  d[b,n] * dx * isum[b,n]  +  m[b,n] * (dx * sx),  isum = sum_i q[b,i,n] * xq_i
//
// isum is an exact int32 (|isum| <= 32 * 15 * 127). Each output folds the blocks in order, b = 0,
// 1, ..., as acc = fma(d * dx, isum, acc); acc = fma(m, dx * sx, acc), on every path (the scalar
// path calls fma too, and this file is compiled with -ffp-contract=off), so the three paths give
// the same bits and a row's result does not depend on which other rows share the call.
//
// Why: a decode step reads every weight once, so its cost is the bytes. A packed Q4_1 record is
// 0.75 bytes per weight (0.625 with fp16 scales, below) where the fp32 copy is 4, and the integer
// dot (vpdpbusd: 64 u8 x s8 products summed in fours into 16 int32 lanes per instruction) costs
// less than dequantising to fp32 and multiplying.
//
// Packed layout (specjax/kernels/qdot.py packs it): the N outputs are taken 16 at a time (a group,
// zero-padded past N) and group g's block b is one record of 384 bytes:
//
//   d[16] fp32 | m[16] fp32 | 4 chunks of 64 bytes: byte 4j + t of chunk c holds
//                             q[k = 4c + t][column j] (low nibble), q[16 + 4c + t][j] (high)
//
// so one 64-byte load, masked or shifted, is the u8 operand of vpdpbusd for 16 columns x 4 k (lane
// j's four bytes are column j's k = 4c..4c+3) and a broadcast of 4 bytes of xq is the s8 operand.
// Where every d and m is an fp16 value (a GGUF file's Q4_1 and Q4_0 blocks: their scales are fp16),
// the record stores them as fp16 and is 320 bytes, d[16] fp16 | m[16] fp16 | the same 4 chunks;
// the kernel widens them exactly (vcvtph2ps; fp16.h on the scalar path), so the two records give
// the same bits, and a decode step, which reads every record once, reads 17% fewer bytes.
//
// Q8_0 weights (w = d * q, q in -128..127; llama.cpp's Q8_0 x Q8_0, the W4A8 target's tied head):
// a record of 576 bytes, d[16] fp32 | 8 chunks of 64 bytes whose byte 4j + t holds q[4c + t][j] +
// 128, the unsigned operand as stored; isum = sum (q + 128) xq - 128 sx, exact in int32, and
// y[m,n] = sum_b d[b,n] * dx * isum[b,n] folded as acc = fma(d * dx, isum, acc). AVX2 takes q back
// (xor 0x80) and multiplies |q| by xq with q's sign (vpmaddubsw, pair sums below 2^15). A packed
// weight's record size (384, 320 or 576) says which layout it is.
// A group is one contiguous stream of K/32 records, read once per call by the first row tile and
// re-read from L1 by the others. On AVX2 the same record feeds vpmaddubsw (8 columns per half):
// eight u8 x s8 pair sums of at most 2 * 15 * 127 add up to at most 30480 in int16, exact.
//
// Like matmul.cc, this file is compiled once per part (SJ_PART = main, avx512, avx2, scalar) with
// its own -m flags (avx512 adds BW and VNNI) and the path is chosen at run time; part `main` holds
// the XLA FFI handler, the ISA choice, the activation quantization's scratch and the thread pool.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fp16.h"
#include "isa.h"

namespace {

constexpr long kGroup = 16;    // output columns per group
constexpr long kBlock = 32;    // k per block
constexpr long kRecord = 384;  // bytes per group-block record (Q4_1, fp32 d and m)
constexpr long kQOff = 128;    // the nibbles' offset in a record
constexpr long kRecordH = 320;  // the same with fp16 d and m
constexpr long kQOffH = 64;

// A Q4_1 record's size and its nibbles' offset, by its scales' type (H: fp16).
template <bool H>
constexpr long record_of() { return H ? kRecordH : kRecord; }
template <bool H>
constexpr long qoff_of() { return H ? kQOffH : kQOff; }
constexpr long kRecord8 = 576;  // bytes per group-block record (Q8_0)
constexpr long kQOff8 = 64;     // the bytes' offset in a Q8_0 record
constexpr long kMaxM = 64;     // rows per pass over the weight (a call takes any number)

inline float load_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One row's activations, scalar (the AVX-512 part has a vector copy with the same results): per
// block of 32, xq, dx and dx * sx. Out-of-range conversions (non-finite x) give -127, as
// vcvtps2dq's integer indefinite does before the clamp.
inline void quant_row_scalar(const float* x, long k, int8_t* xq, float* dx, float* dxs,
                             int32_t* sxs) {
  for (long b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      const float a = std::fabs(xb[i]);
      amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sx = 0;
    for (int i = 0; i < kBlock; ++i) {
      const float r = std::nearbyint(xb[i] * inv);  // the default mode: round half to even
      int32_t v = r >= -2147483648.0f && r < 2147483648.0f ? int32_t(r) : INT32_MIN;
      v = v < -127 ? -127 : v > 127 ? 127 : v;
      xq[b * kBlock + i] = int8_t(v);
      sx += v;
    }
    dx[b] = amax / 127.0f;
    dxs[b] = dx[b] * float(sx);
    sxs[b] = sx;
  }
}

// The RMSNorm a layer applies before its product, done here on the product's rows (`x` is then
// the residual stream, not the normed activations): out[i] = scale[i] * (x[i] * inv) for i < n,
// inv = 1 / sqrt(mean + eps), mean = (sum of x[i] * x[i]) * float(1 / n), the sum a pairwise
// tree over the squares zero-padded to a power of two w (level h = w/2, w/4, .., 1: sq[i] +=
// sq[i + h]). Every operation is one IEEE operation (sqrt and the division correctly rounded,
// no fused multiply-add: the file is compiled with -ffp-contract=off), so every path, and any
// vector width the compiler picks for these loops, gives the same bits, and a row's norm
// depends on that row alone. sq: w floats of scratch.
// The norm's tree width: the power of two at or above n (the scratch norm_row_impl needs).
inline long tree_width(long n) {
  long w = 1;
  while (w < n) w <<= 1;
  return w;
}

inline void norm_row_impl(const float* x, long n, const float* scale, float eps, float* out,
                          float* sq) {
  const long w = tree_width(n);
  for (long i = 0; i < n; ++i) sq[i] = x[i] * x[i];
  for (long i = n; i < w; ++i) sq[i] = 0.0f;
  for (long h = w / 2; h >= 1; h /= 2)
    for (long i = 0; i < h; ++i) sq[i] = sq[i] + sq[i + h];
  const float mean = sq[0] * static_cast<float>(1.0 / double(n));
  const float inv = 1.0f / std::sqrt(mean + eps);
  for (long i = 0; i < n; ++i) out[i] = scale[i] * (x[i] * inv);
}

}  // namespace

// out[r][0..15] (row stride ldo) = rows r < `rows` of the quantized activations (xq row stride ldq,
// dx / dxs row stride ldd) times one group's nblk Q4_1 records (`record` bytes each: kRecord or
// kRecordH); rows <= kMaxM.
typedef void GroupFn(const int8_t* xq, long ldq, const float* dx, const float* dxs, long ldd,
                     const uint8_t* w, long nblk, long rows, float* out, long ldo, long record);
// The same for Q8_0 records: sx (row stride ldd) is each block's sum of xq.
typedef void Group8Fn(const int8_t* xq, long ldq, const float* dx, const int32_t* sx, long ldd,
                      const uint8_t* w, long nblk, long rows, float* out, long ldo);
// One row of k activations -> xq[k], dx[k/32], dxs[k/32], sx[k/32].
typedef void QuantFn(const float* x, long k, int8_t* xq, float* dx, float* dxs, int32_t* sx);
// One row's RMSNorm (norm_row_impl): x[n], scale[n] -> out[n]; sq: scratch of the power of two
// at or above n floats.
typedef void NormFn(const float* x, long n, const float* scale, float eps, float* out, float* sq);

#if SJ_PART == SJ_AVX512 || SJ_PART == SJ_AVX2
#include <immintrin.h>

#include <array>
#include <utility>

#ifndef SJ_QDOT_PREFETCH
// Bytes ahead of the record in use that the first row tile prefetches (0: none). 6 KiB against
// 1.5 and 12 KiB, weights from memory, 16 rows: the head 755 against 970-1010 and 890-1450 us
// (experiments/kernels/README.md, "qdot's records from memory").
#define SJ_QDOT_PREFETCH 6144
#endif

namespace {

template <long R>
inline void prefetch_record(const uint8_t* p) {
  if constexpr (SJ_QDOT_PREFETCH > 0)
    for (int l = 0; l < R / 64; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(p + SJ_QDOT_PREFETCH + 64 * l), _MM_HINT_T0);
}

// Calls run(r, mt) for the row tiles r, r + T, ... of `rows` rows (mt: the tile's rows, <= T).
template <int T, class Run>
inline void row_tiles(long rows, Run run) {
  for (long r = 0; r < rows; r += T) run(r, rows - r < T ? rows - r : long(T));
}

#if SJ_PART == SJ_AVX512

constexpr int kTile = 8;  // rows per register tile: 8 accumulators + 8 nibble vectors + d, m

// A Q4_1 record's 16 scales (i = 0) or mins (i = 1) as fp32: stored so, or widened from fp16.
template <bool H>
inline __m512 scales(const uint8_t* p, int i) {
  if constexpr (H)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i)));
  else
    return _mm512_loadu_ps(p + 64 * i);
}

template <int MT, bool H>
void tile(const int8_t* __restrict xq, long ldq, const float* __restrict dx,
          const float* __restrict dxs, long ldd, const uint8_t* __restrict w, long nblk,
          float* __restrict out, long ldo, bool first) {
  constexpr long R = record_of<H>();
  __m512 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (long b = 0; b < nblk; ++b) {
    const uint8_t* p = w + b * R;
    if (first) prefetch_record<R>(p);
    const __m512 d = scales<H>(p, 0), mn = scales<H>(p, 1);
    __m512i q[8];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(p + qoff_of<H>() + 64 * c);
      q[c] = _mm512_and_si512(v, low);
      q[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    // Rows unrolled: the accumulators stay in registers (8 to 12% faster at 8-16 rows than a
    // row loop keeping them in memory; experiments/kernels/README.md, "qdot at 8-16 rows").
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) {
      const int8_t* xr = xq + r * ldq + b * kBlock;
      // Two dependency chains (q[c] holds k = 4c..4c+3), summed exactly. (1, 4 or 8 chains, or
      // one for tall tiles: no faster.)
      constexpr int NC = 2;
      __m512i s[NC];
      for (int c = 0; c < NC; ++c) s[c] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c)
        s[c % NC] = _mm512_dpbusd_epi32(s[c % NC], q[c], _mm512_set1_epi32(load_i32(xr + 4 * c)));
      for (int c = 1; c < NC; ++c) s[0] = _mm512_add_epi32(s[0], s[c]);
      const __m512 is = _mm512_cvtepi32_ps(s[0]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[r * ldd + b])), is, acc[r]);
      acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(dxs[r * ldd + b]), acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

typedef void TileFn(const int8_t*, long, const float*, const float*, long, const uint8_t*, long,
                    float*, long, bool);

template <bool H, int... Ms>
constexpr std::array<TileFn*, sizeof...(Ms)> tiles(std::integer_sequence<int, Ms...>) {
  return {&tile<Ms + 1, H>...};
}

void group(const int8_t* xq, long ldq, const float* dx, const float* dxs, long ldd,
           const uint8_t* w, long nblk, long rows, float* out, long ldo, long record) {
  static constexpr auto full = tiles<false>(std::make_integer_sequence<int, kTile>{});
  static constexpr auto half = tiles<true>(std::make_integer_sequence<int, kTile>{});
  const auto& table = record == kRecordH ? half : full;
  row_tiles<kTile>(rows, [&](long r, long mt) {
    table[mt - 1](xq + r * ldq, ldq, dx + r * ldd, dxs + r * ldd, ldd, w, nblk, out + r * ldo,
                  ldo, r == 0);
  });
}

// Q8_0: the record's bytes are q + 128 (the u8 operand of vpdpbusd), so the dot product is
// sum (q + 128) xq and isum = that - 128 sx, exact in int32.
template <int MT>
void tile8(const int8_t* __restrict xq, long ldq, const float* __restrict dx,
           const int32_t* __restrict sx, long ldd, const uint8_t* __restrict w, long nblk,
           float* __restrict out, long ldo, bool first) {
  __m512 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  for (long b = 0; b < nblk; ++b) {
    const uint8_t* p = w + b * kRecord8;
    if (first) prefetch_record<kRecord8>(p);
    const __m512 d = _mm512_loadu_ps(p);
    __m512i q[8];
    for (int c = 0; c < 8; ++c) q[c] = _mm512_loadu_si512(p + kQOff8 + 64 * c);
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) {
      const int8_t* xr = xq + r * ldq + b * kBlock;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        s0 = _mm512_dpbusd_epi32(s0, q[c], _mm512_set1_epi32(load_i32(xr + 4 * c)));
        s1 = _mm512_dpbusd_epi32(s1, q[c + 1], _mm512_set1_epi32(load_i32(xr + 4 * c + 4)));
      }
      const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(s0, s1),
                                         _mm512_set1_epi32(sx[r * ldd + b] * 128));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[r * ldd + b])),
                               _mm512_cvtepi32_ps(s), acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

typedef void Tile8Fn(const int8_t*, long, const float*, const int32_t*, long, const uint8_t*, long,
                     float*, long, bool);

template <int... Ms>
constexpr std::array<Tile8Fn*, sizeof...(Ms)> tiles8(std::integer_sequence<int, Ms...>) {
  return {&tile8<Ms + 1>...};
}

void group8(const int8_t* xq, long ldq, const float* dx, const int32_t* sx, long ldd,
            const uint8_t* w, long nblk, long rows, float* out, long ldo) {
  static constexpr auto table = tiles8(std::make_integer_sequence<int, kTile>{});
  row_tiles<kTile>(rows, [&](long r, long mt) {
    table[mt - 1](xq + r * ldq, ldq, dx + r * ldd, sx + r * ldd, ldd, w, nblk, out + r * ldo,
                  ldo, r == 0);
  });
}

// quant_row_scalar's arithmetic, 16 lanes at a time (the same operations, so the same bits).
void quant_row(const float* x, long k, int8_t* xq, float* dx, float* dxs, int32_t* sxs) {
  for (long b = 0; b < k / kBlock; ++b) {
    const __m512 a = _mm512_loadu_ps(x + b * kBlock), c = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512i qa = _mm512_max_epi32(_mm512_min_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(a, vi)), hi), lo);
    const __m512i qc = _mm512_max_epi32(_mm512_min_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(c, vi)), hi), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 16), _mm512_cvtepi32_epi8(qc));
    const int32_t sx = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
    dx[b] = amax / 127.0f;
    dxs[b] = dx[b] * float(sx);
    sxs[b] = sx;
  }
}

#else  // SJ_AVX2

constexpr int kTile = 4;  // rows per register tile (16 ymm: 8 nibble vectors, d, m, 4 accumulators)

// Half h of a Q4_1 record's scales (i = 0) or mins (i = 1) as fp32: stored so, or widened from
// fp16 (F16C).
template <bool H>
inline __m256 scales(const uint8_t* p, int i, int h) {
  if constexpr (H)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * i + 16 * h)));
  else
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p + 64 * i + 32 * h));
}

// One half (8 columns) of the group: h = 0 columns 0..7, h = 1 columns 8..15.
template <int MT, bool H>
void tile(const int8_t* __restrict xq, long ldq, const float* __restrict dx,
          const float* __restrict dxs, long ldd, const uint8_t* __restrict w, long nblk,
          float* __restrict out, long ldo, int h, bool first) {
  constexpr long R = record_of<H>();
  __m256 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (long b = 0; b < nblk; ++b) {
    const uint8_t* p = w + b * R;
    if (first) prefetch_record<R>(p);
    const __m256 d = scales<H>(p, 0, h), mn = scales<H>(p, 1, h);
    __m256i q[8];
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(p + qoff_of<H>() + 64 * c + 32 * h));
      q[c] = _mm256_and_si256(v, low);
      q[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    for (int r = 0; r < MT; ++r) {
      const int8_t* xr = xq + r * ldq + b * kBlock;
      __m256i s = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(load_i32(xr)));
      for (int c = 1; c < 8; ++c) {  // (q[c] holds k = 4c..4c+3)
        const __m256i xb = _mm256_set1_epi32(load_i32(xr + 4 * c));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(q[c], xb));
      }
      const __m256 is = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[r * ldd + b])), is, acc[r]);
      acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(dxs[r * ldd + b]), acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) _mm256_storeu_ps(out + r * ldo + 8 * h, acc[r]);
}

typedef void TileFn(const int8_t*, long, const float*, const float*, long, const uint8_t*, long,
                    float*, long, int, bool);

template <bool H, int... Ms>
constexpr std::array<TileFn*, sizeof...(Ms)> tiles(std::integer_sequence<int, Ms...>) {
  return {&tile<Ms + 1, H>...};
}

void group(const int8_t* xq, long ldq, const float* dx, const float* dxs, long ldd,
           const uint8_t* w, long nblk, long rows, float* out, long ldo, long record) {
  static constexpr auto full = tiles<false>(std::make_integer_sequence<int, kTile>{});
  static constexpr auto half = tiles<true>(std::make_integer_sequence<int, kTile>{});
  const auto& table = record == kRecordH ? half : full;
  for (int h = 0; h < 2; ++h)
    row_tiles<kTile>(rows, [&](long r, long mt) {
      table[mt - 1](xq + r * ldq, ldq, dx + r * ldd, dxs + r * ldd, ldd, w, nblk, out + r * ldo,
                    ldo, h, h == 0 && r == 0);
    });
}

// Q8_0 on AVX2 (one half, 8 columns): the record's bytes less 128 are q; vpmaddubsw takes |q|
// (u8) times xq with q's sign, so each pair sum is at most 2 * 128 * 127 < 2^15, exact in int16,
// and each is widened to int32 before the next is added. isum is the same int32 as AVX-512's.
template <int MT>
void tile8(const int8_t* __restrict xq, long ldq, const float* __restrict dx, long ldd,
           const uint8_t* __restrict w, long nblk, float* __restrict out, long ldo, int h,
           bool first) {
  __m256 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i bias = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  for (long b = 0; b < nblk; ++b) {
    const uint8_t* p = w + b * kRecord8;
    if (first) prefetch_record<kRecord8>(p);
    const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 32 * h));
    __m256i q[8], a[8];
    for (int c = 0; c < 8; ++c) {
      q[c] = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kQOff8 + 64 * c + 32 * h)),
          bias);
      a[c] = _mm256_abs_epi8(q[c]);
    }
    for (int r = 0; r < MT; ++r) {
      const int8_t* xr = xq + r * ldq + b * kBlock;
      __m256i s = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i xb = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xr + 4 * c)), q[c]);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(a[c], xb), ones));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[r * ldd + b])),
                               _mm256_cvtepi32_ps(s), acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) _mm256_storeu_ps(out + r * ldo + 8 * h, acc[r]);
}

typedef void Tile8Fn(const int8_t*, long, const float*, long, const uint8_t*, long, float*, long,
                     int, bool);

template <int... Ms>
constexpr std::array<Tile8Fn*, sizeof...(Ms)> tiles8(std::integer_sequence<int, Ms...>) {
  return {&tile8<Ms + 1>...};
}

void group8(const int8_t* xq, long ldq, const float* dx, const int32_t*, long ldd,
            const uint8_t* w, long nblk, long rows, float* out, long ldo) {
  static constexpr auto table = tiles8(std::make_integer_sequence<int, kTile>{});
  for (int h = 0; h < 2; ++h)
    row_tiles<kTile>(rows, [&](long r, long mt) {
      table[mt - 1](xq + r * ldq, ldq, dx + r * ldd, ldd, w, nblk, out + r * ldo, ldo, h,
                    h == 0 && r == 0);
    });
}

void quant_row(const float* x, long k, int8_t* xq, float* dx, float* dxs, int32_t* sx) {
  quant_row_scalar(x, k, xq, dx, dxs, sx);
}

#endif

}  // namespace

extern "C" GroupFn SJ_PATH(sj_qdot_group);
extern "C" Group8Fn SJ_PATH(sj_qdot_group8);
extern "C" QuantFn SJ_PATH(sj_qdot_quant);
extern "C" NormFn SJ_PATH(sj_qdot_norm);
void SJ_PATH(sj_qdot_norm)(const float* x, long n, const float* scale, float eps, float* out,
                           float* sq) {
  norm_row_impl(x, n, scale, eps, out, sq);
}
void SJ_PATH(sj_qdot_group)(const int8_t* xq, long ldq, const float* dx, const float* dxs,
                            long ldd, const uint8_t* w, long nblk, long rows, float* out,
                            long ldo, long record) {
  group(xq, ldq, dx, dxs, ldd, w, nblk, rows, out, ldo, record);
}
void SJ_PATH(sj_qdot_group8)(const int8_t* xq, long ldq, const float* dx, const int32_t* sx,
                             long ldd, const uint8_t* w, long nblk, long rows, float* out,
                             long ldo) {
  group8(xq, ldq, dx, sx, ldd, w, nblk, rows, out, ldo);
}
void SJ_PATH(sj_qdot_quant)(const float* x, long k, int8_t* xq, float* dx, float* dxs,
                            int32_t* sx) {
  quant_row(x, k, xq, dx, dxs, sx);
}

#elif SJ_PART == SJ_SCALAR

// Portable reference path: plain loops, the vector paths' fold (fma per block, blocks in order).
extern "C" GroupFn sj_qdot_group_scalar;
extern "C" Group8Fn sj_qdot_group8_scalar;
extern "C" QuantFn sj_qdot_quant_scalar;
extern "C" NormFn sj_qdot_norm_scalar;

void sj_qdot_norm_scalar(const float* x, long n, const float* scale, float eps, float* out,
                         float* sq) {
  norm_row_impl(x, n, scale, eps, out, sq);
}

void sj_qdot_group_scalar(const int8_t* xq, long ldq, const float* dx, const float* dxs, long ldd,
                          const uint8_t* w, long nblk, long rows, float* out, long ldo,
                          long record) {
  const bool half = record == kRecordH;
  const long qoff = half ? kQOffH : kQOff;
  for (long r = 0; r < rows; ++r)
    for (int j = 0; j < kGroup; ++j) out[r * ldo + j] = 0.0f;
  for (long b = 0; b < nblk; ++b) {
    const uint8_t* p = w + b * record;
    float d[kGroup], mn[kGroup];
    for (int j = 0; j < kGroup; ++j) {
      d[j] = half ? sj_fp16::to_float(p + 2 * j) : load_f32(p + 4 * j);
      mn[j] = half ? sj_fp16::to_float(p + 32 + 2 * j) : load_f32(p + 64 + 4 * j);
    }
    uint8_t q[kBlock][kGroup];
    for (int c = 0; c < 4; ++c)
      for (int j = 0; j < kGroup; ++j)
        for (int t = 0; t < 4; ++t) {
          const uint8_t v = p[qoff + 64 * c + 4 * j + t];
          q[4 * c + t][j] = v & 15;
          q[16 + 4 * c + t][j] = v >> 4;
        }
    for (long r = 0; r < rows; ++r) {
      const int8_t* xr = xq + r * ldq + b * kBlock;
      const float dxr = dx[r * ldd + b], dsr = dxs[r * ldd + b];
      for (int j = 0; j < kGroup; ++j) {
        int32_t isum = 0;
        for (int i = 0; i < kBlock; ++i) isum += int32_t(q[i][j]) * int32_t(xr[i]);
        float& o = out[r * ldo + j];
        o = std::fma(d[j] * dxr, float(isum), o);
        o = std::fma(mn[j], dsr, o);
      }
    }
  }
}

void sj_qdot_group8_scalar(const int8_t* xq, long ldq, const float* dx, const int32_t*, long ldd,
                           const uint8_t* w, long nblk, long rows, float* out, long ldo) {
  for (long r = 0; r < rows; ++r)
    for (int j = 0; j < kGroup; ++j) out[r * ldo + j] = 0.0f;
  for (long b = 0; b < nblk; ++b) {
    const uint8_t* p = w + b * kRecord8;
    for (long r = 0; r < rows; ++r) {
      const int8_t* xr = xq + r * ldq + b * kBlock;
      const float dxr = dx[r * ldd + b];
      for (int j = 0; j < kGroup; ++j) {
        int32_t isum = 0;
        for (int c = 0; c < 8; ++c)
          for (int t = 0; t < 4; ++t)
            isum += (int32_t(p[kQOff8 + 64 * c + 4 * j + t]) - 128) * int32_t(xr[4 * c + t]);
        float& o = out[r * ldo + j];
        o = std::fma(load_f32(p + 4 * j) * dxr, float(isum), o);
      }
    }
  }
}

void sj_qdot_quant_scalar(const float* x, long k, int8_t* xq, float* dx, float* dxs,
                          int32_t* sx) {
  quant_row_scalar(x, k, xq, dx, dxs, sx);
}

#elif SJ_PART == SJ_MAIN

#include <algorithm>
#include <string>
#include <vector>

#include "handler.h"

SJ_PATHS(GroupFn, sj_qdot_group);
SJ_PATHS(Group8Fn, sj_qdot_group8);
SJ_PATHS(QuantFn, sj_qdot_quant);
SJ_PATHS(NormFn, sj_qdot_norm);

namespace {

// ----------------------------------------------------------------------------- ISA choice

// The isa codes: 0 scalar, 1 avx2+fma+f16c, 2 avx512 f/bw/vl/vnni.
SJ_ISA(SJ_CPU("avx512f") && SJ_CPU("avx512bw") && SJ_CPU("avx512vl") && SJ_CPU("avx512vnni") &&
           SJ_CPU("fma"),
       SJ_CPU("avx2") && SJ_CPU("fma") && SJ_CPU("f16c"))

struct Path {
  GroupFn* group;
  Group8Fn* group8;
  QuantFn* quant;
  NormFn* norm;
};

Path path() {
  return {SJ_PICK(sj_qdot_group), SJ_PICK(sj_qdot_group8), SJ_PICK(sj_qdot_quant),
          SJ_PICK(sj_qdot_norm)};
}

// ----------------------------------------------------------------------------- one call

struct Job {
  const int8_t* xq;   // [m, k]
  const float* dx;    // [m, nblk]
  const float* dxs;   // [m, nblk]
  const int32_t* sx;  // [m, nblk]
  const uint8_t* w;   // [ng, nblk, record]
  float* y;           // [m, n]
  long m, k, n, ng, nblk, record;  // record: kRecord or kRecordH (Q4_1), kRecord8 (Q8_0)
  Path f;

  void group(const uint8_t* wg, float* out, long ldo) const {
    if (record == kRecord8)
      f.group8(xq, k, dx, sx, nblk, wg, nblk, m, out, ldo);
    else
      f.group(xq, k, dx, dxs, nblk, wg, nblk, m, out, ldo, record);
  }
};

void run_groups(const Job& j, long g0, long g1) {
  alignas(64) float buf[kMaxM * kGroup];
  for (long g = g0; g < g1; ++g) {
    const long col = g * kGroup;
    const uint8_t* w = j.w + g * j.nblk * j.record;
    if (col + kGroup <= j.n) {  // a full group: straight into y
      j.group(w, j.y + col, j.n);
      continue;
    }
    j.group(w, buf, kGroup);
    for (long r = 0; r < j.m; ++r)
      std::memcpy(j.y + r * j.n + col, buf + r * kGroup, (j.n - col) * sizeof(float));
  }
}

// Below this much work (weight bytes, times the row tiles that re-read them) a call is not worth
// waking another thread for.
constexpr long kThreadedBytes = 128 * 1024;

// The quantized activations: per calling thread, grown as needed (allocation only when a call
// needs more than any before it on this thread).
struct Scratch {
  std::vector<int8_t> xq;
  std::vector<float> dx, dxs;
  std::vector<int32_t> sx;
  std::vector<float> xn, sq;  // a normed row, the norm's tree
};

// The RMSNorm before a product (none where scale is null): scale [nn] (nn <= k, the norm's width;
// the activations' k is nn rounded up to a block, the rest zeros), eps.
struct Norm {
  const float* scale;
  long nn;
  float eps;
};

// m <= kMaxM rows; record: the packed weight's bytes per group-block, kRecord or kRecordH (Q4_1)
// or kRecord8 (Q8_0). With a norm, x's rows are normed (norm_row_impl) before they are quantized.
void qdot_rows(const float* x, const uint8_t* w, float* y, long m, long k, long n, long record,
               Norm nrm) {
  static thread_local Scratch s;
  const long ng = (n + kGroup - 1) / kGroup, nblk = k / kBlock;
  if (long(s.xq.size()) < m * k) s.xq.resize(m * k);
  if (long(s.dx.size()) < m * nblk) {
    s.dx.resize(m * nblk);
    s.dxs.resize(m * nblk);
    s.sx.resize(m * nblk);
  }
  const Path f = path();
  if (nrm.scale != nullptr) {
    if (long(s.xn.size()) < k) s.xn.resize(k);
    if (long(s.sq.size()) < tree_width(nrm.nn)) s.sq.resize(tree_width(nrm.nn));
  }
  for (long r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    if (nrm.scale != nullptr) {
      f.norm(xr, nrm.nn, nrm.scale, nrm.eps, s.xn.data(), s.sq.data());
      std::fill(s.xn.begin() + nrm.nn, s.xn.begin() + k, 0.0f);
      xr = s.xn.data();
    }
    f.quant(xr, k, s.xq.data() + r * k, s.dx.data() + r * nblk, s.dxs.data() + r * nblk,
            s.sx.data() + r * nblk);
  }
  const Job j{s.xq.data(), s.dx.data(), s.dxs.data(), s.sx.data(), w, y, m, k, n, ng, nblk,
              record, f};
  sj_pool::split(ng, ng * nblk * record * ((m + 7) / 8), kThreadedBytes,
                 [&](long g0, long g1) { run_groups(j, g0, g1); });
}

// Any number of rows, kMaxM at a time (a prefill's rows, a large batch): each pass reads the
// weight once; a row's result does not depend on which pass it falls in.
void qdot_dense(const float* x, const uint8_t* w, float* y, long m, long k, long n, long record,
                Norm nrm = {nullptr, 0, 0.0f}) {
  for (long r = 0; r < m; r += kMaxM)
    qdot_rows(x + r * k, w, y + r * n, std::min(kMaxM, m - r), k, n, record, nrm);
}

// ----------------------------------------------------------------------------- XLA FFI

// Checks x[...,K], w[ng, K/32, 384 or 320 (Q4_1) or 576 (Q8_0)], y[...,N] (M: the product of the
// leading dimensions) against the packed layout; returns an error message, or "" if they agree.
std::string check(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd,
                  ffi::Span<const int64_t> yd) {
  const long m = sj_ffi::rows(xd, yd);
  if (m < 0 || wd.size() != 3)
    return "specjax_qdot_f32: expected x[...,K], w[ng,K/32,384|320|576], y[...,N]";
  const long k = sj_ffi::last(xd), ng = wd[0], n = sj_ffi::last(yd);
  if (k % kBlock != 0 || wd[1] != k / kBlock ||
      (wd[2] != kRecord && wd[2] != kRecordH && wd[2] != kRecord8) ||
      n > ng * kGroup ||
      n <= (ng - 1) * kGroup)
    return "specjax_qdot_f32: bad packed layout";
  return "";
}

ffi::Error QdotF32(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  std::string err = check(x.dimensions(), w.dimensions(), y->dimensions());
  if (!err.empty()) return sj_ffi::invalid(err);
  const long m = sj_ffi::rows(x.dimensions(), y->dimensions()), k = sj_ffi::last(x.dimensions()),
             n = sj_ffi::last(y->dimensions());
  return sj_ffi::product(y->typed_data(), m, k, n, [&] {
    qdot_dense(x.typed_data(), w.typed_data(), y->typed_data(), m, k, n, w.dimensions()[2]);
  });
}

// The product of the RMS-normed rows of x (scale [nn], k = nn rounded up to a block).
ffi::Error QdotNormF32(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale,
                       ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y, float eps) {
  std::string err = check(x.dimensions(), w.dimensions(), y->dimensions());
  if (!err.empty()) return sj_ffi::invalid(err);
  const long m = sj_ffi::rows(x.dimensions(), y->dimensions()), k = sj_ffi::last(x.dimensions()),
             n = sj_ffi::last(y->dimensions());
  const long nn = scale.dimensions().size() == 1 ? scale.dimensions()[0] : -1;
  if (nn < 1 || nn > k || (nn + kBlock - 1) / kBlock * kBlock != k)
    return sj_ffi::invalid("specjax_qdot_norm_f32: expected scale[N] with K = N rounded up to 32");
  return sj_ffi::product(y->typed_data(), m, k, n, [&] {
    qdot_dense(x.typed_data(), w.typed_data(), y->typed_data(), m, k, n, w.dimensions()[2],
               Norm{scale.typed_data(), nn, eps});
  });
}

}  // namespace

SJ_PRODUCT_HANDLER(SpecjaxQdotF32, QdotF32, ffi::F32, ffi::U8);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQdotNormF32, QdotNormF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

// ----------------------------------------------------------------------------- ctypes API

extern "C" {

SJ_LIBRARY_EXPORTS(specjax_qdot)

// The activation quantization alone (tests): x[m][k] -> xq[m][k], dx[m][k/32], dxs[m][k/32].
SJ_EXPORT void specjax_qdot_quantize(const float* x, long m, long k, int8_t* xq, float* dx,
                                     float* dxs) {
  const Path f = path();
  std::vector<int32_t> sx(k / kBlock);
  for (long r = 0; r < m; ++r)
    f.quant(x + r * k, k, xq + r * k, dx + r * (k / kBlock), dxs + r * (k / kBlock), sx.data());
}

// The RMSNorm alone (tests): x[m][n], scale[n] -> out[m][n], on the path in use.
SJ_EXPORT void specjax_qdot_norm_rows(const float* x, long m, long n, const float* scale,
                                      float eps, float* out) {
  const Path f = path();
  std::vector<float> sq(tree_width(n));
  for (long r = 0; r < m; ++r) f.norm(x + r * n, n, scale, eps, out + r * n, sq.data());
}

// y = the product on host pointers, outside XLA (benchmarks without a jit in between).
// record: 384 or 320 (Q4_1) or 576 (Q8_0).
SJ_EXPORT void specjax_qdot_f32(const float* x, const uint8_t* w, float* y, long m, long k,
                                long n, long record) {
  qdot_dense(x, w, y, m, k, n, record);
}

}  // extern "C"

#endif
