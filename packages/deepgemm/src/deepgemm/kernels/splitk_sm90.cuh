// Split-K GEMM for sm_90a (bf16, or fp8 with DeepGEMM's 1x128 / 128x128 scales), for shapes whose
// output tiles cannot fill the GPU: D = C + A @ B^T.
//
// The persistent kernel (gemm_sm90.cuh) gives each CTA whole output tiles. When M is small (decode
// batches, M = 1 .. 128) and N is a few thousand, there are fewer tiles than SMs unless they are
// made very narrow, and narrow tiles re-read A once per tile and run wgmma at a fraction of its
// rate. Here the K loop is split instead: the grid is (n-blocks, m-blocks, SPLITS), CTA (x, y, z)
// computes tile (y, x) over K blocks [z * KB_PER_SPLIT, (z + 1) * KB_PER_SPLIT), and the partial
// sums of a tile are combined by whichever of its CTAs finishes last:
//   - (REDUCE = 0) every CTA writes its fp32 partial tile (only rows < M) to the workspace `ws`,
//     __threadfence(), then one thread increments the tile's counter;
//   - the CTA that sees SPLITS - 1 adds the partials in split order 0 .. SPLITS - 1 (its own read
//     back too: the same value it wrote), adds C, converts and stores D, and resets the counter
//     to 0 for the next launch.
// The sum order never depends on which CTA finishes last, so results are deterministic. The
// counters are zero-initialized once on the host; every launch leaves them zero again.
// REDUCE = 1 (PAR_REDUCE): every CTA of a tile reduces 1/SPLITS of it instead (same split order, same sums): each
// waits on the tile's counter until all SPLITS partials are written, sums its slice and D is written by
// all of them at once; a second counter per tile counts the slices done and the last resets both. The
// last-CTA scheme moves SPLITS x BLOCK_M x BLOCK_N x 4 bytes through one SM after the main loop (at
// M = 128 that tail is a few us); here each SM moves 1/SPLITS of it. The wait needs every CTA of the
// grid resident at once: the host launches it only when the grid is one wave (grid <= SMs x CTAs/SM).
// REDUCE = 2: the SPLITS CTAs of a tile are one thread-block cluster (1, 1, SPLITS <= 8): partials stay in each
// CTA's shared memory and CTA r sums slice r of the tile over the cluster through distributed shared memory
// (split order), then writes D; no fp32 partials go through L2 at all (gang scheduling: no wait can hang).
//
// Operands may be MN-major (A_MN: A stored [K, M]; B_MN: B stored [K, N], i.e. DeepGEMM's "t" A /
// "n" B): such a tile is loaded as BLOCK/64 TMA boxes of 64 MN-elements x 64 K-rows (128-byte
// swizzled) and read by wgmma with its transpose immediate, so the operand is never copied.
//
// Inside a CTA the pipeline is the persistent kernel's: one producer thread issues TMA loads of
// the A and B tiles (128-byte swizzled K-major boxes of 64 bf16) into a STAGES-deep mbarrier ring;
// BLOCK_M / 64 math warpgroups run wgmma m64nBLOCK_Nk16 on 64 rows each, with one K block in
// flight when 4+ stages fit. For M = 1 .. 16 the 64-row wgmma does mostly zero rows (TMA
// zero-fills rows past M without reading memory), which costs nothing: such GEMMs are bound by
// reading B, and the deep ring keeps STAGES x BLOCK_N x 128 bytes of B in flight per SM.
//
// FP8 (e4m3 A and B, K-major): a K block is 128 elements (still one 128-byte swizzle row), run as
// wgmma m64nBLOCK_Nk32 into a fresh partial-sum set and promoted as in gemm_sm90.cuh:
// acc += part * (sfa[row, kb] * sfb[n0 / 128, kb]). BLOCK_N divides 128, so a tile has one weight-scale
// block. The producer loads each K block's activation scales (BLOCK_M fp32 of the MN-major sfa) with TMA into
// the stage next to A and B, and each math warp holds 32 K blocks' weight scales one per lane (read ahead,
// broadcast with a shuffle): no global load sits on a K block's critical path. (The first version read
// both from global memory per K block: at M = 64 / 128 each K block then waited ~1 us for its scales and the
// kernel lost to the persistent one, H200 R1 2026-12-02.) A split's sum is its blocks' promoted partials in K
// order; the splits are then added in split order as for bf16 (deterministic).
//
// MCAST = 2 (K-major A): 2-CTA clusters along the grid's n-blocks. Both CTAs of a cluster have the same
// m-block and split, so the same A slices: each loads half of the A tile (BLOCK_M / 2 rows) and multicasts
// it into both, halving A's L2 -> SM traffic (at M = 128 every n-block re-reads the whole A panel: for
// 128 x 2112 x 7168 bf16 with 64-wide tiles that is 60 MB of A against 30 MB of weights). A stage is
// refilled only when the consumers of both CTAs released it (lane i of each math warp arrives in CTA i),
// and each producer waits for the last releases before its CTA exits (no remote arrival may target an
// exited CTA). An odd n-block count gets one phantom CTA (n0 >= N: TMA zero-fills its B, it writes nothing).
// A consumer's release in the peer CTA is a plain remote arrival (.release.cta, tilehal mbarrier_release_peer:
// the wgmmas that read the stage are complete, no cluster-scope fence is needed before the peer's TMA refills it);
// tilehal's mbarrier_arrive_cluster (.release.cluster) made the persistent kernel's multicast 1.5-2x slower on the
// H200 (grouped, s26) and is what the split-K multicast plans measured with in s26 R2 (1.1-1.9x slower);
// -DDEEPGEMM_MCAST_RELEASE_CLUSTER=1 keeps it (A/B timing). With REDUCE = 1 the host launches a multicast grid only
// where the driver holds all its clusters at once (every split waits for the others).
//
// C_EARLY (opt-in, SPLITS > 1 with C): split 0's math threads load their accumulator fragments' C values into
// registers before the main loop (the loads land while it runs) and add them to their partial sums before those
// are written; the reduction then adds no C. Every reduction after the main loop otherwise waits one C round
// trip (L2 at best, DRAM when the prefetch lost the race) on top of the partials' (bf16 M = 128 x 4096 x 7168,
// H200 s26: 30.1 us with C against 28.7 without). Sum order 0 + (split 0 + C) + split 1 + ...: deterministic, and
// the same for every REDUCE mode, but not the bits of the default order (split sum + C).
#pragma once
#include <tilehal/tilehal.cuh>
#include <tilehal/mbarrier.cuh>
#include <tilehal/tma.cuh>
#include <tilehal/wgmma.cuh>
#include <tilehal/wgmma16_ops.cuh>

