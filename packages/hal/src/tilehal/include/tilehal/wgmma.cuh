// Hopper warpgroup MMA (wgmma) with operands in shared memory, plus setmaxnreg.
//
// A warpgroup is 4 consecutive warps (128 threads). For m64nN with fp32 accumulators, thread t of
// the warpgroup (warp w = t / 32, lane l = t % 32) holds N/2 floats d[]: for each 8-column chunk j,
//   d[4j + 0] = D[16w + l/4,     8j + 2(l%4)]     d[4j + 1] = D[16w + l/4,     8j + 2(l%4) + 1]
//   d[4j + 2] = D[16w + l/4 + 8, 8j + 2(l%4)]     d[4j + 3] = D[16w + l/4 + 8, 8j + 2(l%4) + 1]
// Sequence per tile step: wgmma_fence(); mma...; wgmma_commit(); ... wgmma_wait<0>().
#pragma once
#include "common.cuh"
#include "convert.cuh"  // to_float, store_pair
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

// `desc` moved on by `units` 16-byte units (a step along K, another m64 block, ...). Only the
// start-address field (bits 0-13: shared address >> 4, below 2^14 for any address in shared memory)
// changes and a sum that stays inside shared memory cannot carry out of it, so this is one 32-bit add
// on the low word: no 64-bit add and carry between consecutive wgmma issues.
TILEHAL_DEVICE u64 desc_advance(u64 desc, u32 units) {
  return (desc & 0xFFFFFFFF00000000ull) | static_cast<u32>(static_cast<u32>(desc) + units);
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

// One K block, waited: d = A_tile @ B_tile^T over K_STEPS wgmma steps of 32 bytes of K each (the first
// step overwrites d), A and B K-major in 128-byte-swizzled rows (a_tile: this warpgroup's 64 rows).
// The fp8 kernels' per-block partial sums, promoted with the block's scales right after.
template <typename Mma, int K_STEPS, int R>
TILEHAL_DEVICE void wgmma_block_k128b_sync(float (&d)[R], const void* a_tile, const void* b_tile) {
  const u64 desc_a = make_smem_desc_k128b(a_tile);
  const u64 desc_b = make_smem_desc_k128b(b_tile);
  wgmma_fence_operands(d);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < K_STEPS; ++k) Mma::mma(d, desc_a + k * 2, desc_b + k * 2, k > 0);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(d);
}

// Direct epilogue of one warpgroup's m64nBLOCK_N fp32 accumulator (the layout above) into row-major
// D [rows, SHAPE_N]: the thread's rows r0 and r0 + 8 (r0 = its first row, 16w + l/4 plus the tile's
// first row), columns n0 + 8j + 2(l%4) and + 1. Rows >= row_limit and columns >= SHAPE_N are not
// written; row r lies at d + (row_base + r) * SHAPE_N (row_base: a masked group's first row). HAS_C:
// C, laid out as D, is added in fp32 first; VEC_C (fp32 C only): as one float2 load where both
// columns are in range and N is even, else element by element. C is read kChunk column chunks of both
// rows at a time, every load of a chunk before its stores: c may be d, so a load the compiler must keep
// behind a store of D would wait for that store's data (one memory round trip per 8 columns and row;
// 32 in a row for a 128-wide tile, now 2).
template <int SHAPE_N, int BLOCK_N, bool HAS_C, bool VEC_C, typename OutT, typename CT>
TILEHAL_DEVICE void store_acc_direct(const float (&acc)[BLOCK_N / 2], OutT* d, const CT* c, u64 row_base, int r0,
                                     int row_limit, int n0, int lane) {
  static_assert(!VEC_C || sizeof(CT) == 4, "VEC_C reads C as float2");
  constexpr bool kEvenN = SHAPE_N % 2 == 0;
  constexpr int kJ = BLOCK_N / 8;
  constexpr int kChunk = HAS_C ? (kJ < 8 ? kJ : 8) : kJ;
#pragma unroll
  for (int j0 = 0; j0 < kJ; j0 += kChunk) {
    [[maybe_unused]] float cx[2][kChunk], cy[2][kChunk];
    if constexpr (HAS_C) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + half * 8;
        const u64 row_off = (row_base + r) * static_cast<u64>(SHAPE_N);
#pragma unroll
        for (int jj = 0; jj < kChunk; ++jj) {
          const int col = n0 + (j0 + jj) * 8 + (lane % 4) * 2;
          cx[half][jj] = cy[half][jj] = 0.f;
          if (r >= row_limit || j0 + jj >= kJ || col >= SHAPE_N) continue;
          const bool both = col + 1 < SHAPE_N;
          const CT* cp = c + row_off + col;
          if (VEC_C && both && kEvenN) {
            const float2 cv = *reinterpret_cast<const float2*>(cp);
            cx[half][jj] = cv.x, cy[half][jj] = cv.y;
          } else {
            cx[half][jj] = to_float(cp[0]);
            if (both) cy[half][jj] = to_float(cp[1]);
          }
        }
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + half * 8;
      if (r >= row_limit) continue;
      const u64 row_off = (row_base + r) * static_cast<u64>(SHAPE_N);
#pragma unroll
      for (int jj = 0; jj < kChunk; ++jj) {
        const int j = j0 + jj;
        const int col = n0 + j * 8 + (lane % 4) * 2;
        if (j >= kJ || col >= SHAPE_N) continue;
        const bool both = col + 1 < SHAPE_N;
        float x = acc[4 * j + 2 * half], y = acc[4 * j + 2 * half + 1];
        if constexpr (HAS_C) x += cx[half][jj], y += cy[half][jj];
        store_pair(d + row_off + col, x, y, both, kEvenN);
      }
    }
  }
}

}  // namespace tilehal
