// y[M,N] = x[M,K] @ dequant(W)^T for W [N,K] stored as GGUF quantized blocks along K (Q8_0, Q4_0,
// Q4_1, Q4_K, Q6_K), fp32 activations, fp32 accumulation, the weights dequantised in registers.
//
// Why: a decode step reads every weight once, so its cost is the bytes. A Q4_1 weight is 5 bits
// (20 bytes per 32 values) where the fp32 copy is 32: the kernel streams the blocks as stored and
// turns each into floats only in registers, never into a dequantised copy in memory.
//
// Packed layout (specjax/kernels/blocks.py packs it): the GGUF tensor's rows (the N outputs) are
// taken 16 at a time (a group, zero-padded past N), and the group's block b is one record of
// 16 * (the GGUF block size) bytes with the same bytes as stored, transposed across the 16 rows:
//
//   Q8_0  d[16] fp16 | q[32][16] int8                   544 bytes   w = d * q
//   Q4_0  d[16] fp16 | q[16][16] nibble pairs           288 bytes   w = d * (q - 8)
//   Q4_1  d[16] fp16 | m[16] fp16 | q[16][16] pairs     320 bytes   w = d * q + m
//   Q4_K  d[16] | dmin[16] fp16 | scales[12][16] | q[128][16] pairs      2304 bytes (256 k)
//         w = (d * sc_j) * q - (dmin * m_j), sub-block j of 32 with 6-bit sc_j, m_j
//   Q6_K  ql[128][16] | qh[64][16] | scales[16][16] int8 | d[16] fp16      3360 bytes (256 k)
//         w = (d * scale_i) * (q - 32), q 6 bits from ql's nibble and qh's 2 bits, 16 per scale
//
// where byte [j][i] is byte j of row i's field (for Q4_0 / Q4_1, its low nibble is element j and
// its high nibble element j + 16, GGUF's order). Why transposed: one vector load then holds the
// same k of 16 output columns, so a broadcast x[m][k] times it updates 16 outputs with one FMA,
// with no horizontal sums, and a group is one contiguous stream of K/block records (read once per
// call, re-read from L1/L2 by further row tiles). The bytes per weight are exactly GGUF's.
//
// Numerics: the dequantised value is computed exactly as gguf's reference (numpy) does (fp16
// fields widened to fp32, then each product and sum rounded separately, as numpy rounds them: this
// file is compiled with -ffp-contract=off), so the kernel's result is the fp32 product with the
// dequantised weight up to summation order. Each output sums k in a fixed order (blocks in order;
// within a Q4_0 / Q4_1 block k = 0, 16, 1, 17, ...; the K-quants in the orders their loops state),
// whatever M is and however rows are tiled, so a row's result does not depend on which other rows
// share the call. Every path runs that one arithmetic (the AVX-512 and AVX2 paths the same
// template code, one fma per k and output; the scalar path std::fma in the same k orders), so the
// paths give the same bits.
//
// Like matmul.cc, this file is compiled once per part (SJ_PART = main, avx512, avx2, scalar) with
// its own -m flags and the path is chosen at run time; part `main` holds the XLA FFI handler, the
// ISA choice and the thread pool (pool.h).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fp16.h"
#include "isa.h"

namespace {

enum QType { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ6_K = 4, kNumTypes = 5 };
constexpr long kGroup = 16;                                    // output columns per group
constexpr long kBlock = 32;                                    // k per simple block
constexpr long kBlockOf[kNumTypes] = {32, 32, 32, 256, 256};   // k per block (K-quants: 256)
constexpr long kRecord[kNumTypes] = {544, 288, 320, 2304, 3360};  // bytes per group-block record
constexpr long kMaxM = 64;                       // rows per call

}  // namespace

// out[rows][16] = x[rows][K] (row stride ldx) @ one group's dequantised columns; rows <= kMaxM.
typedef void GroupFn(int qtype, const float* x, long ldx, const uint8_t* w, long nblk, long rows,
                     float* out);

#if SJ_PART == SJ_AVX512 || SJ_PART == SJ_AVX2
#include <immintrin.h>

#include <array>
#include <utility>

