// FP8 GEMM with 1x128 scales on BOTH operands (DeepGEMM's (1, 1, 128) "1D1D" recipe, used for weight
// gradients) for sm_90a: D = C + A @ B^T, A [M, K] and B [N, K] e4m3 K-major, one fp32 scale per row
// and 128-wide K block for each (sfa [SK, M], sfb [SK, N], both stored MN-major with a 16-byte
// aligned stride, read by TMA).
//
// The structure is the persistent kernel's (gemm_sm90.cuh): CTAs walk output tiles in 16-wide
// n-bands; one producer thread TMA-loads A, B and both scale vectors of each K block into a
// STAGES-deep mbarrier ring; BLOCK_M / 64 math warpgroups run wgmma m64nBLOCK_Nk32 per 128-wide K
// block into a partial-sum set, then promote it: acc += part * sfa[row] * sfb[col]. Unlike the
// (1, 128, 128) recipe the weight scale changes per column, so each thread reads the scales of its
// BLOCK_N / 4 columns from shared memory (float2 pairs: a thread's columns come in adjacent pairs).
//
// M and K are runtime arguments (K-grouped weight gradients launch this kernel once per group with
// that group's K and scale offset, so every group shares one compiled kernel); N is compiled in.
// `sf_k_offset` is the first scale row (K block) of this GEMM inside sfa / sfb, which lets a
// k-grouped call pass the whole [sum SK, M] scale tensors. Tiles past M or N are zero-filled by TMA;
// the epilogue stores straight from registers, bounds-checked.
#pragma once
#include <tilehal/tilehal.cuh>
#include <tilehal/mbarrier.cuh>
#include <tilehal/tma.cuh>
#include <tilehal/wgmma.cuh>

namespace deepgemm {
using namespace tilehal;

template <int NUM_MATH_WG> constexpr int k1d1dProducerRegs = 40;
template <int NUM_MATH_WG> constexpr int k1d1dMathRegs = NUM_MATH_WG == 1 ? 256 : 232;
constexpr int k1d1dBand = 16;  // n-blocks per rasterization band

template <int SHAPE_N, int BLOCK_M, int BLOCK_N, int STAGES, typename OutT, bool HAS_C>
__global__ void __launch_bounds__((BLOCK_M / 64 + 1) * 128, 1)
gemm_1d1d_sm90(const __grid_constant__ TmaDescriptor tma_a, const __grid_constant__ TmaDescriptor tma_b,
               const __grid_constant__ TmaDescriptor tma_sfa, const __grid_constant__ TmaDescriptor tma_sfb,
               OutT* d, const float* c, int shape_m, int shape_k, int sf_k_offset) {
  constexpr int BLOCK_K = 128;
  constexpr int K_STEP = 32;
  constexpr int NUM_MATH_WG = BLOCK_M / 64;
  constexpr int NUM_MATH_THREADS = NUM_MATH_WG * 128;
  constexpr int A_BYTES = BLOCK_M * 128;
  constexpr int B_BYTES = BLOCK_N * 128;
  constexpr int SFA_BYTES = BLOCK_M * 4;
  constexpr int SFB_BYTES = BLOCK_N * 4;
  constexpr int ACC = BLOCK_N / 2;
  constexpr int NUM_N_BLOCKS = (SHAPE_N + BLOCK_N - 1) / BLOCK_N;
  static_assert(BLOCK_M == 64 || BLOCK_M == 128, "one or two math warpgroups");
  static_assert(BLOCK_N % 8 == 0 && BLOCK_N <= 256, "wgmma N");
  // TMA writes the scale vectors in 16-byte units.
  static_assert(SFA_BYTES % 16 == 0 && SFB_BYTES % 16 == 0, "scale tiles");
  using Mma = WgmmaE4M3<BLOCK_N>;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* smem_a = smem;
  unsigned char* smem_b = smem_a + STAGES * A_BYTES;
  float* smem_sfa = reinterpret_cast<float*>(smem_b + STAGES * B_BYTES);
  float* smem_sfb = smem_sfa + STAGES * BLOCK_M;
  u64* full_bar = reinterpret_cast<u64*>(smem_sfb + STAGES * BLOCK_N);
  u64* empty_bar = full_bar + STAGES;

  const int tid = threadIdx.x;
  const int num_k_blocks = (shape_k + BLOCK_K - 1) / BLOCK_K;
  const int num_m_blocks = (shape_m + BLOCK_M - 1) / BLOCK_M;
  const int num_tiles = num_m_blocks * NUM_N_BLOCKS;

  if (tid == NUM_MATH_THREADS) {
    tma_prefetch_descriptor(&tma_a);
    tma_prefetch_descriptor(&tma_b);
    tma_prefetch_descriptor(&tma_sfa);
    tma_prefetch_descriptor(&tma_sfb);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(&full_bar[s], 1);
      mbarrier_init(&empty_bar[s], NUM_MATH_WG * 4);
    }
    fence_barrier_init();
  }
  __syncthreads();

