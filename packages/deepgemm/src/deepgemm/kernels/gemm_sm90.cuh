// DeepGEMM-style persistent, warp-specialized GEMM for sm_90a: D = C + A @ B^T.
//
// One CTA per SM walks output tiles (BLOCK_M x BLOCK_N) in a swizzled order. Warpgroup
// NUM_MATH_WG (the last) is the producer: one thread issues TMA loads of A, B (and the fp8
// activation scales) into a STAGES-deep ring of shared-memory buffers guarded by mbarriers
// ("full": data landed, "empty": consumers are done). Warpgroups 0..NUM_MATH_WG-1 each own 64 rows
// of the tile and run wgmma on it. For fp8, each 128-wide K block is accumulated on its own and
// then promoted into the fp32 total with its scales (sfa per row x sfb per 128 columns), which is
// DeepGEMM's answer to fp8 wgmma's limited accumulation precision. Epilogue: with TMA_STORE the
// tile is staged in shared memory and written by one asynchronous TMA store (bounds-checked by the
// descriptor), so the math warps start the next tile while it drains; otherwise (fp32 output, C,
// masked groups, N not 8-aligned) threads store straight from the accumulators, bounds-checked.
// K is zero-padded by TMA either way.
#pragma once
#include <tilehal/tilehal.cuh>
#include <tilehal/mbarrier.cuh>
#include <tilehal/tma.cuh>
#include <tilehal/wgmma.cuh>

namespace deepgemm {
using namespace tilehal;

enum GemmKind : int { kNormal = 0, kGroupedContiguous = 1, kGroupedMasked = 2 };

constexpr int kSwizzleGroupN = 16;  // n-blocks per rasterization band: neighbours share A and B in L2
constexpr int kProducerRegs = 40;
constexpr int kMathRegs = 232;

// Which output tile a CTA does next. Producer and consumers run identical copies.
template <int KIND, int SHAPE_N, int BLOCK_M, int BLOCK_N, int NUM_GROUPS>
struct TileScheduler {
  static constexpr int kNumNBlocks = (SHAPE_N + BLOCK_N - 1) / BLOCK_N;
  int shape_m;
  const int* group_info;  // m_indices (contiguous) or masked_m (masked)
  int next_tile;

  TILEHAL_DEVICE TileScheduler(int m, const int* info) : shape_m(m), group_info(info), next_tile(blockIdx.x) {}

  static TILEHAL_DEVICE void rasterize(int tile, int num_m_blocks, int& m_block, int& n_block) {
    const int per_band = num_m_blocks * kSwizzleGroupN;
    const int band = tile / per_band;
    const int first_n = band * kSwizzleGroupN;
    const int n_in_band = min(kSwizzleGroupN, kNumNBlocks - first_n);
    const int in_band = tile - band * per_band;
    m_block = in_band / n_in_band;
    n_block = first_n + in_band % n_in_band;
  }

