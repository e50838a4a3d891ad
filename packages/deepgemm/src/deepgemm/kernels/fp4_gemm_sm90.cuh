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
#include <tilehal/wgmma.cuh>

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

// e4m3 bytes of the e2m1 magnitudes 0, .5, 1, 1.5 | 2, 3, 4, 6.
constexpr u32 kE4M3T0 = 0x3C383000u, kE4M3T1 = 0x4C484440u;

// 8 e2m1 codes through a magnitude table (t0, t1: bytes of magnitudes 0..3 | 4..7) -> 8 e4m3 bytes.
TILEHAL_DEVICE void decode_e4m3_tab(u32 w, u32 t0, u32 t1, u32& lo, u32& hi) {
  u32 s_lo, s_hi;
  sign_masks(w, s_lo, s_hi);
  lo = prmt(t0, t1, w & 0x7777u) | s_lo;
  hi = prmt(t0, t1, (w >> 16) & 0x7777u) | s_hi;
}

// 8 e2m1 codes (low nibble first) -> 8 e4m3 bytes: lo = codes 0..3, hi = codes 4..7. Exact.
TILEHAL_DEVICE void decode_e4m3(u32 w, u32& lo, u32& hi) {
  constexpr u32 T0 = kE4M3T0, T1 = kE4M3T1;
  u32 s_lo, s_hi;
  sign_masks(w, s_lo, s_hi);
  lo = prmt(T0, T1, w & 0x7777u) | s_lo;
  hi = prmt(T0, T1, (w >> 16) & 0x7777u) | s_hi;
}

// 8 e2m1 codes -> 4 bf16x2 words (codes 0-1, 2-3, 4-5, 6-7). Exact.
// The tables' first words (l0, h0: prmt's register operand) may come in from a register that lives across a
// loop (decode_bf16_tab), so that ptxas does not rebuild them from immediates for every call.
constexpr u32 kBf16L0 = 0xC0800000u, kBf16H0 = 0x3F3F3F00u;

