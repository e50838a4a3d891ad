// bf16 GEMV for M = 1: D[1, N] = C + a[1, K] @ B[N, K]^T (B K-major), for decode steps where the whole GEMM is
// one pass over the weights.
//
// A tile kernel at M = 1 runs wgmma on 63 zero rows and needs split-K (a reduction through L2) to give every
// SM enough of B; here there is no tile, no shared-memory ring and no cross-CTA reduction: each warp owns one
// row of B (or 1/WARPS_PER_ROW of it) and streams it with 16-byte loads (ld.global.nc, L1 no-allocate, L2
// 256-byte prefetch), UNROLL loads in flight per lane before any FMA, against the activation vector (read
// through L1: every warp of an SM reads the same K range). A warp's dot product is reduced with shuffles, the
// parts of a row in warp order through shared memory (fixed order: deterministic), and C (fp32 or bf16) is
// added by the row's first warp. K must be a multiple of 8 and the rows of B 16-byte aligned (the host checks).
#pragma once
#include <tilehal/tilehal.cuh>

namespace deepgemm {
using namespace tilehal;

TILEHAL_DEVICE float dot_bf16x2(u32 x, u32 y, float acc) {
  const float2 fx = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
  const float2 fy = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&y));
  return fmaf(fx.y, fy.y, fmaf(fx.x, fy.x, acc));
}

template <int SHAPE_N, int SHAPE_K, int WARPS_PER_ROW, typename OutT, bool HAS_C, typename CT>
__global__ void __launch_bounds__(256, 4)
gemv_sm90(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b, long long ldb,
          OutT* __restrict__ d, const CT* __restrict__ c) {
  constexpr int WARPS = 8;
  constexpr int W = WARPS_PER_ROW;
  static_assert(W == 1 || W == 2 || W == 4 || W == 8, "warps per row divide the CTA's 8 warps");
  static_assert(SHAPE_K % 8 == 0, "K in whole 16-byte vectors");
  constexpr int ROWS = WARPS / W;
  constexpr int KV = SHAPE_K / 8;            // 16-byte vectors per row
  constexpr int CHUNK = (KV + W - 1) / W;    // vectors per warp
  constexpr int ITERS = (CHUNK + 31) / 32;   // per lane
  constexpr int UNROLL = ITERS < 4 ? ITERS : 4;
  __shared__ float part[WARPS];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * ROWS + warp / W;
  const int lo = (warp % W) * CHUNK;
  const int hi = min(KV, lo + CHUNK);
  const bool live = row < SHAPE_N;
  const uint4* brow = reinterpret_cast<const uint4*>(b + static_cast<long long>(live ? row : 0) * ldb);
  const uint4* av = reinterpret_cast<const uint4*>(a);

  float acc0 = 0.f, acc1 = 0.f;
  for (int it0 = 0; it0 < ITERS; it0 += UNROLL) {
    uint4 bv[UNROLL], xv[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = lo + (it0 + u) * 32 + lane;
      const bool ok = live && it0 + u < ITERS && v < hi;
      bv[u] = ok ? load_nc_v4<uint4, 256>(brow + v) : make_uint4(0, 0, 0, 0);
      xv[u] = ok ? __ldg(av + v) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      acc0 = dot_bf16x2(bv[u].x, xv[u].x, acc0);
      acc1 = dot_bf16x2(bv[u].y, xv[u].y, acc1);
      acc0 = dot_bf16x2(bv[u].z, xv[u].z, acc0);
      acc1 = dot_bf16x2(bv[u].w, xv[u].w, acc1);
    }
  }
  float sum = acc0 + acc1;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if constexpr (W > 1) {
    if (lane == 0) part[warp] = sum;
    __syncthreads();
    if (warp % W != 0) return;
    sum = part[warp];
#pragma unroll
    for (int i = 1; i < W; ++i) sum += part[warp + i];  // in K order
  }
  if (lane != 0 || !live) return;
  if constexpr (HAS_C) sum += to_float(c[row]);
  if constexpr (sizeof(OutT) == 2) {
    d[row] = __float2bfloat16_rn(sum);
  } else {
    d[row] = sum;
  }
}

}  // namespace deepgemm
