// Runs tilelang's generated CUDA C++ on the CPU: one std::thread per CUDA thread, blocks one after
// another, __syncthreads() as a block barrier, warp shuffles / ldmatrix / mma.sync through a
// per-warp exchange. A cp.async poisons its destination when issued (0xff bytes: NaN for floats)
// and lands when a cp_async_wait retires its group, so a missing wait, or a prefetch issued before
// the barrier that ends the reads of its buffer, reads poison here (stale data on a GPU). A test
// tool: it checks every lowering against the interpreter on a machine without a GPU.
#pragma once
#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct tl_dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local tl_dim3 threadIdx;
inline thread_local tl_dim3 blockIdx;
inline tl_dim3 gridDim, blockDim;

struct TlWarp {
  std::barrier<> bar{32};
  alignas(16) unsigned char slots[32][64];
};
inline std::barrier<>* tl_block_barrier = nullptr;
inline std::vector<TlWarp*> tl_warps;
inline thread_local int tl_lane = 0, tl_warp = 0;
inline std::mutex tl_atomic_mutex;

inline void __syncthreads() { tl_block_barrier->arrive_and_wait(); }

template <typename T> inline std::array<T, 32> tl_gather(const T& v) {
  static_assert(sizeof(T) <= 64, "exchange slot");
  TlWarp& w = *tl_warps[tl_warp];
  std::memcpy(w.slots[tl_lane], &v, sizeof(T));
  w.bar.arrive_and_wait();
  std::array<T, 32> out;
  for (int i = 0; i < 32; ++i) std::memcpy(&out[i], w.slots[i], sizeof(T));
  w.bar.arrive_and_wait();
  return out;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int off, int = 32) {
  return tl_gather(v)[tl_lane ^ off];
}
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
using std::max;
using std::min;

// ---------------------------------------------------------------- narrow types (bits + conversions)
struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
struct __nv_fp8_e4m3 { uint8_t x; };
struct __nv_fp8_e5m2 { uint8_t x; };

inline float tl_h2f(uint16_t b) { _Float16 h; std::memcpy(&h, &b, 2); return (float)h; }
inline uint16_t tl_f2h(float f) { _Float16 h = (_Float16)f; uint16_t b; std::memcpy(&b, &h, 2); return b; }
inline float tl_bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t tl_f2bf(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
inline float tl_fp8_decode(uint8_t b, int ebits, int mbits, bool fn) {
  int bias = (1 << (ebits - 1)) - 1;
  int s = b >> 7, e = (b >> mbits) & ((1 << ebits) - 1), m = b & ((1 << mbits) - 1);
  float v;
  if (fn && e == (1 << ebits) - 1 && m == (1 << mbits) - 1) return NAN;
  if (!fn && e == (1 << ebits) - 1) return m ? NAN : (s ? -INFINITY : INFINITY);
  if (e == 0) v = std::ldexp((float)m, 1 - bias - mbits);
  else v = std::ldexp(1.0f + (float)m / (1 << mbits), e - bias);
  return s ? -v : v;
}
inline uint8_t tl_fp8_encode(float f, int ebits, int mbits, bool fn) {
  if (std::isnan(f)) return fn ? 0x7f : 0x7e;
  float best = INFINITY; int bi = 0;
  for (int c = 0; c < 128; ++c) {
    float v = tl_fp8_decode((uint8_t)c, ebits, mbits, fn);
    if (std::isnan(v) || std::isinf(v)) continue;
    float d = std::fabs(v - std::fabs(f));
    if (d < best || (d == best && (c & 1) == 0)) { best = d; bi = c; }
  }
  return (uint8_t)(bi | (f < 0 ? 0x80 : 0));
}

namespace tilehal {
typedef uint32_t u32;
typedef unsigned long long u64;
inline float to_float(float x) { return x; }
inline float to_float(__half x) { return tl_h2f(x.x); }
inline float to_float(__nv_bfloat16 x) { return tl_bf2f(x.x); }
inline float to_float(__nv_fp8_e4m3 x) { return tl_fp8_decode(x.x, 4, 3, true); }
inline float to_float(__nv_fp8_e5m2 x) { return tl_fp8_decode(x.x, 5, 2, false); }
template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline __half from_float<__half>(float x) { return __half{tl_f2h(x)}; }
template <> inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __nv_bfloat16{tl_f2bf(x)}; }
template <> inline __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) {
  return __nv_fp8_e4m3{tl_fp8_encode(std::max(-448.0f, std::min(448.0f, x)), 4, 3, true)}; }
template <> inline __nv_fp8_e5m2 from_float<__nv_fp8_e5m2>(float x) { return __nv_fp8_e5m2{tl_fp8_encode(x, 5, 2, false)}; }

