// Conversions between fp32 and the narrow types, by overload so templates stay generic.
#pragma once
#include "common.cuh"

namespace tilehal {

TILEHAL_DEVICE float to_float(float x) { return x; }
TILEHAL_DEVICE float to_float(__half x) { return __half2float(x); }
TILEHAL_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
TILEHAL_DEVICE float to_float(__nv_fp8_e4m3 x) { return float(x); }
TILEHAL_DEVICE float to_float(__nv_fp8_e5m2 x) { return float(x); }

template <typename T> TILEHAL_DEVICE T from_float(float x);
template <> TILEHAL_DEVICE float from_float<float>(float x) { return x; }
template <> TILEHAL_DEVICE __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> TILEHAL_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
// fp8 conversions saturate to the finite range (e4m3: +-448), as DeepGEMM's casts assume.
template <> TILEHAL_DEVICE __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) { return __nv_fp8_e4m3(x); }
template <> TILEHAL_DEVICE __nv_fp8_e5m2 from_float<__nv_fp8_e5m2>(float x) { return __nv_fp8_e5m2(x); }

// Two bf16 packed in 32 bits <-> float2 (one instruction each way on sm_90).
TILEHAL_DEVICE float2 bf16x2_to_float2(unsigned bits) {
  __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&bits);
  return __bfloat1622float2(v);
}
TILEHAL_DEVICE unsigned float2_to_bf16x2(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned*>(&v);
}
// The same for two fp16.
TILEHAL_DEVICE float2 half2_to_float2(unsigned bits) {
  __half2 h = *reinterpret_cast<__half2*>(&bits);
  return __half22float2(h);
}
TILEHAL_DEVICE unsigned float2_to_half2(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}

// By element type, for kernels templated over bf16 / fp16: two values packed in 32 bits (the
// first in the low half) <-> float2, rounded to nearest even.
template <typename T> TILEHAL_DEVICE float2 to_float2(unsigned bits);
template <> TILEHAL_DEVICE float2 to_float2<__nv_bfloat16>(unsigned bits) { return bf16x2_to_float2(bits); }
template <> TILEHAL_DEVICE float2 to_float2<__half>(unsigned bits) { return half2_to_float2(bits); }
template <typename T> TILEHAL_DEVICE unsigned from_float2(float a, float b);
template <> TILEHAL_DEVICE unsigned from_float2<__nv_bfloat16>(float a, float b) { return float2_to_bf16x2(a, b); }
template <> TILEHAL_DEVICE unsigned from_float2<__half>(float a, float b) { return float2_to_half2(a, b); }

// Eight consecutive elements starting at column `col` of a row (zeros past `k`), as fp32: one 16-byte load
// for 2-byte types (two for fp32) when VEC and all eight are in range (the host checks k, the row stride
// and the base address are multiples of 8 elements / 16 bytes), element by element otherwise.
template <typename T, bool VEC>
TILEHAL_DEVICE void load8(const T* row, int col, int k, float (&v)[8]) {
  if (VEC && col + 7 < k) {
    if constexpr (sizeof(T) == 4) {
      const float4 f0 = *reinterpret_cast<const float4*>(row + col);
      const float4 f1 = *reinterpret_cast<const float4*>(row + col + 4);
      v[0] = f0.x, v[1] = f0.y, v[2] = f0.z, v[3] = f0.w, v[4] = f1.x, v[5] = f1.y, v[6] = f1.z, v[7] = f1.w;
    } else {
      const uint4 u = *reinterpret_cast<const uint4*>(row + col);
      const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = to_float(h[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = col + i < k ? to_float(row[col + i]) : 0.f;
  }
}

// Eight fp32 values rounded to T (bf16 or fp16, nearest even) at row[col..col+7] (those below k): one
// 16-byte store when VEC and all eight are in range, element by element otherwise.
template <typename T, bool VEC>
TILEHAL_DEVICE void store8(T* row, int col, int k, const float (&v)[8]) {
  static_assert(sizeof(T) == 2, "store8 writes bf16 or fp16");
  if (VEC && col + 7 < k) {
    uint4 pk;
    pk.x = from_float2<T>(v[0], v[1]);
    pk.y = from_float2<T>(v[2], v[3]);
    pk.z = from_float2<T>(v[4], v[5]);
    pk.w = from_float2<T>(v[6], v[7]);
    *reinterpret_cast<uint4*>(row + col) = pk;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) if (col + i < k) row[col + i] = from_float<T>(v[i]);
  }
}

// Two adjacent epilogue outputs (OutT is __nv_bfloat16 or float): one 4- / 8-byte store when both
// are wanted and the address allows it, else element by element (odd N, the last column).
template <typename OutT>
TILEHAL_DEVICE void store_pair(OutT* p, float x, float y, bool both, bool aligned) {
  if constexpr (sizeof(OutT) == 2) {
    if (both && aligned) {
      *reinterpret_cast<unsigned*>(p) = float2_to_bf16x2(x, y);
    } else {
      p[0] = __float2bfloat16_rn(x);
      if (both) p[1] = __float2bfloat16_rn(y);
    }
  } else {
    if (both && aligned) {
      *reinterpret_cast<float2*>(p) = make_float2(x, y);
    } else {
      p[0] = x;
      if (both) p[1] = y;
    }
  }
}

}  // namespace tilehal
