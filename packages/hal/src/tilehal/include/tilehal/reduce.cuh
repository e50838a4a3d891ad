// Warp- and block-level reductions (butterfly shuffles: every lane ends with the result).
#pragma once
#include "common.cuh"

namespace tilehal {

struct SumOp { template <typename T> TILEHAL_DEVICE T operator()(T a, T b) const { return a + b; } };
struct MaxOp { template <typename T> TILEHAL_DEVICE T operator()(T a, T b) const { return a > b ? a : b; } };
struct MinOp { template <typename T> TILEHAL_DEVICE T operator()(T a, T b) const { return a < b ? a : b; } };

template <typename T, typename Op, int Width = 32>
TILEHAL_DEVICE T warp_reduce(T v, Op op) {
#pragma unroll
  for (int offset = Width / 2; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset, Width));
  return v;
}

template <typename T, int Width = 32> TILEHAL_DEVICE T warp_sum(T v) { return warp_reduce<T, SumOp, Width>(v, SumOp()); }
template <typename T, int Width = 32> TILEHAL_DEVICE T warp_max(T v) { return warp_reduce<T, MaxOp, Width>(v, MaxOp()); }
template <typename T, int Width = 32> TILEHAL_DEVICE T warp_min(T v) { return warp_reduce<T, MinOp, Width>(v, MinOp()); }

// Block-wide reduction; `scratch` holds at least blockDim.x / 32 values. All threads get the
// result. Contains __syncthreads(): every thread of the block must call it.
template <typename T, typename Op>
TILEHAL_DEVICE T block_reduce(T v, Op op, T identity, T* scratch) {
  const int lane = lane_id(), warp = warp_id(), num_warps = (blockDim.x + 31) >> 5;
  v = warp_reduce<T, Op>(v, op);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = lane < num_warps ? scratch[lane] : identity;
  r = warp_reduce<T, Op>(r, op);
  __syncthreads();  // scratch may be reused right after
  return r;
}

template <typename T> TILEHAL_DEVICE T block_sum(T v, T* scratch) { return block_reduce(v, SumOp(), T(0), scratch); }
template <typename T> TILEHAL_DEVICE T block_max(T v, T* scratch) { return block_reduce(v, MaxOp(), T(-INFINITY), scratch); }

}  // namespace tilehal
