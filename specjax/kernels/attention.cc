// Decode attention over a static KV cache plus the step's T new entries, for one call of T <= 64
// query tokens (a verification block, a tree, a lookahead window):
//
//   q    [B, T, K, G, D]  the T tokens' queries, G per kv head (the layout the QKV product gives)
//   kc   [B, K, S, D]     the cache as it was before this call (vc the same), float32 or
//                         bfloat16 (a bf16 model's cache: read into float32 a tile at a time,
//                         exactly, so the arithmetic and its bits are the float32 cache's)
//   kn   [B, T, K, D]     the T new entries (vn the same)
//   mask [B, T, S + T]    bool: token t sees cache slot s (column s) / new entry j (column S + j)
//   o    [B, T, K, G, D]  softmax(scale * q.k over the visible columns) @ v, the layout the
//                         output projection reads (so no transpose on either side)
//
// The arithmetic is the model's XLA attention (specjax/model.py, Attention) up to fp32 summation
// order: s = (q.k) * scale, optionally cap * tanh(s / cap); masked columns out; p = exp(s - max) /
// sum; o = sum p v. A row that sees no column averages every column's v uniformly, as the XLA
// path's softmax over equal "minimum" scores does. Its order of operations is defined below ("the
// arithmetic") by the keys a row sees alone, so a row's result is the same whatever T is, however
// the block is shaped (a chain, a tree) and whichever other rows share the call: batch
// invariance, which makes a speculative verification give the bits of autoregressive steps.
//
// Why: XLA's CPU attention for T > 1 runs the two products as separate dot operations over the
// whole cache (every slot, filled or not), with transposes, concatenations and a masked softmax
// around them: ~8 ms of a 27 ms T = 8 forward of SmolLM2-135M at 256 of 512 slots filled, ~15 ms
// at T = 16 (experiments/kernels, "attention"). Here one call reads each row's visible slots
// only: a cache slot past the last one any row of the block sees is never read.
//
// Like matmul.cc, this file is compiled once per part (SJ_PART = main, avx512, avx2, scalar) with
// its own -m flags and the path is chosen at run time. The arithmetic is written once over an
// 8-lane vector type (V8): AVX2 registers on the avx2 and avx512 parts, eight floats with std::fma
// on the scalar part, compiled with -ffp-contract=off, so every path gives the same bits. Part
// `main` holds the XLA FFI handler, the ISA choice and the split of one call's rows over the
// thread pool (pool.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa.h"

// One call's operands (row-major, dense) and sizes.
struct Call {
  const float* q;
  const void *kc, *vc;  // float, or bfloat16 bits (uint16_t) where half
  const float *kn, *vn;
  const uint8_t* mask;
  float* o;
  long b, k, rows, t, s, d, g;  // rows = t * g per kv head
  float scale, softcap;
  bool half;
};

// Rows r0..r1 of kv head h of batch bi; prob and col hold at least (r1 - r0) * (S + T + 8)
// floats and int32s.
typedef void RowsFn(const Call* c, long bi, long h, long r0, long r1, float* prob, int32_t* col);

namespace {

// One past the last visible column among the first s of a token's mask row (0: none visible).
inline long last_visible(const uint8_t* m, long s) {
  long hi = s;
  while (hi >= 8) {  // eight slots at a time through the unfilled tail of a long cache
    uint64_t word;
    std::memcpy(&word, m + hi - 8, 8);
    if (word) break;
    hi -= 8;
  }
  while (hi > 0 && !m[hi - 1]) --hi;
  return hi;
}

// The first visible column among the first hi of a token's mask row (hi: none visible).
inline long first_visible(const uint8_t* m, long hi) {
  long lo = 0;
  while (lo + 8 <= hi) {  // eight slots at a time past other rows' slots of a packed prefill
    uint64_t word;
    std::memcpy(&word, m + lo, 8);
    if (word) break;
    lo += 8;
  }
  while (lo < hi && !m[lo]) ++lo;
  return lo;
}

}  // namespace

// ----------------------------------------------------------------------------- 8-lane vectors
//
// The arithmetic is written once, below, over V8: eight fp32 lanes with load, fma, add, mul,
// max. On the avx2 and avx512 parts V8 is one ymm register (AVX-512 CPUs run the AVX2 code, so
// those two paths are the same instructions); on the scalar part it is eight floats and fma is
// std::fma (the file is compiled with -ffp-contract=off, so nothing else fuses). Each operation
// is one IEEE operation, rounded once, on every path: the paths give the same bits.

#if SJ_PART == SJ_AVX512 || SJ_PART == SJ_AVX2
#include <immintrin.h>