TILEHAL_DEVICE void decode_bf16_tab(u32 w, u32 (&r)[4], u32 L0, u32 H0) {
  constexpr u32 L1 = 0xC0804000u;  // low bytes of bf16(0, .5, 1, 1.5 | 2, 3, 4, 6): L0 | L1
  constexpr u32 H1 = 0x40404040u;  // high bytes: H0 | H1
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

TILEHAL_DEVICE void decode_bf16(u32 w, u32 (&r)[4]) { decode_bf16_tab(w, r, kBf16L0, kBf16H0); }

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
// Fp4StageOf: the layout by token and weight-row counts (the decode-to-shared kernel's tiles are not 8 NT x 16 WN).
template <int TOKENS, int ROWS, bool ACT_FP8>
struct Fp4StageOf {
  static constexpr int kA = TOKENS * 128 * (ACT_FP8 ? 1 : 2);
  static constexpr int kW = ROWS * 64;
  static constexpr int kSfb = ROWS * 16;
  static constexpr int kSfa = ACT_FP8 ? TOKENS * 4 : 0;
  static constexpr int kOffW = kA, kOffSfb = kA + kW, kOffSfa = kA + kW + kSfb;
  static constexpr int kBytes = (kA + kW + kSfb + kSfa + 1023) / 1024 * 1024;
};

template <int NT, int WN, bool ACT_FP8>
struct Fp4Stage : Fp4StageOf<8 * NT, 16 * WN, ACT_FP8> {
  static constexpr int kRows = 16 * WN, kTokens = 8 * NT;
};

// Dynamic shared memory (cuda_fp4.smem_bytes mirrors it): alignment slack, the ring (the epilogue's
// [TOKENS][ROWS] fp32 tile reuses it once drained, so at least that much), the barriers.
template <int NT, int WN, bool ACT_FP8, int STAGES>
TILEHAL_HOST_DEVICE constexpr int fp4_ring_bytes() {
  constexpr int ring = STAGES * Fp4Stage<NT, WN, ACT_FP8>::kBytes, red = 8 * NT * 16 * WN * 4;
  return ring > red ? ring : red;
}

// Where a CTA's tile is: blockIdx.x = row block, blockIdx.y = K split, blockIdx.z = (group, m-block); its
// valid tokens (masked_m for grouped launches) and its range of 128-wide K chunks.
struct Fp4Tile {
  int group, m0, rows_m, n_cta, c_begin, c_end;
};

template <bool MASKED>
TILEHAL_DEVICE Fp4Tile fp4_tile(const int* masked_m, int shape_m, int shape_k, int m_blocks, int tokens, int rows,
                                int chunks_per_split) {
  Fp4Tile t;
  t.group = blockIdx.z / m_blocks;
  t.rows_m = shape_m;
  if constexpr (MASKED) t.rows_m = min(max(__ldg(masked_m + t.group), 0), shape_m);
  t.m0 = static_cast<int>(blockIdx.z % m_blocks) * tokens;
  t.n_cta = blockIdx.x * rows;
  t.c_begin = blockIdx.y * chunks_per_split;
  t.c_end = min(t.c_begin + chunks_per_split, shape_k / 128);
  return t;
}

// The TMA ring of the three ring kernels over dynamic shared memory (1024-aligned): STAGES stages, then the
// full (1 arrival + bytes) and empty (`consumers` warp arrivals) barriers; thread `init_thread` prefetches
// the descriptors (sfa may be null) and initializes the barriers. Every thread calls it (it syncs the CTA).
struct Fp4Ring {
  unsigned char* smem;
  u64* full;
  u64* empty;
};

template <int STAGES, int RING_BYTES>
TILEHAL_DEVICE Fp4Ring fp4_ring_init(unsigned char* smem_raw, int init_thread, int consumers, const TmaDescriptor* b,
                                     const TmaDescriptor* sfb, const TmaDescriptor* a, const TmaDescriptor* sfa) {
  Fp4Ring r;
  r.smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  r.full = reinterpret_cast<u64*>(r.smem + RING_BYTES);
  r.empty = r.full + STAGES;
  if (static_cast<int>(threadIdx.x) == init_thread) {
    tma_prefetch_descriptor(b);
    tma_prefetch_descriptor(sfb);
    tma_prefetch_descriptor(a);
    if (sfa != nullptr) tma_prefetch_descriptor(sfa);
#pragma unroll
    for (int i = 0; i < STAGES; ++i) {
      mbarrier_init(&r.full[i], 1);
      mbarrier_init(&r.empty[i], consumers);  // lane 0 of every consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();
  return r;
}

// The producer (one lane): each 128-wide K chunk of the tile -> stage i % STAGES once it is empty: the codes
// (one 64-byte-swizzled box), the weight scales, the activations (e4m3: one 128-byte-swizzled box and the
// scales; bf16: two 64-wide halves).
template <int NT, int WN, bool ACT_FP8, int STAGES>
TILEHAL_DEVICE void fp4_produce(const Fp4Ring& r, const Fp4Tile& t, const TmaDescriptor* tma_b,
                                const TmaDescriptor* tma_sfb, const TmaDescriptor* tma_a, const TmaDescriptor* tma_sfa,
                                int shape_m, int shape_n, int shape_k) {
  using St = Fp4Stage<NT, WN, ACT_FP8>;
  const int b_row = t.group * shape_n + t.n_cta;
  const int a_row = t.group * shape_m + t.m0;
  const int sf_k = shape_k / 128;
  for (int ch = t.c_begin, i = 0; ch < t.c_end; ++ch, ++i) {
    const int s = i % STAGES;
    mbarrier_wait(&r.empty[s], ((i / STAGES) & 1) ^ 1);
    unsigned char* st = r.smem + s * St::kBytes;
    mbarrier_arrive_expect_tx(&r.full[s], St::kA + St::kW + St::kSfb + St::kSfa);
    tma_load_2d(st + St::kOffW, tma_b, &r.full[s], ch * 64, b_row);
    tma_load_2d(st + St::kOffSfb, tma_sfb, &r.full[s], ch * 4, b_row);
    tma_load_2d(st, tma_a, &r.full[s], ch * 128, a_row);
    if constexpr (ACT_FP8) {
      tma_load_2d(st + St::kOffSfa, tma_sfa, &r.full[s], t.m0, t.group * sf_k + ch);
    } else {
      tma_load_2d(st + St::kTokens * 128, tma_a, &r.full[s], ch * 128 + 64, a_row);
    }
  }
}

// A consumer's partial tile -> shared memory [TOKENS][ROWS] (token-major: D rows are then written along N).
// acc[4j + i] is the m16n8 swap-AB accumulator: weight row 16 warp + g + 8 (i / 2), token 8j + 2q + i % 2.
// It first syncs the CTA (the tile reuses the drained ring / activation tile); warps past WN store nothing.
template <int NT, int WN>
TILEHAL_DEVICE void store_partial(const float (&acc)[NT * 4], float* red, int warp) {
  constexpr int ROWS = 16 * WN;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  __syncthreads();
  if (warp < WN) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = warp * 16 + g + 8 * (i / 2);
        const int t = j * 8 + 2 * q + (i % 2);
        red[t * ROWS + r] = acc[4 * j + i];
      }
    }
  }
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

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;

  const Fp4Tile tile = fp4_tile<MASKED>(masked_m, shape_m, shape_k, m_blocks, TOKENS, ROWS, chunks_per_split);
  if (tile.m0 >= tile.rows_m) return;  // every CTA of this tile returns: the counter is never touched
  const int group = tile.group, m0 = tile.m0, rows_m = tile.rows_m, n_cta = tile.n_cta, c_begin = tile.c_begin;
  const int c_end = tile.c_end;

  extern __shared__ unsigned char smem_raw[];
  const Fp4Ring ring = fp4_ring_init<STAGES, fp4_ring_bytes<NT, WN, ACT_FP8, STAGES>()>(
      smem_raw, NUM_CONSUMERS, WN, &tma_b, &tma_sfb, &tma_a, ACT_FP8 ? &tma_sfa : nullptr);
  unsigned char* smem = ring.smem;
  float* red = reinterpret_cast<float*>(smem);  // [TOKENS][ROWS], over the drained ring
  u64* full_bar = ring.full;
  u64* empty_bar = ring.empty;

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;

  if (warp == WN) {
    // ---------------------------------------------------------------- producer warp
    if (lane == 0) fp4_produce<NT, WN, ACT_FP8, STAGES>(ring, tile, &tma_b, &tma_sfb, &tma_a, &tma_sfa, shape_m, shape_n,
                                                       shape_k);
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
  {
    float flat[NT * 4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) flat[4 * nt + i] = acc[nt][i];
    store_partial<NT, WN>(flat, red, warp);
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

// ==================================================================================================
// wgmma variant (bf16 activations): the weights are wgmma's register A operand.
//
// One consumer warpgroup owns 64 weight rows (NWG warpgroups: 64 NWG rows per CTA) and all 8 NT tokens
// of the CTA: per 128-wide K chunk it decodes its rows' codes straight into m64nNk16 A fragments
// (thread (warp w, lane 4g + q) holds rows 16w + g and + 8, K pairs 2q and 8 + 2q of every k16 step: the
// mma.sync m16n8k16 A layout) and issues 8 wgmmas against the stage's activation tile (two 128-byte-
// swizzled [TOKENS][64] bf16 halves, K-major: the wgmma B descriptor reads the TMA layout as is).
//
// Weight scales: a chunk whose 2 x 4 scales per thread are all powers of two (UE8M0, as
// cast_weights_to_fp4 makes them by default) in the exponent range [2, 252] is folded into the decoded
// bf16 weights (e2m1 * 2^e is exact in bf16), so its wgmmas accumulate straight into the K-long fp32
// accumulator: no promotion instructions at all. The warpgroup votes per chunk (bar.red.and); any other
// chunk runs the exact slow path: every scale split into 4 pieces of 6 significant bits, each piece
// folded (exactly) into its own copy of the weights, 4x the wgmmas. Only wgmma ever writes the
// accumulators (an FFMA on them would make ptxas serialize the wgmmas). Either way D is the
// reference's value up to fp32 summation order (every product exact).
//
// A fragments in two half-chunk buffers: each half's decode overlaps the other half's wgmmas (wait_group
// 1); a chunk's stage is released once its last wgmmas retire.
//
// Split-K across the CTAs of a thread-block cluster (gridDim.y = cluster size = splits, <= 8): every
// CTA leaves its fp32 partial tile in its own shared memory, the cluster syncs, and CTA r sums slice r
// of the tile over all splits in split order (deterministic) through distributed shared memory and
// writes D: no global workspace, no counters, every CTA reduces in parallel.
// ==================================================================================================

// Register-A wgmma wrappers: DG_FP4_RS(N, pred, D registers, A registers, B descriptor, D operands) defines
// WgmmaRsBF16<N> (m64nNk16 bf16, B K-major) and WgmmaRsE4M3<N> (m64nNk32 e4m3) from one operand list (the
// kinds differ only in the PTX shape / types and bf16's transpose-B immediate). The lines per N are generated.
#define DG_FP4_RS_ONE(NAME, N, SHAPE, TAIL, PRED, DREGS, AREGS, DESC, ...)                                       \
  template <> struct NAME<N> {                                                                                 \
    static TILEHAL_DEVICE void mma(float* d, const u32* a, u64 desc_b, int scale_d) {                          \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\nwgmma.mma_async.sync.aligned." SHAPE " {" DREGS \
                   "}, {" AREGS "}, " DESC ", p, 1, 1" TAIL ";\n}\n"                                              \
                   : __VA_ARGS__                                                                               \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));                   \
    }                                                                                                          \
  };
#define DG_FP4_RS(N, PRED, DREGS, AREGS, DESC, ...)                                                            \
  DG_FP4_RS_ONE(WgmmaRsBF16, N, "m64n" #N "k16.f32.bf16.bf16", ", 0", PRED, DREGS, AREGS, DESC, __VA_ARGS__)     \
  DG_FP4_RS_ONE(WgmmaRsE4M3, N, "m64n" #N "k32.f32.e4m3.e4m3", "", PRED, DREGS, AREGS, DESC, __VA_ARGS__)
template <int N> struct WgmmaRsBF16;
template <int N> struct WgmmaRsE4M3;
// GENERATED by packages/deepgemm/scripts/gen_fp4_wgmma_rs.py -- do not edit by hand.
DG_FP4_RS(8, "%9", "%0, %1, %2, %3", "%4, %5, %6, %7", "%8", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]))
DG_FP4_RS(16, "%13", "%0, %1, %2, %3, %4, %5, %6, %7", "%8, %9, %10, %11", "%12", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]))
DG_FP4_RS(32, "%21", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15", "%16, %17, %18, %19", "%20", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]))
DG_FP4_RS(64, "%37", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31", "%32, %33, %34, %35", "%36", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]))
DG_FP4_RS(128, "%69", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63", "%64, %65, %66, %67", "%68", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]))
// END GENERATED
#undef DG_FP4_RS
#undef DG_FP4_RS_ONE


template <int V> struct IntC { static constexpr int value = V; };

TILEHAL_DEVICE u32 bf16x2_mul(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// A power-of-two fp32 scale whose products with e2m1 magnitudes (0.5 .. 6) are normal bf16 numbers.
TILEHAL_DEVICE bool foldable(float s) {
  const u32 b = __float_as_uint(s);
  const u32 e = (b >> 23) & 0xFFu;
  return (b & 0x7FFFFFu) == 0 && e >= 2 && e <= 252;
}

// AND of `p` over the 128 threads of warpgroup `wg` (named barrier 1 + wg; 0 is __syncthreads).
TILEHAL_DEVICE bool warpgroup_all(bool p, int wg) {
  u32 r;
  asm volatile("{\n.reg .pred pi, po;\nsetp.ne.u32 pi, %1, 0;\nbar.red.and.pred po, %2, 128, pi;\n"
               "selp.u32 %0, 1, 0, po;\n}"
               : "=r"(r)
               : "r"(static_cast<u32>(p)), "r"(wg + 1)
               : "memory");
  return r != 0;
}

template <int R>
TILEHAL_DEVICE void fence_regs(u32 (&a)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// The same for 16 registers of a larger fragment array (a + 0 .. a + 15, constant indices after unrolling).
TILEHAL_DEVICE void fence_regs16(u32* a) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

TILEHAL_DEVICE float4 ld_cluster_f4(const void* p, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

// The 16 codes of 32-wide group `gg` that thread q needs for rows at `row_unit` (the row's swizzled 16-byte
// unit): bytes q, 4 + q, 8 + q, 12 + q, i.e. K pairs 2q, 8 + 2q of k16 step 0 and of step 1.
TILEHAL_DEVICE u32 gather_codes_k16(const unsigned char* row_unit, int q) {
  const uint4 u = *reinterpret_cast<const uint4*>(row_unit);
  const u32 sel = static_cast<u32>(q) | static_cast<u32>(q + 4) << 4;
  return prmt(prmt(u.x, u.y, sel), prmt(u.z, u.w, sel), 0x5410);
}

// The split-K reduction and D of a CTA whose fp32 partial tile is in shared memory as [TOKENS][ROWS] (every
// thread of the CTA calls it after the tile is complete and the CTA synced): CTA r of the cluster sums slice r
// over the splits in split order through distributed shared memory, adds C and writes D in row-major [M, N].
template <int ROWS, int TOKENS, typename OutT, bool HAS_C, int THREADS>
TILEHAL_DEVICE void cluster_reduce_store(const float* red, OutT* d, const float* c, int group, int shape_m,
                                         int shape_n, int m0, int rows_m, int n_cta) {
  const int splits = gridDim.y;
  const int valid4 = min(TOKENS, rows_m - m0) * ROWS / 4;
  const float4* red4 = reinterpret_cast<const float4*>(red);
  int e_begin = 0, e_end = valid4;
  if (splits > 1) {
    cluster_sync();  // every split's partial tile is in its CTA's shared memory
    const int rank = static_cast<int>(cluster_ctarank());
    const int per = (valid4 + splits - 1) / splits;
    e_begin = min(valid4, rank * per);
    e_end = min(valid4, e_begin + per);
  } else {
    __syncthreads();
  }
  OutT* d_g = d + static_cast<size_t>(group) * shape_m * shape_n;
  const float* c_g = HAS_C ? c + static_cast<size_t>(group) * shape_m * shape_n : nullptr;
  for (int e = e_begin + static_cast<int>(threadIdx.x); e < e_end; e += THREADS) {
    float4 v;
    if (splits == 1) {
      v = red4[e];
    } else {
      v = ld_cluster_f4(red4 + e, 0);
      for (int sp = 1; sp < splits; ++sp) {  // in split order: the same sum whichever CTA reduces
        const float4 t = ld_cluster_f4(red4 + e, sp);
        v.x += t.x, v.y += t.y, v.z += t.z, v.w += t.w;
      }
    }
    const int t = (4 * e) / ROWS, r = (4 * e) % ROWS;
    const int m = m0 + t;
    if (m >= rows_m) continue;
    const float vals[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int n = n_cta + r + u;
      if (n >= shape_n) break;
      const size_t off = static_cast<size_t>(m) * shape_n + n;
      float x = vals[u];
      if constexpr (HAS_C) x += c_g[off];
      if constexpr (sizeof(OutT) == 2) {
        d_g[off] = __float2bfloat16_rn(x);
      } else {
        d_g[off] = x;
      }
    }
  }
  if (splits > 1) cluster_sync();  // no CTA leaves while a peer still reads its shared memory
}


// The wgmma kernels' epilogue: the partial tile -> shared memory [TOKENS][ROWS] over the drained ring
// (acc[4j + i]: row 16 warp + g + 8 (i / 2), token 8j + 2q + i % 2, the mma.sync kernel's layout), then
// the cluster's split-K reduction through distributed shared memory (CTA r sums slice r in split order)
// and D (+ C) in row-major [M, N]. Every thread of the CTA (THREADS: WN consumer warps + the producer
// warp, or WN warps for the streaming kernel) calls it.
template <int NT, int WN, typename OutT, bool HAS_C, int THREADS = 32 * WN + 32>
TILEHAL_DEVICE void cluster_epilogue(const float (&acc)[NT * 4], float* red, int warp, OutT* d, const float* c,
                                     int group, int shape_m, int shape_n, int m0, int rows_m, int n_cta) {
  store_partial<NT, WN>(acc, red, warp);
  cluster_reduce_store<16 * WN, 8 * NT, OutT, HAS_C, THREADS>(red, d, c, group, shape_m, shape_n, m0, rows_m, n_cta);
}

// kMinBlocks of the wgmma kernel (cuda_fp4.wgmma_min_blocks mirrors it).
template <int NT> constexpr int kWgMinBlocks = NT <= 2 ? 3 : NT <= 4 ? 2 : 1;

template <int NT, int NWG, typename OutT, bool HAS_C, bool MASKED, int STAGES>
__global__ void __launch_bounds__(128 * NWG + 32, kWgMinBlocks<NT>)
fp4_wgmma_sm90(const __grid_constant__ TmaDescriptor tma_b, const __grid_constant__ TmaDescriptor tma_sfb,
               const __grid_constant__ TmaDescriptor tma_a, OutT* __restrict__ d, const float* __restrict__ c,
               const int* __restrict__ masked_m, int shape_m, int shape_n, int shape_k, int m_blocks,
               int chunks_per_split) {
  constexpr int WN = 4 * NWG;
  using St = Fp4Stage<NT, WN, false>;
  constexpr int ROWS = St::kRows;      // 64 NWG
  constexpr int TOKENS = St::kTokens;  // 8 NT = the wgmma N
  constexpr int NUM_CONSUMERS = 128 * NWG;
  constexpr int R = TOKENS / 2;  // accumulators per thread
  using Mma = WgmmaRsBF16<TOKENS>;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;

  const Fp4Tile tile = fp4_tile<MASKED>(masked_m, shape_m, shape_k, m_blocks, TOKENS, ROWS, chunks_per_split);
  if (tile.m0 >= tile.rows_m) return;  // the whole cluster (one tile) returns together
  const int group = tile.group, m0 = tile.m0, rows_m = tile.rows_m, n_cta = tile.n_cta, c_begin = tile.c_begin;
  const int c_end = tile.c_end;

  extern __shared__ unsigned char smem_raw[];
  const Fp4Ring ring = fp4_ring_init<STAGES, fp4_ring_bytes<NT, WN, false, STAGES>()>(
      smem_raw, NUM_CONSUMERS, WN, &tma_b, &tma_sfb, &tma_a, nullptr);
  unsigned char* smem = ring.smem;
  u64 *full_bar = ring.full, *empty_bar = ring.empty;
  float acc[R] = {};  // written by wgmma only (ptxas serializes wgmmas whose accumulators other code writes)

  if (warp == WN) {
    // ---------------------------------------------------------------- producer warp
    if (lane == 0) fp4_produce<NT, WN, false, STAGES>(ring, tile, &tma_b, &tma_sfb, &tma_a, nullptr, shape_m, shape_n,
                                                     shape_k);
  } else {
    // ---------------------------------------------------------------- consumer warpgroups
    const int wg = warp / 4;
    const int r0 = warp * 16 + g;  // rows r0 and r0 + 8 of the CTA
    // A fragments of a chunk in two halves (unit u = groups 2u, 2u + 1: [group & 1][k16 step][a0..a3]):
    // unit 1 is decoded while unit 0's wgmmas run, and the next chunk's unit 0 while unit 1's do.
    // 32 registers: with 64 accumulators (128 tokens) the kernel stays within 168 without serializing.
    u32 afr[32];
    int pending = -1;  // stage whose last wgmmas are still in flight (fast path)

    auto release = [&](int s) {
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&empty_bar[s]);
    };

    for (int i = 0, n_ch = c_end - c_begin; i < n_ch; ++i) {
      const int s = i % STAGES;
      mbarrier_wait(&full_bar[s], (i / STAGES) & 1);
      const unsigned char* st = smem + s * St::kBytes;
      const float4 sb0 = *reinterpret_cast<const float4*>(st + St::kOffSfb + r0 * 16);
      const float4 sb1 = *reinterpret_cast<const float4*>(st + St::kOffSfb + (r0 + 8) * 16);
      const float sc[2][4] = {{sb0.x, sb0.y, sb0.z, sb0.w}, {sb1.x, sb1.y, sb1.z, sb1.w}};
      bool ok = true;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) ok = ok && foldable(sc[h][gg]);
      const bool fold = warpgroup_all(ok, wg);
      const u64 desc0 = make_smem_desc_k128b(st);
      const u64 desc1 = make_smem_desc_k128b(st + TOKENS * 128);

      if (fold) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          // unit u's buffer is free: its previous wgmmas retired at the wait after the other unit's issue
#pragma unroll
          for (int g2 = 0; g2 < 2; ++g2) {
            const int gg = 2 * u + g2;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const u32 w = gather_codes_k16(st + St::kOffW + swz<64>(r0 + 8 * h, gg), q);
              u32 v[4];
              decode_bf16(w, v);
              const u32 s2 = prmt(__float_as_uint(sc[h][gg]), 0u, 0x3232);  // bf16x2 (s, s): exact, a power of two
              // [step][a0 a1 a2 a3]: a0 / a2 = row r0, K pairs 2q / 8 + 2q; a1 / a3 = row r0 + 8
              u32* f = afr + 16 * u + 8 * g2;
              f[0 + h] = bf16x2_mul(v[0], s2);
              f[2 + h] = bf16x2_mul(v[1], s2);
              f[4 + h] = bf16x2_mul(v[2], s2);
              f[6 + h] = bf16x2_mul(v[3], s2);
            }
          }
          wgmma_fence_operands(acc);
          wgmma_fence();
#pragma unroll
          for (int g2 = 0; g2 < 2; ++g2) {
            const u64 dsc = (u == 0 ? desc0 : desc1) + g2 * 4;  // groups 2u + g2: half u, 64 bytes in per group
            Mma::mma(acc, afr + 16 * u + 8 * g2, dsc, 1);
            Mma::mma(acc, afr + 16 * u + 8 * g2 + 4, dsc + 2, 1);
          }
          wgmma_commit();
          wgmma_wait<1>();  // the other unit's wgmmas (previous chunk's unit 1, or this chunk's unit 0) are done
          fence_regs16(afr + 16 * (1 - u));
          wgmma_fence_operands(acc);
          if (u == 0 && pending >= 0) release(pending);  // the previous chunk is fully consumed
        }
        pending = s;
      } else {
        // Exact slow path (a scale that is not a power of two): split every scale into 4 pieces of at
        // most 6 significant bits (s = s0 + s1 + s2 + s3 exactly), so e2m1 * piece (<= 8 bits) is an exact
        // bf16; the 4 piece-weighted wgmmas of a group sum exactly the products e2m1 * s * a in fp32.
        wgmma_wait<0>();
        fence_regs16(afr);
        fence_regs16(afr + 16);
        wgmma_fence_operands(acc);
        if (pending >= 0) release(pending);
        pending = -1;
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const u32 w = gather_codes_k16(st + St::kOffW + swz<64>(r0 + 8 * h, gg), q);
            u32 v[4];
            decode_bf16(w, v);
            float rest = sc[h][gg];
#pragma unroll
            for (int pc = 0; pc < 4; ++pc) {
              const float piece = __uint_as_float(__float_as_uint(rest) & 0xFFFC0000u);  // top 6 bits
              rest -= piece;                                                            // exact
              const u32 s2 = prmt(__float_as_uint(piece), 0u, 0x3232);
              afr[pc * 8 + 0 + h] = bf16x2_mul(v[0], s2);
              afr[pc * 8 + 2 + h] = bf16x2_mul(v[1], s2);
              afr[pc * 8 + 4 + h] = bf16x2_mul(v[2], s2);
              afr[pc * 8 + 6 + h] = bf16x2_mul(v[3], s2);
            }
          }
          const u64 dsc = (gg < 2 ? desc0 : desc1) + (gg & 1) * 4;
          wgmma_fence_operands(acc);
          wgmma_fence();
#pragma unroll
          for (int pc = 0; pc < 4; ++pc) {
            Mma::mma(acc, afr + pc * 8, dsc, 1);
            Mma::mma(acc, afr + pc * 8 + 4, dsc + 2, 1);
          }
          wgmma_commit();
          wgmma_wait<0>();
          fence_regs16(afr);
          fence_regs16(afr + 16);
          wgmma_fence_operands(acc);
        }
        release(s);
      }
    }
    wgmma_wait<0>();
    fence_regs16(afr);
    fence_regs16(afr + 16);
    wgmma_fence_operands(acc);
    if (pending >= 0) release(pending);
  }

  cluster_epilogue<NT, WN, OutT, HAS_C>(acc, reinterpret_cast<float*>(smem), warp, d, c, group, shape_m, shape_n, m0,
                                        rows_m, n_cta);
}

// The 16 codes of 32-wide group `gg` that thread q needs for an m64nNk32 e4m3 A fragment: bytes 2q, 2q + 1
// (K 4q .. 4q + 3) and 8 + 2q, 9 + 2q (K 16 + 4q ..) of the row's 16-byte unit, as one word of 8 codes.
TILEHAL_DEVICE u32 gather_codes_k32(const unsigned char* row_unit, int q) {
  const uint4 u = *reinterpret_cast<const uint4*>(row_unit);
  const u32 x = (q & 2) ? u.y : u.x, y = (q & 2) ? u.w : u.z;
  return prmt(x, y, (q & 1) ? 0x7632u : 0x5410u);
}

// ==================================================================================================
// wgmma variant for e4m3 activations: m64nNk32 e4m3 with the decoded weights as register A.
//
// Per 128-wide chunk one fresh partial P (4 chained wgmmas) is promoted once: acc += P * 2^E[row] * sa[token].
// The per-32 weight scales are folded into the decoded e4m3 weights relative to the row's largest scale
// of the chunk (2^E): a power-of-two scale 2^(E - d) with d <= 5 moves every nonzero table byte down by
// 8d (the e4m3 exponent field), exact since the smallest magnitude (.5, field 6) stays normal. A chunk
// where some thread's scale is not such (fp32 scales, a spread over 5 binades, a sign) runs the exact
// slow path: a fresh P per 32-wide group promoted with that group's scale. The next chunk's decode runs
// while the current chunk's wgmmas do (double-buffered A fragments). NT <= 8 (registers: acc, P, A).
// ==================================================================================================
template <int NT, int NWG, typename OutT, bool HAS_C, bool MASKED, int STAGES>
__global__ void __launch_bounds__(128 * NWG + 32, kWgMinBlocks<NT>)
fp4_wgmma_fp8_sm90(const __grid_constant__ TmaDescriptor tma_b, const __grid_constant__ TmaDescriptor tma_sfb,
                   const __grid_constant__ TmaDescriptor tma_a, const __grid_constant__ TmaDescriptor tma_sfa,
                   OutT* __restrict__ d, const float* __restrict__ c, const int* __restrict__ masked_m, int shape_m,
                   int shape_n, int shape_k, int m_blocks, int chunks_per_split) {
  constexpr int WN = 4 * NWG;
  using St = Fp4Stage<NT, WN, true>;
  constexpr int TOKENS = St::kTokens;
  constexpr int NUM_CONSUMERS = 128 * NWG;
  constexpr int R = TOKENS / 2;
  using Mma = WgmmaRsE4M3<TOKENS>;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;

  const Fp4Tile tile = fp4_tile<MASKED>(masked_m, shape_m, shape_k, m_blocks, TOKENS, St::kRows, chunks_per_split);
  if (tile.m0 >= tile.rows_m) return;  // the whole cluster (one tile) returns together
  const int group = tile.group, m0 = tile.m0, rows_m = tile.rows_m, n_cta = tile.n_cta, c_begin = tile.c_begin;
  const int c_end = tile.c_end;

  extern __shared__ unsigned char smem_raw[];
  const Fp4Ring ring = fp4_ring_init<STAGES, fp4_ring_bytes<NT, WN, true, STAGES>()>(
      smem_raw, NUM_CONSUMERS, WN, &tma_b, &tma_sfb, &tma_a, &tma_sfa);
  unsigned char* smem = ring.smem;
  u64 *full_bar = ring.full, *empty_bar = ring.empty;
  float acc[R] = {};  // written by wgmma only (ptxas serializes wgmmas whose accumulators other code writes)

  if (warp == WN) {
    if (lane == 0) fp4_produce<NT, WN, true, STAGES>(ring, tile, &tma_b, &tma_sfb, &tma_a, &tma_sfa, shape_m, shape_n,
                                                    shape_k);
  } else {
    const int wg = warp / 4;
    const int r0 = warp * 16 + g;
    u32 afr[2][16];  // A fragments of two chunks: [group][a0..a3]
    float P[R];      // the chunk's partial sums: written by wgmma only
    float rs[2][2];  // per buffer: 2^E of rows r0 and r0 + 8 (the folded chunk's row factor)
    const int n_ch = c_end - c_begin;

    auto scales = [&](const unsigned char* st, float (&sc)[2][4]) {
      const float4 sb0 = *reinterpret_cast<const float4*>(st + St::kOffSfb + r0 * 16);
      const float4 sb1 = *reinterpret_cast<const float4*>(st + St::kOffSfb + (r0 + 8) * 16);
      sc[0][0] = sb0.x, sc[0][1] = sb0.y, sc[0][2] = sb0.z, sc[0][3] = sb0.w;
      sc[1][0] = sb1.x, sc[1][1] = sb1.y, sc[1][2] = sb1.z, sc[1][3] = sb1.w;
    };

    // Wait for chunk i, vote, and (folded) decode it into buffer BUF. Returns whether it folded.
    auto prep = [&](auto buf_c, int i) -> bool {
      constexpr int BUF = decltype(buf_c)::value;
      const int s = i % STAGES;
      mbarrier_wait(&full_bar[s], (i / STAGES) & 1);
      const unsigned char* st = smem + s * St::kBytes;
      float sc[2][4];
      scales(st, sc);
      bool ok = true;
      u32 ex[2][4], emax[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        emax[h] = 0;
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) {
          const u32 b = __float_as_uint(sc[h][gg]);
          ex[h][gg] = b >> 23;  // sign bit included: a negative scale fails the range check below
          ok = ok && (b & 0x7FFFFFu) == 0 && ex[h][gg] >= 1 && ex[h][gg] <= 254;
          emax[h] = max(emax[h], ex[h][gg]);
        }
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) ok = ok && emax[h] - ex[h][gg] <= 5;
        rs[BUF][h] = __uint_as_float(min(max(emax[h], 1u), 254u) << 23);
      }
      const bool fold = warpgroup_all(ok, wg);
      if (fold) {
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const u32 w = gather_codes_k32(st + St::kOffW + swz<64>(r0 + 8 * h, gg), q);
            const u32 dl = (emax[h] - ex[h][gg]) * 8;  // e4m3 exponent field steps
            u32 lo, hi;
            decode_e4m3_tab(w, kE4M3T0 - dl * 0x01010100u, kE4M3T1 - dl * 0x01010101u, lo, hi);
            afr[BUF][gg * 4 + h] = lo;       // a0 / a1: rows r0 / r0 + 8, K 4q .. 4q + 3
            afr[BUF][gg * 4 + 2 + h] = hi;   // a2 / a3: K 16 + 4q ..
          }
        }
      }
      return fold;
    };

    auto release = [&](int s) {
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&empty_bar[s]);
    };

    // acc += P * (row factor * sa[token]) with the stage's activation scales.
    auto promote = [&](const unsigned char* st, float f0, float f1) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float2 sa = *reinterpret_cast<const float2*>(st + St::kOffSfa + (j * 8 + 2 * q) * 4);
        acc[4 * j + 0] += P[4 * j + 0] * (f0 * sa.x);
        acc[4 * j + 1] += P[4 * j + 1] * (f0 * sa.y);
        acc[4 * j + 2] += P[4 * j + 2] * (f1 * sa.x);
        acc[4 * j + 3] += P[4 * j + 3] * (f1 * sa.y);
      }
    };

    // Run chunk i (prepared in BUF, folded or not); prepare chunk i + 1 meanwhile; returns its fold flag.
    auto run = [&](auto buf_c, int i, bool fold) -> bool {
      constexpr int BUF = decltype(buf_c)::value;
      const int s = i % STAGES;
      const unsigned char* st = smem + s * St::kBytes;
      const u64 desc = make_smem_desc_k128b(st);
      bool next = false;
      if (fold) {
        wgmma_fence_operands(P);
        wgmma_fence();
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) Mma::mma(P, &afr[BUF][gg * 4], desc + gg * 2, gg > 0);
        wgmma_commit();
        if (i + 1 < n_ch) next = prep(IntC<BUF ^ 1>{}, i + 1);
        wgmma_wait<0>();
        fence_regs(afr[BUF]);
        wgmma_fence_operands(P);
        promote(st, rs[BUF][0], rs[BUF][1]);
      } else {
        float sc[2][4];
        scales(st, sc);
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const u32 w = gather_codes_k32(st + St::kOffW + swz<64>(r0 + 8 * h, gg), q);
            decode_e4m3(w, afr[BUF][h], afr[BUF][2 + h]);
          }
          wgmma_fence_operands(P);
          wgmma_fence();
          Mma::mma(P, &afr[BUF][0], desc + gg * 2, 0);
          wgmma_commit();
          wgmma_wait<0>();
          fence_regs(afr[BUF]);
          wgmma_fence_operands(P);
          promote(st, sc[0][gg], sc[1][gg]);
        }
        if (i + 1 < n_ch) next = prep(IntC<BUF ^ 1>{}, i + 1);
      }
      release(s);
      return next;
    };

    bool f = n_ch > 0 ? prep(IntC<0>{}, 0) : false;
    for (int i = 0; i < n_ch; i += 2) {
      f = run(IntC<0>{}, i, f);
      if (i + 1 < n_ch) f = run(IntC<1>{}, i + 1, f);
    }
  }

  cluster_epilogue<NT, WN, OutT, HAS_C>(acc, reinterpret_cast<float*>(smem), warp, d, c, group, shape_m, shape_n, m0,
                                        rows_m, n_cta);
}