namespace deepgemm {
using namespace tilehal;

// Registers after setmaxnreg: as in gemm_sm90.cuh, the producer warpgroup gives back what the math
// warpgroups take ((168 - 40) x 128 = 2 x (232 - 168) x 128; one math warpgroup reaches 256).
template <int NUM_MATH_WG> constexpr int kSplitKProducerRegs = 40;
template <int NUM_MATH_WG> constexpr int kSplitKMathRegs = NUM_MATH_WG == 1 ? 256 : 232;

// A relaxed-poll with acquire semantics at GPU scope (the split-K tile counters).
TILEHAL_DEVICE int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The shared::cluster address of `p` (this CTA's shared memory) in CTA `rank` of the cluster, and a 16-byte load there.
TILEHAL_DEVICE u32 mapa_shared(const void* p, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  return remote;
}
TILEHAL_DEVICE float4 ld_shared_cluster_f4(u32 addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr) : "memory");
  return v;
}

#ifndef DEEPGEMM_PREFETCH_L2
#define DEEPGEMM_PREFETCH_L2
TILEHAL_DEVICE void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#endif

// C_EARLY: one accumulator pair's C values (columns col, col + 1 of a row), fp32 or bf16, 0 outside the matrix.
template <typename CT> struct CPair;
template <> struct CPair<float> {
  float2 v;
  TILEHAL_DEVICE void load(const float* p, bool pair, bool second) {
    if (pair) {
      v = *reinterpret_cast<const float2*>(p);
    } else {
      v = make_float2(p[0], second ? p[1] : 0.f);
    }
  }
  TILEHAL_DEVICE float2 get() const { return v; }
};
template <> struct CPair<__nv_bfloat16> {
  unsigned v;  // two bf16: half the registers of an fp32 pair
  TILEHAL_DEVICE void load(const __nv_bfloat16* p, bool pair, bool second) {
    if (pair) {
      v = *reinterpret_cast<const unsigned*>(p);
    } else {
      const unsigned short lo = *reinterpret_cast<const unsigned short*>(p);
      const unsigned short hi = second ? *reinterpret_cast<const unsigned short*>(p + 1) : 0;
      v = static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
    }
  }
  TILEHAL_DEVICE float2 get() const { return bf16x2_to_float2(v); }
};

