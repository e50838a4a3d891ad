// mbarrier: shared-memory barriers that count thread arrivals and TMA transaction bytes (sm_90).
// A barrier completes a phase when `count` arrivals happened and every expected byte landed;
// waiters name the phase parity they wait for (0, 1, 0, ... per use of the barrier).
#pragma once
#include "common.cuh"

namespace tilehal {

// 32-bit shared-window address of a shared-memory pointer, as PTX's .shared operands want it.
TILEHAL_DEVICE u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

TILEHAL_DEVICE void mbarrier_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Make barrier initialisation visible to the async proxy (TMA) and, in clusters, to peer CTAs.
TILEHAL_DEVICE void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Order generic-proxy shared-memory writes before later async-proxy (TMA, wgmma) accesses.
TILEHAL_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

TILEHAL_DEVICE void mbarrier_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
TILEHAL_DEVICE void mbarrier_arrive_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Arrive on the barrier at the same offset in CTA `cta` of the cluster with the default .release.cta semantics: a
// multicast consumer's stage release once the wgmmas that read the stage have completed (no cluster-scope fence is
// needed before the peer's TMA overwrites it; what CUTLASS's cluster barrier does).
TILEHAL_DEVICE void mbarrier_arrive_remote(u64* bar, u32 cta) {
  asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
               "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)), "r"(cta)
               : "memory");
}

// Arrive on the barrier at the same offset in CTA `cta` of the cluster (for multicast consumers), .release.cluster.
TILEHAL_DEVICE void mbarrier_arrive_cluster(u64* bar, u32 cta) {
  asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
               "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)),
               "r"(cta)
               : "memory");
}

// A multicast consumer's release of a stage in CTA `cta`: mbarrier_arrive_remote, or with CLUSTER_SCOPE (A/B timing)
// mbarrier_arrive_cluster.
template <bool CLUSTER_SCOPE = false>
TILEHAL_DEVICE void mbarrier_release_peer(u64* bar, u32 cta) {
  if constexpr (CLUSTER_SCOPE) {
    mbarrier_arrive_cluster(bar, cta);
  } else {
    mbarrier_arrive_remote(bar, cta);
  }
}

TILEHAL_DEVICE bool mbarrier_try_wait(u64* bar, u32 parity) {
  u32 done;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
               : "=r"(done)
               : "r"(smem_addr(bar)), "r"(parity)
               : "memory");
  return done != 0;
}

// --- thread-block clusters (sm_90) ---------------------------------------------------------
// Rank of this CTA in its cluster (0 when launched without clusters).
TILEHAL_DEVICE u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA in the cluster arrives and waits: barrier initialisation becomes
// visible to peer CTAs (remote arrivals, multicast TMA) before anyone uses it.
TILEHAL_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Block until the phase with `parity` has completed. try_wait already suspends in hardware for a
// while, so the loop spins only a few times.
TILEHAL_DEVICE void mbarrier_wait(u64* bar, u32 parity) {
  while (!mbarrier_try_wait(bar, parity)) {
  }
}

}  // namespace tilehal