// ==================================================================================================
// Streaming kernel (bf16 activations, 8-64 tokens per m-block): no TMA, no mbarriers, no producer warp.
//
// At M <= 16 the time is the weight bytes, so every thread loads its share of the CTA's whole K range
// into registers up front (P chunk slots, `ld.global.nc.L1::no_allocate.v4`: 16 codes-bytes of each of
// its two rows per 128-wide chunk; slot j is refilled with chunk j + P once chunk j is consumed), so a
// warp keeps up to 16 rows x P x 64 bytes in flight with no barrier between the loads and the math.
// The CTA's activations (bf16, only the valid tokens' rows) land in shared memory by cp.async meanwhile,
// swizzled so that the B-fragment reads are conflict free: the whole K range at once for narrow token tiles,
// else through a ring of three one-chunk buffers (RING).
//
// mma.sync m16n8k16 swap-AB (weights = A, 16 rows per warp; tokens = B): thread q of a quad takes the
// whole 32-wide group q of the chunk (K 32q .. 32q + 31: its 16 contiguous bytes of codes), so one mma
// sums 4 groups (one per q) and the scales cannot apply after it: a power-of-two scale (UE8M0, the
// cast's default) is folded into the decoded bf16 weights (exact); a chunk where any of the warp's
// scales is not one runs every scale as 4 pieces of 6 significant bits (exact, 4x the mmas), as the
// wgmma kernel does. Step j of the chunk (j = 0..7) takes K 32q + 4j .. + 3 of every row and token:
// a0 / a2 = row g, codes 4j, 4j + 1 / 4j + 2, 4j + 3; a1 / a3 = row g + 8; b0 / b1 the same K of token g.
// K splits are one thread-block cluster along grid y (cluster_epilogue: DSMEM reduction in split order).
// ==================================================================================================