#ifndef DEEPGEMM_MCAST_RELEASE_CLUSTER
#define DEEPGEMM_MCAST_RELEASE_CLUSTER 0
#endif

// C (added when HAS_C) is read in its own dtype CT: fp32, or bf16 (DeepGEMM's bf16 accumulation).
// FP8: tma_sfa describes the MN-major sfa as [ceil(K/128), M] fp32 (boxes of 1 x BLOCK_M), sfb is fp32
// [ceil(N/128), ceil(K/128)]; bf16 kernels take a zero descriptor and a null pointer there.
template <bool FP8, int SHAPE_N, int SHAPE_K, int BLOCK_M, int BLOCK_N, int STAGES, int SPLITS, typename OutT,
          bool HAS_C, typename CT, bool A_MN, bool B_MN, int MCAST = 1, int REDUCE = 0, bool C_EARLY = false>
__global__ void __launch_bounds__((BLOCK_M / 64 + 1) * 128, 1)
splitk_sm90(const __grid_constant__ TmaDescriptor tma_a, const __grid_constant__ TmaDescriptor tma_b,
            const __grid_constant__ TmaDescriptor tma_sfa, OutT* d, const CT* c, float* __restrict__ ws,
            int* counters, int shape_m, const float* __restrict__ sfb) {
  constexpr int BLOCK_K = FP8 ? 128 : 64;  // one 128-byte swizzle row
  constexpr int K_STEP = FP8 ? 32 : 16;    // K per wgmma instruction (32 bytes)
  constexpr int NUM_K_BLOCKS = (SHAPE_K + BLOCK_K - 1) / BLOCK_K;
  constexpr int KB_PER_SPLIT = (NUM_K_BLOCKS + SPLITS - 1) / SPLITS;
  constexpr int NUM_MATH_WG = BLOCK_M / 64;
  constexpr int NUM_MATH_THREADS = NUM_MATH_WG * 128;
  constexpr int A_BYTES = BLOCK_M * 128;
  constexpr int B_BYTES = BLOCK_N * 128;
  constexpr int SFA_BYTES = FP8 ? BLOCK_M * 4 : 0;  // one activation scale per row and K block
  constexpr int ACC = BLOCK_N / 2;
  constexpr int kInFlight = STAGES >= 4 ? 1 : 0;
  static_assert(BLOCK_M == 64 || BLOCK_M == 128, "one or two math warpgroups");
  static_assert(BLOCK_N % 8 == 0 && BLOCK_N <= 256, "wgmma N");
  // The host picks SPLITS so that every split owns at least one K block.
  static_assert(SPLITS >= 1 && (SPLITS - 1) * KB_PER_SPLIT < NUM_K_BLOCKS, "an empty split");
  static_assert(!B_MN || BLOCK_N % 64 == 0, "an MN-major B tile is whole 64-column atoms");
  static_assert(!FP8 || (!A_MN && !B_MN && 128 % BLOCK_N == 0), "fp8: K-major operands, one weight-scale block per tile");
  static_assert(MCAST == 1 || (MCAST == 2 && !A_MN), "multicast: 2-CTA clusters sharing a K-major A");
  constexpr bool PAR_REDUCE = REDUCE == 1;
  constexpr bool CLUSTER_REDUCE = REDUCE == 2 && SPLITS > 1;
  static_assert(REDUCE >= 0 && REDUCE <= 2 && (!CLUSTER_REDUCE || (MCAST == 1 && SPLITS <= 8)),
                "reduce: 0 last CTA, 1 every split a slice, 2 through the cluster's shared memory (<= 8 splits)");
  static_assert(!C_EARLY || (HAS_C && SPLITS > 1), "C_EARLY: split 0 adds C (with C, more than one split)");
  constexpr bool kReduceC = HAS_C && !C_EARLY;  // the reduction adds C (else split 0's partial carries it)
  constexpr int RED_STRIDE = BLOCK_N + 8;  // fp32 partial tile rows in shared memory (padded: 2-way stores)
  constexpr int ATOM_BYTES = 64 * 128;  // one MN-major atom column: 64 K-rows of 128 bytes
  using Mma = Wgmma16<BLOCK_N>;  // bf16 wgmma with the transpose immediates (MN-major operands)

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* smem_a = smem;
  unsigned char* smem_b = smem_a + STAGES * A_BYTES;
  float* smem_sfa = reinterpret_cast<float*>(smem_b + STAGES * B_BYTES);
  u64* full_bar = reinterpret_cast<u64*>(smem_b + STAGES * (B_BYTES + SFA_BYTES));
  u64* empty_bar = full_bar + STAGES;
  int* last_flag = reinterpret_cast<int*>(empty_bar + STAGES);

  const int tid = threadIdx.x;
  const int n_block = blockIdx.x, m_block = blockIdx.y, split = blockIdx.z;
  const int kb_begin = split * KB_PER_SPLIT;
  const int kb_end = min(NUM_K_BLOCKS, kb_begin + KB_PER_SPLIT);

  if (tid == NUM_MATH_THREADS) {
    tma_prefetch_descriptor(&tma_a);
    tma_prefetch_descriptor(&tma_b);
    if constexpr (FP8) tma_prefetch_descriptor(&tma_sfa);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(&full_bar[s], 1);
      mbarrier_init(&empty_bar[s], MCAST * NUM_MATH_WG * 4);  // lane 0 of every math warp (of every CTA)
    }
    fence_barrier_init();
  }
  if constexpr (MCAST > 1) {
    cluster_sync();  // the peer's multicast and remote arrivals need our barriers initialised
  } else {
    __syncthreads();
  }
  [[maybe_unused]] const int rank = MCAST > 1 ? static_cast<int>(cluster_ctarank()) : 0;

  if (tid >= NUM_MATH_THREADS) {
    // ---------------------------------------------------------------- producer warpgroup
    setmaxnreg_dec<kSplitKProducerRegs<NUM_MATH_WG>>();
    if (tid == NUM_MATH_THREADS) {
      const int num_kb_total = kb_end - kb_begin;
      for (int kb = kb_begin, it = 0; kb < kb_end; ++kb, ++it) {
        const int s = it % STAGES;
        mbarrier_wait(&empty_bar[s], ((it / STAGES) & 1) ^ 1);
        mbarrier_arrive_expect_tx(&full_bar[s], A_BYTES + B_BYTES + SFA_BYTES);
        if constexpr (FP8) tma_load_2d(smem_sfa + s * BLOCK_M, &tma_sfa, &full_bar[s], m_block * BLOCK_M, kb);
        if constexpr (A_MN) {
#pragma unroll
          for (int i = 0; i < BLOCK_M / 64; ++i)
            tma_load_2d(smem_a + s * A_BYTES + i * ATOM_BYTES, &tma_a, &full_bar[s], m_block * BLOCK_M + i * 64,
                        kb * BLOCK_K);
        } else {
          if constexpr (MCAST > 1) {
            tma_load_2d_multicast(smem_a + s * A_BYTES + rank * (A_BYTES / 2), &tma_a, &full_bar[s], kb * BLOCK_K,
                                  m_block * BLOCK_M + rank * (BLOCK_M / 2), 0x3);
          } else {
            tma_load_2d(smem_a + s * A_BYTES, &tma_a, &full_bar[s], kb * BLOCK_K, m_block * BLOCK_M);
          }
        }
        if constexpr (B_MN) {
#pragma unroll
          for (int i = 0; i < BLOCK_N / 64; ++i)
            tma_load_2d(smem_b + s * B_BYTES + i * ATOM_BYTES, &tma_b, &full_bar[s], n_block * BLOCK_N + i * 64,
                        kb * BLOCK_K);
        } else {
          tma_load_2d(smem_b + s * B_BYTES, &tma_b, &full_bar[s], kb * BLOCK_K, n_block * BLOCK_N);
        }
      }
      if constexpr (MCAST > 1) {
        // Stay alive until both CTAs' consumers released every stage of this CTA.
        for (int i = 0, it = num_kb_total; i < STAGES; ++i, ++it) mbarrier_wait(&empty_bar[it % STAGES], ((it / STAGES) & 1) ^ 1);
      }
    }
    if constexpr (kReduceC && (PAR_REDUCE || CLUSTER_REDUCE)) {
      // The producer warpgroup's other 127 threads pull this CTA's slice of C into L2 while the main loop runs,
      // so the reduction's C loads (after the wait for the other splits) hit L2 instead of waiting on DRAM.
      if (tid != NUM_MATH_THREADS) {
        const int m0 = m_block * BLOCK_M, n0 = n_block * BLOCK_N;
        const int rows = min(BLOCK_M, shape_m - m0);
        constexpr int VEC = PAR_REDUCE ? (SHAPE_N % 4 == 0 ? 4 : (SHAPE_N % 2 == 0 ? 2 : 1)) : 4;
        const int per_row = PAR_REDUCE ? (min(BLOCK_N, SHAPE_N - n0) + VEC - 1) / VEC : BLOCK_N / 4;
        const int all = rows * per_row, per = (all + SPLITS - 1) / SPLITS;
        const int first = min(all, split * per), last = min(all, first + per);
        const int cols = min(BLOCK_N, SHAPE_N - n0);
        constexpr int LINE = 128 / static_cast<int>(sizeof(CT));
        if (first < last && cols > 0) {
          for (int r = first / per_row + (tid - NUM_MATH_THREADS - 1); r <= (last - 1) / per_row; r += 127)
            for (int col = 0; col < cols; col += LINE) prefetch_l2(c + static_cast<u64>(m0 + r) * SHAPE_N + n0 + col);
        }
      }
    }
    if constexpr (CLUSTER_REDUCE) {  // the whole warpgroup takes part in the epilogue's two cluster barriers
      __syncwarp();
      cluster_sync();  // the partial tiles are in shared memory
      cluster_sync();  // every CTA has read its slice from the others
    }
    return;
  }

  // ------------------------------------------------------------------ math warpgroups
  setmaxnreg_inc<kSplitKMathRegs<NUM_MATH_WG>>();
  const int wg = tid / 128;
  const int warp = (tid % 128) / 32;
  const int lane = tid % 32;
  const int row_in_tile = wg * 64 + warp * 16 + lane / 4;  // and +8
  // Hand stage s back to the producer(s): lane i of each warp arrives in CTA i of the cluster.
  auto release = [&](int s) {
    if constexpr (MCAST == 1) {
      if (lane == 0) mbarrier_arrive(&empty_bar[s]);
    } else {
      if (lane < MCAST) mbarrier_release_peer<DEEPGEMM_MCAST_RELEASE_CLUSTER>(&empty_bar[s], lane);
    }
  };
  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
  // C_EARLY: pair 2j + half holds row (tile row row_in_tile + 8 half), columns 8j + 2 (lane % 4), +1
  [[maybe_unused]] CPair<CT> cpair[C_EARLY ? ACC / 2 : 1];
  if constexpr (C_EARLY) {
    if (split == 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
          const int r = m_block * BLOCK_M + row_in_tile + half * 8, col = n_block * BLOCK_N + j * 8 + (lane % 4) * 2;
          cpair[2 * j + half].v = {};
          if (r < shape_m && col < SHAPE_N)
            cpair[2 * j + half].load(c + static_cast<u64>(r) * SHAPE_N + col, SHAPE_N % 2 == 0, col + 1 < SHAPE_N);
        }
      }
    }
  }

  const int num_kb = kb_end - kb_begin;
  if constexpr (FP8) {
    constexpr int SF_K = (SHAPE_K + 127) / 128;
    float part[ACC];
    constexpr int SF_N = (SHAPE_N + 127) / 128;
    const float* sfb_row = sfb + min(n_block * BLOCK_N / 128, SF_N - 1) * SF_K;  // (a phantom CTA reads the last)
    // Lane l holds the weight scale of K block kb_begin + 32c + l of chunk c (the current chunk and the next,
    // read one chunk ahead); iteration it takes lane it % 32's with a shuffle.
    auto sfb_chunk = [&](int chunk) {
      const int kb = kb_begin + chunk * 32 + lane;
      return kb < kb_end ? __ldg(sfb_row + kb) : 0.f;
    };
    float sfb_cur = sfb_chunk(0);
    float sfb_next = sfb_chunk(1);
    for (int it = 0; it < num_kb; ++it) {
      const int s = it % STAGES;
      if (it > 0 && it % 32 == 0) {  // warp-uniform
        sfb_cur = sfb_next;
        sfb_next = sfb_chunk(it / 32 + 1);
      }
      const float sb = __shfl_sync(0xffffffffu, sfb_cur, it % 32);
      mbarrier_wait(&full_bar[s], (it / STAGES) & 1);
      wgmma_block_k128b_sync<WgmmaE4M3<BLOCK_N>, BLOCK_K / K_STEP>(part, smem_a + s * A_BYTES + wg * 64 * 128,
                                                                   smem_b + s * B_BYTES);
      // Rows past M have zero A and zero scales (TMA fill) and are never stored.
      const float s0 = smem_sfa[s * BLOCK_M + row_in_tile] * sb;
      const float s1 = smem_sfa[s * BLOCK_M + row_in_tile + 8] * sb;
      __syncwarp();
      release(s);
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) {
        acc[4 * j + 0] += part[4 * j + 0] * s0;
        acc[4 * j + 1] += part[4 * j + 1] * s0;
        acc[4 * j + 2] += part[4 * j + 2] * s1;
        acc[4 * j + 3] += part[4 * j + 3] * s1;
      }
    }
  } else {
    for (int it = 0; it < num_kb; ++it) {
      const int s = it % STAGES;
      mbarrier_wait(&full_bar[s], (it / STAGES) & 1);
      // A warpgroup's 64 rows of A start 64 x 128 bytes in: 64 K-major rows, or one MN-major atom column.
      const u64 desc_a = A_MN ? make_smem_desc_mn128b(smem_a + s * A_BYTES + wg * ATOM_BYTES, BLOCK_K)
                              : make_smem_desc_k128b(smem_a + s * A_BYTES + wg * 64 * 128);
      const u64 desc_b = B_MN ? make_smem_desc_mn128b(smem_b + s * B_BYTES, BLOCK_K) : make_smem_desc_k128b(smem_b + s * B_BYTES);
      // One K step (16 elements): 32 bytes along a K-major row, or 16 rows of 128 bytes MN-major.
      constexpr u64 kStepA = A_MN ? (K_STEP * 128) >> 4 : (K_STEP * 2) >> 4;
      constexpr u64 kStepB = B_MN ? (K_STEP * 128) >> 4 : (K_STEP * 2) >> 4;
      wgmma_fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < BLOCK_K / K_STEP; ++k)
        Mma::template ss<A_MN ? 1 : 0, B_MN ? 1 : 0>(WgBF16{}, acc, desc_a + k * kStepA, desc_b + k * kStepB, 1);
      wgmma_commit();
      wgmma_wait<kInFlight>();
      wgmma_fence_operands(acc);
      if (it >= kInFlight) {
        __syncwarp();
        release((it + STAGES - kInFlight) % STAGES);
      }
    }
    if constexpr (kInFlight) {
      wgmma_wait<0>();
      wgmma_fence_operands(acc);
      if constexpr (MCAST > 1) {  // the producers' exit drain waits for every release
        __syncwarp();
        release((num_kb - 1) % STAGES);
      }
    }
  }

  // ---------------------------------------------------------------- epilogue
  const int n0 = n_block * BLOCK_N;
  if (MCAST > 1 && n0 >= SHAPE_N) return;  // a phantom CTA (odd n-block count): nothing to write
  const int r0 = m_block * BLOCK_M + row_in_tile;
  constexpr bool kEvenN = SHAPE_N % 2 == 0;
  if constexpr (C_EARLY) {
    if (split == 0) {
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float2 cv = cpair[2 * j + half].get();
          acc[4 * j + 2 * half] += cv.x;
          acc[4 * j + 2 * half + 1] += cv.y;
        }
      }
    }
  }
  const u64 split_stride = static_cast<u64>(shape_m) * SHAPE_N;
  if constexpr (CLUSTER_REDUCE) {
    // The splits of a tile are one cluster: each CTA leaves its fp32 partial tile in its own shared memory
    // (over the drained ring), and CTA r sums slice r of the tile over all splits in split order
    // (deterministic) through distributed shared memory, adds C and writes D: no workspace, no counters.
    named_barrier_sync(1, NUM_MATH_THREADS);  // every warpgroup's wgmmas are done with the ring
    float* red = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j)
        *reinterpret_cast<float2*>(red + (row_in_tile + half * 8) * RED_STRIDE + j * 8 + (lane % 4) * 2) =
            make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
    }
    __syncwarp();
    cluster_sync();
    const u32 rank = cluster_ctarank();
    constexpr int G = BLOCK_N / 4;  // float4 groups per row
    const int m0 = m_block * BLOCK_M;
    const int rows = min(BLOCK_M, shape_m - m0);
    const int all = rows * G;
    const int per = (all + SPLITS - 1) / SPLITS;
    const int first = min(all, static_cast<int>(rank) * per);
    const int last = min(all, first + per);
    constexpr bool kVec = SHAPE_N % 4 == 0;
    u32 peer[SPLITS];
