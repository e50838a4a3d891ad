// Paged decode on tensor cores (mma.sync m16n8k16) with per-warp pipelines.
//
// Contract, grid and split partials: paged_decode_common.cuh. Why a second kernel: the SIMT
// kernel (paged_decode_simt.cuh) spends ~4000 warp instructions per 64-token tile on CUDA-core
// dot products, conversions and three CTA barriers, which at 4 KB of K/V per token-row group is
// close to the SM's issue rate at 4 TB/s. Here the GQA group's q heads are the M rows of an
// m16n8k16 MMA (rows >= G are zero padding; the tensor cores have throughput to spare), so a
// 16-token step costs ~32 MMAs + 16 ldmatrix per warp, and the FlashAttention-2 trick feeds the
// probabilities straight from the QK accumulators into the P@V MMA as the A operand (no
// shared-memory round trip).
//
// Work split: 4 warps per CTA, each with its own STAGES-deep cp.async pipeline over its own
// 16-token steps (warp w takes steps w, w+4, ...), its own online-softmax state and its own
// accumulators, so the main loop has no CTA barrier at all, only __syncwarp. Shared tiles
// are XOR-swizzled in 16-byte chunks (chunk ^ (row & 7)) so ldmatrix reads are conflict free.
// The warps' partial (m, l, O) merge once through shared memory at the end. The block list of
// the CTA's share (physical id, valid tokens) is staged in shared memory once.
// Requires a power-of-two block_size (host checks).
#pragma once
#include "paged_decode_common.cuh"

namespace kvpool {

constexpr int kMmaWarps = kThreads / 32;  // cuda_decode.MMA_WARPS
constexpr int kMmaStepTokens = 16;  // tokens per warp step: one MMA k-step of P @ V (cuda_decode.MMA_STEP)
constexpr int kMmaMaxItems = 512;   // blocks one CTA may own; the host picks splits accordingly (MMA_MAX_ITEMS)
constexpr int kPrefetchTokens = 2048;  // largest share whose K/V lines prefetch_l2 requests up front

template <typename T, int D, int STAGES>
struct DecodeSmemMma {
  static constexpr int kRowBytes = D * int(sizeof(T));
  static constexpr int kStepBytes = kMmaStepTokens * kRowBytes;  // K (or V) of one warp step
  static constexpr int kWarpBytes = 2 * STAGES * kStepBytes;    // K stages then V stages
  static constexpr int kBytes = kMmaWarps * kWarpBytes + 2 * kMmaMaxItems * 4;
};

// One m16n8k16 MMA whose A rows 8..15 are zero padding (only a0, a2 live: rows < 8 hold the
// GQA group's q heads).
template <typename T>
__device__ __forceinline__ void mma_rows8(float (&c)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
  tilehal::mma_m16n8k16(typename tilehal::MmaTag<T>::type(), c, {a0, 0u, a2, 0u}, {b0, b1});
}

// Q of (sequence b, kv head h)'s G q heads as the MMA A operand: this lane holds row (q head) lane/4,
// columns (lane%4)*2 + {0,1} and +8 of every 16-wide k-step; rows >= G are zero.
template <typename T, int D, int G>
__device__ __forceinline__ void load_q_operand(const T* __restrict__ q, int b, int h, int H, int lane,
                                               unsigned (&qa)[D / 16][2]) {
  const int qrow = lane >> 2, qcol = (lane & 3) * 2;
  const T* qp = q + ((long long)b * H * G + h * G + min(qrow, G - 1)) * D;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    qa[kk][0] = qrow < G ? *reinterpret_cast<const unsigned*>(qp + kk * 16 + qcol) : 0u;
    qa[kk][1] = qrow < G ? *reinterpret_cast<const unsigned*>(qp + kk * 16 + 8 + qcol) : 0u;
  }
}

