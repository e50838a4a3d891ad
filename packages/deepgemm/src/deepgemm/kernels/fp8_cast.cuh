// Fused fp8 (e4m3) casts: one kernel each for DeepGEMM's per-token (1 x GRAN_K) and per-block
// (GRAN_K x GRAN_K) quantization, replacing chains of torch ops (pad, view, abs, amax, clamp, div,
// mul, cast, contiguous).
//
// Both compute exactly what deepgemm.utils' torch reference computes, bit for bit:
//   amax = max |x| over the block's finite values (NaN and +-Inf ignored), clamped below at 1e-4,
//   sf   = amax / 448 (IEEE division), rounded up to a power of two with UE8M0,
//   q    = fp8(x * (1 / sf)), round-to-nearest-even, saturating: +-Inf -> +-448, NaN stays NaN at
//          its position; finite |x * (1/sf)| <= 448 up to one rounding, so no finite value saturates.
// Elements past K (or N) count as zeros, like the reference's zero padding.
#pragma once
#include <tilehal/tilehal.cuh>

namespace deepgemm {

using tilehal::u64;

// The e4m3 recipe and the 8-element row accesses live in tilehal (fp8.cuh, convert.cuh), shared with
// tilestack's RMSNorm + cast kernel.
using tilehal::abs_max8;
using tilehal::group_amax;
using tilehal::load8;
using tilehal::scale_of;
using tilehal::store8;

constexpr int kWarpCols = 256;  // columns one warp covers: 32 lanes x 8

// The row kernels' work split: one warp per (row, kWarpCols columns) of a [rows, cols] matrix, warps
// numbered across the grid (8 per CTA). Sets the warp's row, the lane's first column (8 consecutive
// per lane) and the lane; false for the warps past the last task.
TILEHAL_DEVICE bool warp_row_task(int rows, int cols, int& row, int& col, int& lane) {
  const int chunks = (cols + kWarpCols - 1) / kWarpCols;
  const long long task = static_cast<long long>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (task >= static_cast<long long>(rows) * chunks) return false;
  row = static_cast<int>(task / chunks);
  const int chunk = static_cast<int>(task % chunks);
  lane = threadIdx.x & 31;
  col = chunk * kWarpCols + lane * 8;
  return true;
}

// Per token: x [rows, k] (row stride ldx elements) -> q [rows, k] (row stride k) and
// sf[row * sf_rs + kb * sf_cs]. One warp per (row, 256 columns); each lane holds 8 consecutive
// elements, GRAN_K / 8 lanes share one scale.
template <typename T, int GRAN_K, bool VEC>
__global__ void __launch_bounds__(256) per_token_cast(const T* __restrict__ x, unsigned char* __restrict__ q,
                                                      float* __restrict__ sf, int rows, int k, long long ldx,
                                                      long long sf_rs, long long sf_cs, bool ue8m0) {
  static_assert(GRAN_K == 32 || GRAN_K == 64 || GRAN_K == 128, "GRAN_K is 32, 64 or 128");
  int row, col, lane;
  if (!warp_row_task(rows, k, row, col, lane)) return;
  float v[8];
  load8<T, VEC>(x + row * ldx, col, k, v);
  const float a = group_amax<GRAN_K / 8>(abs_max8(v));
  const float s = scale_of(a, ue8m0);
  const float inv = 1.0f / s;
  store8(q + static_cast<long long>(row) * k, col, k, v, inv, VEC);
  if (col < k && lane % (GRAN_K / 8) == 0) sf[row * sf_rs + static_cast<long long>(col / GRAN_K) * sf_cs] = s;
}

// Per block: x [groups][n, k] (row stride ldx, group stride ldg) -> q (contiguous) and
// sf [groups][ceil(n/128), ceil(k/128)] (contiguous). One CTA of 8 warps per 128 x 128 block: in pass
// i, warp w reads rows 16 i + 2 w and 16 i + 2 w + 1 (lanes 0-15 and 16-31), 8 columns per lane. The
// block's 64 values per thread stay in registers between the reduction and the stores.
template <typename T, bool VEC>
__global__ void __launch_bounds__(256) per_block_cast(const T* __restrict__ x, unsigned char* __restrict__ q,
                                                      float* __restrict__ sf, int n, int k, long long ldx,
                                                      long long ldg, bool ue8m0) {
  __shared__ float warp_amax[8];
  const int kb = blockIdx.x, nb = blockIdx.y, g = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const T* xg = x + g * ldg;
  unsigned char* qg = q + static_cast<long long>(g) * n * k;
  const int col = kb * 128 + (lane % 16) * 8;
  const int r0 = nb * 128 + warp * 2 + lane / 16;
  float v[8][8];
  float a = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = r0 + 16 * i;
    if (r < n) {
      load8<T, VEC>(xg + r * ldx, col, k, v[i]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[i][e] = 0.f;
    }
    a = fmaxf(a, abs_max8(v[i]));
  }
  a = group_amax<32>(a);
  if (lane == 0) warp_amax[warp] = a;
  __syncthreads();
  a = warp_amax[0];
#pragma unroll
  for (int w = 1; w < 8; ++w) a = fmaxf(a, warp_amax[w]);
  const float s = scale_of(a, ue8m0);
  const float inv = 1.0f / s;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = r0 + 16 * i;
    if (r < n) store8(qg + static_cast<long long>(r) * k, col, k, v[i], inv, VEC);
  }
  if (threadIdx.x == 0) {
    const int sn = (n + 127) / 128, sk = (k + 127) / 128;
    sf[(static_cast<long long>(g) * sn + nb) * sk + kb] = s;
  }
}

}  // namespace deepgemm

namespace deepgemm {

// SwiGLU's activation, the MoE experts' step between their two GEMMs: y = silu(g) * u for
// x = [g | u] ([rows, 2f], row stride ldx), in fp32 as torch computes F.silu(g.float()) * u.float()
// (silu(g) = g / (1 + exp(-g)), IEEE division, accurate exp). FP8: y cast per token and 128
// columns like per_token_cast (q [rows, f], sf[row * sf_rs + kb * sf_cs]); else y rounded to bf16.
template <typename T, bool FP8, bool VEC>
__global__ void __launch_bounds__(256) silu_mul(const T* __restrict__ x, void* __restrict__ out,
                                                float* __restrict__ sf, int rows, int f, long long ldx,
                                                long long sf_rs, long long sf_cs, bool ue8m0) {
  int row, col, lane;
  if (!warp_row_task(rows, f, row, col, lane)) return;
  float g[8], u[8], y[8];
  load8<T, VEC>(x + row * ldx, col, f, g);
  load8<T, VEC>(x + row * ldx + f, col, f, u);
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  const long long o = static_cast<long long>(row) * f;
  if constexpr (FP8) {
    const float a = group_amax<16>(abs_max8(y));  // 16 lanes x 8 = one 128-column scale block
    const float s = scale_of(a, ue8m0);
    store8(static_cast<unsigned char*>(out) + o, col, f, y, 1.0f / s, VEC);
    if (col < f && lane % 16 == 0) sf[row * sf_rs + static_cast<long long>(col / 128) * sf_cs] = s;
  } else {
    store8<__nv_bfloat16, VEC>(static_cast<__nv_bfloat16*>(out) + o, col, f, y);
  }
}

}  // namespace deepgemm
