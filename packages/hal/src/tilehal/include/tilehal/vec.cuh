// Vectorized global-memory access: 16-byte transactions where the caller guarantees alignment.
#pragma once
#include "common.cuh"

namespace tilehal {

// N elements of T moved as one aligned chunk (N * sizeof(T) must be 4, 8 or 16 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
  TILEHAL_DEVICE T& operator[](int i) { return v[i]; }
  TILEHAL_DEVICE const T& operator[](int i) const { return v[i]; }
};

template <typename T, int N>
TILEHAL_DEVICE Vec<T, N> load_vec(const T* ptr) {
  return *reinterpret_cast<const Vec<T, N>*>(ptr);
}

template <typename T, int N>
TILEHAL_DEVICE void store_vec(T* ptr, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(ptr) = v;
}

// Read-only 16-byte load that is not kept in L1, for data streamed once (KV blocks, GEMM weights,
// epilogue inputs). V: int4 (.s32 lanes) or uint4 (.u32); L2_PREFETCH = 256 also asks L2 to fetch the
// whole 256-byte line around the address (a warp walking a row sequentially).
template <typename V = int4, int L2_PREFETCH = 0>
TILEHAL_DEVICE V load_nc_v4(const void* ptr) {
  static_assert(L2_PREFETCH == 0 || L2_PREFETCH == 256, "L2 prefetch: 0 or 256 bytes");
  constexpr bool kSigned = static_cast<decltype(V::x)>(-1) < 0;  // int4 or uint4
  static_assert(sizeof(V) == 16 && (!kSigned || L2_PREFETCH == 0), "int4, or uint4 (with or without L2 prefetch)");
  V r;
  if constexpr (kSigned) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(ptr));
  } else if constexpr (L2_PREFETCH == 0) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(ptr));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(ptr));
  }
  return r;
}

TILEHAL_DEVICE void store_v4(int4* ptr, const int4& v) {
  asm volatile("st.global.v4.s32 [%0], {%1, %2, %3, %4};" :: "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// Asynchronous global->shared copy of 16 bytes (sm_80+), with zero fill when !pred.
TILEHAL_DEVICE void cp_async_16(void* smem, const void* gmem, bool pred = true) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(n));
}
// 4- and 8-byte variants (cached in L1: .ca), for rows too narrow or misaligned for 16 bytes.
TILEHAL_DEVICE void cp_async_8(void* smem, const void* gmem, bool pred = true) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int n = pred ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" :: "r"(s), "l"(gmem), "r"(n));
}
TILEHAL_DEVICE void cp_async_4(void* smem, const void* gmem, bool pred = true) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int n = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(s), "l"(gmem), "r"(n));
}
TILEHAL_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
TILEHAL_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

}  // namespace tilehal
