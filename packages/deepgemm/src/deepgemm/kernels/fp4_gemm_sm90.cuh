// FP4 (e2m1) weights x fp8 / bf16 activations for sm_90: D[m, n] = C + sum_k a(m, k) * w(n, k).
//
// Hopper has no FP4 tensor cores, so the point is memory: at decode shapes (M <= 128, large N x K)
// the time is the weight bytes, and e2m1 codes (two per byte) plus one fp32 scale per 32 (or 128)
// weights are 3.2x (3.8x) fewer bytes than bf16. The kernel streams them with many CTAs (split-K
// when N alone gives too few) and decodes them in registers straight into mma.sync operands.
//
// Semantics (deepgemm.fp4.reference is the same in torch):
//   w(n, k) = e2m1(code[n, k]) * sfb[n, k / GRAN]                (exact in fp32)
//   fp8 activations: a(m, k) = e4m3[m, k] * sfa[m, k / 128]; bf16 activations: a(m, k) = a[m, k]
//   every 32-wide K group g is one exact partial sum P(m, n, g) = sum_{k in g} a'(m, k) * e2m1(n, k)
//   (a' = e4m3 or bf16 value, products exact, fp32 sums), promoted as acc += P * sfb * sfa.
// So kernel and reference differ only in fp32 summation order.
//
// Swap-AB: the weights are mma.sync's A operand (16 rows of N per m-tile), the activations its B
// operand (8 tokens per n-tile), accumulators are D^T. Inside a 128-wide K chunk, the 32-wide group
// gg is one m16n8k32 e4m3 mma (fp8) or two m16n8k16 bf16 mmas, and thread q of a quad holds K
// positions [gg*32 + 8q, +8) of its rows: the same K permutation for A and B (a dot product does not
// care), chosen so that a thread reads 4 contiguous bytes of codes and 8 contiguous activations, and
// every mma sums a single scale group (so the scales apply after the mma, in fp32).
//
// Decode (no tables in memory): prmt looks up the 3 magnitude bits of 4 codes at once in a
// register-resident byte table (e4m3 or the two bytes of bf16); a second prmt in sign-replicate mode
// turns the 4 sign bits into 0x80 byte masks.
//
// Data movement: a producer warp streams each 128-wide K chunk of the CTA's weight rows (codes: one
// 64-byte-swizzled TMA box; scales: one box), activations (128-byte-swizzled boxes) and activation
// scales into a STAGES-deep shared-memory ring (mbarriers: full = bytes landed, empty = consumed), so
// a CTA keeps its whole K range in flight without spending registers on it; WN consumer warps each
// own 16 weight rows of every stage. The swizzles make the consumers' 4-byte code reads and 8/16-byte
// activation reads bank-conflict free.
//
// Work split: the CTA's K range is split `gridDim.y` ways (the planner picks one resident wave).
// Partial tiles go through shared memory (transposed to token-major), then across CTAs through an fp32
// workspace: every CTA of a tile writes its part, and the last to arrive (per-tile counter) adds the
// parts in split order (deterministic), writes D and resets the counter (so the kernel is CUDA-graph
// replayable without a memset). Weight scales are 1 x 32 here (the host expands 1 x 128 ones).
#pragma once
#include <tilehal/tilehal.cuh>
#include <tilehal/mbarrier.cuh>
#include <tilehal/tma.cuh>