TILEHAL_DEVICE float ldg_stream_f32(const float* p) {
  float v;
  asm volatile("ld.global.nc.L1::no_allocate.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// 16 bytes global -> shared (cp.async.cg), zero-filled when !valid (nothing is read then).
TILEHAL_DEVICE void cp_async16_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

TILEHAL_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Physical 16-byte unit of unit u of token row t in the streaming kernel's activation tile: a quarter
// warp (tokens 2p, 2p + 1; q = 0..3) reads units 16c + 4q + s, which this maps onto 8 distinct bank groups.
TILEHAL_DEVICE int stream_unit(int t, int u) { return u ^ (((u >> 3) & 1) << 1) ^ (t & 1); }

// Steps 2x and 2x + 1 of a chunk for every n-tile: rows g / g + 8 decoded into d0 / d1 (4 bf16x2 words:
// codes 0-1, 2-3, 4-5, 6-7 of word x), multiplied by the bf16x2 scale (pieces) s0 / s1, times the 16-byte
// activation unit of token 8 nt + g at act + nt * nt_stride (steps 2x: .x .y, 2x + 1: .z .w; zeros past the
// valid tokens, whose rows are never loaded).
template <int NT>
TILEHAL_DEVICE void stream_steps(float (&acc)[NT][4], const u32 (&d0)[4], const u32 (&d1)[4], u32 s0, u32 s1,
                                 const unsigned char* act, int nt_stride, int valid_t, int g) {
  const u32 a_lo[4] = {bf16x2_mul(d0[0], s0), bf16x2_mul(d1[0], s1), bf16x2_mul(d0[1], s0), bf16x2_mul(d1[1], s1)};
  const u32 a_hi[4] = {bf16x2_mul(d0[2], s0), bf16x2_mul(d1[2], s1), bf16x2_mul(d0[3], s0), bf16x2_mul(d1[3], s1)};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (nt * 8 + g < valid_t) v = *reinterpret_cast<const uint4*>(act + nt * nt_stride);
    const u32 b_lo[2] = {v.x, v.y};
    const u32 b_hi[2] = {v.z, v.w};
    mma_m16n8k16(MmaBF16{}, acc[nt], a_lo, b_lo);
    mma_m16n8k16(MmaBF16{}, acc[nt], a_hi, b_hi);
  }
}

// kMinBlocks of the streaming kernel (cuda_fp4.stream_min_blocks mirrors it): 128 registers a thread.
template <int WN> constexpr int kStreamMinBlocks = 16 / WN;

// Activations of chunks [c0, c0 + n) of the CTA's range, token rows [0, valid_t) -> shared memory at `dst`
// (row stride `stride` bytes, chunk c at byte 256 (c - c0) of its row: unit 16 (c - c0) + u, swizzled).
template <int THREADS>
TILEHAL_DEVICE void stream_copy_act(unsigned char* dst, int stride, const __nv_bfloat16* a_g, int lda, int c0, int n,
                                    int valid_t) {
  const int units = n * 16;  // 16-byte units per token row
  for (int e = threadIdx.x; e < valid_t * units; e += THREADS) {
    const int t = e / units, u = e % units;
    cp_async16_zfill(dst + t * stride + stream_unit(t, u) * 16, a_g + static_cast<size_t>(t) * lda + c0 * 128 + u * 8,
                     true);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// RING = false: the CTA's whole K range of activations is staged once ([TOKENS][cps x 256 bytes]); RING = true
// (wide token tiles, whose whole range would not fit): a ring of 3 one-chunk buffers ([TOKENS][256 bytes]
// each), chunk i + 2 copied while chunk i is consumed (one CTA barrier per chunk).
template <int NT, int WN, int P, typename OutT, bool HAS_C, bool MASKED, bool RING = false>
__global__ void __launch_bounds__(32 * WN, kStreamMinBlocks<WN>)
fp4_stream_sm90(const unsigned char* __restrict__ b, const float* __restrict__ sfb,
                const __nv_bfloat16* __restrict__ a, OutT* __restrict__ d, const float* __restrict__ c,
                const int* __restrict__ masked_m, int shape_m, int shape_n, int shape_k, int lda, int m_blocks,
                int chunks_per_split) {
  constexpr int ROWS = 16 * WN, TOKENS = 8 * NT, THREADS = 32 * WN;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;

  const Fp4Tile tile = fp4_tile<MASKED>(masked_m, shape_m, shape_k, m_blocks, TOKENS, ROWS, chunks_per_split);
  if (tile.m0 >= tile.rows_m) return;  // the whole cluster (one tile) returns together
  const int group = tile.group, m0 = tile.m0, rows_m = tile.rows_m, n_cta = tile.n_cta, c_begin = tile.c_begin;
  const int valid_t = min(TOKENS, rows_m - m0);
  const int n_ch = max(0, tile.c_end - c_begin);

  // This thread's two weight rows: codes from byte 64 c_begin + 16 q, scales from group 4 c_begin + q.
  const unsigned char* wp[2];
  const float* sp[2];
  bool rv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = n_cta + warp * 16 + g + 8 * h;
    rv[h] = r < shape_n;
    const size_t row = static_cast<size_t>(group) * shape_n + (rv[h] ? r : 0);
    wp[h] = b + row * (shape_k / 2) + c_begin * 64 + q * 16;
    sp[h] = sfb + row * (shape_k / 32) + c_begin * 4 + q;
  }
  uint4 cw[P][2];
  float cs[P][2];
#pragma unroll
  for (int j = 0; j < P; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      cw[j][h] = make_uint4(0u, 0u, 0u, 0u);
      cs[j][h] = 1.f;
      if (j < n_ch && rv[h]) {
        cw[j][h] = load_nc_v4<uint4>(wp[h] + j * 64);
        cs[j][h] = ldg_stream_f32(sp[h] + j * 4);
      }
    }
  }

  // Activations -> shared memory (cp.async; rows past the valid tokens are neither copied nor read).
  extern __shared__ __align__(128) unsigned char smem[];
  const __nv_bfloat16* a_g = a + (static_cast<size_t>(group) * shape_m + m0) * lda + c_begin * 128;
  constexpr int RING_BUF = TOKENS * 256;
  const int stride = RING ? 256 : chunks_per_split * 256;
  if constexpr (RING) {
    stream_copy_act<THREADS>(smem, stride, a_g, lda, 0, min(n_ch, 1), valid_t);
    stream_copy_act<THREADS>(smem + RING_BUF, stride, a_g, lda, 1, n_ch > 1 ? 1 : 0, valid_t);
  } else {
    stream_copy_act<THREADS>(smem, stride, a_g, lda, 0, n_ch, valid_t);
    cp_async_wait_all();
    __syncthreads();
  }

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;

  // stream_unit(g, 16c + 4q + x) = 16c + 4q + (x ^ swz_c): the XOR touches bits 0-1 only.
  const int swz_c = (((q >> 1) & 1) << 1) | (g & 1);
  const int thr_off = g * stride + q * 64;
  // The decode tables' register words, opaque to the compiler (shape_k >= 0: the product is 0) and per-lane (a
  // uniform register would be copied into a vector one before every prmt), kept live across the loop.
  const u32 opaque0 = (static_cast<u32>(shape_k) >> 31) * static_cast<u32>(lane);
  const u32 tab_l0 = kBf16L0 | opaque0, tab_h0 = kBf16H0 | opaque0;

  for (int base = 0; base < n_ch; base += P) {
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int i = base + j;  // chunk of this CTA's range (uniform over the CTA)
      if (i < n_ch) {
        const unsigned char* act = smem;  // chunk i's tile, unit 0 of token row 0
        if constexpr (RING) {
          asm volatile("cp.async.wait_group 1;" ::: "memory");  // chunk i landed (i + 1 may still fly)
          __syncthreads();  // ... for every thread's copies, and chunk i - 1's buffer is free for chunk i + 2
          stream_copy_act<THREADS>(smem + ((i + 2) % 3) * RING_BUF, stride, a_g, lda, i + 2, i + 2 < n_ch ? 1 : 0,
                                   valid_t);
          act = smem + (i % 3) * RING_BUF;
        }
        const unsigned char* act_i = act + thr_off + (RING ? 0 : i * 256);  // row g, unit 4q of chunk i
        const float s0 = cs[j][0], s1 = cs[j][1];
        const bool fold = __all_sync(0xFFFFFFFFu, foldable(s0) && foldable(s1));
        const u32 s2_0 = prmt(__float_as_uint(s0), 0u, 0x3232), s2_1 = prmt(__float_as_uint(s1), 0u, 0x3232);
        const u32 w[2][4] = {{cw[j][0].x, cw[j][0].y, cw[j][0].z, cw[j][0].w},
                             {cw[j][1].x, cw[j][1].y, cw[j][1].z, cw[j][1].w}};
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const unsigned char* ax = act_i + ((x ^ swz_c) << 4);  // unit stream_unit(g, 16 i + 4q + x) of row g
          u32 d0[4], d1[4];
          decode_bf16_tab(w[0][x], d0, tab_l0, tab_h0);
          decode_bf16_tab(w[1][x], d1, tab_l0, tab_h0);
          if (fold) {
            stream_steps<NT>(acc, d0, d1, s2_0, s2_1, ax, 8 * stride, valid_t, g);
          } else {
            float rest0 = s0, rest1 = s1;
#pragma unroll 1
            for (int pc = 0; pc < 4; ++pc) {  // s = p0 + p1 + p2 + p3 exactly, each of <= 6 significant bits
              const float p0 = __uint_as_float(__float_as_uint(rest0) & 0xFFFC0000u);
              const float p1 = __uint_as_float(__float_as_uint(rest1) & 0xFFFC0000u);
              rest0 -= p0;
              rest1 -= p1;
              stream_steps<NT>(acc, d0, d1, prmt(__float_as_uint(p0), 0u, 0x3232),
                               prmt(__float_as_uint(p1), 0u, 0x3232), ax, 8 * stride, valid_t, g);
            }
          }
        }
        if (i + P < n_ch) {  // refill the slot with chunk i + P (the other slots' loads are in flight meanwhile)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (rv[h]) {
              cw[j][h] = load_nc_v4<uint4>(wp[h] + (i + P) * 64);
              cs[j][h] = ldg_stream_f32(sp[h] + (i + P) * 4);
            }
          }
        }
      }
    }
  }
  if constexpr (RING) cp_async_wait_all();  // the last (empty) groups: nothing may still write the tile

  float flat[NT * 4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) flat[4 * nt + i] = acc[nt][i];
  cluster_epilogue<NT, WN, OutT, HAS_C, THREADS>(flat, reinterpret_cast<float*>(smem), warp, d, c, group, shape_m,
                                                 shape_n, m0, rows_m, n_cta);
}