// One 16-token step of a warp on landed K / V tiles (16 rows of D, 16-byte chunks XOR-swizzled by
// row & 7, at shared addresses ks / vs): S = Q K^T on two n-tiles of 8 tokens, the online softmax of
// row lane/4 over this lane's 4 tokens (step token n*8 + (lane%4)*2 + e; valid(token) says whether it
// counts, asked after the QK MMAs; the row's other 12 tokens live in the lanes xor 1, 2), and O += P V with P taken straight from the QK
// accumulators as the A operand (the FlashAttention-2 trick: no shared-memory round trip).
template <typename T, int D, typename Valid>
__device__ __forceinline__ void mma_decode_step(const unsigned (&qa)[D / 16][2], float (&o)[D / 8][4], float& m_run,
                                                float& l_run, unsigned ks, unsigned vs, Valid valid, float scale_log2,
                                                int lane) {
  using Tag = typename tilehal::MmaTag<T>::type;
  constexpr int kRowBytes = D * int(sizeof(T));
  // ldmatrix row addresses (lane supplies one row of one 8x8 matrix), before the swizzle.
  const int k_tok = (lane >> 4) * 8 + (lane & 7), k_half = (lane >> 3) & 1;  // K: non-transposed
  const int v_tok = ((lane >> 3) & 1) * 8 + (lane & 7), v_half = lane >> 4;   // V: transposed
  float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    unsigned bk[4];
    tilehal::ldmatrix_x4(bk, ks + k_tok * kRowBytes + (((2 * kk + k_half) ^ (k_tok & 7)) << 4));
    mma_rows8<T>(s[0], qa[kk][0], qa[kk][1], bk[0], bk[1]);
    mma_rows8<T>(s[1], qa[kk][0], qa[kk][1], bk[2], bk[3]);
  }
  float mx = -INFINITY;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s[n][e] = valid(n * 8 + (lane & 3) * 2 + e) ? s[n][e] * scale_log2 : -INFINITY;
      mx = fmaxf(mx, s[n][e]);
    }
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m_run, mx);
  const float base = m_new == -INFINITY ? 0.f : m_new;  // nothing valid yet: keep p at 0, not nan
  const float alpha = exp2f(m_run - base);
  m_run = m_new;
  const float p00 = exp2f(s[0][0] - base), p01 = exp2f(s[0][1] - base);
  const float p10 = exp2f(s[1][0] - base), p11 = exp2f(s[1][1] - base);
  l_run = l_run * alpha + (p00 + p01 + p10 + p11);
#pragma unroll
  for (int n = 0; n < D / 8; ++n) { o[n][0] *= alpha; o[n][1] *= alpha; }
  // The QK accumulator layout (row, token pair) is the A-operand layout of P (row, k pair).
  const unsigned pa0 = tilehal::pack2(Tag(), p00, p01), pa2 = tilehal::pack2(Tag(), p10, p11);
  // O += P V: V rows are tokens (k), columns head-dim (n); ldmatrix.trans gives B.
#pragma unroll
  for (int n = 0; n < D / 8; n += 2) {
    unsigned bv[4];
    tilehal::ldmatrix_x4_trans(bv, vs + v_tok * kRowBytes + (((n + v_half) ^ (v_tok & 7)) << 4));
    mma_rows8<T>(o[n], pa0, pa2, bv[0], bv[1]);
    mma_rows8<T>(o[n + 1], pa0, pa2, bv[2], bv[3]);
  }
}