namespace deepgemm {
namespace fp4 {
using namespace tilehal;

TILEHAL_DEVICE u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Sign masks (0x80 per byte) of codes 0..3 (lo) and 4..7 (hi) of a word of 8 codes.
TILEHAL_DEVICE void sign_masks(u32 w, u32& lo, u32& hi) {
  const u32 w4 = w << 4;  // even codes' sign bit (bit 3 of a byte) moves to the byte's msb
  lo = prmt(w, w4, 0x9D8C) & 0x80808080u;
  hi = prmt(w, w4, 0xBFAE) & 0x80808080u;
}

// 8 e2m1 codes (low nibble first) -> 8 e4m3 bytes: lo = codes 0..3, hi = codes 4..7. Exact.
TILEHAL_DEVICE void decode_e4m3(u32 w, u32& lo, u32& hi) {
  constexpr u32 T0 = 0x3C383000u, T1 = 0x4C484440u;  // e4m3 of 0, .5, 1, 1.5 | 2, 3, 4, 6
  u32 s_lo, s_hi;
  sign_masks(w, s_lo, s_hi);
  lo = prmt(T0, T1, w & 0x7777u) | s_lo;
  hi = prmt(T0, T1, (w >> 16) & 0x7777u) | s_hi;
}

// 8 e2m1 codes -> 4 bf16x2 words (codes 0-1, 2-3, 4-5, 6-7). Exact.
TILEHAL_DEVICE void decode_bf16(u32 w, u32 (&r)[4]) {
  constexpr u32 L0 = 0xC0800000u, L1 = 0xC0804000u;  // low bytes of bf16(0, .5, 1, 1.5 | 2, 3, 4, 6)
  constexpr u32 H0 = 0x3F3F3F00u, H1 = 0x40404040u;  // high bytes
  u32 s_lo, s_hi;
  sign_masks(w, s_lo, s_hi);
  const u32 sel_lo = w & 0x7777u, sel_hi = (w >> 16) & 0x7777u;
  const u32 xl = prmt(L0, L1, sel_lo), yl = prmt(H0, H1, sel_lo) | s_lo;
  const u32 xh = prmt(L0, L1, sel_hi), yh = prmt(H0, H1, sel_hi) | s_hi;
  r[0] = prmt(xl, yl, 0x5140);
  r[1] = prmt(xl, yl, 0x7362);
  r[2] = prmt(xh, yh, 0x5140);
  r[3] = prmt(xh, yh, 0x7362);
}

TILEHAL_DEVICE u32 lds_u32(const unsigned char* p) { return *reinterpret_cast<const u32*>(p); }

// Byte offset of 16-byte unit `unit` of row `row` in a TMA tile with ROW_BYTES-wide rows and the
// matching swizzle (64B: unit ^= (row / 2) % 4; 128B: unit ^= row % 8), from a 1024-aligned base.
template <int ROW_BYTES>
TILEHAL_DEVICE int swz(int row, int unit) {
  if constexpr (ROW_BYTES == 64) {
    return row * 64 + ((unit ^ ((row >> 1) & 3)) << 4);
  } else {
    return row * 128 + ((unit ^ (row & 7)) << 4);
  }
}

// Shared memory of one pipeline stage (one 128-wide K chunk), every region 16-byte aligned and the
// swizzled ones 1024-aligned: activations [TOKENS][128 bytes] (bf16: two such halves), codes
// [ROWS][64 bytes], weight scales [ROWS][4] fp32, activation scales [TOKENS] fp32.
template <int NT, int WN, bool ACT_FP8>
struct Fp4Stage {
  static constexpr int kRows = 16 * WN, kTokens = 8 * NT;
  static constexpr int kA = kTokens * 128 * (ACT_FP8 ? 1 : 2);
  static constexpr int kW = kRows * 64;
  static constexpr int kSfb = kRows * 16;
  static constexpr int kSfa = ACT_FP8 ? kTokens * 4 : 0;
  static constexpr int kOffW = kA, kOffSfb = kA + kW, kOffSfa = kA + kW + kSfb;
  static constexpr int kBytes = (kA + kW + kSfb + kSfa + 1023) / 1024 * 1024;
};

// Dynamic shared memory (cuda_fp4.smem_bytes mirrors it): alignment slack, the ring (the epilogue's
// [TOKENS][ROWS] fp32 tile reuses it once drained, so at least that much), the barriers.
template <int NT, int WN, bool ACT_FP8, int STAGES>
TILEHAL_HOST_DEVICE constexpr int fp4_ring_bytes() {
  constexpr int ring = STAGES * Fp4Stage<NT, WN, ACT_FP8>::kBytes, red = 8 * NT * 16 * WN * 4;
  return ring > red ? ring : red;
}

// Small token tiles: several CTAs per SM (the planner assumes this many).
template <int NT> constexpr int kMinBlocks = NT <= 2 ? 4 : 1;

template <int NT, int WN, bool ACT_FP8, typename OutT, bool HAS_C, bool MASKED, int STAGES>
__global__ void __launch_bounds__(32 * (WN + 1), kMinBlocks<NT>)
fp4_gemm_sm90(const __grid_constant__ TmaDescriptor tma_b, const __grid_constant__ TmaDescriptor tma_sfb,
              const __grid_constant__ TmaDescriptor tma_a, const __grid_constant__ TmaDescriptor tma_sfa,
              OutT* __restrict__ d, const float* __restrict__ c, float* __restrict__ workspace,
              int* __restrict__ counters, const int* __restrict__ masked_m, int shape_m, int shape_n, int shape_k,
              int m_blocks, int chunks_per_split) {
  using St = Fp4Stage<NT, WN, ACT_FP8>;
  constexpr int ROWS = St::kRows;      // weight rows (output columns) per CTA
  constexpr int TOKENS = St::kTokens;  // activation rows (output rows) per CTA
  constexpr int A_REGS = ACT_FP8 ? 2 : 4;          // 8 activations of one group and n-tile
  constexpr int NH = NT * A_REGS > 16 ? 2 : 1;     // passes over the n-tiles per group (registers)
  constexpr int NUM_CONSUMERS = 32 * WN;

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4, q = lane % 4;

  // Which tile: blockIdx.x = row block, blockIdx.y = K split, blockIdx.z = (group, m-block).
  const int group = blockIdx.z / m_blocks;
  const int m_block = blockIdx.z % m_blocks;
  int rows_m = shape_m;  // valid tokens of this group
  if constexpr (MASKED) rows_m = min(max(__ldg(masked_m + group), 0), shape_m);
  const int m0 = m_block * TOKENS;
  if (m0 >= rows_m) return;  // every CTA of this tile returns: the counter is never touched

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  float* red = reinterpret_cast<float*>(smem);  // [TOKENS][ROWS], over the drained ring
  u64* full_bar = reinterpret_cast<u64*>(smem + fp4_ring_bytes<NT, WN, ACT_FP8, STAGES>());
  u64* empty_bar = full_bar + STAGES;

  const int n_cta = blockIdx.x * ROWS;
  const int num_chunks = shape_k / 128;
  const int c_begin = blockIdx.y * chunks_per_split;
  const int c_end = min(c_begin + chunks_per_split, num_chunks);

  if (threadIdx.x == NUM_CONSUMERS) {
    tma_prefetch_descriptor(&tma_b);
    tma_prefetch_descriptor(&tma_sfb);
    tma_prefetch_descriptor(&tma_a);
    if constexpr (ACT_FP8) tma_prefetch_descriptor(&tma_sfa);
#pragma unroll
    for (int i = 0; i < STAGES; ++i) {
      mbarrier_init(&full_bar[i], 1);
      mbarrier_init(&empty_bar[i], WN);  // lane 0 of every consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;

  if (warp == WN) {
    // ---------------------------------------------------------------- producer warp
    if (lane == 0) {
      const int b_row = group * shape_n + n_cta;
      const int a_row = group * shape_m + m0;
      const int sf_k = shape_k / 128;
      for (int ch = c_begin, i = 0; ch < c_end; ++ch, ++i) {
        const int s = i % STAGES;
        mbarrier_wait(&empty_bar[s], ((i / STAGES) & 1) ^ 1);
        unsigned char* st = smem + s * St::kBytes;
        mbarrier_arrive_expect_tx(&full_bar[s], St::kA + St::kW + St::kSfb + St::kSfa);
        tma_load_2d(st + St::kOffW, &tma_b, &full_bar[s], ch * 64, b_row);
        tma_load_2d(st + St::kOffSfb, &tma_sfb, &full_bar[s], ch * 4, b_row);
        if constexpr (ACT_FP8) {
          tma_load_2d(st, &tma_a, &full_bar[s], ch * 128, a_row);
          tma_load_2d(st + St::kOffSfa, &tma_sfa, &full_bar[s], m0, group * sf_k + ch);
        } else {
          tma_load_2d(st, &tma_a, &full_bar[s], ch * 128, a_row);
          tma_load_2d(st + TOKENS * 128, &tma_a, &full_bar[s], ch * 128 + 64, a_row);
        }
      }
    }
  } else {
    // ---------------------------------------------------------------- consumer warps
    const int r0 = warp * 16 + g;  // this thread's weight rows in the CTA: r0 and r0 + 8
    for (int ch = c_begin, i = 0; ch < c_end; ++ch, ++i) {
      const int s = i % STAGES;
      mbarrier_wait(&full_bar[s], (i / STAGES) & 1);
      const unsigned char* st = smem + s * St::kBytes;
      const float4 sb0 = *reinterpret_cast<const float4*>(st + St::kOffSfb + r0 * 16);
      const float4 sb1 = *reinterpret_cast<const float4*>(st + St::kOffSfb + (r0 + 8) * 16);
      float sa[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if constexpr (ACT_FP8) {
          const float2 v = *reinterpret_cast<const float2*>(st + St::kOffSfa + (nt * 8 + 2 * q) * 4);
          sa[nt][0] = v.x, sa[nt][1] = v.y;
        } else {
          sa[nt][0] = sa[nt][1] = 1.f;
        }
      }
#pragma unroll
      for (int gg = 0; gg < 4; ++gg) {
        // Codes: 4 bytes (K positions [gg*32 + 8q, +8)) of rows r0 and r0 + 8.
        const u32 w0 = lds_u32(st + St::kOffW + swz<64>(r0, gg) + q * 4);
        const u32 w1 = lds_u32(st + St::kOffW + swz<64>(r0 + 8, gg) + q * 4);
        const float s0 = gg == 0 ? sb0.x : gg == 1 ? sb0.y : gg == 2 ? sb0.z : sb0.w;
        const float s1 = gg == 0 ? sb1.x : gg == 1 ? sb1.y : gg == 2 ? sb1.z : sb1.w;
        u32 af[4], a_lo[4], a_hi[4];
        if constexpr (ACT_FP8) {
          decode_e4m3(w0, af[0], af[2]);
          decode_e4m3(w1, af[1], af[3]);
        } else {
          u32 q0[4], q1[4];
          decode_bf16(w0, q0);
          decode_bf16(w1, q1);
          a_lo[0] = q0[0], a_lo[1] = q1[0], a_lo[2] = q0[1], a_lo[3] = q1[1];  // K positions 8q + 0..3
          a_hi[0] = q0[2], a_hi[1] = q1[2], a_hi[2] = q0[3], a_hi[3] = q1[3];  // 8q + 4..7
        }
#pragma unroll
        for (int half = 0; half < NH; ++half) {
          u32 bf[NT / NH][A_REGS];
#pragma unroll
          for (int j = 0; j < NT / NH; ++j) {
            const int t = (half * (NT / NH) + j) * 8 + g;  // token row of the stage's activation tile
            if constexpr (ACT_FP8) {  // bytes [gg*32 + 8q, +8) of a 128-byte row
              const uint2 v = *reinterpret_cast<const uint2*>(st + swz<128>(t, 2 * gg + (q >> 1)) + (q & 1) * 8);
              bf[j][0] = v.x, bf[j][1] = v.y;
            } else {  // bf16: half gg / 2 of the chunk, bytes [(gg % 2) * 64 + 16q, +16)
              const uint4 v = *reinterpret_cast<const uint4*>(st + (gg >> 1) * TOKENS * 128 +
                                                              swz<128>(t, (gg & 1) * 4 + q));
              bf[j][0] = v.x, bf[j][1] = v.y, bf[j][2] = v.z, bf[j][3] = v.w;
            }
          }
#pragma unroll
          for (int j = 0; j < NT / NH; ++j) {
            const int nt = half * (NT / NH) + j;
            float p[4] = {0.f, 0.f, 0.f, 0.f};
            if constexpr (ACT_FP8) {
              const u32 bb[2] = {bf[j][0], bf[j][1]};
              mma_m16n8k32(MmaE4M3{}, p, af, bb);
            } else {
              const u32 b_lo[2] = {bf[j][0], bf[j][1]};
              const u32 b_hi[2] = {bf[j][2], bf[j][3]};
              mma_m16n8k16(MmaBF16{}, p, a_lo, b_lo);
              mma_m16n8k16(MmaBF16{}, p, a_hi, b_hi);
            }
            acc[nt][0] += p[0] * (s0 * sa[nt][0]);
            acc[nt][1] += p[1] * (s0 * sa[nt][1]);
            acc[nt][2] += p[2] * (s1 * sa[nt][0]);
            acc[nt][3] += p[3] * (s1 * sa[nt][1]);
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&empty_bar[s]);
    }
  }

  // Partial tile -> shared memory [TOKENS][ROWS] (token-major, so D rows are written along N), over
  // the ring: every consumer has finished reading it, and every load it waited for has landed.
  __syncthreads();
  if (warp < WN) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = warp * 16 + g + 8 * (i / 2);
        const int t = nt * 8 + 2 * q + (i % 2);
        red[t * ROWS + r] = acc[nt][i];
      }
    }
  }
  __syncthreads();
  constexpr int TILE = TOKENS * ROWS;
  constexpr int THREADS = 32 * (WN + 1);
  // ------------------------------------------------------------------ split-K reduction and epilogue

  // Only the tile's valid tokens travel (M = 1: one row of the 8-token tile), as float4s. The last CTA
  // reads every split's part with all of a thread's loads in flight (PER_T float4s per split, two splits
  // per step): a serial load-add chain here cost ~0.6 us of L2 latency per split and element.
  const int splits = gridDim.y;
  const int tile_id = blockIdx.z * gridDim.x + blockIdx.x;
  const int valid4 = min(TOKENS, rows_m - m0) * ROWS / 4;
  constexpr int PER_T = (TILE / 4 + THREADS - 1) / THREADS;
  float4* red4 = reinterpret_cast<float4*>(red);
  __shared__ int is_last;
  if (splits > 1) {
    float4* part = reinterpret_cast<float4*>(workspace + (static_cast<size_t>(tile_id) * splits + blockIdx.y) * TILE);
    for (int e = threadIdx.x; e < valid4; e += THREADS) __stcg(part + e, red4[e]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      const int prev = atomicAdd(counters + tile_id, 1);
      is_last = prev == splits - 1;
      if (is_last) counters[tile_id] = 0;  // every other CTA of the tile has arrived: reset for the next launch
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const float4* parts = reinterpret_cast<const float4*>(workspace + static_cast<size_t>(tile_id) * splits * TILE);
    float4 v[PER_T];
#pragma unroll
    for (int i = 0; i < PER_T; ++i) v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 2
    for (int sp = 0; sp < splits; ++sp) {  // in split order: the sum is the same whichever CTA is last
#pragma unroll
      for (int i = 0; i < PER_T; ++i) {
        const int e = threadIdx.x + i * THREADS;
        if (e < valid4) {
          const float4 t = __ldcg(parts + static_cast<size_t>(sp) * (TILE / 4) + e);
          v[i].x += t.x, v[i].y += t.y, v[i].z += t.z, v[i].w += t.w;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < PER_T; ++i) {
      const int e = threadIdx.x + i * THREADS;
      if (e < valid4) red4[e] = v[i];
    }
  }
  __syncthreads();

  OutT* d_g = d + static_cast<size_t>(group) * shape_m * shape_n;
  const float* c_g = HAS_C ? c + static_cast<size_t>(group) * shape_m * shape_n : nullptr;
  for (int e = threadIdx.x; e < valid4 * 4; e += THREADS) {
    const int t = e / ROWS, r = e % ROWS;
    const int m = m0 + t, n = n_cta + r;
    if (m >= rows_m || n >= shape_n) continue;
    float v = red[e];
    const size_t off = static_cast<size_t>(m) * shape_n + n;
    if constexpr (HAS_C) v += c_g[off];
    if constexpr (sizeof(OutT) == 2) {
      d_g[off] = __float2bfloat16_rn(v);
    } else {
      d_g[off] = v;
    }
  }
}

}  // namespace fp4
}  // namespace deepgemm