  TILEHAL_DEVICE bool next(int& m_block, int& n_block, int& group) {
    if constexpr (KIND == kGroupedMasked) {
      int tile = next_tile;
      next_tile += gridDim.x;
      for (int g = 0; g < NUM_GROUPS; ++g) {
        const int rows = min(max(__ldg(group_info + g), 0), shape_m);
        const int m_blocks = (rows + BLOCK_M - 1) / BLOCK_M;
        const int tiles = m_blocks * kNumNBlocks;
        if (tile < tiles) {
          rasterize(tile, m_blocks, m_block, n_block);
          group = g;
          return true;
        }
        tile -= tiles;
      }
      return false;
    } else {
      const int num_m_blocks = (shape_m + BLOCK_M - 1) / BLOCK_M;
      while (true) {
        const int tile = next_tile;
        next_tile += gridDim.x;
        if (tile >= num_m_blocks * kNumNBlocks) return false;
        rasterize(tile, num_m_blocks, m_block, n_block);
        group = 0;
        if constexpr (KIND == kGroupedContiguous) {
          // Experts start on BLOCK_M boundaries, so a block's first row names its expert;
          // a negative (padding) or out-of-range index skips the whole block.
          group = __ldg(group_info + m_block * BLOCK_M);
          if (group < 0 || group >= NUM_GROUPS) continue;
        }
        return true;
      }
    }
  }
};

// std::conditional without <type_traits> (NVRTC ships no C++ standard library).
template <bool C, typename T, typename F> struct Select { using type = T; };
template <typename T, typename F> struct Select<false, T, F> { using type = F; };

template <typename OutT>
TILEHAL_DEVICE void store_pair(OutT* p, float x, float y, bool both, bool aligned) {
  if constexpr (sizeof(OutT) == 2) {
    if (both && aligned) {
      *reinterpret_cast<unsigned*>(p) = float2_to_bf16x2(x, y);
    } else {
      p[0] = __float2bfloat16_rn(x);
      if (both) p[1] = __float2bfloat16_rn(y);
    }
  } else {
    if (both && aligned) {
      *reinterpret_cast<float2*>(p) = make_float2(x, y);
    } else {
      p[0] = x;
      if (both) p[1] = y;
    }
  }
}

// bar.sync on a named barrier among `count` threads (id 0 is __syncthreads's).
TILEHAL_DEVICE void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

template <int SHAPE_N, int SHAPE_K, int BLOCK_M, int BLOCK_N, int STAGES, int KIND, int NUM_GROUPS, bool FP8,
          typename OutT, bool HAS_C, bool TMA_STORE>
__global__ void __launch_bounds__((BLOCK_M / 64 + 1) * 128, 1)
gemm_sm90(const __grid_constant__ TmaDescriptor tma_a, const __grid_constant__ TmaDescriptor tma_b,
          const __grid_constant__ TmaDescriptor tma_sfa, const __grid_constant__ TmaDescriptor tma_d,
          const float* __restrict__ sfb, OutT* d, const float* c,
          const int* __restrict__ group_info, int shape_m) {
  constexpr int BLOCK_K = FP8 ? 128 : 64;  // one 128-byte swizzle row either way
  constexpr int K_STEP = FP8 ? 32 : 16;    // K per wgmma instruction (32 bytes)
  constexpr int NUM_K_BLOCKS = (SHAPE_K + BLOCK_K - 1) / BLOCK_K;
  constexpr int NUM_MATH_WG = BLOCK_M / 64;
  constexpr int NUM_MATH_THREADS = NUM_MATH_WG * 128;
  constexpr int SF_K = (SHAPE_K + 127) / 128;
  constexpr int SF_N = (SHAPE_N + 127) / 128;
  constexpr int A_BYTES = BLOCK_M * 128;
  constexpr int B_BYTES = BLOCK_N * 128;
  constexpr int SFA_BYTES = FP8 ? BLOCK_M * 4 : 0;
  constexpr int ACC = BLOCK_N / 2;
  static_assert(BLOCK_M == 64 || BLOCK_M == 128, "one or two math warpgroups");
  static_assert(BLOCK_N % 8 == 0 && BLOCK_N <= 256, "wgmma N");
  static_assert(!FP8 || BLOCK_N <= 128 + ((BLOCK_N & -BLOCK_N) < 128 ? (BLOCK_N & -BLOCK_N) : 128),
                "an fp8 tile may span at most two 128-wide scale blocks of B");
  using Mma = typename Select<FP8, WgmmaE4M3<BLOCK_N>, WgmmaBF16<BLOCK_N>>::type;

  extern __shared__ unsigned char smem_raw[];
  // Swizzled tiles need 1024-byte aligned bases (the host reserves the slack).
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* smem_a = smem;
  unsigned char* smem_b = smem_a + STAGES * A_BYTES;
  float* smem_sfa = reinterpret_cast<float*>(smem_b + STAGES * B_BYTES);
  OutT* smem_d = reinterpret_cast<OutT*>(reinterpret_cast<unsigned char*>(smem_sfa) + STAGES * SFA_BYTES);
  constexpr int D_BYTES = TMA_STORE ? BLOCK_M * BLOCK_N * static_cast<int>(sizeof(OutT)) : 0;
  static_assert(!TMA_STORE || (KIND != kGroupedMasked && !HAS_C), "TMA store would write rows/values it must not");
  u64* full_bar = reinterpret_cast<u64*>(reinterpret_cast<unsigned char*>(smem_d) + D_BYTES);
  u64* empty_bar = full_bar + STAGES;

  const int tid = threadIdx.x;
  if (tid == NUM_MATH_THREADS) {
    tma_prefetch_descriptor(&tma_a);
    tma_prefetch_descriptor(&tma_b);
    if constexpr (FP8) tma_prefetch_descriptor(&tma_sfa);
    if constexpr (TMA_STORE) tma_prefetch_descriptor(&tma_d);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(&full_bar[s], 1);
      mbarrier_init(&empty_bar[s], NUM_MATH_WG * 4);  // lane 0 of every math warp
    }
    fence_barrier_init();
  }
  __syncthreads();