#pragma unroll
    for (int sp = 0; sp < SPLITS; ++sp) peer[sp] = mapa_shared(red, sp);
    for (int i = first + tid; i < last; i += NUM_MATH_THREADS) {
      const int r = i / G, g = i % G;
      const int col = n0 + g * 4;
      if (col >= SHAPE_N) continue;
      const u32 off = static_cast<u32>((r * RED_STRIDE + g * 4) * 4);
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);  // 0 + split 0 + split 1 ...: the other reductions' exact sums
#pragma unroll
      for (int sp = 0; sp < SPLITS; ++sp) {
        const float4 t = ld_shared_cluster_f4(peer[sp] + off);
        v.x += t.x, v.y += t.y, v.z += t.z, v.w += t.w;
      }
      float x[4] = {v.x, v.y, v.z, v.w};
      const u64 goff = static_cast<u64>(m0 + r) * SHAPE_N + col;
      if constexpr (kReduceC) {
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (kVec || col + u < SHAPE_N) x[u] += to_float(c[goff + u]);
      }
      if (kVec) {
        store_pair(d + goff, x[0], x[1], true, true);
        store_pair(d + goff + 2, x[2], x[3], true, true);
      } else {
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (col + u < SHAPE_N) store_pair(d + goff + u, x[u], 0.f, false, false);
      }
    }
    __syncwarp();
    cluster_sync();  // no CTA leaves while a peer still reads its shared memory
    return;
  }
  if constexpr (SPLITS > 1) {
    float* mine = ws + split * split_stride;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + half * 8;
      if (r >= shape_m) continue;
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) {
        const int col = n0 + j * 8 + (lane % 4) * 2;
        if (col >= SHAPE_N) continue;
        float* p = mine + static_cast<u64>(r) * SHAPE_N + col;
        if (kEvenN) {
          __stcg(reinterpret_cast<float2*>(p), make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]));
        } else {
          __stcg(p, acc[4 * j + 2 * half]);
          if (col + 1 < SHAPE_N) __stcg(p + 1, acc[4 * j + 2 * half + 1]);
        }
      }
    }
    __threadfence();  // our partial is visible device-wide before the counter says so
    named_barrier_sync(1, NUM_MATH_THREADS);
    int* counter = counters + m_block * gridDim.x + n_block;
    [[maybe_unused]] int* done = counter + gridDim.x * gridDim.y;
    if constexpr (PAR_REDUCE) {
      // Every split waits for the tile's other splits (the grid is one co-resident wave: the host checks it),
      // then reduces its own slice of the tile.
      if (tid == 0) {
        atomicAdd(counter, 1);
        while (ld_acquire_gpu(counter) < SPLITS) __nanosleep(32);
      }
      named_barrier_sync(1, NUM_MATH_THREADS);
    } else {
      if (tid == 0) {
        const int arrived = atomicAdd(counter, 1);
        const int last = arrived == SPLITS - 1;
        if (last) *counter = 0;  // every split has arrived: ready for the next launch
        *last_flag = last;
      }
      named_barrier_sync(1, NUM_MATH_THREADS);
      if (!*last_flag) return;
    }
    __threadfence();  // acquire side: the other splits' partials are read after their arrivals
    // The last CTA sums every split's partial (its own too: read back, the value it wrote) in split
    // order, element-parallel over all its math threads: consecutive threads take consecutive VEC-wide
    // column groups of a row (coalesced 16-byte loads of the partials and C, coalesced stores of D).
    // Each thread first issues the loads of UNROLL groups x SPLITS partials (independent, all in
    // flight together), then adds and stores, so the reduction costs a few L2 round trips however
    // few rows are valid (M = 1 has one row: the fragment layout would leave it to 4 threads).
    constexpr int VEC = SHAPE_N % 4 == 0 ? 4 : (SHAPE_N % 2 == 0 ? 2 : 1);
    constexpr int UNROLL = 4;
    const int m0 = m_block * BLOCK_M;
    const int rows = min(BLOCK_M, shape_m - m0);
    const int per_row = (min(BLOCK_N, SHAPE_N - n0) + VEC - 1) / VEC;
    const int all = rows * per_row;
    // PAR_REDUCE: split z sums elements [z * per, (z + 1) * per) of the tile; else the last CTA sums all.
    const int per = PAR_REDUCE ? (all + SPLITS - 1) / SPLITS : all;
    const int first = PAR_REDUCE ? min(all, split * per) : 0;
    const int total = min(all, first + per);
    for (int base = first + tid; base < total; base += NUM_MATH_THREADS * UNROLL) {
      float sum[UNROLL][VEC];
      [[maybe_unused]] float cv[UNROLL][VEC];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) sum[u][v] = 0.f;
        const int i = base + u * NUM_MATH_THREADS;
        if (i >= total) continue;
        const u64 off = static_cast<u64>(m0 + i / per_row) * SHAPE_N + n0 + (i % per_row) * VEC;
        // C is loaded here, with the partials and before any store of D: c may be d, so a load after a
        // store would wait for it (one HBM round trip per group instead of one for all of them).
        if constexpr (kReduceC) {
#pragma unroll
          for (int v = 0; v < VEC; ++v) cv[u][v] = to_float(c[off + v]);
        }
