// Shared basics for every TileStack CUDA kernel. Kernels are compiled with NVRTC, so only
// headers that NVRTC can see are used (no <cstdint> from the host toolchain).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

// NVRTC has no <cmath>: provide the constants kernels expect from it.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define TILEHAL_DEVICE __device__ __forceinline__
#define TILEHAL_HOST_DEVICE __host__ __device__ __forceinline__

namespace tilehal {

typedef unsigned long long u64;
typedef unsigned int u32;
typedef long long i64;

template <typename T>
TILEHAL_HOST_DEVICE constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

constexpr int kWarpSize = 32;

TILEHAL_DEVICE int lane_id() { return threadIdx.x & 31; }
TILEHAL_DEVICE int warp_id() { return threadIdx.x >> 5; }

// bar.sync on a named barrier among `count` threads (a multiple of 32; id 0 is __syncthreads's):
// lets a subset of the CTA's warps (e.g. a warp-specialized kernel's math warps) meet.
TILEHAL_DEVICE void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// bar.arrive: count this thread towards named barrier `id` without waiting (the producer side of a
// bar.sync / bar.arrive pair, e.g. warpgroups taking turns on the tensor cores).
TILEHAL_DEVICE void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// Persistent-kernel tile order: tile t of a grid of num_m x NUM_N tiles -> (m, n), walking bands of
// BAND columns (n) and the m tiles inside a band, so the CTAs running together share operand panels
// in L2. The last band holds the NUM_N % BAND remaining columns.
template <int BAND, int NUM_N>
TILEHAL_DEVICE void band_tile_coords(int t, int num_m, int& m, int& n) {
  const int per_band = num_m * BAND;
  const int band = t / per_band;
  const int first_n = band * BAND;
  const int n_in_band = min(BAND, NUM_N - first_n);
  const int in_band = t - band * per_band;
  m = in_band / n_in_band;
  n = first_n + in_band % n_in_band;
}

}  // namespace tilehal