// two values rounded to T (16-bit) packed in 32 bits, the first in the low half (tilehal's convert.cuh)
template <typename T> inline unsigned from_float2(float a, float b) {
  T lo = from_float<T>(a), hi = from_float<T>(b);
  return (unsigned)lo.x | ((unsigned)hi.x << 16);
}

template <typename T, int N> struct alignas(sizeof(T) * N) Vec {
  T v[N];
  T& operator[](int i) { return v[i]; }
  const T& operator[](int i) const { return v[i]; }
};
template <typename T, int N> inline Vec<T, N> load_vec(const T* p) { Vec<T, N> r; std::memcpy(&r, p, sizeof(r)); return r; }
template <typename T, int N> inline void store_vec(T* p, const Vec<T, N>& v) { std::memcpy(p, &v, sizeof(v)); }

// cp.async, per thread: copies not yet committed, then committed groups (oldest first)
struct TlCp { void* s; const void* g; bool pred; int n; };
inline thread_local std::vector<TlCp> tl_cp_open;
inline thread_local std::vector<std::vector<TlCp>> tl_cp_groups;
inline void tl_cp(void* s, const void* g, bool pred, int n) {
  if ((reinterpret_cast<uintptr_t>(s) % n) || (pred && reinterpret_cast<uintptr_t>(g) % n)) std::abort();
  std::memset(s, 0xff, n);  // in flight: nothing may read it before the wait that retires it
  tl_cp_open.push_back({s, g, pred, n});
}
inline void cp_async_16(void* s, const void* g, bool pred = true) { tl_cp(s, g, pred, 16); }
inline void cp_async_8(void* s, const void* g, bool pred = true) { tl_cp(s, g, pred, 8); }
inline void cp_async_4(void* s, const void* g, bool pred = true) { tl_cp(s, g, pred, 4); }
inline void cp_async_commit() {
  tl_cp_groups.push_back(std::move(tl_cp_open));
  tl_cp_open.clear();
}
template <int N> inline void cp_async_wait() {  // all but the N most recent committed groups land
  while (tl_cp_groups.size() > (size_t)N) {
    for (const TlCp& c : tl_cp_groups.front()) {
      if (c.pred) std::memcpy(c.s, c.g, c.n); else std::memset(c.s, 0, c.n);
    }
    tl_cp_groups.erase(tl_cp_groups.begin());
  }
}

inline void tl_ldmatrix(u32* r, int count, const void* row, bool trans) {
  if (reinterpret_cast<uintptr_t>(row) % 16) std::abort();
  auto rows = tl_gather(reinterpret_cast<uintptr_t>(row));
  int l = tl_lane;
  for (int i = 0; i < count; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(rows[8 * i + l / 4]);
      lo = p[2 * (l % 4)]; hi = p[2 * (l % 4) + 1];
    } else {
      lo = reinterpret_cast<const uint16_t*>(rows[8 * i + 2 * (l % 4)])[l / 4];
      hi = reinterpret_cast<const uint16_t*>(rows[8 * i + 2 * (l % 4) + 1])[l / 4];
    }
    r[i] = (u32)lo | ((u32)hi << 16);
  }
}
inline void ldmatrix_x4(u32 (&r)[4], const void* p) { tl_ldmatrix(r, 4, p, false); }
inline void ldmatrix_x4_trans(u32 (&r)[4], const void* p) { tl_ldmatrix(r, 4, p, true); }
inline void ldmatrix_x2(u32 (&r)[2], const void* p) { tl_ldmatrix(r, 2, p, false); }
inline void ldmatrix_x2_trans(u32 (&r)[2], const void* p) { tl_ldmatrix(r, 2, p, true); }

struct MmaF16 {}; struct MmaBF16 {}; struct MmaE4M3 {}; struct MmaE5M2 {}; struct MmaS8 {};
inline float tl_elem(MmaF16, u32 r, int i) { return tl_h2f((uint16_t)(r >> (16 * i))); }
inline float tl_elem(MmaBF16, u32 r, int i) { return tl_bf2f((uint16_t)(r >> (16 * i))); }
inline float tl_elem(MmaE4M3, u32 r, int i) { return tl_fp8_decode((uint8_t)(r >> (8 * i)), 4, 3, true); }
inline float tl_elem(MmaE5M2, u32 r, int i) { return tl_fp8_decode((uint8_t)(r >> (8 * i)), 5, 2, false); }
inline float tl_elem(MmaS8, u32 r, int i) { return (float)(int8_t)(uint8_t)(r >> (8 * i)); }