#pragma unroll
        for (int sp = 0; sp < SPLITS; ++sp) {
          const float* p = ws + sp * split_stride + off;
          if constexpr (VEC == 4) {
            const float4 x = __ldcg(reinterpret_cast<const float4*>(p));
            sum[u][0] += x.x, sum[u][1] += x.y, sum[u][2] += x.z, sum[u][3] += x.w;
          } else if constexpr (VEC == 2) {
            const float2 x = __ldcg(reinterpret_cast<const float2*>(p));
            sum[u][0] += x.x, sum[u][1] += x.y;
          } else {
            sum[u][0] += __ldcg(p);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = base + u * NUM_MATH_THREADS;
        if (i >= total) continue;
        const u64 off = static_cast<u64>(m0 + i / per_row) * SHAPE_N + n0 + (i % per_row) * VEC;
        if constexpr (kReduceC) {
#pragma unroll
          for (int v = 0; v < VEC; ++v) sum[u][v] += cv[u][v];
        }
#pragma unroll
        for (int v = 0; v < VEC; v += 2) {
          if constexpr (VEC == 1) {
            store_pair(d + off, sum[u][0], 0.f, false, false);
          } else {
            store_pair(d + off + v, sum[u][v], sum[u][v + 1], true, true);
          }
        }
      }
    }
    if constexpr (PAR_REDUCE) {
      // The last split out of its slice resets both counters for the next launch (every split has passed its
      // wait by then).
      named_barrier_sync(1, NUM_MATH_THREADS);
      if (tid == 0 && atomicAdd(done, 1) == SPLITS - 1) {
        *counter = 0;
        *done = 0;
      }
    }
    return;
  }

  // One split: store straight from the accumulators.
  store_acc_direct<SHAPE_N, BLOCK_N, HAS_C, false>(acc, d, c, 0, r0, shape_m, n0, lane);
}

}  // namespace deepgemm