  TileScheduler<KIND, SHAPE_N, BLOCK_M, BLOCK_N, NUM_GROUPS> sched(shape_m, group_info);
  int m_block, n_block, group;

  if (tid >= NUM_MATH_THREADS) {
    // ---------------------------------------------------------------- producer warpgroup
    setmaxnreg_dec<kProducerRegs>();
    if (tid != NUM_MATH_THREADS) return;
    u32 it = 0;
    while (sched.next(m_block, n_block, group)) {
      const int a_row = m_block * BLOCK_M + (KIND == kGroupedMasked ? group * shape_m : 0);
      const int b_row = n_block * BLOCK_N + (KIND == kNormal ? 0 : group * SHAPE_N);
      for (int kb = 0; kb < NUM_K_BLOCKS; ++kb, ++it) {
        const int s = it % STAGES;
        mbarrier_wait(&empty_bar[s], ((it / STAGES) & 1) ^ 1);
        mbarrier_arrive_expect_tx(&full_bar[s], A_BYTES + B_BYTES + SFA_BYTES);
        tma_load_2d(smem_a + s * A_BYTES, &tma_a, &full_bar[s], kb * BLOCK_K, a_row);
        tma_load_2d(smem_b + s * B_BYTES, &tma_b, &full_bar[s], kb * BLOCK_K, b_row);
        if constexpr (FP8) {
          const int sf_row = kb + (KIND == kGroupedMasked ? group * SF_K : 0);
          tma_load_2d(smem_sfa + s * BLOCK_M, &tma_sfa, &full_bar[s], m_block * BLOCK_M, sf_row);
        }
      }
    }
    return;
  }

  // ------------------------------------------------------------------ math warpgroups
  setmaxnreg_inc<kMathRegs>();
  const int wg = tid / 128;
  const int warp = (tid % 128) / 32;
  const int lane = tid % 32;
  const int row_in_tile = wg * 64 + warp * 16 + lane / 4;  // and +8
  float acc[ACC];
  float part[FP8 ? ACC : 1];
  u32 it = 0;