namespace {

#if SJ_PART == SJ_AVX512
struct V {
  using T = __m512;
  static constexpr int W = 16;
  static constexpr int MT = 16;  // row tile: 16 accumulators + 2 weights + 2 scales of 32 zmm
  static T half(const uint8_t* p) {  // W fp16 -> fp32 (exact)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static T i8(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  static void u4(const uint8_t* p, T& lo, T& hi) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  using I = __m512i;
  static I u8(const uint8_t* p) {  // W bytes -> int32 lanes
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I band(I a, int b) { return _mm512_and_si512(a, _mm512_set1_epi32(b)); }
  static I bor(I a, I b) { return _mm512_or_si512(a, b); }
  static I shr(I a, int b) { return _mm512_srli_epi32(a, b); }
  static I shl(I a, int b) { return _mm512_slli_epi32(a, b); }
  static T cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static T bcast(const float* p) { return _mm512_set1_ps(*p); }
  static T set(float a) { return _mm512_set1_ps(a); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T zero() { return _mm512_setzero_ps(); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
};
#else
struct V {
  using T = __m256;
  static constexpr int W = 8;
  static constexpr int MT = 4;  // 8 accumulators + 4 weights + 4 scales of 16 ymm
  static T half(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static T i8(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  static void u4(const uint8_t* p, T& lo, T& hi) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  using I = __m256i;
  static I u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static I band(I a, int b) { return _mm256_and_si256(a, _mm256_set1_epi32(b)); }
  static I bor(I a, I b) { return _mm256_or_si256(a, b); }
  static I shr(I a, int b) { return _mm256_srli_epi32(a, b); }
  static I shl(I a, int b) { return _mm256_slli_epi32(a, b); }
  static T cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static T bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static T set(float a) { return _mm256_set1_ps(a); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T zero() { return _mm256_setzero_ps(); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
};
#endif

constexpr int L = kGroup / V::W;  // vectors per group row

// The 4-bit types: 16 byte rows per record, each giving k = j (low nibbles) and k = j + 16 (high).
template <int Q, int MT>
inline void q4_block(const float* __restrict x, long ldx, const uint8_t* __restrict p,
                     typename V::T (&acc)[MT][L]) {
  typename V::T d[L], mn[L];
  for (int l = 0; l < L; ++l) {
    d[l] = V::half(p + 2 * V::W * l);
    mn[l] = Q == kQ4_1 ? V::half(p + 32 + 2 * V::W * l) : V::zero();
  }
  const uint8_t* q = p + (Q == kQ4_1 ? 64 : 32);
  const typename V::T eight = V::set(8.0f);
  for (int j = 0; j < 16; ++j) {
    typename V::T lo[L], hi[L];
    for (int l = 0; l < L; ++l) {
      V::u4(q + 16 * j + V::W * l, lo[l], hi[l]);
      if constexpr (Q == kQ4_0) {  // (q - 8) is exact in fp32, then one rounding: d * (q - 8)
        lo[l] = V::mul(d[l], V::sub(lo[l], eight));
        hi[l] = V::mul(d[l], V::sub(hi[l], eight));
      } else {  // d * q, rounded, + m, rounded (no FMA: the reference rounds twice)
        lo[l] = V::add(V::mul(d[l], lo[l]), mn[l]);
        hi[l] = V::add(V::mul(d[l], hi[l]), mn[l]);
      }
    }
    for (int m = 0; m < MT; ++m) {
      const typename V::T a = V::bcast(x + m * ldx + j);
      const typename V::T b = V::bcast(x + m * ldx + j + 16);
      for (int l = 0; l < L; ++l) acc[m][l] = V::fma(a, lo[l], acc[m][l]);
      for (int l = 0; l < L; ++l) acc[m][l] = V::fma(b, hi[l], acc[m][l]);
    }
  }
}

template <int MT>
inline void q8_block(const float* __restrict x, long ldx, const uint8_t* __restrict p,
                     typename V::T (&acc)[MT][L]) {
  typename V::T d[L];
  for (int l = 0; l < L; ++l) d[l] = V::half(p + 2 * V::W * l);
  const uint8_t* q = p + 32;
  for (int j = 0; j < 32; ++j) {
    typename V::T w[L];
    for (int l = 0; l < L; ++l) w[l] = V::mul(V::i8(q + 16 * j + V::W * l), d[l]);
    for (int m = 0; m < MT; ++m) {
      const typename V::T a = V::bcast(x + m * ldx + j);
      for (int l = 0; l < L; ++l) acc[m][l] = V::fma(a, w[l], acc[m][l]);
    }
  }
}

// Q4_K's 6-bit scale and min of sub-block j (gguf's get_scale_min), times d and dmin.
inline void q4k_scale(const uint8_t* sc, int j, int l, typename V::T d, typename V::T dmin,
                      typename V::T& ds, typename V::T& dm) {
  const uint8_t* b = sc + V::W * l;
  typename V::I s, m;
  if (j < 4) {
    s = V::band(V::u8(b + 16 * j), 63);
    m = V::band(V::u8(b + 16 * (j + 4)), 63);
  } else {
    const typename V::I hi = V::u8(b + 16 * (j + 4));
    s = V::bor(V::band(hi, 15), V::shl(V::shr(V::u8(b + 16 * (j - 4)), 6), 4));
    m = V::bor(V::shr(hi, 4), V::shl(V::shr(V::u8(b + 16 * j), 6), 4));
  }
  ds = V::mul(d, V::cvt(s));
  dm = V::mul(dmin, V::cvt(m));
}

// Q4_K: four 64-k chunks; byte row e of chunk c gives k = 64c + e (low) and 64c + 32 + e (high).
template <int MT>
inline void q4k_block(const float* __restrict x, long ldx, const uint8_t* __restrict p,
                      typename V::T (&acc)[MT][L]) {
  const uint8_t* sc = p + 64;
  const uint8_t* q = p + 256;
  for (int c = 0; c < 4; ++c) {
    typename V::T d0[L], m0[L], d1[L], m1[L];
    for (int l = 0; l < L; ++l) {
      const typename V::T d = V::half(p + 2 * V::W * l), dmin = V::half(p + 32 + 2 * V::W * l);
      q4k_scale(sc, 2 * c, l, d, dmin, d0[l], m0[l]);
      q4k_scale(sc, 2 * c + 1, l, d, dmin, d1[l], m1[l]);
    }
    for (int e = 0; e < 32; ++e) {
      typename V::T lo[L], hi[L];
      for (int l = 0; l < L; ++l) {
        V::u4(q + 16 * (32 * c + e) + V::W * l, lo[l], hi[l]);
        lo[l] = V::sub(V::mul(d0[l], lo[l]), m0[l]);  // rounded twice, as the reference
        hi[l] = V::sub(V::mul(d1[l], hi[l]), m1[l]);
      }
      for (int m = 0; m < MT; ++m) {
        const typename V::T a = V::bcast(x + m * ldx + 64 * c + e);
        const typename V::T b = V::bcast(x + m * ldx + 64 * c + 32 + e);
        for (int l = 0; l < L; ++l) acc[m][l] = V::fma(a, lo[l], acc[m][l]);
        for (int l = 0; l < L; ++l) acc[m][l] = V::fma(b, hi[l], acc[m][l]);
      }
    }
  }
}

// Q6_K: k = 128h + 32u + t (t < 32) takes ql byte 64h + 32(u & 1) + t (nibble u >> 1) and qh
// byte 32h + t (bits 2u); its scale is scales[8h + 2u + t / 16].
template <int MT>
inline void q6k_block(const float* __restrict x, long ldx, const uint8_t* __restrict p,
                      typename V::T (&acc)[MT][L]) {
  const uint8_t* ql = p;
  const uint8_t* qh = p + 2048;
  const uint8_t* sc = p + 3072;
  const typename V::T c32 = V::set(32.0f);
  for (int h = 0; h < 2; ++h)
    for (int t0 = 0; t0 < 32; t0 += 16) {
      typename V::T ds[4][L];
      for (int u = 0; u < 4; ++u)
        for (int l = 0; l < L; ++l)
          ds[u][l] = V::mul(V::half(p + 3328 + 2 * V::W * l),
                            V::i8(sc + 16 * (8 * h + 2 * u + t0 / 16) + V::W * l));
      for (int t = t0; t < t0 + 16; ++t) {
        typename V::T w[4][L];
        for (int l = 0; l < L; ++l) {
          const typename V::I a = V::u8(ql + 16 * (64 * h + t) + V::W * l);
          const typename V::I b = V::u8(ql + 16 * (64 * h + 32 + t) + V::W * l);
          const typename V::I hb = V::u8(qh + 16 * (32 * h + t) + V::W * l);
          const typename V::I q[4] = {
              V::bor(V::band(a, 15), V::shl(V::band(hb, 3), 4)),
              V::bor(V::band(b, 15), V::shl(V::band(V::shr(hb, 2), 3), 4)),
              V::bor(V::shr(a, 4), V::shl(V::band(V::shr(hb, 4), 3), 4)),
              V::bor(V::shr(b, 4), V::shl(V::shr(hb, 6), 4))};
          for (int u = 0; u < 4; ++u) w[u][l] = V::mul(ds[u][l], V::sub(V::cvt(q[u]), c32));
        }
        for (int m = 0; m < MT; ++m)
          for (int u = 0; u < 4; ++u) {
            const typename V::T a = V::bcast(x + m * ldx + 128 * h + 32 * u + t);
            for (int l = 0; l < L; ++l) acc[m][l] = V::fma(a, w[u][l], acc[m][l]);
          }
      }
    }
}

// One row tile: out[MT][16] = x[MT][K] @ the group's nblk records.
template <int Q, int MT>
void tile(const float* x, long ldx, const uint8_t* w, long nblk, float* out) {
  typename V::T acc[MT][L];
  for (int m = 0; m < MT; ++m)
    for (int l = 0; l < L; ++l) acc[m][l] = V::zero();
  for (long b = 0; b < nblk; ++b) {
    const uint8_t* p = w + b * kRecord[Q];
    _mm_prefetch(reinterpret_cast<const char*>(p + 4 * kRecord[Q]), _MM_HINT_T0);
    const float* xb = x + b * kBlockOf[Q];
    if constexpr (Q == kQ8_0)
      q8_block<MT>(xb, ldx, p, acc);
    else if constexpr (Q == kQ4_K)
      q4k_block<MT>(xb, ldx, p, acc);
    else if constexpr (Q == kQ6_K)
      q6k_block<MT>(xb, ldx, p, acc);
    else
      q4_block<Q, MT>(xb, ldx, p, acc);
  }
  for (int m = 0; m < MT; ++m)
    for (int l = 0; l < L; ++l) V::store(out + m * kGroup + l * V::W, acc[m][l]);
}

typedef void TileFn(const float*, long, const uint8_t*, long, float*);

template <int Q, int... Ms>
constexpr std::array<TileFn*, sizeof...(Ms)> tiles(std::integer_sequence<int, Ms...>) {
  return {&tile<Q, Ms + 1>...};
}

void group(int qtype, const float* x, long ldx, const uint8_t* w, long nblk, long rows,
           float* out) {
  static constexpr std::array<TileFn*, V::MT> table[kNumTypes] = {
      tiles<kQ8_0>(std::make_integer_sequence<int, V::MT>{}),
      tiles<kQ4_0>(std::make_integer_sequence<int, V::MT>{}),
      tiles<kQ4_1>(std::make_integer_sequence<int, V::MT>{}),
      tiles<kQ4_K>(std::make_integer_sequence<int, V::MT>{}),
      tiles<kQ6_K>(std::make_integer_sequence<int, V::MT>{})};
  for (long r = 0; r < rows; r += V::MT) {
    const long mt = rows - r < V::MT ? rows - r : V::MT;
    table[qtype][mt - 1](x + r * ldx, ldx, w, nblk, out + r * kGroup);
  }
}

}  // namespace

extern "C" void SJ_PATH(sj_blocks)(int qtype, const float* x, long ldx, const uint8_t* w,
                                  long nblk, long rows, float* out) {
  group(qtype, x, ldx, w, nblk, rows, out);
}

#elif SJ_PART == SJ_SCALAR

namespace {

using sj_fp16::to_float;  // fp16.h: exact, without F16C (the portable path runs anywhere)

// A K-quant record's 256 x 16 dequantised weights, w[k][column], as the reference computes them.
void dequant_k(int qtype, const uint8_t* p, float (&w)[256][kGroup]) {
  for (int i = 0; i < kGroup; ++i) {
    auto byte = [&](long r) { return int(p[16 * r + i]); };  // byte row r of the record
    if (qtype == kQ4_K) {
      const float d = to_float(p + 2 * i), dmin = to_float(p + 32 + 2 * i);
      for (int j = 0; j < 8; ++j) {
        int s, m;
        if (j < 4) {
          s = byte(4 + j) & 63;
          m = byte(4 + j + 4) & 63;
        } else {
          s = (byte(4 + j + 4) & 15) | ((byte(4 + j - 4) >> 6) << 4);
          m = (byte(4 + j + 4) >> 4) | ((byte(4 + j) >> 6) << 4);
        }
        const float ds = d * float(s), dm = dmin * float(m);
        for (int e = 0; e < 32; ++e) {
          const int q = (byte(16 + 32 * (j / 2) + e) >> (4 * (j & 1))) & 15;
          w[32 * j + e][i] = ds * float(q) - dm;
        }
      }
    } else {  // Q6_K
      const float d = to_float(p + 3328 + 2 * i);
      for (int k = 0; k < 256; ++k) {
        const int h = k / 128, u = (k % 128) / 32, t = k % 32;
        const int lo = (byte(64 * h + 32 * (u & 1) + t) >> (4 * (u >> 1))) & 15;
        const int hi = (byte(128 + 32 * h + t) >> (2 * u)) & 3;
        const float ds = d * float(int8_t(p[16 * (192 + k / 16) + i]));
        w[k][i] = ds * float((lo | (hi << 4)) - 32);
      }
    }
  }
}

// The record's 32 x 16 dequantised weights, w[k][column], as the reference computes them.
void dequant(int qtype, const uint8_t* p, float (&w)[kBlock][kGroup]) {
  float d[kGroup], mn[kGroup] = {};
  for (int i = 0; i < kGroup; ++i) d[i] = to_float(p + 2 * i);
  if (qtype == kQ4_1)
    for (int i = 0; i < kGroup; ++i) mn[i] = to_float(p + 32 + 2 * i);
  if (qtype == kQ8_0) {
    for (int j = 0; j < 32; ++j)
      for (int i = 0; i < kGroup; ++i) w[j][i] = d[i] * float(int8_t(p[32 + 16 * j + i]));
    return;
  }
  const uint8_t* q = p + (qtype == kQ4_1 ? 64 : 32);
  for (int j = 0; j < 16; ++j)
    for (int i = 0; i < kGroup; ++i) {
      const int lo = q[16 * j + i] & 15, hi = q[16 * j + i] >> 4;
      if (qtype == kQ4_0) {
        w[j][i] = d[i] * float(lo - 8);
        w[j + 16][i] = d[i] * float(hi - 8);
      } else {
        w[j][i] = d[i] * float(lo) + mn[i];
        w[j + 16][i] = d[i] * float(hi) + mn[i];
      }
    }
}

// The k order of the vector paths' K-quant loops (q4k_block, q6k_block): order[i] = the i-th k
// of a 256-block.
struct KOrder {
  int q4k[256], q6k[256];
  KOrder() {
    int i = 0;
    for (int c = 0; c < 4; ++c)
      for (int e = 0; e < 32; ++e) q4k[i++] = 64 * c + e, q4k[i++] = 64 * c + 32 + e;
    i = 0;
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 32; ++t)
        for (int u = 0; u < 4; ++u) q6k[i++] = 128 * h + 32 * u + t;
  }
};

}  // namespace

// Portable reference path: dequantise a record, then one fma per k and output in the vector
// paths' k order (std::fma rounds once, as vfmadd does): the same bits as the vector paths.
extern "C" void sj_blocks_scalar(int qtype, const float* x, long ldx, const uint8_t* w, long nblk,
                                 long rows, float* out) {
  for (long i = 0; i < rows * kGroup; ++i) out[i] = 0.0f;
  if (qtype == kQ4_K || qtype == kQ6_K) {
    static const KOrder order;
    const int* ks = qtype == kQ4_K ? order.q4k : order.q6k;
    static thread_local float wk[256][kGroup];
    for (long b = 0; b < nblk; ++b) {
      dequant_k(qtype, w + b * kRecord[qtype], wk);
      for (long m = 0; m < rows; ++m)
        for (int j = 0; j < 256; ++j) {
          const int k = ks[j];
          const float a = x[m * ldx + b * 256 + k];
          for (int i = 0; i < kGroup; ++i) out[m * kGroup + i] = std::fma(a, wk[k][i], out[m * kGroup + i]);
        }
    }
    return;
  }
  float wd[kBlock][kGroup];
  for (long b = 0; b < nblk; ++b) {
    dequant(qtype, w + b * kRecord[qtype], wd);
    for (long m = 0; m < rows; ++m) {
      const float* xb = x + m * ldx + b * kBlock;
      float* o = out + m * kGroup;
      for (int j = 0; j < 32; ++j) {
        // the vector paths' order: 4-bit blocks k = 0, 16, 1, 17, ...; Q8_0 k = 0, 1, 2, ...
        const int k = qtype == kQ8_0 ? j : (j >> 1) + 16 * (j & 1);
        for (int i = 0; i < kGroup; ++i) o[i] = std::fma(xb[k], wd[k][i], o[i]);
      }
    }
  }
}

#elif SJ_PART == SJ_MAIN

#include <string>
#include <vector>

#include "handler.h"

SJ_PATHS(GroupFn, sj_blocks);

namespace {

// ----------------------------------------------------------------------------- ISA choice

// The isa codes: 0 scalar, 1 avx2+fma+f16c, 2 avx512f.
SJ_ISA(SJ_CPU("avx512f"), SJ_CPU("avx2") && SJ_CPU("fma") && SJ_CPU("f16c"))

GroupFn* group_fn() { return SJ_PICK(sj_blocks); }

// ----------------------------------------------------------------------------- one call

struct Job {
  int qtype;
  const float* x;    // [m, k]
  const uint8_t* w;  // [ng, nblk, record]
  float* y;          // [m, n]
  long m, k, n, ng, nblk;
  GroupFn* fn;
};

void run_groups(const Job& j, long g0, long g1) {
  alignas(64) float buf[kMaxM * kGroup];
  const long record = kRecord[j.qtype];
  for (long g = g0; g < g1; ++g) {
    const long col = g * kGroup;
    const long ncols = std::min(kGroup, j.n - col);
    j.fn(j.qtype, j.x, j.k, j.w + g * j.nblk * record, j.nblk, j.m, buf);
    for (long r = 0; r < j.m; ++r)
      std::memcpy(j.y + r * j.n + col, buf + r * kGroup, ncols * sizeof(float));
  }
}

// Below this many weight bytes a call is not worth waking another thread for.
constexpr long kThreadedBytes = 128 * 1024;

void blocks_dense(int qtype, const float* x, const uint8_t* w, float* y, long m, long k, long n) {
  const long ng = (n + kGroup - 1) / kGroup, nblk = k / kBlockOf[qtype];
  const Job j{qtype, x, w, y, m, k, n, ng, nblk, group_fn()};
  sj_pool::split(ng, ng * nblk * kRecord[qtype], kThreadedBytes,
                 [&](long g0, long g1) { run_groups(j, g0, g1); });
}

// ----------------------------------------------------------------------------- XLA FFI

// Checks x[...,K], w[ng, K/block, record], y[...,N] (M: the product of the leading dimensions)
// against qtype's packed layout; returns an error message, or "" if they agree.
std::string check(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd,
                  ffi::Span<const int64_t> yd, int32_t qtype) {
  const long m = sj_ffi::rows(xd, yd);
  if (m < 0 || wd.size() != 3)
    return "specjax_blocks_f32: expected x[...,K], w[ng,K/block,record], y[...,N]";
  if (qtype < 0 || qtype >= kNumTypes)
    return "specjax_blocks_f32: unknown qtype " + std::to_string(qtype);
  const long k = sj_ffi::last(xd), ng = wd[0], n = sj_ffi::last(yd);
  if (m > kMaxM) return "specjax_blocks_f32: M > 64";
  if (k % kBlockOf[qtype] != 0 || wd[1] != k / kBlockOf[qtype] || wd[2] != kRecord[qtype] ||
      n > ng * kGroup || n <= (ng - 1) * kGroup)
    return "specjax_blocks_f32: bad packed block layout";
  return "";
}

ffi::Error BlocksF32(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                     ffi::ResultBuffer<ffi::F32> y, int32_t qtype) {
  std::string err = check(x.dimensions(), w.dimensions(), y->dimensions(), qtype);
  if (!err.empty()) return sj_ffi::invalid(err);
  const long m = sj_ffi::rows(x.dimensions(), y->dimensions()), k = sj_ffi::last(x.dimensions()),
             n = sj_ffi::last(y->dimensions());
  return sj_ffi::product(y->typed_data(), m, k, n, [&] {
    blocks_dense(qtype, x.typed_data(), w.typed_data(), y->typed_data(), m, k, n);
  });
}

}  // namespace

SJ_PRODUCT_HANDLER(SpecjaxBlocksF32, BlocksF32, ffi::F32, ffi::U8, .Attr<int32_t>("qtype"));

// ----------------------------------------------------------------------------- ctypes API

extern "C" {

SJ_LIBRARY_EXPORTS(specjax_blocks)

// y = x @ dequant(w)^T on host pointers, outside XLA (benchmarks without a jit in between).
SJ_EXPORT void specjax_blocks_f32(int qtype, const float* x, const uint8_t* w, float* y, long m,
                                  long k, long n) {
  blocks_dense(qtype, x, w, y, m, k, n);
}

}  // extern "C"

#endif
