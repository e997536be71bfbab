// Decode attention over a static KV cache plus the step's T new entries, for one call of T <= 64
// query tokens (a verification block, a tree, a lookahead window):
//
//   q    [B, T, K, G, D]  the T tokens' queries, G per kv head (the layout the QKV product gives)
//   kc   [B, K, S, D]     the cache as it was before this call (vc the same)
//   kn   [B, T, K, D]     the T new entries (vn the same)
//   mask [B, T, S + T]    bool: token t sees cache slot s (column s) / new entry j (column S + j)
//   o    [B, T, K, G, D]  softmax(scale * q.k over the visible columns) @ v, the layout the
//                         output projection reads (so no transpose on either side)
//
// The arithmetic is the model's XLA attention (specjax/model.py, Attention) up to fp32 summation
// order: s = (q.k) * scale, optionally cap * tanh(s / cap); masked columns out; p = exp(s - max) /
// sum; o = sum p v. A row that sees no column averages every column's v uniformly, as the XLA
// path's softmax over equal "minimum" scores does.
//
// Why: XLA's CPU attention for T > 1 runs the two products as separate dot operations over the
// whole cache (every slot, filled or not), with transposes, concatenations and a masked softmax
// around them: ~8 ms of a 27 ms T = 8 forward of SmolLM2-135M at 256 of 512 slots filled, ~15 ms
// at T = 16 (experiments/kernels, "attention"). Here one call reads each row's visible slots
// only: a cache slot past the last one any row of the block sees is never read.
//
// Like matmul.cc, this file is compiled once per part (SJ_PART = main, avx512, avx2, scalar) with
// its own -m flags and the path is chosen at run time. avx2 and scalar share the portable code
// (the compiler vectorises what it can under their flags); avx512 has its own dot, exp and
// accumulation. Part `main` holds the XLA FFI handler, the ISA choice and the split of one call's
// rows over the thread pool (pool.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#define SJ_MAIN 0
#define SJ_AVX512 1
#define SJ_AVX2 2
#define SJ_SCALAR 3

#ifndef SJ_PART
#error "compile with -DSJ_PART=SJ_MAIN|SJ_AVX512|SJ_AVX2|SJ_SCALAR"
#endif

// One call's operands (row-major, dense) and sizes.
struct Call {
  const float *q, *kc, *vc, *kn, *vn;
  const uint8_t* mask;
  float* o;
  long b, k, rows, t, s, d, g;  // rows = t * g per kv head
  float scale, softcap;
};

// Rows r0..r1 of kv head h of batch bi; scratch holds at least (r1 - r0) * (S + T) floats.
typedef void RowsFn(const Call* c, long bi, long h, long r0, long r1, float* scratch);

namespace {

constexpr float kNegInf = -INFINITY;

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

inline float capped(float x, float cap) { return cap > 0 ? cap * std::tanh(x / cap) : x; }

// A row that sees nothing: the uniform average of every column's v (the XLA path's result).
inline void uniform(const Call* c, const float* vc, long ldc, const float* vn, long ldn, float* o) {
  const long d = c->d, n = c->s + c->t;
  const float p = 1.0f / float(n);
  for (long e = 0; e < d; ++e) o[e] = 0.0f;
  for (long j = 0; j < c->s; ++j)
    for (long e = 0; e < d; ++e) o[e] += p * vc[j * ldc + e];
  for (long j = 0; j < c->t; ++j)
    for (long e = 0; e < d; ++e) o[e] += p * vn[j * ldn + e];
}

}  // namespace

#if SJ_PART == SJ_AVX512
#include <immintrin.h>

