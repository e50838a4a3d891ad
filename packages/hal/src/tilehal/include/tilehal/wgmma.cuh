// Hopper warpgroup MMA (wgmma) with operands in shared memory, plus setmaxnreg.
//
// A warpgroup is 4 consecutive warps (128 threads). For m64nN with fp32 accumulators, thread t of
// the warpgroup (warp w = t / 32, lane l = t % 32) holds N/2 floats d[]: for each 8-column chunk j,
//   d[4j + 0] = D[16w + l/4,     8j + 2(l%4)]     d[4j + 1] = D[16w + l/4,     8j + 2(l%4) + 1]
//   d[4j + 2] = D[16w + l/4 + 8, 8j + 2(l%4)]     d[4j + 3] = D[16w + l/4 + 8, 8j + 2(l%4) + 1]
// Sequence per tile step: wgmma_fence(); mma...; wgmma_commit(); ... wgmma_wait<0>().
#pragma once
#include "common.cuh"
#include "mbarrier.cuh"  // smem_addr
#include "wgmma_ops.cuh"

namespace tilehal {

// Shared-memory matrix descriptor layouts (bits 62-63 of the descriptor).
enum class SmemSwizzle : int { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

// Descriptor of a K-major tile whose rows are `row_bytes` apart in 8-row core-matrix groups.
// For the 128-byte swizzle (rows of 128 bytes, as TMA's SWIZZLE_128B writes them) the stride
// between 8-row groups is 1024 bytes and the leading offset is unused; the tile base must be
// 1024-byte aligned. Advancing along K inside the 128-byte row = adding bytes >> 4 to the result.
TILEHAL_DEVICE u64 make_smem_desc(const void* tile, SmemSwizzle swizzle, u32 leading_bytes, u32 stride_bytes) {
  u64 addr = smem_addr(tile);
  u64 desc = 0;
  desc |= (addr & 0x3FFFF) >> 4;
  desc |= static_cast<u64>((leading_bytes & 0x3FFFF) >> 4) << 16;
  desc |= static_cast<u64>((stride_bytes & 0x3FFFF) >> 4) << 32;
  desc |= static_cast<u64>(static_cast<int>(swizzle)) << 62;
  return desc;
}

TILEHAL_DEVICE u64 make_smem_desc_k128b(const void* tile) {
  return make_smem_desc(tile, SmemSwizzle::k128B, 16, 1024);
}

// Descriptor of an MN-major tile (MN contiguous: read with the wgmma transpose immediate, bf16/fp16
// only) in 128-byte swizzled atoms: each atom is `k_rows` K-rows of 128 bytes (64 bf16 along MN),
// as one TMA box of (64 MN elements x k_rows) writes it, and atoms for the next 64 MN elements
// follow `k_rows * 128` bytes later (the leading offset). The stride offset is the 1024 bytes
// between 8-row groups along K; advancing K by k elements = adding (k * 128) >> 4 to the result.
TILEHAL_DEVICE u64 make_smem_desc_mn128b(const void* tile, u32 k_rows) {
  return make_smem_desc(tile, SmemSwizzle::k128B, k_rows * 128, 1024);
}

// Make register writes visible to the next wgmma (accumulators touched by ordinary code).
TILEHAL_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
TILEHAL_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Wait until at most N committed wgmma groups are pending.
template <int N>
TILEHAL_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keep the compiler from moving accumulator reads/writes across wgmma boundaries.
template <int R>
TILEHAL_DEVICE void wgmma_fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Redistribute the register file between warpgroups (all 128 threads of a warpgroup execute it).
template <int N>
TILEHAL_DEVICE void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
TILEHAL_DEVICE void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

}  // namespace tilehal
