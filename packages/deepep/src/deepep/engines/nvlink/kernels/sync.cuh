// Device helpers shared by the NVLink kernels (intranode.cu, low_latency.cu).
//
// Flags are u64: high 32 bits = the call's epoch, low 32 bits = a payload (a row count).
// Every spin-wait has an absolute deadline (globaltimer, ns); on expiry the kernel records
// (stage, peer) in host-mapped memory and returns, so the host raises instead of hanging.
#pragma once
#include <tilehal/tilehal.cuh>

using tilehal::u64;
using tilehal::u32;

#define DEEPEP_MAX_RANKS 16

namespace deepep {

enum Stage {
  kDispatchCounts = 1, kDispatchData = 2, kCombineHello = 3, kCombineData = 4,
  kLLDispatch = 5, kLLCombine = 6, kLLDispatchCounts = 7, kLLCombineWeights = 8, kLayoutTiles = 9
};

__device__ __forceinline__ u64 now_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 tagged(u32 epoch, u32 payload) { return (u64(epoch) << 32) | payload; }

// Spin until the flag carries `epoch`; false (and the error recorded) past the deadline.
__device__ __forceinline__ bool wait_flag(const u64* p, u32 epoch, u64 deadline, volatile int* err, int stage,
                                          int peer, u32* payload) {
  while (true) {
    u64 v = ld_acquire(p);
    if (u32(v >> 32) == epoch) {
      if (payload) *payload = u32(v);
      return true;
    }
    __nanosleep(32);  // hundreds of warps may poll at once: leave L2 to the incoming writes
    if (now_ns() > deadline) {
      err[1] = peer;
      err[0] = stage;
      __threadfence_system();
      return false;
    }
  }
}

// Copy n 16-byte words with the lanes of a warp, four loads in flight per lane before the
// stores (the loop otherwise waits out one load latency per word). kPeerWritten loads bypass
// L1 (`cg`): the source was written by a peer over NVLink since this SM may last have looked.
template <bool kPeerWritten>
__device__ __forceinline__ int4 load16(const int4* p) {
  if constexpr (kPeerWritten) return __ldcg(p);
  else return *p;
}
template <bool kPeerWritten>
__device__ __forceinline__ void copy_row(int4* dst, const int4* src, int n, int lane) {
  int i = lane;
  for (; i + 96 < n; i += 128) {
    const int4 a = load16<kPeerWritten>(src + i), b = load16<kPeerWritten>(src + i + 32);
    const int4 c = load16<kPeerWritten>(src + i + 64), d = load16<kPeerWritten>(src + i + 96);
    dst[i] = a;
    dst[i + 32] = b;
    dst[i + 64] = c;
    dst[i + 96] = d;
  }
  for (; i < n; i += 32) dst[i] = load16<kPeerWritten>(src + i);
}
__device__ __forceinline__ void warp_copy16(int4* dst, const int4* src, int n, int lane) {
  copy_row<true>(dst, src, n, lane);
}

template <typename T>
__device__ __forceinline__ void add_vec(float* acc, int4 v);
template <>
__device__ __forceinline__ void add_vec<__nv_bfloat16>(float* acc, int4 v) {
  const unsigned* u = reinterpret_cast<const unsigned*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = tilehal::bf16x2_to_float2(u[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}
template <>
__device__ __forceinline__ void add_vec<float>(float* acc, int4 v) {
  const float* f = reinterpret_cast<const float*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] += f[i];
}
template <typename T> struct VecElems;
template <> struct VecElems<__nv_bfloat16> { static constexpr int n = 8; };
template <> struct VecElems<float> { static constexpr int n = 4; };

template <typename T>
__device__ __forceinline__ int4 pack_vec(const float* acc);
template <>
__device__ __forceinline__ int4 pack_vec<__nv_bfloat16>(const float* acc) {
  int4 r;
  unsigned* u = reinterpret_cast<unsigned*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) u[i] = tilehal::float2_to_bf16x2(acc[2 * i], acc[2 * i + 1]);
  return r;
}
template <>
__device__ __forceinline__ int4 pack_vec<float>(const float* acc) {
  return *reinterpret_cast<const int4*>(acc);
}

}  // namespace deepep