  // Tile t -> (m_block, n_block): bands of k1d1dBand n-blocks, m-blocks walked inside a band, so the
  // CTAs running together share B panels (and A panels) in L2.
  auto tile_coords = [&](int t, int& m_block, int& n_block) {
    band_tile_coords<k1d1dBand, NUM_N_BLOCKS>(t, num_m_blocks, m_block, n_block);
  };

  if (tid >= NUM_MATH_THREADS) {
    // ---------------------------------------------------------------- producer warpgroup
    setmaxnreg_dec<k1d1dProducerRegs<NUM_MATH_WG>>();
    if (tid != NUM_MATH_THREADS) return;
    u32 it = 0;
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      int m_block, n_block;
      tile_coords(t, m_block, n_block);
      for (int kb = 0; kb < num_k_blocks; ++kb, ++it) {
        const int s = it % STAGES;
        mbarrier_wait(&empty_bar[s], ((it / STAGES) & 1) ^ 1);
        mbarrier_arrive_expect_tx(&full_bar[s], A_BYTES + B_BYTES + SFA_BYTES + SFB_BYTES);
        tma_load_2d(smem_a + s * A_BYTES, &tma_a, &full_bar[s], kb * BLOCK_K, m_block * BLOCK_M);
        tma_load_2d(smem_b + s * B_BYTES, &tma_b, &full_bar[s], kb * BLOCK_K, n_block * BLOCK_N);
        tma_load_2d(smem_sfa + s * BLOCK_M, &tma_sfa, &full_bar[s], m_block * BLOCK_M, sf_k_offset + kb);
        tma_load_2d(smem_sfb + s * BLOCK_N, &tma_sfb, &full_bar[s], n_block * BLOCK_N, sf_k_offset + kb);
      }
    }
    return;
  }

  // ------------------------------------------------------------------ math warpgroups
  setmaxnreg_inc<k1d1dMathRegs<NUM_MATH_WG>>();
  const int wg = tid / 128;
  const int warp = (tid % 128) / 32;
  const int lane = tid % 32;
  const int row_in_tile = wg * 64 + warp * 16 + lane / 4;  // and +8
  const int col_in_chunk = (lane % 4) * 2;                  // + 8j, and +1
  float acc[ACC];
  float part[ACC];
  u32 it = 0;

  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    int m_block, n_block;
    tile_coords(t, m_block, n_block);
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;

    for (int kb = 0; kb < num_k_blocks; ++kb, ++it) {
      const int s = it % STAGES;
      mbarrier_wait(&full_bar[s], (it / STAGES) & 1);
      wgmma_block_k128b_sync<Mma, BLOCK_K / K_STEP>(part, smem_a + s * A_BYTES + wg * 64 * 128, smem_b + s * B_BYTES);
      const float sa0 = smem_sfa[s * BLOCK_M + row_in_tile];
      const float sa1 = smem_sfa[s * BLOCK_M + row_in_tile + 8];
      const float* sfb_s = smem_sfb + s * BLOCK_N + col_in_chunk;
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) {
        const float2 sb = *reinterpret_cast<const float2*>(sfb_s + j * 8);
        acc[4 * j + 0] += part[4 * j + 0] * (sa0 * sb.x);
        acc[4 * j + 1] += part[4 * j + 1] * (sa0 * sb.y);
        acc[4 * j + 2] += part[4 * j + 2] * (sa1 * sb.x);
        acc[4 * j + 3] += part[4 * j + 3] * (sa1 * sb.y);
      }
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&empty_bar[s]);  // scales and tiles of this stage are read
    }

    // ---------------------------------------------------------------- epilogue (direct, bounds-checked)
    store_acc_direct<SHAPE_N, BLOCK_N, HAS_C, true>(acc, d, c, 0, m_block * BLOCK_M + row_in_tile, shape_m,
                                                 n_block * BLOCK_N, lane);
  }
}

}  // namespace deepgemm