namespace {

inline __mmask16 tail(long n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// Lane i of the result = the sum of v[i]'s 16 lanes: a transposing add tree (45 instructions for
// 16 sums where 16 separate horizontal reductions take ~100).
inline __m512 sum16(__m512 v[16]) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int kRows = 4;  // query rows that share each key's and value's loads

// s[r][j] = scale * q[r].k[j] (capped) for rows r < nr and the n keys of k (key j at k + j * ldk);
// keys no row sees (vis[r][off + j]) are skipped (their scores are set by the caller's mask
// pass). Four keys x four rows per step: 16 accumulators, summed by sum16.
inline void scores(const float* const* q, int nr, const float* k, long ldk,
                   const uint8_t* const* vis, long off, long n, long d, float scale, float cap,
                   float* s, long lds) {
  const __m512 sv = _mm512_set1_ps(scale);
  for (long j0 = 0; j0 < n; j0 += 4) {
    const int nk = int(std::min<long>(4, n - j0));
    bool any = false;
    for (int r = 0; r < nr && !any; ++r)
      for (int i = 0; i < nk; ++i) any |= vis[r][off + j0 + i] != 0;
    if (!any) continue;
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    const float* kb = k + j0 * ldk;
    for (long e = 0; e < d; e += 16) {
      const __mmask16 m = tail(d - e);
      __m512 kv[4], qv[kRows];
      for (int i = 0; i < 4; ++i)
        kv[i] = _mm512_maskz_loadu_ps(i < nk ? m : 0, kb + i * ldk + e);
      for (int r = 0; r < kRows; ++r)
        qv[r] = _mm512_maskz_loadu_ps(r < nr ? m : 0, q[r < nr ? r : 0] + e);
      for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < 4; ++i) acc[4 * r + i] = _mm512_fmadd_ps(qv[r], kv[i], acc[4 * r + i]);
    }
    __m512 x = _mm512_mul_ps(sum16(acc), sv);  // lane 4 r + i: row r, key j0 + i
    if (cap > 0) {
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, x);
      for (int i = 0; i < 16; ++i) tmp[i] = capped(tmp[i], cap);
      x = _mm512_load_ps(tmp);
    }
    alignas(64) float out[16];
    _mm512_store_ps(out, x);
    for (int r = 0; r < nr; ++r)
      for (int i = 0; i < nk; ++i) s[r * lds + j0 + i] = out[4 * r + i];
  }
}

// Masked columns of one row's scores [n] to -inf; returns the row's largest score.
inline float mask_max(float* s, const uint8_t* vis, long n) {
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 mx = ninf;
  for (long j = 0; j < n; j += 16) {
    const long nk = std::min<long>(16, n - j);
    __mmask16 seen = 0;
    for (long i = 0; i < nk; ++i) seen |= __mmask16(vis[j + i] != 0) << i;
    const __m512 x = _mm512_mask_loadu_ps(ninf, seen, s + j);
    _mm512_mask_storeu_ps(s + j, tail(nk), x);
    mx = _mm512_max_ps(mx, x);
  }
  return _mm512_reduce_max_ps(mx);
}

// exp(x) for x <= 0 (Cody-Waite reduction, degree-6 polynomial: ~1 ulp); x < -87.3 gives 0.
inline __m512 exp_le0(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(~zero, _mm512_scalef_ps(p, n));
}

