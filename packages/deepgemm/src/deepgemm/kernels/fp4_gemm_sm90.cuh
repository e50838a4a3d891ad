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
// Work split: CTA = WN x WK warps; warp (wn, wk) owns MT m-tiles (16 MT rows) and takes the CTA's K
// chunks wk, wk + WK, ...; the CTA's K range is split `gridDim.y` ways. Partial tiles are summed in
// shared memory (over wk), then across CTAs through an fp32 workspace: every CTA of a tile writes its
// part, and the last to arrive (per-tile counter) adds the parts in split order (deterministic),
// writes D and resets the counter (so the kernel is CUDA-graph replayable without a memset).
#pragma once
#include <tilehal/tilehal.cuh>

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

TILEHAL_DEVICE u32 ldg_u32(const void* p) {
  u32 v;
  asm("ld.global.nc.L1::no_allocate.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
TILEHAL_DEVICE float4 ldg_f4(const void* p) {
  float4 v;
  asm("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
TILEHAL_DEVICE uint2 ldg_u2(const void* p) {
  uint2 v;
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
// Volatile twins: kept in program order relative to the (volatile) mma.sync, so the compiler does not
// hoist every group's B operands of a wide token tile at once (that spills at NT = 16).
TILEHAL_DEVICE uint2 ldg_u2_ordered(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
TILEHAL_DEVICE uint4 ldg_u4_ordered(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
TILEHAL_DEVICE uint4 ldg_u4(const void* p) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// One K chunk (128) of one thread's weights: MT m-tiles x 2 rows (g, g+8) x 4 groups of 8 codes,
// and their scales (one per group for GRAN 32, one per chunk for GRAN 128).
// With PRE_A the chunk's activations (B operands of 4 groups x NT n-tiles) and activation scales ride
// along, so small-M kernels have no load on the critical path at all.
template <int MT, int GRAN, int NT, bool PRE_A, int A_REGS>
struct WChunk {
  u32 w[MT][2][4];
  float s[MT][2][GRAN == 32 ? 4 : 1];
  u32 act[PRE_A ? 4 : 1][PRE_A ? NT : 1][A_REGS];
  float sa[PRE_A ? NT : 1][2];
};

// Small token tiles: two CTAs per SM (at most 128 registers) keep twice the loads in flight.
template <int NT> constexpr int kMinBlocks = NT <= 4 ? 2 : 1;

template <int NT, int MT, int WN, int WK, bool ACT_FP8, int GRAN, typename OutT, bool HAS_C, bool MASKED>
__global__ void __launch_bounds__(32 * WN * WK, kMinBlocks<NT>)
fp4_gemm_sm90(const unsigned char* __restrict__ a, const float* __restrict__ sfa, const unsigned char* __restrict__ b,
              const float* __restrict__ sfb, OutT* __restrict__ d, const float* __restrict__ c,
              float* __restrict__ workspace, int* __restrict__ counters, const int* __restrict__ masked_m,
              int shape_m, int shape_n, int shape_k, int lda, int sfa_stride_g, int sfa_stride_m,
              int sfa_stride_k, int m_blocks, int chunks_per_split) {
  static_assert(GRAN == 32 || GRAN == 128, "weight scale groups of 32 or 128 along K");
  static_assert(MT == 1 || MT == 2, "one or two m16 tiles of weight rows per warp");
  constexpr int ROWS = 16 * MT * WN;  // weight rows (output columns) per CTA
  constexpr int TOKENS = 8 * NT;      // activation rows (output rows) per CTA
  constexpr int A_BYTES = ACT_FP8 ? 1 : 2;
  constexpr int SF_PER_CHUNK = 128 / GRAN;
  constexpr int A_REGS = ACT_FP8 ? 2 : 4;  // 8 activations of one group and n-tile
  constexpr bool PRE_A = NT * A_REGS <= 8;  // prefetch activations with the weights (NT <= 2 / 4)
  constexpr int NH = NT * A_REGS > 32 ? 2 : 1;  // passes over the n-tiles per group (B operand registers)
  using Chunk = WChunk<MT, GRAN, NT, PRE_A, A_REGS>;

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int wn = warp % WN, wk = warp / WN;
  const int g = lane / 4, q = lane % 4;

  // Which tile: blockIdx.x = row block, blockIdx.y = K split, blockIdx.z = (group, m-block).
  const int group = blockIdx.z / m_blocks;
  const int m_block = blockIdx.z % m_blocks;
  int rows_m = shape_m;  // valid tokens of this group
  if constexpr (MASKED) rows_m = min(max(__ldg(masked_m + group), 0), shape_m);
  const int m0 = m_block * TOKENS;
  if (m0 >= rows_m) return;  // every CTA of this tile returns: the counter is never touched

  const int sk = shape_k / GRAN;
  const unsigned char* a_g = a + static_cast<size_t>(group) * shape_m * lda * A_BYTES;
  const float* sfa_g = ACT_FP8 ? sfa + static_cast<size_t>(group) * sfa_stride_g : nullptr;
  const unsigned char* b_g = b + static_cast<size_t>(group) * shape_n * (shape_k / 2);
  const float* sfb_g = sfb + static_cast<size_t>(group) * shape_n * sk;

  const int n_cta = blockIdx.x * ROWS;
  int row[MT][2];  // this thread's weight rows (A rows g and g + 8 of each m-tile)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Clamped: loads stay in bounds; the epilogue skips columns past N.
      row[mt][h] = min(n_cta + (wn * MT + mt) * 16 + g + 8 * h, shape_n - 1);
    }
  }
  // Tokens this thread feeds as B (n index g of each n-tile); clamped like the rows.
  int tok[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) tok[nt] = min(m0 + nt * 8 + g, rows_m - 1);

  const int num_chunks = shape_k / 128;
  const int c_begin = blockIdx.y * chunks_per_split;
  const int c_end = min(c_begin + chunks_per_split, num_chunks);

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

  // The 8 activations of group gg of chunk `chunk` for n-tile nt: K positions [gg*32 + 8q, +8).
  auto load_act = [&](u32 (&dst)[A_REGS], int chunk, int gg, int nt) {
    const size_t k_off = static_cast<size_t>(chunk) * 128 + gg * 32 + q * 8;
    const unsigned char* p = a_g + (static_cast<size_t>(tok[nt]) * lda + k_off) * A_BYTES;
    if constexpr (ACT_FP8) {
      const uint2 v = PRE_A ? ldg_u2(p) : ldg_u2_ordered(p);
      dst[0] = v.x, dst[1] = v.y;
    } else {
      const uint4 v = PRE_A ? ldg_u4(p) : ldg_u4_ordered(p);
      dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
    }
  };
  // Activation scales of a chunk for the two C columns (tokens 2q, 2q+1) of each n-tile.
  auto load_sa = [&](float (&dst)[2], int chunk, int nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if constexpr (ACT_FP8) {
        const int t = min(m0 + nt * 8 + 2 * q + j, rows_m - 1);
        dst[j] = __ldg(sfa_g + static_cast<size_t>(t) * sfa_stride_m + static_cast<size_t>(chunk) * sfa_stride_k);
      } else {
        dst[j] = 1.f;
      }
    }
  };

  auto load = [&](Chunk& wc, int chunk) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned char* p = b_g + static_cast<size_t>(row[mt][h]) * (shape_k / 2) + chunk * 64 + q * 4;
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) wc.w[mt][h][gg] = ldg_u32(p + gg * 16);
        const float* ps = sfb_g + static_cast<size_t>(row[mt][h]) * sk + chunk * SF_PER_CHUNK;
        if constexpr (GRAN == 32) {
          const float4 v = ldg_f4(ps);
          wc.s[mt][h][0] = v.x, wc.s[mt][h][1] = v.y, wc.s[mt][h][2] = v.z, wc.s[mt][h][3] = v.w;
        } else {
          wc.s[mt][h][0] = __ldg(ps);
        }
      }
    }
    if constexpr (PRE_A) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        load_sa(wc.sa[nt], chunk, nt);
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) load_act(wc.act[gg][nt], chunk, gg, nt);
      }
    }
  };

  auto compute = [&](const Chunk& wc, int chunk) {
    float sa[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if constexpr (PRE_A) {
        sa[nt][0] = wc.sa[nt][0], sa[nt][1] = wc.sa[nt][1];
      } else {
        load_sa(sa[nt], chunk, nt);
      }
    }
#pragma unroll
    for (int gg = 0; gg < 4; ++gg) {
      // Without PRE_A the B operands are loaded here, NH passes of NT / NH n-tiles (register budget).
#pragma unroll
      for (int half = 0; half < NH; ++half) {
        u32 bf[NT / NH][A_REGS];
#pragma unroll
        for (int j = 0; j < NT / NH; ++j) {
          if constexpr (PRE_A) {
#pragma unroll
            for (int i = 0; i < A_REGS; ++i) bf[j][i] = wc.act[gg][j][i];
          } else {
            load_act(bf[j], chunk, gg, half * (NT / NH) + j);
          }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const float s0 = wc.s[mt][0][GRAN == 32 ? gg : 0], s1 = wc.s[mt][1][GRAN == 32 ? gg : 0];
          if constexpr (ACT_FP8) {
            u32 af[4];
            decode_e4m3(wc.w[mt][0][gg], af[0], af[2]);
            decode_e4m3(wc.w[mt][1][gg], af[1], af[3]);
#pragma unroll
            for (int j = 0; j < NT / NH; ++j) {
              const int nt = half * (NT / NH) + j;
              float p[4] = {0.f, 0.f, 0.f, 0.f};
              const u32 bb[2] = {bf[j][0], bf[j][1]};
              mma_m16n8k32(MmaE4M3{}, p, af, bb);
              acc[mt][nt][0] += p[0] * (s0 * sa[nt][0]);
              acc[mt][nt][1] += p[1] * (s0 * sa[nt][1]);
              acc[mt][nt][2] += p[2] * (s1 * sa[nt][0]);
              acc[mt][nt][3] += p[3] * (s1 * sa[nt][1]);
            }
          } else {
            u32 r0[4], r1[4];
            decode_bf16(wc.w[mt][0][gg], r0);
            decode_bf16(wc.w[mt][1][gg], r1);
            const u32 a_lo[4] = {r0[0], r1[0], r0[1], r1[1]};  // K positions 8q + 0..3
            const u32 a_hi[4] = {r0[2], r1[2], r0[3], r1[3]};  // 8q + 4..7
#pragma unroll
            for (int j = 0; j < NT / NH; ++j) {
              const int nt = half * (NT / NH) + j;
              float p[4] = {0.f, 0.f, 0.f, 0.f};
              const u32 b_lo[2] = {bf[j][0], bf[j][1]};
              const u32 b_hi[2] = {bf[j][A_REGS - 2], bf[j][A_REGS - 1]};
              mma_m16n8k16(MmaBF16{}, p, a_lo, b_lo);
              mma_m16n8k16(MmaBF16{}, p, a_hi, b_hi);
              acc[mt][nt][0] += p[0] * s0;
              acc[mt][nt][1] += p[1] * s0;
              acc[mt][nt][2] += p[2] * s1;
              acc[mt][nt][3] += p[3] * s1;
            }
          }
        }
      }
    }
  };

  // Register pipeline of two chunks: chunk i+WK's weights load while chunk i computes.
  {
    Chunk cur, nxt;
    int chunk = c_begin + wk;
    if (chunk < c_end) load(cur, chunk);
#pragma unroll 1
    for (; chunk < c_end; chunk += 2 * WK) {
      const int c1 = chunk + WK;
      if (c1 < c_end) load(nxt, c1);
      compute(cur, chunk);
      if (c1 >= c_end) break;
      const int c2 = c1 + WK;
      if (c2 < c_end) load(cur, c2);
      compute(nxt, c1);
    }
  }

  // ------------------------------------------------------------------ reduction and epilogue
  // Partial tiles -> shared memory [WK][TOKENS][ROWS] (token-major, so D rows are written along N).
  extern __shared__ float red[];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = (wn * MT + mt) * 16 + g + 8 * (i / 2);
        const int t = nt * 8 + 2 * q + (i % 2);
        red[(wk * TOKENS + t) * ROWS + r] = acc[mt][nt][i];
      }
    }
  }
  __syncthreads();
  constexpr int TILE = TOKENS * ROWS;
  constexpr int THREADS = 32 * WN * WK;
  for (int e = threadIdx.x; e < TILE; e += THREADS) {
    float v = red[e];
#pragma unroll
    for (int j = 1; j < WK; ++j) v += red[j * TILE + e];
    red[e] = v;
  }

  const int splits = gridDim.y;
  const int tile_id = blockIdx.z * gridDim.x + blockIdx.x;
  __shared__ int is_last;
  if (splits > 1) {
    float* part = workspace + (static_cast<size_t>(tile_id) * splits + blockIdx.y) * TILE;
    for (int e = threadIdx.x; e < TILE; e += THREADS) __stcg(part + e, red[e]);
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
    const float* parts = workspace + static_cast<size_t>(tile_id) * splits * TILE;
    for (int e = threadIdx.x; e < TILE; e += THREADS) {
      float v = 0.f;
      for (int s = 0; s < splits; ++s) v += __ldcg(parts + static_cast<size_t>(s) * TILE + e);
      red[e] = v;
    }
  } else {
    __syncthreads();
  }

  OutT* d_g = d + static_cast<size_t>(group) * shape_m * shape_n;
  const float* c_g = HAS_C ? c + static_cast<size_t>(group) * shape_m * shape_n : nullptr;
  for (int e = threadIdx.x; e < TILE; e += THREADS) {
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