namespace {

struct V8 {
  __m256 v;
};
inline V8 v_zero() { return {_mm256_setzero_ps()}; }
inline V8 v_set(float x) { return {_mm256_set1_ps(x)}; }
inline V8 v_load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void v_store(float* p, V8 a) { _mm256_storeu_ps(p, a.v); }
inline V8 v_fma(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline V8 v_add(V8 a, V8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline V8 v_mul(V8 a, V8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline V8 v_max(V8 a, V8 b) { return {_mm256_max_ps(a.v, b.v)}; }  // a > b ? a : b
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float v_hsum(V8 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
// v_hsum of eight registers at once, out[u] = v_hsum(a[u]): the same additions in the same tree
// (lo + hi halves, then lanes 0 + 2 and 1 + 3, then those two), four and eight sums per
// instruction.
inline void v_hsum8(const V8* a, float* out) {
  __m256 h[4];  // h[i] = [lo + hi of a[2i] | lo + hi of a[2i + 1]]
  for (int i = 0; i < 4; ++i)
    h[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i].v, a[2 * i + 1].v, 0x20),
                         _mm256_permute2f128_ps(a[2 * i].v, a[2 * i + 1].v, 0x31));
  __m256 q[2];  // per 128-bit half: (l0 + l2, l1 + l3) of two registers' h
  for (int i = 0; i < 2; ++i)
    q[i] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // f holds a[0], a[2], a[4], a[6] | a[1], a[3], a[5], a[7]
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
inline float v_hmax(V8 a) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}
inline V8 v_round(V8 a) {  // to nearest, ties to even
  return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline V8 v_pow2(V8 n) {  // 2^n for integral n in [-126, 127]
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
}
inline V8 v_zero_below(V8 a, V8 x, float lo) {  // a where x >= lo, else 0
  return {_mm256_and_ps(a.v, _mm256_cmp_ps(x.v, _mm256_set1_ps(lo), _CMP_GE_OQ))};
}

}  // namespace

#elif SJ_PART == SJ_SCALAR

namespace {

struct V8 {
  float v[8];
};
inline V8 v_zero() { return {{0, 0, 0, 0, 0, 0, 0, 0}}; }
inline V8 v_set(float x) { return {{x, x, x, x, x, x, x, x}}; }
inline V8 v_load(const float* p) {
  V8 r;
  for (int l = 0; l < 8; ++l) r.v[l] = p[l];
  return r;
}
inline void v_store(float* p, V8 a) {
  for (int l = 0; l < 8; ++l) p[l] = a.v[l];
}
#define SJ_LANES(expr) \
  V8 r;                \
  for (int l = 0; l < 8; ++l) r.v[l] = expr; \
  return r
inline V8 v_fma(V8 a, V8 b, V8 c) { SJ_LANES(std::fma(a.v[l], b.v[l], c.v[l])); }
inline V8 v_add(V8 a, V8 b) { SJ_LANES(a.v[l] + b.v[l]); }
inline V8 v_mul(V8 a, V8 b) { SJ_LANES(a.v[l] * b.v[l]); }
inline V8 v_max(V8 a, V8 b) { SJ_LANES(a.v[l] > b.v[l] ? a.v[l] : b.v[l]); }
inline V8 v_round(V8 a) { SJ_LANES(std::nearbyint(a.v[l])); }
inline V8 v_pow2(V8 n) {
  V8 r;
  for (int l = 0; l < 8; ++l) {
    const uint32_t bits = uint32_t(int32_t(n.v[l]) + 127) << 23;
    std::memcpy(&r.v[l], &bits, 4);
  }
  return r;
}
inline V8 v_zero_below(V8 a, V8 x, float lo) { SJ_LANES(x.v[l] >= lo ? a.v[l] : 0.0f); }
#undef SJ_LANES
inline float v_hsum(V8 a) {
  const float* x = a.v;
  return ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
}
inline void v_hsum8(const V8* a, float* out) {
  for (int u = 0; u < 8; ++u) out[u] = v_hsum(a[u]);
}
inline float v_hmax(V8 a) {
  float m = a.v[0];
  for (int l = 1; l < 8; ++l) m = m > a.v[l] ? m : a.v[l];
  return m;
}

}  // namespace

#endif

#if SJ_PART != SJ_MAIN

namespace {

// ----------------------------------------------------------------------------- the arithmetic
//
// Per query row, over the columns it sees (its visible cache slots, then its visible new entries,
// each in order; the "visible list"):
//   s_j = capped(dot(q, k_j) * scale)      dot: lane l sums q[e] * k_j[e] for e = l mod 8 with
//                                           fmas in order of e, then v_hsum's fixed tree
//   p_j = exp(s_j - max_j s_j)              exp_le0 below, the same polynomial on every path
//   sum = lanes by rank in the visible list (p of rank i into lane i mod 8), then v_hsum
//   o   = sum over the visible list, in order, of fma(p_j / sum, v_j, o)
// Every quantity is fixed by the row's visible list alone: where its columns sit in the call
// (after how many other tokens, in a chain or a tree, beside which other rows) changes nothing,
// so row r of a T-token call has the bits of the one-token call that sees the same keys.

// q[0, d) . k[0, d); past a multiple of 8, the lanes read zeros.
inline float dot(const float* q, const float* k, long d) {
  V8 acc = v_zero();
  long e = 0;
  for (; e + 8 <= d; e += 8) acc = v_fma(v_load(q + e), v_load(k + e), acc);
  if (e < d) {
    alignas(32) float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (long i = e; i < d; ++i) a[i - e] = q[i], b[i - e] = k[i];
    acc = v_fma(v_load(a), v_load(b), acc);
  }
  return v_hsum(acc);
}

// exp(x) for x <= 0 (Cody-Waite reduction, degree-6 polynomial: ~1 ulp); x < -87.3 gives 0.
inline V8 exp_le0(V8 x) {
  const float lo = -87.3f;
  const V8 xc = v_max(x, v_set(lo));
  const V8 n = v_round(v_mul(xc, v_set(1.44269504088896341f)));
  const V8 nn = v_mul(n, v_set(-1.0f));
  V8 r = v_fma(nn, v_set(0.693359375f), xc);
  r = v_fma(nn, v_set(-2.12194440e-4f), r);
  V8 p = v_set(1.9875691500e-4f);
  p = v_fma(p, r, v_set(1.3981999507e-3f));
  p = v_fma(p, r, v_set(8.3334519073e-3f));
  p = v_fma(p, r, v_set(4.1665795894e-2f));
  p = v_fma(p, r, v_set(1.6666665459e-1f));
  p = v_fma(p, r, v_set(5.0000001201e-1f));
  p = v_fma(p, v_mul(r, r), v_add(r, v_set(1.0f)));
  return v_zero_below(v_mul(p, v_pow2(n)), x, lo);
}

// The visible list's scores p[0, n) -> exp(p - max) in place, divided by their sum.
inline void softmax(float* p, long n) {
  V8 mx = v_set(-INFINITY);
  long i = 0;
  for (; i + 8 <= n; i += 8) mx = v_max(v_load(p + i), mx);
  float m = v_hmax(mx);
  for (; i < n; ++i) m = p[i] > m ? p[i] : m;
  const long n8 = (n + 7) / 8 * 8;
  for (long j = n; j < n8; ++j) p[j] = -INFINITY;  // exp gives 0: lanes past n add nothing
  V8 sum = v_zero();
  for (i = 0; i < n8; i += 8) {
    const V8 e = exp_le0(v_add(v_load(p + i), v_set(-m)));
    v_store(p + i, e);
    sum = v_add(sum, e);
  }
  const V8 inv = v_set(1.0f / v_hsum(sum));
  for (i = 0; i < n8; i += 8) v_store(p + i, v_mul(v_load(p + i), inv));
}

// Rows taken together where they share a visible list (the query heads of one token): their
// scores and their sums over v read each key and value once for all of them. Three rows of eight
// keys (or 64 lanes of v) are 24 accumulators: registers enough on the AVX-512 part (32), not on
// AVX2's 16, which takes one row at a time. A row's arithmetic is the same either way.
#if SJ_PART == SJ_AVX512
constexpr int kGroupRows = 3;
#else
constexpr int kGroupRows = 1;
#endif

// Several tokens' groups that see the same columns of a tile (a verification block's tokens all
// see the same cache slots) go together too, up to kTakeRows rows, where the zmm paths run (d a
// multiple of 16, at most kDots16MaxD): six rows of two keys' chains, or of 64 lanes of v, are
// 24 zmm accumulators beside six query or probability registers. They share each key's and
// value's loads; each row's chains are the same as alone.
#if SJ_PART == SJ_AVX512
constexpr int kTakeRows = 6;
#else
constexpr int kTakeRows = kGroupRows;
#endif

// The scores of R rows' queries q[r] against the keys at columns js[0, n), eight keys at a time:
// 8 R independent chains, each folding its pair's products exactly as dot() does (lane l: e = l
// mod 8, in order of e), then v_hsum8's tree, which is v_hsum's. So out[r][i] = dot(q[r],
// key(js[i]), d), whichever keys and rows share a pass (a short last eight repeats its last key
// and drops the extra sums). d: a multiple of 8.
template <int R, class Key>
void dots(const float* const* q, Key key, const int32_t* js, long n, long d, float* const* out) {
  for (long i = 0; i < n; i += 8) {
    const long m = std::min(8L, n - i);
    const float* kp[8];
    for (int u = 0; u < 8; ++u) kp[u] = key(js[i + (u < m ? u : m - 1)]);
    V8 acc[R][8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u)
      for (int r = 0; r < R; ++r) acc[r][u] = v_zero();
    for (long e = 0; e < d; e += 8) {
      V8 qe[R];
      for (int r = 0; r < R; ++r) qe[r] = v_load(q[r] + e);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const V8 ku = v_load(kp[u] + e);
        for (int r = 0; r < R; ++r) acc[r][u] = v_fma(qe[r], ku, acc[r][u]);
      }
    }
    for (int r = 0; r < R; ++r) {
      alignas(32) float sums[8];
      v_hsum8(acc[r], sums);
      for (long u = 0; u < m; ++u) out[r][i + u] = sums[u];
    }
  }
}

#if SJ_PART == SJ_AVX512
// dots() with two keys to a zmm register: its low 8 lanes are key 2w's chains, its high 8 key
// 2w + 1's, each lane the same chain of fmas as dots()'s 8-lane registers (so the same bits), in
// half the fmas. The queries are laid out once per call doubled ([q[e, e+8), q[e, e+8)] per 8
// lanes), so each step loads them whole. d: a multiple of 8, at most kDots16MaxD.
constexpr long kDots16MaxD = 256;

inline __m512 pair_of(const float* a, const float* b) {  // [a[0, 8), b[0, 8)]
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(
      _mm256_loadu_ps(a))), _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

// v_hsum8 of the eight keys' chains dots16 holds in four zmm registers (a[w]: key 2w in lanes
// 0-7, key 2w + 1 in lanes 8-15), with the same pairs added at each level as v_hsum's tree, so
// the same bits: (l0 + l4, l1 + l5, l2 + l6, l3 + l7) per key, then (that0 + that2, that1 +
// that3), then their sum; four keys a 16-lane register at the first level, eight at the others
// (11 shuffles and additions for eight keys, against 27 through v_hsum8's 8-lane registers).
inline void hsum8_pairs(const __m512* a, float* out) {
  // level 1: [k0 | k1 | k2 | k3] (4 lanes each) from a[0], a[1]; [k4 | .. | k7] from a[2], a[3]
  const __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(a[0], a[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(a[2], a[3], _MM_SHUFFLE(3, 1, 3, 1)));
  // level 2: 128-bit group i: [k_i: t0 + t2, t1 + t3, k_{i+4}: t0 + t2, t1 + t3]
  const __m512 s2 = _mm512_add_ps(_mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(3, 2, 3, 2)));
  // level 3: group i: [k_i, k_{i+4}, k_i, k_{i+4}]
  const __m512 s3 = _mm512_add_ps(_mm512_shuffle_ps(s2, s2, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(s2, s2, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 f = _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 4, 8, 12, 1, 5, 9, 13), s3);
  _mm256_storeu_ps(out, _mm512_castps512_ps256(f));
}

template <int R, long DC, class Key>
void dots16_d(const float* const* q, Key key, const int32_t* js, long n, long dd,
              float* const* out) {
  const long d = DC > 0 ? DC : dd;  // a compile-time d unrolls the chains' loop
  alignas(64) float qd[R][2 * kDots16MaxD];
  for (int r = 0; r < R; ++r)
    for (long e = 0; e < d; e += 8)
      for (int l = 0; l < 16; ++l) qd[r][2 * e + l] = q[r][e + (l & 7)];
  for (long i = 0; i < n; i += 8) {
    const long m = std::min(8L, n - i);
    const float* kp[8];
    for (int u = 0; u < 8; ++u) kp[u] = key(js[i + (u < m ? u : m - 1)]);
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int w = 0; w < 4; ++w) acc[r][w] = _mm512_setzero_ps();
    for (long e = 0; e < d; e += 8) {
      __m512 qe[R];
      for (int r = 0; r < R; ++r) qe[r] = _mm512_load_ps(qd[r] + 2 * e);
#pragma GCC unroll 4
      for (int w = 0; w < 4; ++w) {
        const __m512 kw = pair_of(kp[2 * w] + e, kp[2 * w + 1] + e);
        for (int r = 0; r < R; ++r) acc[r][w] = _mm512_fmadd_ps(qe[r], kw, acc[r][w]);
      }
    }
    for (int r = 0; r < R; ++r) {
      alignas(32) float sums[8];
      hsum8_pairs(acc[r], sums);
      for (long u = 0; u < m; ++u) out[r][i + u] = sums[u];
    }
  }
}

template <int R, class Key>
void dots16(const float* const* q, Key key, const int32_t* js, long n, long d, float* const* out) {
  if (d == 64)
    dots16_d<R, 64>(q, key, js, n, d, out);
  else
    dots16_d<R, 0>(q, key, js, n, d, out);
}
#endif

// Registers for pv_slab: V8 (8 lanes) on every part, and on the AVX-512 part a zmm register of 16
// lanes. A lane's fma is the same IEEE operation at either width, so the width changes no bit.
struct Lanes8 {
  typedef V8 V;
  static constexpr int n = 8;
  static V load(const float* p) { return v_load(p); }
  static void store(float* p, V a) { v_store(p, a); }
  static V set(float x) { return v_set(x); }
  static V fma(V a, V b, V c) { return v_fma(a, b, c); }
};

#if SJ_PART == SJ_AVX512
struct Lanes16 {
  typedef __m512 V;
  static constexpr int n = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  static V set(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};
#endif

// o[r][e0, e0 + W NV) = fma(p[r][i], v_i[e0, e0 + W NV), o[r]) over the entries i = 0, 1, ..., n
// - 1 in order (W = L::n lanes a register), skipping a row's entries whose p is 0, the R rows' o
// in registers meanwhile: each lane is one chain of fmas in the entries' order, the order the
// arithmetic fixes.
template <class L, int R, int NV, class Val>
void pv_slab(const float* const* p, const int32_t* js, long n, Val val, long e0, float* const* o) {
  typename L::V acc[R][NV];
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) acc[r][u] = L::load(o[r] + e0 + L::n * u);
  for (long i = 0; i < n; ++i) {
    const float* v = val(js[i]) + e0;
    bool all = true;
    for (int r = 0; r < R; ++r) all = all && p[r][i] != 0.0f;
    if (all) {
      typename L::V pv[R];
      for (int r = 0; r < R; ++r) pv[r] = L::set(p[r][i]);
#pragma GCC unroll 8
      for (int u = 0; u < NV; ++u) {
        const typename L::V vu = L::load(v + L::n * u);
        for (int r = 0; r < R; ++r) acc[r][u] = L::fma(pv[r], vu, acc[r][u]);
      }
    } else {  // (an entry whose exp underflowed to 0 in some row: that row skips it)
      for (int r = 0; r < R; ++r) {
        if (p[r][i] == 0.0f) continue;
        const typename L::V pr = L::set(p[r][i]);
#pragma GCC unroll 8
        for (int u = 0; u < NV; ++u) acc[r][u] = L::fma(pr, L::load(v + L::n * u), acc[r][u]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) L::store(o[r] + e0 + L::n * u, acc[r][u]);
}

// o[r][0, d) = fma(p[r][i], v_i[0, d), o[r]) over the entries in order: slabs of up to 64 lanes
// in registers, the tail past a multiple of 8 lane by lane (the same fma).
template <int R, class Val>
void pv(const float* const* p, const int32_t* js, long n, Val val, long d, float* const* o) {
  const long d8 = d / 8 * 8;
  for (long e0 = 0; e0 < d8; e0 += 64) {
#if SJ_PART == SJ_AVX512
    switch ((d8 - e0) >= 64 ? 4 : (d8 - e0) % 16 == 0 ? (d8 - e0) / 16 : 0) {
      case 4: pv_slab<Lanes16, R, 4>(p, js, n, val, e0, o); continue;
      case 3: pv_slab<Lanes16, R, 3>(p, js, n, val, e0, o); continue;
      case 2: pv_slab<Lanes16, R, 2>(p, js, n, val, e0, o); continue;
      case 1: pv_slab<Lanes16, R, 1>(p, js, n, val, e0, o); continue;
      default: break;
    }
#endif
    switch (std::min(8L, (d8 - e0) / 8)) {
      case 1: pv_slab<Lanes8, R, 1>(p, js, n, val, e0, o); break;
      case 2: pv_slab<Lanes8, R, 2>(p, js, n, val, e0, o); break;
      case 3: pv_slab<Lanes8, R, 3>(p, js, n, val, e0, o); break;
      case 4: pv_slab<Lanes8, R, 4>(p, js, n, val, e0, o); break;
      case 5: pv_slab<Lanes8, R, 5>(p, js, n, val, e0, o); break;
      case 6: pv_slab<Lanes8, R, 6>(p, js, n, val, e0, o); break;
      case 7: pv_slab<Lanes8, R, 7>(p, js, n, val, e0, o); break;
      default: pv_slab<Lanes8, R, 8>(p, js, n, val, e0, o); break;
    }
  }
  for (int r = 0; r < R; ++r)
    for (long e = d8; e < d; ++e)
      for (long i = 0; i < n; ++i)
        if (p[r][i] != 0.0f) o[r][e] = std::fma(p[r][i], val(js[i])[e], o[r][e]);
}

// Calls fn(std::integral_constant<int, R>()) with R = rows (1 .. Max), a compile-time count.
template <int Max, class Fn>
inline void with_rows(long rows, Fn&& fn) {
  if constexpr (Max > 1) {
    if (rows == Max) return fn(std::integral_constant<int, Max>());
    return with_rows<Max - 1>(rows, fn);
  } else {
    fn(std::integral_constant<int, 1>());
  }
}

// o[0, d) = fma(p, v[0, d), o) (the tail past a multiple of 8 lane by lane: the same fma).
inline void axpy(float p, const float* v, long d, float* o) {
  const V8 pv = v_set(p);
  long e = 0;
  for (; e + 8 <= d; e += 8) v_store(o + e, v_fma(pv, v_load(v + e), v_load(o + e)));
  for (; e < d; ++e) o[e] = std::fma(p, v[e], o[e]);
}

// p[0, n) = capped(p * scale): one IEEE multiply an entry, then, where cap > 0, cap * tanh(x /
// cap); without a cap a plain loop the compiler vectorizes (the same multiply, the same bits).
inline void scale_scores(float* p, long n, float scale, float cap) {
  if (cap > 0) {
    for (long i = 0; i < n; ++i) p[i] = cap * std::tanh(p[i] * scale / cap);
  } else {
    for (long i = 0; i < n; ++i) p[i] = p[i] * scale;
  }
}

// The columns j0..j1 a mask row sees, in order, into cols -> how many. Eight mask bytes at a
// time: a run of eight visible columns (the common case: a filled cache) is written without a
// test a column.
inline long visible_columns(const uint8_t* m, long j0, long j1, int32_t* cols) {
  long n = 0, j = j0;
  for (; j + 8 <= j1; j += 8) {
    uint64_t word;
    std::memcpy(&word, m + j, 8);
    if (word == 0x0101010101010101ull) {
      for (int u = 0; u < 8; ++u) cols[n + u] = int32_t(j + u);
      n += 8;
    } else if (word) {
      for (int u = 0; u < 8; ++u)
        if (m[j + u]) cols[n++] = int32_t(j + u);
    }
  }
  for (; j < j1; ++j)
    if (m[j]) cols[n++] = int32_t(j);
  return n;
}

// bfloat16 bits src[0, n) -> float32 dst[0, n): the upper half of each float, exact.
inline void widen(const uint16_t* src, long n, float* dst) {
  for (long i = 0; i < n; ++i) {
    const uint32_t u = uint32_t(src[i]) << 16;
    std::memcpy(dst + i, &u, sizeof u);
  }
}

// A row that sees nothing: the uniform average of every column's v (the XLA path's result).
// cache(j0, j1): the cache's v rows j0..j1 as float32, d apart.
template <class Cache>
inline void uniform(const Call* c, Cache cache, const float* vn, long ldn, float* o) {
  const long d = c->d, n = c->s + c->t;
  const float p = 1.0f / float(n);
  for (long e = 0; e < d; ++e) o[e] = 0.0f;
  for (long j = 0; j < c->s; ++j) axpy(p, cache(j, j + 1), d, o);
  for (long j = 0; j < c->t; ++j) axpy(p, vn + j * ldn, d, o);
}

// Rows r0..r1 of kv head h of batch bi. Keys are taken a tile of kTile columns at a time (a tile
// of K, then of V, stays in L1 while every row of the chunk uses it), and the chunk reads the
// cache up to the last slot any of its rows sees and the new entries up to the last one any of
// its rows sees (a causal block, e.g. a prompt's prefill with an empty cache: the chunk of its
// first tokens reads only those). Within a tile, a token's query heads (up to kGroupRows) go
// together, and each row's scores and sum over v run as independent chains, eight keys or 64
// lanes at a time, held in registers: one key or value at a time, each score a dependent chain
// and o kept in memory, the kernel was bound by the chains' latency (2.6x slower at 16 tokens of
// SmolLM2; experiments/kernels/README.md, "Decode attention"). scratch: (r1 - r0) * (S + T + 8)
// floats for the visible lists' probabilities and as many int32 for their columns.
//
// A bfloat16 cache is read a tile at a time into a float32 copy of the tile (exact), which the
// tile's scores or sums then read: XLA converting the whole cache to float32 before the call
// cost a bf16 model's decoding step a pass over every slot, filled or not, in every layer.
constexpr long kTile = 64;

void rows(const Call* c, long bi, long h, long r0, long r1, float* prob, int32_t* col) {
  const long d = c->d, s = c->s, t = c->t, w = s + t, nrow = r1 - r0, g = c->g, k = c->k;
  const long ld = w + 8;
  const long at0 = (bi * k + h) * s * d;  // this head's cache, in elements
  const float* kn = c->kn + (bi * t * k + h) * d;  // new entry j at kn + j * k * d
  const float* vn = c->vn + (bi * t * k + h) * d;
  const long ldn = k * d;
  static thread_local std::vector<float> tile;  // a bf16 cache's tile in float32
  if (c->half && long(tile.size()) < kTile * d) tile.resize(kTile * d);
  // The cache tile being read: slots tile0.. of kc or vc as float32 at base, d apart (in place
  // for a float32 cache, else widened into `tile`). cache(src, j0, j1) makes it rows j0..j1
  // (at most kTile) of src.
  const float* base = nullptr;
  long tile0 = 0;
  auto cache = [&](const void* src, long j0, long j1) -> const float* {
    tile0 = j0;
    if (!c->half) return base = static_cast<const float*>(src) + at0 + j0 * d;
    widen(static_cast<const uint16_t*>(src) + at0 + j0 * d, (j1 - j0) * d, tile.data());
    return base = tile.data();
  };
  // row r of this head is token r / g, query head r % g: q[bi, r / g, h, r % g, :] (o alike)
  auto at = [&](long r) { r += r0; return ((bi * t + r / g) * k + h) * g * d + (r % g) * d; };
  auto mrow = [&](long r) { return c->mask + (bi * t + (r0 + r) / g) * w; };
  auto key = [&](long j) { return j < s ? base + (j - tile0) * d : kn + (j - s) * ldn; };
  auto val = [&](long j) { return j < s ? base + (j - tile0) * d : vn + (j - s) * ldn; };
  long hi = 0, tn = 0, lo = s;
  for (long r = 0; r < nrow; ++r)  // (the g rows of one token share its mask row)
    if (r == 0 || mrow(r) != mrow(r - 1)) {
      const long last = last_visible(mrow(r), s);
      hi = std::max(hi, last);
      if (last > 0) lo = std::min(lo, first_visible(mrow(r), last));
      tn = std::max(tn, last_visible(mrow(r) + s, t));
    }
  // The columns to read, in order: cache [lo, hi), then new entries [s, s + tn). (Which tile a
  // column falls in changes nothing: each row's visible list keeps its order.)
  auto tiles = [&](auto&& fn) {
    for (long j0 = lo; j0 < hi; j0 += kTile) fn(j0, std::min(hi, j0 + kTile));
    for (long j0 = s; j0 < s + tn; j0 += kTile) fn(j0, std::min(s + tn, j0 + kTile));
  };
  // Groups: runs of up to kGroupRows consecutive rows with one mask row (one token's heads).
  long gstart[257], ngroups = 0;
  for (long r = 0; r < nrow;) {
    long e = r + 1;
    while (e < nrow && e - r < kGroupRows && mrow(e) == mrow(r)) ++e;
    gstart[ngroups++] = r;
    r = e;
  }
  gstart[ngroups] = nrow;
  // Rows taken together: one group, or consecutive groups with equal visible columns in the
  // tile, up to `take` rows.
#if SJ_PART == SJ_AVX512
  const long take = d % 16 == 0 && d <= kDots16MaxD ? kTakeRows : kGroupRows;
#else
  const long take = kGroupRows;
#endif
  // Each row's visible list is kept in its group's first row's col; count per row (0: sees
  // nothing), next per row (pv: the list's entries done); n per group: its columns in the tile.
  long count[256], next[256], n[257];  // (rows per chunk are capped at 256 by the caller)
  // Consecutive groups from gi with group gi's n[gi] columns (at cols(g)), while the rows fit
  // in `take` -> one past the last.
  auto run_of = [&](long gi, auto cols) {
    long ge = gi + 1;
    while (ge < ngroups && gstart[ge + 1] - gstart[gi] <= take && n[ge] == n[gi] &&
           (n[gi] <= 0 || std::memcmp(cols(ge), cols(gi), n[gi] * sizeof(int32_t)) == 0))
      ++ge;
    return ge;
  };
  for (long r = 0; r < nrow; ++r) count[r] = next[r] = 0;
  tiles([&](long j0, long j1) {
    if (j0 < s) cache(c->kc, j0, j1);
    for (long gi = 0; gi < ngroups; ++gi) {
      const long r = gstart[gi];
      n[gi] = visible_columns(mrow(r), j0, j1, col + r * ld + count[r]);
    }
    auto cols = [&](long gi) { return col + gstart[gi] * ld + count[gstart[gi]]; };
    for (long gi = 0, ge; gi < ngroups; gi = ge) {
      ge = run_of(gi, cols);
      const long r = gstart[gi], nr = gstart[ge] - r, m = n[gi];
      const int32_t* cr = cols(gi);
      const float* q[kTakeRows] = {};
      float* pr[kTakeRows] = {};
      for (long u = 0; u < nr; ++u) q[u] = c->q + at(r + u), pr[u] = prob + (r + u) * ld + count[r + u];
      if (d % 8 == 0) {
#if SJ_PART == SJ_AVX512
        if (d <= kDots16MaxD)
          with_rows<kTakeRows>(nr, [&](auto R) { dots16<R()>(q, key, cr, m, d, pr); });
        else
#endif
        with_rows<kGroupRows>(nr, [&](auto R) { dots<R()>(q, key, cr, m, d, pr); });
      } else {
        for (long u = 0; u < nr; ++u)
          for (long i = 0; i < m; ++i) pr[u][i] = dot(q[u], key(cr[i]), d);
      }
      for (long u = 0; u < nr; ++u) {
        scale_scores(pr[u], m, c->scale, c->softcap);
        count[r + u] += m;
      }
    }
  });
  for (long r = 0; r < nrow; ++r) {
    float* o = c->o + at(r);
    for (long e = 0; e < d; ++e) o[e] = 0.0f;
    if (count[r] == 0) {
      uniform(c, [&](long j0, long j1) { return cache(c->vc, j0, j1); }, vn, ldn, o);
    } else {
      softmax(prob + r * ld, count[r]);
    }
  }
  tiles([&](long j0, long j1) {
    if (j0 < s) cache(c->vc, j0, j1);
    for (long gi = 0; gi < ngroups; ++gi) {  // n: the group's entries in this tile
      const long r = gstart[gi];
      long i = next[r];
      while (i < count[r] && col[r * ld + i] < j1) ++i;
      n[gi] = count[r] == 0 ? -1 : i - next[r];  // (-1: the uniform average, already in o)
    }
    auto cols = [&](long gi) { return col + gstart[gi] * ld + next[gstart[gi]]; };
    for (long gi = 0, ge; gi < ngroups; gi = ge) {
      ge = run_of(gi, cols);
      if (n[gi] < 0) continue;
      const long r = gstart[gi], nr = gstart[ge] - r, m = n[gi];
      const float* p[kTakeRows] = {};
      float* o[kTakeRows] = {};
      for (long u = 0; u < nr; ++u) p[u] = prob + (r + u) * ld + next[r + u], o[u] = c->o + at(r + u);
      with_rows<kTakeRows>(nr, [&](auto R) { pv<R()>(p, cols(gi), m, val, d, o); });
      for (long u = 0; u < nr; ++u) next[r + u] += m;
    }
  });
}

}  // namespace

extern "C" RowsFn SJ_PATH(sj_attn_rows);
void SJ_PATH(sj_attn_rows)(const Call* c, long bi, long h, long r0, long r1, float* p,
                           int32_t* j) {
  rows(c, bi, h, r0, r1, p, j);
}

#else  // SJ_MAIN

#include <algorithm>
#include <atomic>
#include <vector>

#include "handler.h"

SJ_PATHS(RowsFn, sj_attn_rows);

namespace {

// The isa codes: 0 scalar, 1 avx2+fma, 2 avx512f+fma.
SJ_ISA(SJ_CPU("avx512f") && SJ_CPU("fma"), SJ_CPU("avx2") && SJ_CPU("fma"))

RowsFn* path() { return SJ_PICK(sj_attn_rows); }

// Below this many multiply-adds a call runs on the calling thread alone.
constexpr long kThreadedWork = 1 << 15;
constexpr long kMaxChunkRows = 256;  // (rows() keeps a flag per row on its stack)

struct Job {
  const Call* c;
  RowsFn* fn;
  long per, rows;  // chunks per (batch, kv head), rows per chunk
};

void run_chunk(const void* ctx, long i) {
  const Job& j = *static_cast<const Job*>(ctx);
  static thread_local std::vector<float> prob;
  static thread_local std::vector<int32_t> col;
  const long need = j.rows * (j.c->s + j.c->t + 8);
  if (long(prob.size()) < need) prob.resize(need), col.resize(need);
  const long pair = i / j.per, r0 = (i % j.per) * j.rows;
  j.fn(j.c, pair / j.c->k, pair % j.c->k, r0, std::min(j.c->rows, r0 + j.rows), prob.data(),
       col.data());
}

// A (batch, kv head)'s rows go in as few chunks as give each thread about two (rows of a chunk
// share the tiles of K and V they read), in multiples of 4 rows, at most kMaxChunkRows.
void attend(const Call& c) {
  sj_pool::Pool& p = sj_pool::pool();
  const bool threaded = p.threads > 1 && c.b * c.k * c.rows * (c.s + c.t) * c.d >= kThreadedWork;
  const long pairs = c.b * c.k;
  const long parts = threaded ? std::max<long>(1, (2 * p.threads + pairs - 1) / pairs) : 1;
  long rows = (c.rows + parts - 1) / parts;
  rows = std::min(kMaxChunkRows, (rows + 3) / 4 * 4);
  const long per = (c.rows + rows - 1) / rows;
  Job j{&c, path(), per, rows};
  if (threaded) {
    p.run(run_chunk, &j, pairs * per);
  } else {
    for (long i = 0; i < pairs * per; ++i) run_chunk(&j, i);
  }
}

ffi::Error AttentionF32(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kc,
                        ffi::AnyBuffer vc, ffi::Buffer<ffi::F32> kn,
                        ffi::Buffer<ffi::F32> vn, ffi::Buffer<ffi::PRED> mask,
                        ffi::ResultBuffer<ffi::F32> o, float scale, float softcap) {
  auto qd = q.dimensions(), cd = kc.dimensions(), nd = kn.dimensions(), md = mask.dimensions();
  if (qd.size() != 5 || cd.size() != 4 || nd.size() != 4 || md.size() != 3 ||
      vc.dimensions().size() != 4 || vn.dimensions().size() != 4)
    return sj_ffi::invalid(
        "specjax_attention_f32: expected q[B,T,K,G,D], cache k/v [B,K,S,D], new k/v [B,T,K,D], "
        "mask [B,T,S+T]");
  const long b = qd[0], t = qd[1], k = qd[2], g = qd[3], d = qd[4], s = cd[2];
  for (auto dims : {cd, vc.dimensions()})
    if (dims[0] != b || dims[1] != k || dims[2] != s || dims[3] != d)
      return sj_ffi::invalid("specjax_attention_f32: cache shape mismatch");
  for (auto dims : {nd, vn.dimensions()})
    if (dims[0] != b || dims[1] != t || dims[2] != k || dims[3] != d)
      return sj_ffi::invalid("specjax_attention_f32: new entries' shape mismatch");
  if (md[0] != b || md[1] != t || md[2] != s + t)
    return sj_ffi::invalid("specjax_attention_f32: mask shape mismatch");
  const auto ct = kc.element_type();
  if (vc.element_type() != ct || (ct != ffi::DataType::F32 && ct != ffi::DataType::BF16))
    return sj_ffi::invalid("specjax_attention_f32: the cache must be float32 or bfloat16");
  if (b == 0 || t == 0 || k == 0 || g == 0 || d == 0) return ffi::Error::Success();
  Call c{q.typed_data(), kc.untyped_data(), vc.untyped_data(), kn.typed_data(), vn.typed_data(),
         reinterpret_cast<const uint8_t*>(mask.typed_data()), o->typed_data(),
         b, k, t * g, t, s, d, g, scale, softcap, ct == ffi::DataType::BF16};
  attend(c);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxAttentionF32, AttentionF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));

extern "C" {

SJ_LIBRARY_EXPORTS(specjax_attention)

}  // extern "C"

#endif