// o[r][0:d] += sum_j p[r][j] * v[j] for rows r < nr (p stride ldp) over the n values of v (value j
// at v + j * ldv), skipping a j with every p[r][j] == 0. 64 columns at a time: 4 rows x 4
// vectors of accumulators, each v[j] loaded once for the four rows.
inline void weighted_sum(const float* p, long ldp, int nr, const float* v, long ldv, long n,
                         long d, float* const* o) {
  for (long e0 = 0; e0 < d; e0 += 64) {
    const long w = std::min<long>(64, d - e0);
    __m512 acc[kRows][4];
    __mmask16 m[4];
    for (int c = 0; c < 4; ++c) {
      m[c] = 16 * c < w ? tail(w - 16 * c) : 0;
      for (int r = 0; r < kRows; ++r) acc[r][c] = _mm512_setzero_ps();
    }
    for (long j = 0; j < n; ++j) {
      float pj[kRows];
      bool any = false;
      for (int r = 0; r < kRows; ++r) {
        pj[r] = r < nr ? p[r * ldp + j] : 0.0f;
        any |= pj[r] != 0.0f;
      }
      if (!any) continue;
      const float* vj = v + j * ldv + e0;
      __m512 vv[4];
      for (int c = 0; c < 4; ++c) vv[c] = _mm512_maskz_loadu_ps(m[c], vj + 16 * c);
      for (int r = 0; r < kRows; ++r) {
        const __m512 pr = _mm512_set1_ps(pj[r]);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int c = 0; c < 4; ++c) {
        float* dst = o[r] + e0 + 16 * c;
        _mm512_mask_storeu_ps(dst, m[c], _mm512_add_ps(_mm512_maskz_loadu_ps(m[c], dst),
                                                       acc[r][c]));
      }
  }
}

// p[j] = exp(s[j] - mx) over n scores (-inf: 0); returns the sum.
inline float exps(float* s, long n, float mx) {
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (long j = 0; j < n; j += 16) {
    const __mmask16 k = tail(n - j);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), k, s + j);
    const __m512 p = exp_le0(_mm512_sub_ps(x, m));
    _mm512_mask_storeu_ps(s + j, k, p);
    acc = _mm512_add_ps(acc, p);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace

#else  // portable: avx2 and scalar

namespace {

inline float dot(const float* a, const float* b, long d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  long e = 0;
  for (; e + 8 <= d; e += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[e + l] * b[e + l];
  float sum = 0.0f;
  for (int l = 0; l < 8; ++l) sum += acc[l];
  for (; e < d; ++e) sum += a[e] * b[e];
  return sum;
}

constexpr int kRows = 1;

inline void scores(const float* const* q, int, const float* k, long ldk,
                   const uint8_t* const* vis, long off, long n, long d, float scale, float cap,
                   float* s, long) {
  for (long j = 0; j < n; ++j)
    if (vis[0][off + j]) s[j] = capped(dot(q[0], k + j * ldk, d) * scale, cap);
}

inline float mask_max(float* s, const uint8_t* vis, long n) {
  float mx = kNegInf;
  for (long j = 0; j < n; ++j) {
    if (!vis[j]) s[j] = kNegInf;
    mx = s[j] > mx ? s[j] : mx;
  }
  return mx;
}

inline void weighted_sum(const float* p, long, int, const float* v, long ldv, long n, long d,
                         float* const* o) {
  for (long j = 0; j < n; ++j)
    if (p[j] != 0.0f)
      for (long e = 0; e < d; ++e) o[0][e] += p[j] * v[j * ldv + e];
}

inline float exps(float* s, long n, float mx) {
  float sum = 0.0f;
  for (long j = 0; j < n; ++j) {
    s[j] = s[j] == kNegInf ? 0.0f : std::exp(s[j] - mx);
    sum += s[j];
  }
  return sum;
}

}  // namespace

#endif

#if SJ_PART != SJ_MAIN

namespace {

// Rows r0..r1: scores for all of them, a tile of kTile keys at a time (so that a tile of K, then
// of V, stays in L1 while every row block of kRows uses it), then each row's mask, max and
// normalised exps, then the weighted sums tile by tile. sc holds (r1 - r0) rows of S + T scores.
// The chunk reads the cache up to the last slot any of its rows sees, and the new entries up to
// the last one any of its rows sees (a causal block, e.g. a prompt's prefill with an empty cache:
// the chunk of its first tokens reads only those).
constexpr long kTile = 64;

void rows(const Call* c, long bi, long h, long r0, long r1, float* sc) {
  const long d = c->d, s = c->s, t = c->t, w = s + t, nrow = r1 - r0, g = c->g, k = c->k;
  const float* kc = c->kc + (bi * k + h) * s * d;
  const float* vc = c->vc + (bi * k + h) * s * d;
  const float* kn = c->kn + (bi * t * k + h) * d;  // new entry j at kn + j * k * d
  const float* vn = c->vn + (bi * t * k + h) * d;
  const long ldn = k * d;
  // row r of this head is token r / g, query head r % g: q[bi, r / g, h, r % g, :] (o alike)
  auto at = [&](long r) { r += r0; return ((bi * t + r / g) * k + h) * g * d + (r % g) * d; };
  auto mrow = [&](long r) { return c->mask + (bi * t + (r0 + r) / g) * w; };
  long hi = 0, tn = 0;
  for (long r = 0; r < nrow; ++r)  // (the g rows of one token share its mask row)
    if (r == 0 || mrow(r) != mrow(r - 1)) {
      hi = std::max(hi, last_visible(mrow(r), s));
      tn = std::max(tn, last_visible(mrow(r) + s, t));
    }
  const long ld = hi + tn;  // a row's scores: cache [0, hi), then the new [0, tn)
  // Every (tile, row block) in order: fn(rb, nr, a0, a1, b0, b1) with the tile's cache columns
  // [a0, a1) and its new entries' columns [b0, b1) (either range may be empty).
  auto blocks = [&](auto&& fn) {
    for (long j0 = 0; j0 < ld; j0 += kTile) {
      const long j1 = std::min(ld, j0 + kTile);
      for (long rb = 0; rb < nrow; rb += kRows)
        fn(rb, int(std::min<long>(kRows, nrow - rb)), j0, std::min(j1, hi), std::max(j0, hi), j1);
    }
  };
  blocks([&](long rb, int nr, long a0, long a1, long b0, long b1) {
    const uint8_t* m[kRows];
    const float* q[kRows];
    for (int r = 0; r < nr; ++r) {
      m[r] = mrow(rb + r);
      q[r] = c->q + at(rb + r);
    }
    if (a1 > a0)
      scores(q, nr, kc + a0 * d, d, m, a0, a1 - a0, d, c->scale, c->softcap, sc + rb * ld + a0,
             ld);
    if (b1 > b0)
      scores(q, nr, kn + (b0 - hi) * ldn, ldn, m, s + b0 - hi, b1 - b0, d, c->scale, c->softcap,
             sc + rb * ld + b0, ld);
  });
  bool blank[256];  // (rows per chunk are capped at 256 by the caller)
  for (long r = 0; r < nrow; ++r) {
    float* sr = sc + r * ld;
    const uint8_t* m = mrow(r);
    const float mx = std::max(mask_max(sr, m, hi), mask_max(sr + hi, m + s, tn));
    blank[r] = mx == kNegInf;
    if (blank[r]) {
      for (long j = 0; j < ld; ++j) sr[j] = 0.0f;
      continue;
    }
    const float inv = 1.0f / exps(sr, ld, mx);
    for (long j = 0; j < ld; ++j) sr[j] *= inv;
  }
  for (long r = 0; r < nrow; ++r)
    for (long e = 0; e < d; ++e) c->o[at(r) + e] = 0.0f;
  blocks([&](long rb, int nr, long a0, long a1, long b0, long b1) {
    float* o[kRows];
    for (int r = 0; r < nr; ++r) o[r] = c->o + at(rb + r);
    if (a1 > a0) weighted_sum(sc + rb * ld + a0, ld, nr, vc + a0 * d, d, a1 - a0, d, o);
    if (b1 > b0)
      weighted_sum(sc + rb * ld + b0, ld, nr, vn + (b0 - hi) * ldn, ldn, b1 - b0, d, o);
  });
  for (long r = 0; r < nrow; ++r)
    if (blank[r]) uniform(c, vc, d, vn, ldn, c->o + at(r));
}

}  // namespace

#if SJ_PART == SJ_AVX512
extern "C" RowsFn sj_attn_rows_avx512;
void sj_attn_rows_avx512(const Call* c, long bi, long h, long r0, long r1, float* sc) {
  rows(c, bi, h, r0, r1, sc);
}
#elif SJ_PART == SJ_AVX2
extern "C" RowsFn sj_attn_rows_avx2;
void sj_attn_rows_avx2(const Call* c, long bi, long h, long r0, long r1, float* sc) {
  rows(c, bi, h, r0, r1, sc);
}
#else
extern "C" RowsFn sj_attn_rows_scalar;
void sj_attn_rows_scalar(const Call* c, long bi, long h, long r0, long r1, float* sc) {
  rows(c, bi, h, r0, r1, sc);
}
#endif

#else  // SJ_MAIN

#include <algorithm>
#include <atomic>
#include <vector>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
extern "C" RowsFn sj_attn_rows_avx512, sj_attn_rows_avx2, sj_attn_rows_scalar;
#else
extern "C" RowsFn sj_attn_rows_scalar;
#define sj_attn_rows_avx512 sj_attn_rows_scalar
#define sj_attn_rows_avx2 sj_attn_rows_scalar
#endif

namespace ffi = xla::ffi;

namespace {

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int detect_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

std::atomic<int> g_isa{detect_isa()};

RowsFn* path() {
  switch (g_isa.load(std::memory_order_relaxed)) {
    case kAvx512: return sj_attn_rows_avx512;
    case kAvx2: return sj_attn_rows_avx2;
    default: return sj_attn_rows_scalar;
  }
}

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
  static thread_local std::vector<float> scratch;
  const long need = j.rows * (j.c->s + j.c->t);
  if (long(scratch.size()) < need) scratch.resize(need);
  const long pair = i / j.per, r0 = (i % j.per) * j.rows;
  j.fn(j.c, pair / j.c->k, pair % j.c->k, r0, std::min(j.c->rows, r0 + j.rows), scratch.data());
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

ffi::Error AttentionF32(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc,
                        ffi::Buffer<ffi::F32> vc, ffi::Buffer<ffi::F32> kn,
                        ffi::Buffer<ffi::F32> vn, ffi::Buffer<ffi::PRED> mask,
                        ffi::ResultBuffer<ffi::F32> o, float scale, float softcap) {
  auto qd = q.dimensions(), cd = kc.dimensions(), nd = kn.dimensions(), md = mask.dimensions();
  if (qd.size() != 5 || cd.size() != 4 || nd.size() != 4 || md.size() != 3 ||
      vc.dimensions().size() != 4 || vn.dimensions().size() != 4)
    return ffi::Error::InvalidArgument(
        "specjax_attention_f32: expected q[B,T,K,G,D], cache k/v [B,K,S,D], new k/v [B,T,K,D], "
        "mask [B,T,S+T]");
  const long b = qd[0], t = qd[1], k = qd[2], g = qd[3], d = qd[4], s = cd[2];
  for (auto dims : {cd, vc.dimensions()})
    if (dims[0] != b || dims[1] != k || dims[2] != s || dims[3] != d)
      return ffi::Error::InvalidArgument("specjax_attention_f32: cache shape mismatch");
  for (auto dims : {nd, vn.dimensions()})
    if (dims[0] != b || dims[1] != t || dims[2] != k || dims[3] != d)
      return ffi::Error::InvalidArgument("specjax_attention_f32: new entries' shape mismatch");
  if (md[0] != b || md[1] != t || md[2] != s + t)
    return ffi::Error::InvalidArgument("specjax_attention_f32: mask shape mismatch");
  if (b == 0 || t == 0 || k == 0 || g == 0 || d == 0) return ffi::Error::Success();
  Call c{q.typed_data(), kc.typed_data(), vc.typed_data(), kn.typed_data(), vn.typed_data(),
         reinterpret_cast<const uint8_t*>(mask.typed_data()), o->typed_data(),
         b, k, t * g, t, s, d, g, scale, softcap};
  attend(c);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxAttentionF32, AttentionF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));

extern "C" {

// The isa codes: 0 scalar, 1 avx2+fma, 2 avx512f (detect_isa).
SJ_LIBRARY_EXPORTS(specjax_attention)

}  // extern "C"

#endif