// ==================================================================================================
// Small-M kernel (bf16 activations, <= 32 tokens): the streaming kernel's data path, built for occupancy.
//
// At M <= 16 every kernel above is latency-bound at 8-16 warps per SM (ncu, docs/deepgemm.md). Here a CTA is
// RW x KW warps: RW row warps of 16 weight rows each, and KW k-warps that split the CTA's K range among
// themselves (warp kw takes chunks kw, kw + KW, ... of the range), so a tile of 16 RW rows is worked on by KW
// warps per CTA times gridDim.y CTAs (a thread-block cluster). Each thread keeps P chunks of its two rows'
// codes and scales in registers (`load_nc_v4`, issued before anything else) and refills a slot as soon as it
// is consumed (with P = 1: before the chunk's math, two chunks in flight); P is small (1-3) so that 16-32 warps per
// SM (MINB CTAs of 8 warps) fit their registers. The activations of the CTA's
// whole K range are staged once in shared memory (cp.async, the streaming kernel's swizzle: conflict free).
// Decode, scale folding (power-of-two scales exact in the bf16 weights; any other scale: the 4-piece slow
// path) and the mma.sync m16n8k16 swap-AB steps are the streaming kernel's (stream_steps).
// Reduction, deterministic: the KW k-warps' accumulators are added in k-warp order through shared memory,
// then the cluster's CTAs in split order through DSMEM (cluster_epilogue), which also adds C and writes D.
// ==================================================================================================

// Steps 2x and 2x + 1 of a chunk for every n-tile (stream_steps without its token guard): the activation rows of
// tokens past the valid ones are read as they are (never written: any value), which only reaches the D columns of
// those tokens (an mma's column j sums B's column j alone), never stored.
template <int NT>
TILEHAL_DEVICE void small_steps(float (&acc)[NT][4], const u32 (&d0)[4], const u32 (&d1)[4], u32 s0, u32 s1,
                                const unsigned char* act, int nt_stride) {
  const u32 a_lo[4] = {bf16x2_mul(d0[0], s0), bf16x2_mul(d1[0], s1), bf16x2_mul(d0[1], s0), bf16x2_mul(d1[1], s1)};
  const u32 a_hi[4] = {bf16x2_mul(d0[2], s0), bf16x2_mul(d1[2], s1), bf16x2_mul(d0[3], s0), bf16x2_mul(d1[3], s1)};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint4 v = *reinterpret_cast<const uint4*>(act + nt * nt_stride);
    const u32 b_lo[2] = {v.x, v.y};
    const u32 b_hi[2] = {v.z, v.w};
    mma_m16n8k16(MmaBF16{}, acc[nt], a_lo, b_lo);
    mma_m16n8k16(MmaBF16{}, acc[nt], a_hi, b_hi);
    // 8 token tiles: at most two tiles' B fragments loaded ahead (ptxas would otherwise hoist all 8, 32 registers)
    if constexpr (NT >= 8) {
      if (nt % 2 == 1) asm volatile("" ::: "memory");
    }
  }
}

// MINB: CTAs per SM the kernel is built for (its register budget: 65536 / (32 RW KW MINB) a thread); the planner
// (cuda_fp4.SMALL_BUILD) picks MINB and P per token tile so that nothing spills.
template <int NT, int RW, int KW, int P, int PF, int MINB, typename OutT, bool HAS_C, bool MASKED>
__global__ void __launch_bounds__(32 * RW * KW, MINB)
fp4_small_sm90(const unsigned char* __restrict__ b, const float* __restrict__ sfb,
               const __nv_bfloat16* __restrict__ a, OutT* __restrict__ d, const float* __restrict__ c,
               const int* __restrict__ masked_m, int shape_m, int shape_n, int shape_k, int lda, int m_blocks,
               int chunks_per_split) {
  constexpr int ROWS = 16 * RW, TOKENS = 8 * NT, THREADS = 32 * RW * KW;
  static_assert(NT == 1 || NT == 2 || NT == 4 || NT == 8, "1, 2, 4 or 8 token tiles (<= 64 tokens an m-block)");
  static_assert(PF == 0 || PF == 256, "L2 prefetch: 0 or 256 bytes");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
  const int rw = warp % RW, kw = warp / RW;

  const Fp4Tile tile = fp4_tile<MASKED>(masked_m, shape_m, shape_k, m_blocks, TOKENS, ROWS, chunks_per_split);
  if (tile.m0 >= tile.rows_m) return;  // the whole cluster (one tile) returns together
  const int group = tile.group, m0 = tile.m0, rows_m = tile.rows_m, n_cta = tile.n_cta, c_begin = tile.c_begin;
  const int valid_t = min(TOKENS, rows_m - m0);
  const int n_ch = max(0, tile.c_end - c_begin);         // chunks of the CTA
  const int my_n = n_ch > kw ? (n_ch - kw + KW - 1) / KW : 0;  // of this warp: kw + KW j, j < my_n

  // This thread's two weight rows g and g + 8 of its row warp (a row past N reads row g, or row 0 of the group:
  // valid memory, never stored): codes from byte 64 (c_begin + kw) + 16 q, scales from group 4 (c_begin + kw) + q.
  const int r0 = n_cta + rw * 16 + g;
  const size_t row0 = static_cast<size_t>(group) * shape_n + (r0 < shape_n ? r0 : 0);
  const int dr = r0 + 8 < shape_n ? 8 : 0;  // row g + 8 is row g + dr
  const unsigned char* wp = b + row0 * (shape_k / 2) + (c_begin + kw) * 64 + q * 16;
  // scales by a 32-bit element index off the kernel parameter (fewer live registers than a pointer; the scale
  // tensor has < 2^32 elements: the host checks)
  const u32 si = static_cast<u32>(row0 * (shape_k / 32)) + (c_begin + kw) * 4 + q;
  const int w_off = dr * (shape_k / 2);  // row g + 8: codes w_off bytes on, scales w_off / 16 elements on
  uint4 cw[P][2];
  float cs[P][2];
#pragma unroll
  for (int j = 0; j < P; ++j) {
    cw[j][0] = cw[j][1] = make_uint4(0u, 0u, 0u, 0u);
    cs[j][0] = cs[j][1] = 1.f;
    if (j < my_n) {
      cw[j][0] = load_nc_v4<uint4, PF>(wp + j * KW * 64);
      cw[j][1] = load_nc_v4<uint4, PF>(wp + w_off + j * KW * 64);
      cs[j][0] = ldg_stream_f32(sfb + (si + j * KW * 4));
      cs[j][1] = ldg_stream_f32(sfb + (si + (w_off >> 4) + j * KW * 4));
    }
  }

  // The CTA's activations (its whole K range, valid tokens only) -> shared memory, meanwhile.
  extern __shared__ __align__(128) unsigned char smem[];
  const __nv_bfloat16* a_g = a + (static_cast<size_t>(group) * shape_m + m0) * lda + c_begin * 128;
  const int stride = chunks_per_split * 256;
  stream_copy_act<THREADS>(smem, stride, a_g, lda, 0, n_ch, valid_t);
  cp_async_wait_all();
  __syncthreads();

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;

  const int swz_c = (((q >> 1) & 1) << 1) | (g & 1);  // stream_unit's XOR for this thread (bits 0-1)
  const int thr_off = g * stride + q * 64 + kw * 256;  // row g, unit 4q of the warp's first chunk
  // The decode tables' register words, opaque to the compiler and per lane (see fp4_stream_sm90).
  const u32 opaque0 = (static_cast<u32>(shape_k) >> 31) * static_cast<u32>(lane);
  const u32 tab_l0 = kBf16L0 | opaque0, tab_h0 = kBf16H0 | opaque0;

  for (int base = 0; base < my_n; base += P) {
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int li = base + j;  // the warp's li-th chunk: chunk kw + KW li of the CTA (uniform over the warp)
      if (li < my_n) {
        const unsigned char* act_i = smem + thr_off + li * KW * 256;
        const float s0 = cs[j][0], s1 = cs[j][1];
        const bool fold = __all_sync(0xFFFFFFFFu, foldable(s0) && foldable(s1));
        const u32 s2_0 = prmt(__float_as_uint(s0), 0u, 0x3232), s2_1 = prmt(__float_as_uint(s1), 0u, 0x3232);
        const u32 w[2][4] = {{cw[j][0].x, cw[j][0].y, cw[j][0].z, cw[j][0].w},
                             {cw[j][1].x, cw[j][1].y, cw[j][1].z, cw[j][1].w}};
        if (P == 1 && li + 1 < my_n) {  // one slot: the next chunk's loads go out before this chunk's math (w, s0, s1
          const int o = (li + 1) * KW;   // hold this one's), so a warp still has two chunks in flight
          cw[j][0] = load_nc_v4<uint4, PF>(wp + o * 64);
          cw[j][1] = load_nc_v4<uint4, PF>(wp + w_off + o * 64);
          cs[j][0] = ldg_stream_f32(sfb + (si + o * 4));
          cs[j][1] = ldg_stream_f32(sfb + (si + (w_off >> 4) + o * 4));
        }
        if (fold) {  // the common case: one decode and 2 NT mmas per word, no branch inside the chunk
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            u32 d0[4], d1[4];
            decode_bf16_tab(w[0][x], d0, tab_l0, tab_h0);
            decode_bf16_tab(w[1][x], d1, tab_l0, tab_h0);
            small_steps<NT>(acc, d0, d1, s2_0, s2_1, act_i + ((x ^ swz_c) << 4), 8 * stride);
          }
        } else {  // the exact slow path (x unrolled: w stays in registers)
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            u32 d0[4], d1[4];
            decode_bf16_tab(w[0][x], d0, tab_l0, tab_h0);
            decode_bf16_tab(w[1][x], d1, tab_l0, tab_h0);
            float rest0 = s0, rest1 = s1;
#pragma unroll 1
            for (int pc = 0; pc < 4; ++pc) {  // s = p0 + p1 + p2 + p3 exactly, each of <= 6 significant bits
              const float p0 = __uint_as_float(__float_as_uint(rest0) & 0xFFFC0000u);
              const float p1 = __uint_as_float(__float_as_uint(rest1) & 0xFFFC0000u);
              rest0 -= p0;
              rest1 -= p1;
              small_steps<NT>(acc, d0, d1, prmt(__float_as_uint(p0), 0u, 0x3232), prmt(__float_as_uint(p1), 0u, 0x3232),
                              act_i + ((x ^ swz_c) << 4), 8 * stride);
            }
          }
        }
        if (P > 1 && li + P < my_n) {  // refill the slot with the warp's chunk li + P (the other slots' loads fly meanwhile)
          const int o = (li + P) * KW;
          cw[j][0] = load_nc_v4<uint4, PF>(wp + o * 64);
          cw[j][1] = load_nc_v4<uint4, PF>(wp + w_off + o * 64);
          cs[j][0] = ldg_stream_f32(sfb + (si + o * 4));
          cs[j][1] = ldg_stream_f32(sfb + (si + (w_off >> 4) + o * 4));
        }
      }
    }
  }

  // The k-warps' accumulators, added in k-warp order (k-warp 0 keeps the CTA's partial): [KW - 1][RW][NT 4][32].
  float flat[NT * 4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) flat[4 * nt + i] = acc[nt][i];
  if constexpr (KW > 1) {
    float* part = reinterpret_cast<float*>(smem);
    __syncthreads();  // every warp is done with the activation tile
    if (kw > 0) {
#pragma unroll
      for (int e = 0; e < NT * 4; ++e) part[(((kw - 1) * RW + rw) * NT * 4 + e) * 32 + lane] = flat[e];
    }
    __syncthreads();
    if (kw == 0) {
      for (int k2 = 1; k2 < KW; ++k2) {
#pragma unroll
        for (int e = 0; e < NT * 4; ++e) flat[e] += part[(((k2 - 1) * RW + rw) * NT * 4 + e) * 32 + lane];
      }
    }
  }
  // store_partial (inside) syncs the CTA first, so k-warp 0 has read every part before the tile overwrites them.
  cluster_epilogue<NT, RW, OutT, HAS_C, THREADS>(flat, reinterpret_cast<float*>(smem), kw == 0 ? rw : RW, d, c, group,
                                                 shape_m, shape_n, m0, rows_m, n_cta);
}


