// TMA (cp.async.bulk.tensor): bulk tile copies between global and shared memory on sm_90,
// described by a 128-byte CUtensorMap built on the host (tilehal.tma.encode_tiled) and passed as a
// `const __grid_constant__ tilehal::TmaDescriptor` kernel parameter. Loads signal an mbarrier with
// their byte count (see mbarrier.cuh); out-of-bounds box elements are zero-filled and still counted.
#pragma once
#include "common.cuh"
#include "mbarrier.cuh"

namespace tilehal {

// Same size and alignment as the driver's CUtensorMap (NVRTC cannot include cuda.h).
struct alignas(64) TmaDescriptor {
  u64 opaque[16];
};

TILEHAL_DEVICE void tma_prefetch_descriptor(const TmaDescriptor* desc) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(desc)) : "memory");
}

// Coordinates are in elements, innermost dimension first (c0 = column of a row-major matrix).
TILEHAL_DEVICE void tma_load_2d(void* smem_dst, const TmaDescriptor* desc, u64* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_addr(smem_dst)),
      "l"(reinterpret_cast<u64>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

TILEHAL_DEVICE void tma_load_3d(void* smem_dst, const TmaDescriptor* desc, u64* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<u64>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Multicast load: the tile lands at the same smem offset in every CTA of `cta_mask` (a cluster).
TILEHAL_DEVICE void tma_load_2d_multicast(void* smem_dst, const TmaDescriptor* desc, u64* bar, int c0, int c1,
                                          unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<u64>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

// Store a shared-memory tile to global (bounds-checked by the descriptor: OOB elements are dropped).
TILEHAL_DEVICE void tma_store_2d(const TmaDescriptor* desc, const void* smem_src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<u64>(desc)),
               "r"(smem_addr(smem_src)), "r"(c0), "r"(c1)
               : "memory");
}

TILEHAL_DEVICE void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Wait until at most N committed store groups are still reading shared memory.
template <int N>
TILEHAL_DEVICE void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Wait until at most N committed store groups are still in flight (writes done).
template <int N>
TILEHAL_DEVICE void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace tilehal