// Merge the WARPS warps' partials (m, l, O of rows < G) through shared memory (smem: at least
// WARPS * 8 * (D + 2) floats, free: every thread past its last read of it) and store the CTA's
// output or split partial (store_channel). Every thread of the CTA calls it.
template <typename T, int D, int G, int WARPS>
__device__ __forceinline__ void merge_warps_and_store(unsigned char* smem, const float (&o)[D / 8][4], float m_run,
                                                      float l_run, T* __restrict__ out, float* __restrict__ o_part,
                                                      float* __restrict__ ml_part, int b, int h, int H, int split,
                                                      int splits) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int qrow = lane >> 2, qcol = (lane & 3) * 2;
  __syncthreads();  // every warp is done with the stages that become the merge buffer
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  float* red_o = reinterpret_cast<float*>(smem);  // [warps][8][D]
  float* red_ml = red_o + WARPS * 8 * D;            // [warps][8][2]
  if (qrow < G) {
    float* dst = red_o + (warp * 8 + qrow) * D + qcol;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      dst[n * 8] = o[n][0];
      dst[n * 8 + 1] = o[n][1];
    }
    if ((lane & 3) == 0) {
      red_ml[(warp * 8 + qrow) * 2] = m_run;
      red_ml[(warp * 8 + qrow) * 2 + 1] = l_run;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
    const int g = e / D, d = e % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, red_ml[(w * 8 + g) * 2]);
    const float base = m == -INFINITY ? 0.f : m;
    float acc = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float sc = exp2f(red_ml[(w * 8 + g) * 2] - base);
      acc += sc * red_o[(w * 8 + g) * D + d];
      l += sc * red_ml[(w * 8 + g) * 2 + 1];
    }
    const long long head = (long long)b * H * G + h * G + g;
    store_channel<T, D>(out, o_part, ml_part, head, split, splits, d, acc, m, l);
  }
}

#if defined(KVPOOL_CLUSTER_MERGE)
// KVPOOL_DECODE_COMBINE=cluster (builds with -DKVPOOL_CLUSTER_MERGE, launched as clusters of the `splits` CTAs
// of one (sequence, kv head), cluster rank = split): each CTA merges its warps as merge_warps_and_store does but
// keeps its partial (acc, m, l per q head) in its own shared memory; after a cluster barrier every CTA merges a
// 1/splits slice of the G * D channels from all the cluster's partials over distributed shared memory, in
// paged_decode_combine's order and arithmetic (the same bits), and writes the output; a second barrier keeps
// each CTA's shared memory alive until its peers have read it. No partials in global memory, no combine launch.
__device__ __forceinline__ float ld_cluster_f32(const float* local, unsigned cta) {
  const unsigned laddr = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned raddr;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(raddr) : "r"(laddr), "r"(cta));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(raddr) : "memory");
  return v;
}

__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

template <typename T, int D, int G, int WARPS>
__device__ __forceinline__ void cluster_merge_and_store(unsigned char* smem, const float (&o)[D / 8][4], float m_run,
                                                        float l_run, T* __restrict__ out, int b, int h, int H,
                                                        int split, int splits) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int qrow = lane >> 2, qcol = (lane & 3) * 2;
  __syncthreads();  // every warp is done with the stages that become the merge buffer
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  float* red_o = reinterpret_cast<float*>(smem);  // [warps][8][D]
  float* red_ml = red_o + WARPS * 8 * D;            // [warps][8][2]
  float* part_o = red_ml + WARPS * 16;              // [G][D]: this CTA's partial, read by the cluster
  float* part_ml = part_o + G * D;                  // [G][2]
  if (qrow < G) {
    float* dst = red_o + (warp * 8 + qrow) * D + qcol;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      dst[n * 8] = o[n][0];
      dst[n * 8 + 1] = o[n][1];
    }
    if ((lane & 3) == 0) {
      red_ml[(warp * 8 + qrow) * 2] = m_run;
      red_ml[(warp * 8 + qrow) * 2 + 1] = l_run;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
    const int g = e / D, d = e % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, red_ml[(w * 8 + g) * 2]);
    const float base = m == -INFINITY ? 0.f : m;
    float acc = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float sc = exp2f(red_ml[(w * 8 + g) * 2] - base);
      acc += sc * red_o[(w * 8 + g) * D + d];
      l += sc * red_ml[(w * 8 + g) * 2 + 1];
    }
    part_o[e] = acc;
    if (d == 0) {
      part_ml[g * 2] = m;
      part_ml[g * 2 + 1] = l;
    }
  }
  cluster_barrier();  // every CTA's partial is written (release / acquire at cluster scope)
  const int per = (G * D + splits - 1) / splits;
  for (int e = split * per + threadIdx.x; e < min(G * D, (split + 1) * per); e += blockDim.x) {
    const int g = e / D;
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, ld_cluster_f32(part_ml + g * 2, s));
    const float base = m == -INFINITY ? 0.f : m;
    float num = 0.f, den = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float w = exp2f(ld_cluster_f32(part_ml + g * 2, s) - base);
      den += w * ld_cluster_f32(part_ml + g * 2 + 1, s);
      num += w * ld_cluster_f32(part_o + e, s);
    }
    const long long head = (long long)b * H * G + h * G + g;
    out[head * D + e % D] = tilehal::from_float<T>(den > 0.f ? num / den : 0.f);
  }
  cluster_barrier();  // peers may still read this CTA's partial until here
}
#endif

