// Sparse paged decode built for latency: every selected block's K/V rows in flight before any math.
//
// Contract, grid and split partials: paged_decode_common.cuh (a CTA owns one (sequence, kv head) and
// a contiguous share of its selected blocks). Why a second tensor-core kernel: at issue 15's step
// (64 scattered blocks of 16 tokens per (sequence, kv head)) the mma kernel
// (paged_decode_mma.cuh) stages its block list through shared memory behind a CTA barrier and then
// walks each warp's 16-token steps through a 2-ahead cp.async pipeline, so a warp waits for one
// DRAM (and page-walk) latency after another, with 2 CTAs per SM (its 100 KB of stages and table).
// Here the host gives each CTA only kGatherWarps * BPW steps (one "round"; more rounds only when the
// split count is capped), and each warp:
//   1. resolves the physical row of each of its BPW * 16 tokens in one lane each (selected block ->
//      block table -> row; no shared table, no CTA barrier),
//   2. issues the cp.async of all its K and V rows at once (BPW steps of 16 tokens, 8 KB each at
//      d128) and waits once,
//   3. runs the mma kernel's per-step math (QK^T and P V on m16n8k16, the GQA group's q heads as the
//      MMA rows, online softmax in registers) over the BPW landed steps.
// Shared memory is only the landed steps (BPW = 2: 64 KB a CTA at d128; 3 CTAs per SM, <= 168 registers;
// d256: 2 CTAs, BPW 1 only: BPW 2 spills), so an SM holds ~190 KB of K/V requests at once. Split partials merge in the last split CTA (tickets,
// combine_if_last) or by paged_decode_combine, as the host says. Any block_size (row lookup by
// division); the q heads of one kv head share every K/V tile.
#pragma once
#include "paged_decode_mma.cuh"  // mma_decode_step, merge_warps_and_store