// ==================================================================================================
// Decode-to-shared kernel (bf16 or e4m3 activations): tokens are the wgmma M, the weights its B operand.
//
// DeepGEMM's fp8 kernel at decode shapes (M = 64 / 128) runs one CTA per SM, each a thin slice of N
// (16-56 weight rows) over the whole K range, an 8-deep TMA ring, and SS wgmmas with the tokens as M. This
// kernel is that shape for FP4 weights: per 128-wide K chunk the NWG math warpgroups (64 tokens each)
// decode the chunk's BN weight rows together (each thread a few 16-byte units) into a shared [BN][K] tile
// in the wgmma K-major 128-byte-swizzled layout (bf16: two [BN][64] halves; e4m3: one [BN][128]), and every
// warpgroup runs SS wgmmas of its 64 tokens against it. The decode of chunk i + 1 overlaps chunk i's wgmmas
// (two decoded buffers); one named barrier per chunk (bar.red.and: also the vote on the scales) orders
// decode -> wgmma and wgmma retired -> the buffer's next decode. No register fragments: a thread holds
// BN / 2 accumulators (+ BN / 2 partial sums for e4m3).
//
// Scales (exact, as the other kernels):
// - bf16: a chunk whose scales are all foldable powers of two is decoded as e2m1 * 2^e (exact bf16) and its
//   wgmmas accumulate into the K-long fp32 accumulator; any other chunk runs 4 passes, one per 6-bit piece
//   of the scales (e2m1 * piece is an exact bf16).
// - e4m3: per chunk one fresh partial P (4 k32 wgmmas), promoted as acc += P * sa[token] * 2^E[row], the
//   per-32 scales folded relative to the row's largest one into the e4m3 table (d <= 5 binades: exact);
//   other chunks: one P per 32-wide group, promoted with that group's scale.
//
// K splits (optional, gridDim.y): a thread-block cluster reduced through DSMEM (cluster_reduce_store).
// MCAST = 2 or 4 (no K splits): MCAST-CTA clusters along N share the activation tile: each CTA's producer loads
// 1 / MCAST of the token rows with a TMA multicast into every CTA of the cluster, a stage is refilled once every CTA's
// warps released it (each consumer warp arrives on the empty barrier of every CTA of the cluster), the cluster syncs
// after the barriers' init and before leaving. L2 -> SM traffic of the activations / MCAST (the bound of thin slices).
// ==================================================================================================
// The ring stage (Fp4StageOf) plus the decoded tile's size.
template <int TOKENS, int ROWS, bool ACT_FP8>
struct Fp4DecStage : Fp4StageOf<TOKENS, ROWS, ACT_FP8> {
  static constexpr int kDec = ROWS * 128 * (ACT_FP8 ? 1 : 2);  // one decoded [ROWS][128 K] tile
  static constexpr int kDecBytes = kDec + (ACT_FP8 ? (ROWS * 4 + 1023) / 1024 * 1024 : 0);  // + row factors
};

// The ring (STAGES stages), the two decoded tiles; at least the epilogue's fp32 [TOKENS][ROWS] tile.
template <int TOKENS, int ROWS, bool ACT_FP8, int STAGES>
TILEHAL_HOST_DEVICE constexpr int fp4_dec_bytes() {
  using St = Fp4DecStage<TOKENS, ROWS, ACT_FP8>;
  constexpr int all = STAGES * St::kBytes + 2 * St::kDecBytes, red = TOKENS * ROWS * 4;
  return all > red ? all : red;
}

// AND of `p` over the first `threads` threads of the CTA (named barrier 1; 0 is __syncthreads).
TILEHAL_DEVICE bool threads_all(bool p, int threads) {
  u32 r;
  asm volatile("{\n.reg .pred pi, po;\nsetp.ne.u32 pi, %1, 0;\nbar.red.and.pred po, 1, %2, pi;\n"
               "selp.u32 %0, 1, 0, po;\n}"
               : "=r"(r)
               : "r"(static_cast<u32>(p)), "r"(threads)
               : "memory");
  return r != 0;
}

TILEHAL_DEVICE void threads_sync(int threads) { asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory"); }

// The decode-to-shared kernels' decode of one 128-K chunk (stage `st`, landed) into the decoded tile `buf`, by
// thread t of NTHREADS: fold = the fast path's folded weights (returns whether this thread's scales allow it), else
// plain e2m1 (e4m3) / e2m1 x piece `pc` of the scales (bf16). Ends with the proxy fence for the wgmmas that read it.
template <int BN, bool ACT_FP8, int NTHREADS, typename St>
TILEHAL_DEVICE bool fp4_dec_decode(const unsigned char* st, unsigned char* buf, bool fold, int pc, int t) {
  constexpr int UPR = ACT_FP8 ? 8 : 16;  // decoded 16-byte units per row and chunk
  constexpr int UNITS = BN * UPR;
  constexpr int UPT = (UNITS + NTHREADS - 1) / NTHREADS;
  bool ok = true;
#pragma unroll
  for (int j = 0; j < UPT; ++j) {
    const int idx = t + j * NTHREADS;
    if (UNITS % NTHREADS != 0 && idx >= UNITS) break;
    const int r = idx / UPR, u = idx % UPR;
    if constexpr (ACT_FP8) {
      // unit u = K 16u .. 16u + 15 = code bytes 8u .. 8u + 7; group u / 2
      const uint2 w = *reinterpret_cast<const uint2*>(st + St::kOffW + swz<64>(r, u / 2) + (u % 2) * 8);
      uint4 o;
      if (fold) {
        const float4 s4 = *reinterpret_cast<const float4*>(st + St::kOffSfb + r * 16);
        const float sc[4] = {s4.x, s4.y, s4.z, s4.w};
        u32 emax = 0, e_mine = 0;
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) {
          const u32 b = __float_as_uint(sc[gg]);
          const u32 e = b >> 23;  // sign bit included: a negative scale fails the range check
          ok = ok && (b & 0x7FFFFFu) == 0 && e >= 1 && e <= 254;
          emax = max(emax, e);
          if (gg == u / 2) e_mine = e;
        }
#pragma unroll
        for (int gg = 0; gg < 4; ++gg) ok = ok && emax - (__float_as_uint(sc[gg]) >> 23) <= 5;
        const u32 dl = ok ? (emax - e_mine) * 8 : 0;  // e4m3 exponent-field steps
        decode_e4m3_tab(w.x, kE4M3T0 - dl * 0x01010100u, kE4M3T1 - dl * 0x01010101u, o.x, o.y);
        decode_e4m3_tab(w.y, kE4M3T0 - dl * 0x01010100u, kE4M3T1 - dl * 0x01010101u, o.z, o.w);
        if (u == 0) reinterpret_cast<float*>(buf + St::kDec)[r] = __uint_as_float(min(max(emax, 1u), 254u) << 23);
      } else {
        decode_e4m3(w.x, o.x, o.y);
        decode_e4m3(w.y, o.z, o.w);
      }
      *reinterpret_cast<uint4*>(buf + swz<128>(r, u)) = o;
    } else {
      // unit u = K 8u .. 8u + 7 = code bytes 4u .. 4u + 3; group u / 4; half u / 8 of the tile
      const u32 w = *reinterpret_cast<const u32*>(st + St::kOffW + swz<64>(r, u / 4) + (u % 4) * 4);
      float s = *reinterpret_cast<const float*>(st + St::kOffSfb + r * 16 + (u / 4) * 4);
      if (fold) {
        ok = ok && foldable(s);
      } else {
#pragma unroll
        for (int p2 = 0; p2 < 4; ++p2) {  // piece pc of s: s = s0 + s1 + s2 + s3, 6 significant bits each
          const float piece = __uint_as_float(__float_as_uint(s) & 0xFFFC0000u);
          if (p2 == pc) {
            s = piece;
            break;
          }
          s -= piece;  // exact
        }
      }
      u32 v[4];
      decode_bf16(w, v);
      const u32 s2 = prmt(__float_as_uint(s), 0u, 0x3232);  // bf16x2 (s, s)
      uint4 o;
      o.x = bf16x2_mul(v[0], s2);
      o.y = bf16x2_mul(v[1], s2);
      o.z = bf16x2_mul(v[2], s2);
      o.w = bf16x2_mul(v[3], s2);
      *reinterpret_cast<uint4*>(buf + (u / 8) * (BN * 128) + swz<128>(r, u % 8)) = o;
    }
  }
  fence_proxy_async_shared();  // the generic-proxy stores -> the wgmmas (async proxy) that read them
  return ok;
}

// Independent accumulator sets of the dec kernels (bf16: the K-long sums; e4m3: a chunk's partial sums), so that
// consecutive wgmmas of a chunk do not wait for each other: wgmma j of a chunk accumulates into set j % NSET.
template <bool ACT_FP8, int BN>
constexpr int kDecSets = ACT_FP8 ? (BN <= 32 ? 4 : 2) : (BN <= 16 ? 8 : BN <= 32 ? 4 : BN <= 64 ? 2 : 1);