template <typename T, int D, int G, int STAGES>
__global__ void __launch_bounds__(kThreads) paged_decode_mma_kernel(
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_table, int table_stride, const int* __restrict__ seq_lens,
    const int* __restrict__ block_idx, int idx_b_stride, int idx_h_stride, int num_idx,
    T* __restrict__ out, float* __restrict__ o_part, float* __restrict__ ml_part,
    float scale_log2, int block_size, unsigned* __restrict__ tickets, int prefetch_l2) {
  using S = DecodeSmemMma<T, D, STAGES>;
  constexpr int kChunks = D / 8;                          // 16-byte chunks per K/V row
  constexpr int kKSteps = D / 16;                         // QK k-steps over the head dim
  constexpr int kNTiles = D / 8;                          // P@V n-tiles over the head dim
  constexpr int kLoads = kMmaStepTokens * kChunks / 32;   // cp.async per lane per step, K and V each
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  static_assert(G >= 1 && G <= 8, "q heads per kv head must fit the MMA's 8 live rows");
  static_assert(STAGES >= 2, "at least two stages");
  static_assert(kMmaWarps * 8 * (D + 2) * 4 <= kMmaWarps * S::kWarpBytes, "warp merge must fit the stages");

  KVPOOL_PDL_ENTRY();
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* wbase = smem + warp * S::kWarpBytes;
  const unsigned wbase_s = static_cast<unsigned>(__cvta_generic_to_shared(wbase));
  int* blk_s = reinterpret_cast<int*>(smem + kMmaWarps * S::kWarpBytes);
  int* ntok_s = blk_s + kMmaMaxItems;

  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int H = gridDim.y, splits = gridDim.x;
  unsigned qa[kKSteps][2];
#if defined(KVPOOL_CLUSTER_MERGE)
  load_q_operand<T, D, G>(q, b, h, H, lane, qa);  // issued first: its latency overlaps the block-list staging
#endif
  const DecodeShare share = decode_share(seq_lens, block_table, table_stride, block_idx, idx_b_stride, idx_h_stride,
                                         num_idx, block_size);
  const int num_tokens = share.n_items * block_size;
  const int bs_shift = __ffs(block_size) - 1, bs_mask = block_size - 1;
  const long long row_stride = (long long)H * D;

  for (int i = threadIdx.x; i < share.n_items; i += kThreads) {
    stage_block(i, share, block_size, blk_s, ntok_s);
  }
  __syncthreads();

  auto row_of = [&](int t) -> long long {  // physical token row of CTA-local token t, or -1
    if (t >= num_tokens) return -1;
    const int i = t >> bs_shift, off = t & bs_mask;
    return off < ntok_s[i] ? ((long long)blk_s[i] << bs_shift) + off : -1;
  };

  // prefetch_l2 (host: sparse shares of at most kPrefetchTokens tokens): every K/V line of the share
  // is requested into L2 before the pipeline starts, so the shares' scattered blocks (and their
  // page-table walks) are fetched at once instead of one pipeline step after another.
  if (prefetch_l2 && num_tokens <= kPrefetchTokens) {
    constexpr int kLines = (D * int(sizeof(T)) + 127) / 128;  // 128-byte lines per K (or V) row
    for (int e = threadIdx.x; e < num_tokens * kLines; e += kThreads) {
      const long long row = row_of(e / kLines);
      if (row >= 0) {
        const long long off = row * row_stride + (long long)h * D + (e % kLines) * (128 / int(sizeof(T)));
        asm volatile("prefetch.global.L2 [%0];" :: "l"(k_cache + off));
        asm volatile("prefetch.global.L2 [%0];" :: "l"(v_cache + off));
      }
    }
  }

  const int num_steps = (num_tokens + kMmaStepTokens - 1) / kMmaStepTokens;
  const int my_steps = num_steps > warp ? (num_steps - warp + kMmaWarps - 1) / kMmaWarps : 0;

  auto load_step = [&](int j, int stage) {
    const int t0 = (warp + j * kMmaWarps) * kMmaStepTokens;
    unsigned char* ks = wbase + stage * S::kStepBytes;
    unsigned char* vs = wbase + (STAGES + stage) * S::kStepBytes;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = lane + 32 * i, r = c / kChunks, col = c % kChunks;
      const long long row = row_of(t0 + r);
      const long long off = row < 0 ? 0 : row * row_stride + (long long)h * D + col * 8;
      const int soff = r * S::kRowBytes + ((col ^ (r & 7)) << 4);
      tilehal::cp_async_16(ks + soff, k_cache + off, row >= 0);
      tilehal::cp_async_16(vs + soff, v_cache + off, row >= 0);
    }
  };

