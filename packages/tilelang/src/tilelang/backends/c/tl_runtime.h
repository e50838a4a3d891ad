/* tilelang C runtime: dtype conversions, math helpers and the register-blocked GEMM micro-kernel.
 * Included at the top of every generated kernel. Arithmetic on 16/8-bit floats is done in float;
 * values are rounded (round-to-nearest-even, like numpy/ml_dtypes) when stored. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#define TL_MAX(a, b) ((a) > (b) ? (a) : (b))
#define TL_MIN(a, b) ((a) < (b) ? (a) : (b))

static inline int64_t tl_floordiv(int64_t a, int64_t b) { int64_t q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q; }
static inline int64_t tl_floormod(int64_t a, int64_t b) { int64_t r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

static inline uint32_t tl_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float tl_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float16 through the compiler's _Float16 (F16C / AVX512-FP16 where -march=native has them). */
static inline float tl_f16_to_f32(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline uint16_t tl_f32_to_f16(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }
static inline float tl_round_f16(float f) { return (float)(_Float16)f; }

static inline float tl_bf16_to_f32(uint16_t h) { return tl_u2f((uint32_t)h << 16); }
static inline uint16_t tl_f32_to_bf16(float f) {
  uint32_t u = tl_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float tl_round_bf16(float f) { return tl_bf16_to_f32(tl_f32_to_bf16(f)); }

/* fp8: decode exactly; encode round-to-nearest-even. e4m3fn has no inf: overflow gives NaN (0x7f),
 * as ml_dtypes does; e5m2 overflows to inf. */
static inline float tl_fp8_decode(uint8_t v, int mbits, int bias, int fn) {
  int s = v >> 7, e = (v >> mbits) & ((1 << (7 - mbits)) - 1), m = v & ((1 << mbits) - 1);
  int emax = (1 << (7 - mbits)) - 1;
  float r;
  if (fn && e == emax && m == (1 << mbits) - 1) r = NAN;
  else if (!fn && e == emax) r = m ? NAN : INFINITY;
  else if (e == 0) r = ldexpf((float)m, 1 - bias - mbits);
  else r = ldexpf((float)(m + (1 << mbits)), e - bias - mbits);
  return s ? -r : r;
}
static inline uint8_t tl_fp8_encode(float f, int mbits, int bias, int fn) {
  uint8_t sign = (tl_f2u(f) >> 24) & 0x80;
  float a = fabsf(f);
  float maxv = fn ? 448.0f : 57344.0f;
  if (a != a) return sign | 0x7f;
  if (a > 2.0f * maxv) return fn ? (sign | 0x7f) : (sign | 0x7c);
  int e; frexpf(a, &e); /* a = x * 2^e, x in [0.5, 1) */
  int exp_unb = e - 1;
  int emin = 1 - bias;
  if (exp_unb < emin) exp_unb = emin;
  float q = ldexpf(a, mbits - exp_unb); /* value in units of the last mantissa bit */
  float r = rintf(q);
  float v = ldexpf(r, exp_unb - mbits);
  if (v > maxv) return fn ? (sign | 0x7f) : (sign | 0x7c);
  if (v == 0.0f) return sign;
  int e2; frexpf(v, &e2);
  int be = e2 - 1 + bias;
  uint32_t mant;
  if (be <= 0) { be = 0; mant = (uint32_t)ldexpf(v, bias - 1 + mbits); }
  else mant = (uint32_t)(ldexpf(v, mbits - (e2 - 1))) - (1u << mbits);
  return sign | (uint8_t)(be << mbits) | (uint8_t)mant;
}
static inline float tl_e4m3_to_f32(uint8_t v) { return tl_fp8_decode(v, 3, 7, 1); }
static inline uint8_t tl_f32_to_e4m3(float f) { return tl_fp8_encode(f, 3, 7, 1); }
static inline float tl_round_e4m3(float f) { return tl_e4m3_to_f32(tl_f32_to_e4m3(f)); }
static inline float tl_e5m2_to_f32(uint8_t v) { return tl_fp8_decode(v, 2, 15, 0); }
static inline uint8_t tl_f32_to_e5m2(float f) { return tl_fp8_encode(f, 2, 15, 0); }
static inline float tl_round_e5m2(float f) { return tl_e5m2_to_f32(tl_f32_to_e5m2(f)); }

/* exp2 for float: range reduction + degree-6 polynomial, pure arithmetic so loops vectorize
 * (libm's exp2f does not); within 2 ulp of the correctly rounded result. */
static inline float tl_exp2f(float x) {
  if (!(x > -150.0f)) return x != x ? x : 0.0f;
  if (x >= 128.0f) return INFINITY;
  float n = rintf(x);
  float f = x - n; /* [-0.5, 0.5] */
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t ni = (int32_t)n;
  /* scale in two steps so results in the subnormal range stay correct */
  int32_t n1 = ni / 2, n2 = ni - n1;
  return p * tl_u2f((uint32_t)(n1 + 127) << 23) * tl_u2f((uint32_t)(n2 + 127) << 23);
}
static inline double tl_exp2(double x) { return exp2(x); }
static inline float tl_sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline double tl_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

static inline void *tl_alloc(size_t bytes) {
  size_t n = (bytes + 63) & ~(size_t)63;
  void *p = aligned_alloc(64, n ? n : 64);
  if (p) memset(p, 0, n ? n : 64);
  return p;
}

/* ---------------------------------------------------------------- GEMM micro-kernel
 * C[M,N] (+)= A[M,K] @ B[K,N]; A with any strides (its elements are broadcast), B rows contiguous
 * (ldb), C rows contiguous (ldc). An MR x (NV*VL) block of C lives in registers across K. */
#if defined(__AVX512F__)
#define TL_VL 16
#define TL_MR_DEFAULT 8
#define TL_NV_DEFAULT 2
#elif defined(__AVX__)
#define TL_VL 8
#define TL_MR_DEFAULT 6
#define TL_NV_DEFAULT 2
#else
#define TL_VL 4
#define TL_MR_DEFAULT 4
#define TL_NV_DEFAULT 2
#endif
#ifndef TL_MR /* overridable with -DTL_MR=... through pass_configs={"c_flags": [...]} */
#define TL_MR TL_MR_DEFAULT
#endif
#ifndef TL_NV
#define TL_NV TL_NV_DEFAULT
#endif
#define TL_NR (TL_NV * TL_VL)
typedef float tl_vf __attribute__((vector_size(TL_VL * 4)));
typedef float tl_vfu __attribute__((vector_size(TL_VL * 4), aligned(4)));

static inline void tl_mk_full(int K, const float *restrict A, long sAm, long sAk, const float *restrict B,
                              long ldb, float *restrict C, long ldc, int clear) {
  tl_vf acc[TL_MR][TL_NV];
#pragma GCC unroll 16
  for (int r = 0; r < TL_MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < TL_NV; ++v)
      acc[r][v] = clear ? (tl_vf){0} : *(const tl_vfu *)(C + r * ldc + v * TL_VL);
  for (int k = 0; k < K; ++k) {
    const float *b = B + (long)k * ldb;
    tl_vf bv[TL_NV];
#pragma GCC unroll 4
    for (int v = 0; v < TL_NV; ++v) bv[v] = *(const tl_vfu *)(b + v * TL_VL);
    const float *a = A + (long)k * sAk;
#pragma GCC unroll 16
    for (int r = 0; r < TL_MR; ++r) {
      float av = a[r * sAm];
#pragma GCC unroll 4
      for (int v = 0; v < TL_NV; ++v) acc[r][v] += av * bv[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < TL_MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < TL_NV; ++v) *(tl_vfu *)(C + r * ldc + v * TL_VL) = acc[r][v];
}

/* Edge blocks (fewer than MR rows or NR columns): one vector column strip at a time, scalar tail. */
static inline void tl_mk_edge(int mr, int nr, int K, const float *restrict A, long sAm, long sAk,
                              const float *restrict B, long ldb, float *restrict C, long ldc, int clear) {
  int j = 0;
  for (; j + TL_VL <= nr; j += TL_VL) {
    for (int r = 0; r < mr; ++r) {
      tl_vf acc = clear ? (tl_vf){0} : *(const tl_vfu *)(C + r * ldc + j);
      for (int k = 0; k < K; ++k) acc += A[r * sAm + (long)k * sAk] * *(const tl_vfu *)(B + (long)k * ldb + j);
      *(tl_vfu *)(C + r * ldc + j) = acc;
    }
  }
  for (; j < nr; ++j)
    for (int r = 0; r < mr; ++r) {
      float acc = clear ? 0.0f : C[r * ldc + j];
      for (int k = 0; k < K; ++k) acc += A[r * sAm + (long)k * sAk] * B[(long)k * ldb + j];
      C[r * ldc + j] = acc;
    }
}

/* scratch: at least K*N floats, used to pack B when its rows are not contiguous (transpose_B). */
static void tl_gemm_f32(int M, int N, int K, const float *A, long sAm, long sAk, const float *B, long sBk,
                        long sBn, float *C, long sCm, long sCn, int clear, float *scratch) {
  if (sCn != 1) { /* rare: C tile with non-unit column stride */
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) {
        float acc = clear ? 0.0f : C[i * sCm + j * sCn];
        for (int k = 0; k < K; ++k) acc += A[i * sAm + (long)k * sAk] * B[(long)k * sBk + j * sBn];
        C[i * sCm + j * sCn] = acc;
      }
    return;
  }
  long ldb = sBk;
  if (sBn != 1) {
    for (int k = 0; k < K; ++k)
      for (int j = 0; j < N; ++j) scratch[(long)k * N + j] = B[(long)k * sBk + j * sBn];
    B = scratch;
    ldb = N;
  }
  int i = 0;
  for (; i + TL_MR <= M; i += TL_MR) {
    int j = 0;
    for (; j + TL_NR <= N; j += TL_NR) tl_mk_full(K, A + i * sAm, sAm, sAk, B + j, ldb, C + i * sCm + j, sCm, clear);
    if (j < N) tl_mk_edge(TL_MR, N - j, K, A + i * sAm, sAm, sAk, B + j, ldb, C + i * sCm + j, sCm, clear);
  }
  if (i < M) tl_mk_edge(M - i, N, K, A + i * sAm, sAm, sAk, B, ldb, C + i * sCm, sCm, clear);
}
