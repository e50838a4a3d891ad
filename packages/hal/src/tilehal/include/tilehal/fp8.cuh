// fp8 (e4m3) quantization pieces shared by the stack's cast kernels (deepgemm's per-token / per-block
// casts, SwiGLU + cast, tilestack's RMSNorm + cast): DeepGEMM's recipe, bit for bit with
// deepgemm.utils' torch reference:
//   amax = max |x| over a block's finite values (NaN and +-Inf ignored), clamped below at 1e-4,
//   sf   = amax / 448 (IEEE division), rounded up to a power of two with UE8M0,
//   q    = fp8(x * (1 / sf)), round-to-nearest-even, saturating: +-Inf -> +-448, NaN stays NaN.
#pragma once
#include "common.cuh"

namespace tilehal {

constexpr float kFp8E4m3Max = 448.0f;

// |v| where v is finite, else 0: non-finite values take no part in a block's amax.
TILEHAL_DEVICE float finite_abs(float v) {
  const float a = fabsf(v);
  return a <= 3.402823466e+38f ? a : 0.f;
}

// Max of v over aligned groups of WIDTH lanes (butterfly shuffles; every lane of the warp must call it).
template <int WIDTH>
TILEHAL_DEVICE float group_amax(float v) {
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// A block's scale from its amax: amax / 448 (clamped amax >= 1e-4), rounded up to a power of two with ue8m0.
TILEHAL_DEVICE float scale_of(float amax, bool ue8m0) {
  amax = fmaxf(amax, 1e-4f);
  float sf = amax / kFp8E4m3Max;
  if (ue8m0) {
    const unsigned bits = __float_as_uint(fabsf(sf));
    int e = static_cast<int>((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u ? 1 : 0);
    e = e < 1 ? 1 : (e > 254 ? 254 : e);
    sf = __uint_as_float(static_cast<unsigned>(e) << 23);
  }
  return sf;
}

TILEHAL_DEVICE unsigned char to_e4m3(float v) {
  return static_cast<unsigned char>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

TILEHAL_DEVICE float abs_max8(const float (&v)[8]) {
  float a = finite_abs(v[0]);
#pragma unroll
  for (int i = 1; i < 8; ++i) a = fmaxf(a, finite_abs(v[i]));
  return a;
}

// Eight values times `inv` as e4m3 at row[col..col+7] (those below k): one 8-byte store when `vec`
// and all eight are in range, else byte by byte.
TILEHAL_DEVICE void store8(unsigned char* row, int col, int k, const float (&v)[8], float inv, bool vec) {
  unsigned char q[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) q[i] = to_e4m3(v[i] * inv);
  if (vec && col + 7 < k) {
    uint2 w;
    w.x = q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<unsigned>(q[3]) << 24);
    w.y = q[4] | (q[5] << 8) | (q[6] << 16) | (static_cast<unsigned>(q[7]) << 24);
    *reinterpret_cast<uint2*>(row + col) = w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) if (col + i < k) row[col + i] = q[i];
  }
}

}  // namespace tilehal