#if !defined(KVPOOL_CLUSTER_MERGE)
  load_q_operand<T, D, G>(q, b, h, H, lane, qa);
#endif
  float o[kNTiles][4];
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;  // row lane/4; l_run is this lane's share of the row sum

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < my_steps) load_step(s, s);
    tilehal::cp_async_commit();
  }
  for (int j = 0; j < my_steps; ++j) {
    const int stage = j % STAGES;
    const int next = j + STAGES - 1;
    __syncwarp();  // every lane is done reading the stage refilled here (consumed at step j-1)
    if (next < my_steps) load_step(next, next % STAGES);
    tilehal::cp_async_commit();
    tilehal::cp_async_wait<STAGES - 1>();
    __syncwarp();  // the other lanes' copies of step j are visible
    const int t0 = (warp + j * kMmaWarps) * kMmaStepTokens;
    mma_decode_step<T, D>(qa, o, m_run, l_run, wbase_s + stage * S::kStepBytes,
                          wbase_s + (STAGES + stage) * S::kStepBytes,
                          [&](int t) { return row_of(t0 + t) >= 0; }, scale_log2, lane);
  }
  tilehal::cp_async_wait<0>();  // only empty groups can remain; drain before reusing smem
#if defined(KVPOOL_CLUSTER_MERGE)
  static_assert(kMmaWarps * 8 * D + kMmaWarps * 16 + G * D + 2 * G <= kMmaWarps * S::kWarpBytes / 4,
                "cluster merge buffers must fit the stages");
  if (splits > 1) {
    cluster_merge_and_store<T, D, G, kMmaWarps>(smem, o, m_run, l_run, out, b, h, H, split, splits);
    return;
  }
#endif
  merge_warps_and_store<T, D, G, kMmaWarps>(smem, o, m_run, l_run, out, o_part, ml_part, b, h, H, split, splits);
  // tickets given (host): the last split merges the partials, no paged_decode_combine launch
  if (splits > 1 && tickets != nullptr) combine_if_last<T, D>(o_part, ml_part, out, tickets, b, h, H, G, splits);
}

}  // namespace kvpool