  while (sched.next(m_block, n_block, group)) {
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
    const int n0 = n_block * BLOCK_N;
    const float* sfb_row = sfb + (group * SF_N + n0 / 128) * SF_K;
    const bool has_second_sf = n0 / 128 + 1 < SF_N;
    const int n_off = n0 % 128;

    for (int kb = 0; kb < NUM_K_BLOCKS; ++kb, ++it) {
      const int s = it % STAGES;
      float sb0 = 0.f, sb1 = 0.f;
      if constexpr (FP8) {  // issued before the wait so the load latency hides behind it
        sb0 = __ldg(sfb_row + kb);
        sb1 = has_second_sf ? __ldg(sfb_row + SF_K + kb) : sb0;
      }
      mbarrier_wait(&full_bar[s], (it / STAGES) & 1);

      const u64 desc_a = make_smem_desc_k128b(smem_a + s * A_BYTES + wg * 64 * 128);
      const u64 desc_b = make_smem_desc_k128b(smem_b + s * B_BYTES);
      if constexpr (FP8) {
        wgmma_fence_operands(part);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BLOCK_K / K_STEP; ++k) Mma::mma(part, desc_a + k * 2, desc_b + k * 2, k > 0);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(part);
        const float sa0 = smem_sfa[s * BLOCK_M + row_in_tile];
        const float sa1 = smem_sfa[s * BLOCK_M + row_in_tile + 8];
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&empty_bar[s]);
        // Promote this K block: acc += part * sfa[row] * sfb[column block].
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
          const float sb = (n_off + j * 8 >= 128) ? sb1 : sb0;
          const float s0 = sa0 * sb, s1 = sa1 * sb;
          acc[4 * j + 0] += part[4 * j + 0] * s0;
          acc[4 * j + 1] += part[4 * j + 1] * s0;
          acc[4 * j + 2] += part[4 * j + 2] * s1;
          acc[4 * j + 3] += part[4 * j + 3] * s1;
        }
      } else {
        wgmma_fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BLOCK_K / K_STEP; ++k) Mma::mma(acc, desc_a + k * 2, desc_b + k * 2, 1);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(acc);
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&empty_bar[s]);
      }
    }

    // ---------------------------------------------------------------- epilogue
    if constexpr (TMA_STORE) {
      // The previous tile's store must have finished reading smem_d before it is overwritten.
      if (tid == 0) tma_store_wait_read<0>();
      named_barrier_sync(1, NUM_MATH_THREADS);
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) {
        const int col = j * 8 + (lane % 4) * 2;
        store_pair(smem_d + row_in_tile * BLOCK_N + col, acc[4 * j + 0], acc[4 * j + 1], true, true);
        store_pair(smem_d + (row_in_tile + 8) * BLOCK_N + col, acc[4 * j + 2], acc[4 * j + 3], true, true);
      }
      fence_proxy_async_shared();  // make these generic-proxy writes visible to the TMA engine
      named_barrier_sync(1, NUM_MATH_THREADS);
      if (tid == 0) {
        tma_store_2d(&tma_d, smem_d, n0, m_block * BLOCK_M);
        tma_store_commit();
      }
      continue;
    }
    int row_limit = shape_m;
    u64 row_base = 0;
    if constexpr (KIND == kGroupedMasked) {
      row_limit = min(max(__ldg(group_info + group), 0), shape_m);
      row_base = static_cast<u64>(group) * shape_m;
    }
    const int r0 = m_block * BLOCK_M + row_in_tile;
    constexpr bool kEvenN = SHAPE_N % 2 == 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + half * 8;
      if (r >= row_limit) continue;
      const u64 row_off = (row_base + r) * static_cast<u64>(SHAPE_N);
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) {
        const int col = n0 + j * 8 + (lane % 4) * 2;
        if (col >= SHAPE_N) continue;
        const bool both = col + 1 < SHAPE_N;
        float x = acc[4 * j + 2 * half], y = acc[4 * j + 2 * half + 1];
        if constexpr (HAS_C) {
          const float* cp = c + row_off + col;
          if (both && kEvenN) {
            const float2 cv = *reinterpret_cast<const float2*>(cp);
            x += cv.x, y += cv.y;
          } else {
            x += cp[0];
            if (both) y += cp[1];
          }
        }
        store_pair(d + row_off + col, x, y, both, kEvenN);
      }
    }
  }
  if constexpr (TMA_STORE) {
    if (tid == 0) tma_store_wait<0>();  // shared memory must outlive the last store
  }
}

}  // namespace deepgemm