struct TlFrag { u32 a[4]; u32 b[2]; };
template <typename Tag, typename Acc> inline void tl_mma(Tag tag, Acc (&d)[4], const u32 (&a)[4], const u32 (&b)[2], int K) {
  TlFrag mine; std::memcpy(mine.a, a, 16); std::memcpy(mine.b, b, 8);
  auto all = tl_gather(mine);
  double A[16][32] = {}, B[32][8] = {};
  int per = K / 4;  // elements per register per lane-quad column group
  for (int l = 0; l < 32; ++l) {
    int g = l / 4, t = l % 4;
    int e = K == 16 ? 2 : 4;  // elements per register
    for (int i = 0; i < e; ++i) {
      A[g][t * e + i] = tl_elem(tag, all[l].a[0], i);
      A[g + 8][t * e + i] = tl_elem(tag, all[l].a[1], i);
      A[g][t * e + i + K / 2] = tl_elem(tag, all[l].a[2], i);
      A[g + 8][t * e + i + K / 2] = tl_elem(tag, all[l].a[3], i);
      B[t * e + i][g] = tl_elem(tag, all[l].b[0], i);
      B[t * e + i + K / 2][g] = tl_elem(tag, all[l].b[1], i);
    }
  }
  (void)per;
  int g = tl_lane / 4, t = tl_lane % 4;
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 2; ++c) {
      double s = 0;
      for (int k = 0; k < K; ++k) s += A[g + 8 * h][k] * B[k][2 * t + c];
      d[2 * h + c] = (Acc)(d[2 * h + c] + (Acc)s);
    }
}
inline void mma_m16n8k16(MmaF16 t, float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) { tl_mma(t, d, a, b, 16); }
inline void mma_m16n8k16(MmaBF16 t, float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) { tl_mma(t, d, a, b, 16); }
inline void mma_m16n8k32(MmaE4M3 t, float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) { tl_mma(t, d, a, b, 32); }
inline void mma_m16n8k32(MmaE5M2 t, float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) { tl_mma(t, d, a, b, 32); }
inline void mma_m16n8k32(MmaS8 t, int (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) { tl_mma(t, d, a, b, 32); }
inline u32 pack2_bits(__half lo, __half hi) { return (u32)lo.x | ((u32)hi.x << 16); }
inline u32 pack2_bits(__nv_bfloat16 lo, __nv_bfloat16 hi) { return (u32)lo.x | ((u32)hi.x << 16); }
}  // namespace tilehal

template <typename T> inline T atomicAdd(T* p, T v) {
  std::lock_guard<std::mutex> g(tl_atomic_mutex);
  T old = *p; *p = old + v; return old;
}
inline __half atomicAdd(__half* p, __half v) {
  std::lock_guard<std::mutex> g(tl_atomic_mutex);
  __half old = *p; *p = tilehal::from_float<__half>(tilehal::to_float(old) + tilehal::to_float(v)); return old;
}
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) {
  std::lock_guard<std::mutex> g(tl_atomic_mutex);
  __nv_bfloat16 old = *p;
  *p = tilehal::from_float<__nv_bfloat16>(tilehal::to_float(old) + tilehal::to_float(v)); return old;
}

// the vector atomics of T.atomic_add (float2 / float4 on sm_90, 16-bit pairs): element by element here
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct __half2 { __half x, y; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline __half2 __floats2half2_rn(float x, float y) {
  return {tilehal::from_float<__half>(x), tilehal::from_float<__half>(y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float x, float y) {
  return {tilehal::from_float<__nv_bfloat16>(x), tilehal::from_float<__nv_bfloat16>(y)}; }
inline void atomicAdd(float2* p, float2 v) { atomicAdd(&p->x, v.x); atomicAdd(&p->y, v.y); }
inline void atomicAdd(float4* p, float4 v) {
  atomicAdd(&p->x, v.x); atomicAdd(&p->y, v.y); atomicAdd(&p->z, v.z); atomicAdd(&p->w, v.w); }
inline void atomicAdd(__half2* p, __half2 v) { atomicAdd(&p->x, v.x); atomicAdd(&p->y, v.y); }
inline void atomicAdd(__nv_bfloat162* p, __nv_bfloat162 v) { atomicAdd(&p->x, v.x); atomicAdd(&p->y, v.y); }

alignas(1024) inline unsigned char tl_emu_smem[262144];
#define _tl_smem tl_emu_smem

template <typename F> inline void tl_emu_run(unsigned gx, unsigned gy, unsigned gz, int threads, F body) {
  gridDim = {gx, gy, gz};
  blockDim = {(unsigned)threads, 1, 1};
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        std::barrier<> bar(threads);
        tl_block_barrier = &bar;
        tl_warps.clear();
        for (int w = 0; w < threads / 32; ++w) tl_warps.push_back(new TlWarp());
        std::memset(tl_emu_smem, 0, sizeof(tl_emu_smem));
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t)
          ts.emplace_back([=] {
            threadIdx = {(unsigned)t, 0, 0};
            blockIdx = {x, y, z};
            tl_lane = t % 32; tl_warp = t / 32;
            body();
          });
        for (auto& th : ts) th.join();
        for (auto* w : tl_warps) delete w;
        tl_warps.clear();
      }
}