// The dec kernels' producer (one lane): chunk after chunk of the CTA's K range into the TMA ring once its stage is
// empty: codes, weight scales, activations (MCAST: this CTA's share of the token rows, multicast into the cluster;
// e4m3: and the activation scales).
template <typename St, int STAGES, int TOKENS, bool ACT_FP8, int MCAST>
TILEHAL_DEVICE void fp4_dec_produce(const Fp4Ring& ring, unsigned char* smem, int c_begin, int c_end, int n_cta, int m0,
                                    u32 rank, const TmaDescriptor* tma_b, const TmaDescriptor* tma_sfb,
                                    const TmaDescriptor* tma_a, const TmaDescriptor* tma_sfa) {
  for (int ch = c_begin, i = 0; ch < c_end; ++ch, ++i) {
    const int s = i % STAGES;
    mbarrier_wait(&ring.empty[s], ((i / STAGES) & 1) ^ 1);
    unsigned char* st = smem + s * St::kBytes;
    mbarrier_arrive_expect_tx(&ring.full[s], St::kA + St::kW + St::kSfb + St::kSfa);
    tma_load_2d(st + St::kOffW, tma_b, &ring.full[s], ch * 64, n_cta);
    tma_load_2d(st + St::kOffSfb, tma_sfb, &ring.full[s], ch * 4, n_cta);
    if constexpr (MCAST > 1) {  // this CTA's share of the token rows, into every CTA of the cluster
      constexpr int PART = TOKENS / MCAST;
      constexpr unsigned short MASK = (1u << MCAST) - 1;
      const int off = static_cast<int>(rank) * PART * 128, row = m0 + static_cast<int>(rank) * PART;
      tma_load_2d_multicast(st + off, tma_a, &ring.full[s], ch * 128, row, MASK);
      if constexpr (!ACT_FP8) {
        tma_load_2d_multicast(st + TOKENS * 128 + off, tma_a, &ring.full[s], ch * 128 + 64, row, MASK);
      }
    } else {
      tma_load_2d(st, tma_a, &ring.full[s], ch * 128, m0);
      if constexpr (!ACT_FP8) tma_load_2d(st + TOKENS * 128, tma_a, &ring.full[s], ch * 128 + 64, m0);
    }
    if constexpr (ACT_FP8) tma_load_2d(st + St::kOffSfa, tma_sfa, &ring.full[s], m0, ch);
  }
}

// Issue one chunk's wgmmas (warpgroup wg's 64 tokens of stage `st`'s activations x the decoded tile `buf`) into the
// sets: all of K, wgmma j into set j % NSET (bf16: accumulating; e4m3: fresh sets), or (e4m3, `one` >= 0) group `one`
// only, into set 0.
template <int BN, bool ACT_FP8, int TOKENS, typename Mma, int NSET, int R>
TILEHAL_DEVICE void fp4_dec_issue(float (&sets)[NSET][R], const unsigned char* st, const unsigned char* buf, int wg,
                                  int one) {
  wgmma_fence();
  if constexpr (ACT_FP8) {
    const u64 da = make_smem_desc_k128b(st + wg * 64 * 128);
    const u64 db = make_smem_desc_k128b(buf);
    if (one >= 0) {
      Mma::mma(sets[0], da + one * 2, db + one * 2, 0);
    } else {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Mma::mma(sets[kk % NSET], da + kk * 2, db + kk * 2, kk >= NSET);
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u64 da = make_smem_desc_k128b(st + h * (TOKENS * 128) + wg * 64 * 128);
      const u64 db = make_smem_desc_k128b(buf + h * (BN * 128));
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Mma::mma(sets[(h * 4 + kk) % NSET], da + kk * 2, db + kk * 2, 1);
    }
  }
  wgmma_commit();
}

// e4m3: acc += P * sa[token] * f[col] with P the sum of the first `used` sets (f: the decoded tile's row factors, or
// group `gg`'s scales from stage `st`); t0: the thread's first token row, q: its quad lane.
template <int BN, typename St, int NSET, int R>
TILEHAL_DEVICE void fp4_dec_promote(float (&acc)[R], const float (&sets)[NSET][R], const unsigned char* st,
                                    const unsigned char* buf, int gg, int used, int t0, int q) {
  const float* sfa = reinterpret_cast<const float*>(st + St::kOffSfa);
  const float sa0 = sfa[t0], sa1 = sfa[t0 + 8];
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = 8 * j + 2 * q;
    float f0, f1;
    if (gg < 0) {
      const float2 f = *reinterpret_cast<const float2*>(buf + St::kDec + col * 4);
      f0 = f.x, f1 = f.y;
    } else {
      f0 = *reinterpret_cast<const float*>(st + St::kOffSfb + col * 16 + gg * 4);
      f1 = *reinterpret_cast<const float*>(st + St::kOffSfb + (col + 1) * 16 + gg * 4);
    }
    float P[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      P[e] = sets[0][4 * j + e];
#pragma unroll
      for (int st2 = 1; st2 < NSET; ++st2)
        if (st2 < used) P[e] += sets[st2][4 * j + e];
    }
    acc[4 * j + 0] += P[0] * (sa0 * f0);
    acc[4 * j + 1] += P[1] * (sa0 * f1);
    acc[4 * j + 2] += P[2] * (sa1 * f0);
    acc[4 * j + 3] += P[3] * (sa1 * f1);
  }
}

// The dec kernels' epilogue (every thread): bf16's sets added, the partial tile [TOKENS][BN] over the drained ring
// (acc[4j + i] = token 16 warp + g + 8 (i / 2), column 8j + 2q + i % 2: wgmma's layout; warps past the math ones store
// nothing), then cluster_reduce_store (K splits, C, D).
template <int BN, int NWG, bool ACT_FP8, typename OutT, bool HAS_C, int THREADS, int NSET, int R>
TILEHAL_DEVICE void fp4_dec_epilogue(float (&acc)[R], const float (&sets)[NSET][R], unsigned char* smem, int warp,
                                     int lane, OutT* d, const float* c, int shape_m, int shape_n, int m0, int rows_m,
                                     int n_cta) {
  float* red = reinterpret_cast<float*>(smem);
  if constexpr (!ACT_FP8) {  // the sets' sum (fp32 summation order only)
#pragma unroll
    for (int e = 0; e < R; ++e) {
      acc[e] = sets[0][e];
#pragma unroll
      for (int st = 1; st < NSET; ++st) acc[e] += sets[st][e];
    }
  }
  __syncthreads();
  if (warp < 4 * NWG) {
    const int g = lane / 4, q = lane % 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) red[(warp * 16 + g + 8 * (i / 2)) * BN + 8 * j + 2 * q + i % 2] = acc[4 * j + i];
    }
  }
  cluster_reduce_store<BN, 64 * NWG, OutT, HAS_C, THREADS>(red, d, c, 0, shape_m, shape_n, m0, rows_m, n_cta);
}

template <bool ACT_FP8, int BN> struct Fp4DecMma { using T = WgmmaBF16<BN>; };
template <int BN> struct Fp4DecMma<true, BN> { using T = WgmmaE4M3<BN>; };

template <int BN, int NWG, bool ACT_FP8, typename OutT, bool HAS_C, int STAGES, int MCAST>
__global__ void __launch_bounds__(128 * NWG + 32, 1)
fp4_dec_sm90(const __grid_constant__ TmaDescriptor tma_b, const __grid_constant__ TmaDescriptor tma_sfb,
             const __grid_constant__ TmaDescriptor tma_a, const __grid_constant__ TmaDescriptor tma_sfa,
             OutT* __restrict__ d, const float* __restrict__ c, int shape_m, int shape_n, int shape_k, int m_blocks,
             int chunks_per_split) {
  static_assert(BN % 8 == 0 && BN >= 8 && BN <= 256, "BN: the wgmma N (a multiple of 8, <= 256)");
  static_assert(MCAST == 1 || MCAST == 2 || MCAST == 4, "MCAST: 1, 2 or 4 CTAs share the activation tile");
  constexpr int TOKENS = 64 * NWG, MATH = 128 * NWG, THREADS = MATH + 32;
  using St = Fp4DecStage<TOKENS, BN, ACT_FP8>;
  constexpr int RING = fp4_dec_bytes<TOKENS, BN, ACT_FP8, STAGES>();
  constexpr int R = BN / 2;                       // accumulators per thread and set
  // Independent accumulator sets (bf16: the K-long sums; e4m3: a chunk's partial sums), so that consecutive wgmmas of a
  // chunk do not wait for each other (a dependent m64nBN wgmma costs its pipeline latency, ~100 cycles, at these N):
  // wgmma j of a chunk accumulates into set j % NSET; the sets are added at the end (e4m3: at each promotion).
  constexpr int NSET = kDecSets<ACT_FP8, BN>;
  using Mma = typename Fp4DecMma<ACT_FP8, BN>::T;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const Fp4Tile tile = fp4_tile<false>(nullptr, shape_m, shape_k, m_blocks, TOKENS, BN, chunks_per_split);
  const int m0 = tile.m0, rows_m = tile.rows_m, n_cta = tile.n_cta, c_begin = tile.c_begin, c_end = tile.c_end;

  extern __shared__ unsigned char smem_raw[];
  const Fp4Ring ring = fp4_ring_init<STAGES, RING>(smem_raw, MATH, 4 * NWG * MCAST, &tma_b, &tma_sfb, &tma_a,
                                                   ACT_FP8 ? &tma_sfa : nullptr);
  [[maybe_unused]] u32 rank = 0;
  if constexpr (MCAST > 1) {
    rank = cluster_ctarank();
    cluster_sync();  // the peer's barriers are initialized before any multicast signals them
  }
  unsigned char* smem = ring.smem;
  unsigned char* dec = smem + STAGES * St::kBytes;  // two decoded tiles (1024-aligned: kBytes, kDecBytes are)
  float acc[R] = {};  // e4m3: written by the promotion only (bf16: the sum of the sets at the end)
  [[maybe_unused]] float sets[NSET][R];  // bf16: written by wgmma only (zeroed once); e4m3: fresh every chunk
  if constexpr (!ACT_FP8) {
#pragma unroll
    for (int st = 0; st < NSET; ++st)
#pragma unroll
      for (int e = 0; e < R; ++e) sets[st][e] = 0.f;
  }
  auto fence_sets = [&]() {
#pragma unroll
    for (int st = 0; st < NSET; ++st) wgmma_fence_operands(sets[st]);
  };

  if (warp == 4 * NWG) {
    // ---------------------------------------------------------------- producer (one lane)
    if (lane == 0) {
      fp4_dec_produce<St, STAGES, TOKENS, ACT_FP8, MCAST>(ring, smem, c_begin, c_end, n_cta, m0, rank, &tma_b, &tma_sfb,
                                                          &tma_a, &tma_sfa);
    }
  } else {
    // ---------------------------------------------------------------- math warpgroups
    const int wg = warp / 4, g = lane / 4, q = lane % 4;
    const int n_ch = c_end - c_begin;

    // Decode chunk i (its stage must have landed) into tile `buf` (fp4_dec_decode: fold / plain / piece pc).
    auto decode = [&](int i, unsigned char* buf, bool fold, int pc) -> bool {
      return fp4_dec_decode<BN, ACT_FP8, MATH, St>(smem + (i % STAGES) * St::kBytes, buf, fold, pc, tid);
    };

    auto issue = [&](int i, const unsigned char* buf, int one) {
      fp4_dec_issue<BN, ACT_FP8, TOKENS, Mma>(sets, smem + (i % STAGES) * St::kBytes, buf, wg, one);
    };
    [[maybe_unused]] auto promote = [&](int i, const unsigned char* buf, int gg, int used) {
      fp4_dec_promote<BN, St>(acc, sets, smem + (i % STAGES) * St::kBytes, buf, gg, used, wg * 64 + (warp % 4) * 16 + g,
                              q);
    };

    bool fold = false;
    if (n_ch > 0) {
      mbarrier_wait(&ring.full[0], 0);
      fold = threads_all(decode(0, dec, true, 0), MATH);
    }
    for (int i = 0; i < n_ch; ++i) {
      unsigned char* buf = dec + (i & 1) * St::kDecBytes;
      unsigned char* nbuf = dec + ((i + 1) & 1) * St::kDecBytes;
      // chunk i + 1 -> the other tile (its previous wgmmas, chunk i - 1's, retired before the last barrier)
      auto next = [&]() -> bool {
        if (i + 1 >= n_ch) return true;
        mbarrier_wait(&ring.full[(i + 1) % STAGES], ((i + 1) / STAGES) & 1);
        return decode(i + 1, nbuf, true, 0);
      };
      bool ok;
      if (fold) {  // each branch waits for its own wgmmas (none in flight across the branches' join)
        fence_sets();
        issue(i, buf, -1);
        ok = next();
        wgmma_wait<0>();
        fence_sets();
        if constexpr (ACT_FP8) promote(i, buf, -1, NSET);
      } else {
        // slow path: every thread takes it (the vote is the CTA's); the tile is re-decoded and waited per pass
        if constexpr (ACT_FP8) {
          decode(i, buf, false, 0);
          threads_sync(MATH);
#pragma unroll 1
          for (int gg = 0; gg < 4; ++gg) {
            fence_sets();
            issue(i, buf, gg);
            wgmma_wait<0>();
            fence_sets();
            promote(i, buf, gg, 1);
          }
        } else {
#pragma unroll 1
          for (int pc = 0; pc < 4; ++pc) {
            if (pc > 0) threads_sync(MATH);  // every warpgroup's previous pass retired: the tile may be overwritten
            decode(i, buf, false, pc);
            threads_sync(MATH);
            fence_sets();
            issue(i, buf, -1);
            wgmma_wait<0>();
            fence_sets();
          }
        }
        ok = next();
      }
      __syncwarp();
      if (lane == 0) {  // chunk i's stage: decoded and multiplied (MCAST: the peer refills half of it too)
        mbarrier_arrive(&ring.empty[i % STAGES]);
        if constexpr (MCAST > 1) {
#pragma unroll
          for (u32 r = 1; r < MCAST; ++r) mbarrier_arrive_remote(&ring.empty[i % STAGES], (rank + r) % MCAST);
        }
      }
      // chunk i + 1 decoded everywhere, chunk i's wgmmas retired everywhere (its tile is free), the vote
      fold = threads_all(ok, MATH);
    }
  }

  fp4_dec_epilogue<BN, NWG, ACT_FP8, OutT, HAS_C, THREADS>(acc, sets, smem, warp, lane, d, c, shape_m, shape_n, m0,
                                                           rows_m, n_cta);
  if constexpr (MCAST > 1) cluster_sync();  // the peer's last remote arrivals on this CTA's barriers have landed
}