namespace kvpool {

constexpr int kGatherWarps = kThreads / 32;  // cuda_decode.GATHER_WARPS
constexpr int kGatherStepTokens = 16;        // tokens per warp step (one MMA k-step of P V)

template <typename T, int D, int BPW>
struct DecodeSmemGather {
  static constexpr int kRowBytes = D * int(sizeof(T));
  static constexpr int kStepBytes = kGatherStepTokens * kRowBytes;  // K (or V) of one step
  static constexpr int kWarpBytes = 2 * BPW * kStepBytes;           // K steps then V steps
  static constexpr int kBytes = kGatherWarps * kWarpBytes;
};

// Physical token row of CTA-local token t of a share (-1: past the share, a hole, an out-of-range
// selection, or a position past the sequence), as stage_block + the mma kernel's row_of, any block size.
__device__ __forceinline__ int gather_row(const DecodeShare& s, int t, int block_size) {
  const int i = t / block_size, off = t - i * block_size;
  if (i >= s.n_items) return -1;
  const int lb = s.idx ? __ldg(s.idx + s.item0 + i) : s.item0 + i;
  if (lb < 0 || lb >= s.seq_blocks || off >= s.seq_len - lb * block_size) return -1;
  const int phys = __ldg(s.table + lb);
  return phys >= 0 ? phys * block_size + off : -1;
}

template <typename T, int D, int G, int BPW>
__global__ void __launch_bounds__(kThreads, D >= 256 ? 2 : 3) paged_decode_gather_kernel(
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_table, int table_stride, const int* __restrict__ seq_lens,
    const int* __restrict__ block_idx, int idx_b_stride, int idx_h_stride, int num_idx,
    T* __restrict__ out, float* __restrict__ o_part, float* __restrict__ ml_part,
    float scale_log2, int block_size, unsigned* __restrict__ tickets) {
  using S = DecodeSmemGather<T, D, BPW>;
  constexpr int kChunks = D / 8;                              // 16-byte chunks per K/V row
  constexpr int kKSteps = D / 16;                             // QK k-steps over the head dim
  constexpr int kNTiles = D / 8;                              // P V n-tiles over the head dim
  constexpr int kLoads = kGatherStepTokens * kChunks / 32;    // cp.async per lane per step, K and V each
  constexpr int kRoundTokens = BPW * kGatherStepTokens;       // tokens of one warp round (<= 32: one per lane)
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  static_assert(G >= 1 && G <= 8, "q heads per kv head must fit the MMA's 8 live rows");
  static_assert(BPW == 1 || BPW == 2, "a warp round holds one row per lane");
  static_assert(D < 256 || BPW == 1, "d256 with BPW 2 spills (host: gather_bpw)");
  static_assert(kGatherWarps * 8 * (D + 2) * 4 <= S::kBytes, "warp merge must fit the landed steps");

  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* wbase = smem + warp * S::kWarpBytes;
  const unsigned wbase_s = static_cast<unsigned>(__cvta_generic_to_shared(wbase));

  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int H = gridDim.y, splits = gridDim.x;
  const DecodeShare share = decode_share(seq_lens, block_table, table_stride, block_idx, idx_b_stride, idx_h_stride,
                                         num_idx, block_size);
  const int num_tokens = share.n_items * block_size;
  const int num_steps = (num_tokens + kGatherStepTokens - 1) / kGatherStepTokens;
  const int rounds = (num_steps + kGatherWarps * BPW - 1) / (kGatherWarps * BPW);
  const long long row_stride = (long long)H * D;

  unsigned qa[kKSteps][2];
  load_q_operand<T, D, G>(q, b, h, H, lane, qa);
  float o[kNTiles][4];
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;  // row lane/4; l_run is this lane's share of the row sum

  for (int r = 0; r < rounds; ++r) {
    const int step0 = (r * kGatherWarps + warp) * BPW;  // this warp's first step of the round
    const int t_base = step0 * kGatherStepTokens;
    // 1. one token's physical row per lane (lanes past the round: none)
    const int my_row = lane < kRoundTokens ? gather_row(share, t_base + lane, block_size) : -1;
    __syncwarp();  // the previous round's ldmatrix reads are done before its steps are overwritten
    // 2. every K and V row of the round requested at once
#pragma unroll
    for (int j = 0; j < BPW; ++j) {
      unsigned char* ks = wbase + j * S::kStepBytes;
      unsigned char* vs = wbase + (BPW + j) * S::kStepBytes;
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int c = lane + 32 * i, rr = c / kChunks, col = c % kChunks;
        const int row = __shfl_sync(0xffffffffu, my_row, (j * kGatherStepTokens + rr) & 31);
        const long long off = row < 0 ? 0 : (long long)row * row_stride + (long long)h * D + col * 8;
        const int soff = rr * S::kRowBytes + ((col ^ (rr & 7)) << 4);
        tilehal::cp_async_16(ks + soff, k_cache + off, row >= 0);
        tilehal::cp_async_16(vs + soff, v_cache + off, row >= 0);
      }
    }
    tilehal::cp_async_commit();
    tilehal::cp_async_wait<0>();
    __syncwarp();  // the other lanes' copies are visible
    // 3. the math of each landed step (the mma kernel's)
#pragma unroll
    for (int j = 0; j < BPW; ++j) {
      if (step0 + j >= num_steps) break;  // warp-uniform
      mma_decode_step<T, D>(qa, o, m_run, l_run, wbase_s + j * S::kStepBytes, wbase_s + (BPW + j) * S::kStepBytes,
                            [&](int t) { return __shfl_sync(0xffffffffu, my_row, (j * kGatherStepTokens + t) & 31) >= 0; },
                            scale_log2, lane);
    }
  }
  merge_warps_and_store<T, D, G, kGatherWarps>(smem, o, m_run, l_run, out, o_part, ml_part, b, h, H, split, splits);
  if (splits > 1 && tickets != nullptr) combine_if_last<T, D>(o_part, ml_part, out, tickets, b, h, H, G, splits);
}

}  // namespace kvpool