// ==================================================================================================
// Warp-specialized decode-to-shared kernel (opt-in, DEEPGEMM_FP4_DEC_WS=1): fp4_dec_sm90's tile with the decode taken
// off the math warpgroups' path. Session 29's two rounds timed fp4_dec_sm90 at ~0.6-0.75 us per 128-K chunk whatever
// the activation bytes or M: ~200-250 instructions per warp and chunk on the 8 warps that also run the wgmmas, one named
// barrier per chunk. Here a decoder warpgroup decodes chunk after chunk into a ring of DSTAGES decoded tiles ("slots",
// dfull / dempty mbarriers; a slot's meta word says which chunk, fold or piece / plain, last slot of its chunk), running
// ahead of the math warpgroups, which run DeepGEMM fp8's loop: wait for a slot, its wgmmas, wait, (e4m3) promote,
// release. Scale paths as fp4_dec_sm90: the decoder's warpgroup votes per chunk (bar.red, barrier 2); a bf16 chunk that
// does not fold takes 4 slots (one per 6-bit scale piece), an e4m3 one a plain slot promoted per 32-wide group.
// A TMA stage is refilled once the decoder (codes) and the math warps (activations, and the scales of a per-group
// promotion) released it.
// ==================================================================================================
// The ring, DSTAGES slots (a decoded tile + 1 KiB for its meta word); at least the epilogue's fp32 tile.
template <int TOKENS, int ROWS, bool ACT_FP8, int STAGES, int DSTAGES>
TILEHAL_HOST_DEVICE constexpr int fp4_decws_bytes() {
  using St = Fp4DecStage<TOKENS, ROWS, ACT_FP8>;
  constexpr int all = STAGES * St::kBytes + DSTAGES * (St::kDecBytes + 1024), red = TOKENS * ROWS * 4;
  return all > red ? all : red;
}

template <int BN, int NWG, bool ACT_FP8, typename OutT, bool HAS_C, int STAGES, int DSTAGES>
__global__ void __launch_bounds__(128 * NWG + 160, 1)
fp4_decws_sm90(const __grid_constant__ TmaDescriptor tma_b, const __grid_constant__ TmaDescriptor tma_sfb,
               const __grid_constant__ TmaDescriptor tma_a, const __grid_constant__ TmaDescriptor tma_sfa,
               OutT* __restrict__ d, const float* __restrict__ c, int shape_m, int shape_n, int shape_k, int m_blocks,
               int chunks_per_split) {
  static_assert(BN % 8 == 0 && BN >= 8 && BN <= 256, "BN: the wgmma N (a multiple of 8, <= 256)");
  constexpr int TOKENS = 64 * NWG, MATH = 128 * NWG, DEC = 128, THREADS = MATH + DEC + 32;
  using St = Fp4DecStage<TOKENS, BN, ACT_FP8>;
  constexpr int SLOT = St::kDecBytes + 1024;  // a decoded tile + its meta word (1024: the tiles stay aligned)
  constexpr int RING = fp4_decws_bytes<TOKENS, BN, ACT_FP8, STAGES, DSTAGES>();
  constexpr int R = BN / 2;
  constexpr int NSET = kDecSets<ACT_FP8, BN>;
  using Mma = typename Fp4DecMma<ACT_FP8, BN>::T;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const Fp4Tile tile = fp4_tile<false>(nullptr, shape_m, shape_k, m_blocks, TOKENS, BN, chunks_per_split);
  const int m0 = tile.m0, rows_m = tile.rows_m, n_cta = tile.n_cta, c_begin = tile.c_begin, c_end = tile.c_end;
  const int n_ch = c_end - c_begin;

  extern __shared__ unsigned char smem_raw[];
  // TMA stage release: the decoder's 4 warps and the math warps
  const Fp4Ring ring = fp4_ring_init<STAGES, RING>(smem_raw, MATH, 4 + 4 * NWG, &tma_b, &tma_sfb, &tma_a,
                                                   ACT_FP8 ? &tma_sfa : nullptr);
  unsigned char* smem = ring.smem;
  unsigned char* slots = smem + STAGES * St::kBytes;
  u64* dfull = ring.empty + STAGES;
  u64* dempty = dfull + DSTAGES;
  if (tid == 0) {
#pragma unroll
    for (int j = 0; j < DSTAGES; ++j) {
      mbarrier_init(&dfull[j], 4);         // lane 0 of every decoder warp
      mbarrier_init(&dempty[j], 4 * NWG);  // lane 0 of every math warp
    }
    fence_barrier_init();
  }
  __syncthreads();
  float acc[R] = {};
  [[maybe_unused]] float sets[NSET][R];
  if constexpr (!ACT_FP8) {
#pragma unroll
    for (int st = 0; st < NSET; ++st)
#pragma unroll
      for (int e = 0; e < R; ++e) sets[st][e] = 0.f;
  }

  if (warp == 4 * NWG + 4) {
    // ---------------------------------------------------------------- producer (one lane)
    if (lane == 0) {
      fp4_dec_produce<St, STAGES, TOKENS, ACT_FP8, 1>(ring, smem, c_begin, c_end, n_cta, m0, 0, &tma_b, &tma_sfb, &tma_a,
                                                      &tma_sfa);
    }
  } else if (warp >= 4 * NWG) {
    // ---------------------------------------------------------------- decoder warpgroup
    const int t = tid - MATH;
    int slot = 0;
    // slot -> (chunk i, kind: 0 folded, 1 bf16 piece / e4m3 plain, piece, last slot of the chunk) once decoded
    auto publish = [&](int j, int i, int kind, int pc, bool last) {
      if (t == 0) *reinterpret_cast<int*>(slots + j * SLOT + St::kDecBytes) = i | kind << 24 | pc << 26 | last << 28;
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&dfull[j]);
    };
    auto take = [&]() -> int {  // the next slot, once the math warps released it
      const int j = slot % DSTAGES;
      mbarrier_wait(&dempty[j], ((slot / DSTAGES) & 1) ^ 1);
      ++slot;
      return j;
    };
    for (int i = 0; i < n_ch; ++i) {
      const int s = i % STAGES;
      const unsigned char* st = smem + s * St::kBytes;
      mbarrier_wait(&ring.full[s], (i / STAGES) & 1);
      int j = take();
      const bool ok = fp4_dec_decode<BN, ACT_FP8, DEC, St>(st, slots + j * SLOT, true, 0, t);
      u32 all;
      asm volatile("{\n.reg .pred pi, po;\nsetp.ne.u32 pi, %1, 0;\nbar.red.and.pred po, 2, %2, pi;\n"
                   "selp.u32 %0, 1, 0, po;\n}"
                   : "=r"(all)
                   : "r"(static_cast<u32>(ok)), "r"(DEC)
                   : "memory");
      if (all) {
        publish(j, i, 0, 0, true);
      } else if constexpr (ACT_FP8) {
        fp4_dec_decode<BN, ACT_FP8, DEC, St>(st, slots + j * SLOT, false, 0, t);  // plain e2m1: per-group promotion
        publish(j, i, 1, 0, true);
      } else {
#pragma unroll 1
        for (int pc = 0; pc < 4; ++pc) {  // one slot per 6-bit piece of the scales
          if (pc > 0) j = take();
          fp4_dec_decode<BN, ACT_FP8, DEC, St>(st, slots + j * SLOT, false, pc, t);
          publish(j, i, 1, pc, pc == 3);
        }
      }
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&ring.empty[s]);  // the codes and scales of chunk i are decoded
    }
  } else {
    // ---------------------------------------------------------------- math warpgroups
    const int wg = warp / 4, g = lane / 4, q = lane % 4;
    auto fence_sets = [&]() {
#pragma unroll
      for (int st = 0; st < NSET; ++st) wgmma_fence_operands(sets[st]);
    };
    int slot = 0;
    for (int i = 0; i < n_ch; ++i) {
      const int s = i % STAGES;
      const unsigned char* st = smem + s * St::kBytes;
      mbarrier_wait(&ring.full[s], (i / STAGES) & 1);  // the activations (the decoder saw the codes)
      bool last = false;
      while (!last) {
        const int j = slot % DSTAGES;
        mbarrier_wait(&dfull[j], (slot / DSTAGES) & 1);
        ++slot;
        const unsigned char* buf = slots + j * SLOT;
        const int meta = *reinterpret_cast<const int*>(buf + St::kDecBytes);
        const bool folded = ((meta >> 24) & 3) == 0;
        last = (meta >> 28) & 1;
        if constexpr (ACT_FP8) {
          const int t0 = wg * 64 + (warp % 4) * 16 + g;
          if (folded) {
            fence_sets();
            fp4_dec_issue<BN, ACT_FP8, TOKENS, Mma>(sets, st, buf, wg, -1);
            wgmma_wait<0>();
            fence_sets();
            fp4_dec_promote<BN, St>(acc, sets, st, buf, -1, NSET, t0, q);
          } else {
#pragma unroll 1
            for (int gg = 0; gg < 4; ++gg) {
              fence_sets();
              fp4_dec_issue<BN, ACT_FP8, TOKENS, Mma>(sets, st, buf, wg, gg);
              wgmma_wait<0>();
              fence_sets();
              fp4_dec_promote<BN, St>(acc, sets, st, buf, gg, 1, t0, q);
            }
          }
        } else {
          fence_sets();
          fp4_dec_issue<BN, ACT_FP8, TOKENS, Mma>(sets, st, buf, wg, -1);
          wgmma_wait<0>();
          fence_sets();
        }
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&dempty[j]);
      }
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&ring.empty[s]);  // chunk i's activations (and scales) are consumed
    }
  }

  fp4_dec_epilogue<BN, NWG, ACT_FP8, OutT, HAS_C, THREADS>(acc, sets, smem, warp, lane, d, c, shape_m, shape_n, m0,
                                                           rows_m, n_cta);
}

}  // namespace fp4
}  // namespace deepgemm
