// DeepGEMM-style persistent, warp-specialized GEMM for sm_90a: D = C + A @ B^T.
//
// One CTA per SM walks output tiles (BLOCK_M x BLOCK_N) in a swizzled order. Warpgroup
// NUM_MATH_WG (the last) is the producer: one thread issues TMA loads of A, B (and the fp8
// activation scales) into a STAGES-deep ring of shared-memory buffers guarded by mbarriers
// ("full": data landed, "empty": consumers are done). Warpgroups 0..NUM_MATH_WG-1 each own 64 rows
// of the tile and run wgmma on it. For fp8, each 128-wide K block is accumulated on its own and
// then promoted into the fp32 total with its scales (sfa per row x sfb per 128 columns), which is
// DeepGEMM's answer to fp8 wgmma's limited accumulation precision. With OVERLAP the partial sums
// alternate between two register sets: block kb+1's wgmma is issued before block kb is promoted, so
// the promotion no longer stalls the warpgroup's own tensor-core queue (registers allow this up to
// BLOCK_N = 128). bf16 keeps one K block of wgmma in flight (wait_group 1), so a warpgroup never
// drains its tensor-core queue inside a tile.
//
// MCAST = 2 launches 2-CTA clusters whose CTAs take neighbouring tiles that share an operand
// (MCAST_ON_A: same m-block, n-blocks 2u and 2u+1; else same n-block, m-blocks 2u and 2u+1). Each
// CTA loads half of the shared tile and multicasts it to both, halving that operand's L2 traffic;
// consumers release a stage in both CTAs. A pair whose second tile lies past the matrix computes a
// harmless "phantom" tile (TMA zero-fills its loads, its stores are skipped), so every CTA of a
// cluster runs the same number of pipeline steps whatever the runtime M.
//
// Epilogue: with TMA_STORE the tile is staged in shared memory and written by asynchronous TMA
// stores, so the math warps start the next tile while it drains. The staging tile uses the TMA
// swizzle (D_SWIZZLE bytes per row of a box of D_SWIZZLE/2 columns), which makes the register ->
// shared-memory writes bank-conflict free; D_SWIZZLE = 0 keeps plain BLOCK_N-wide rows. Otherwise
// (fp32 output, C, masked groups, N not 8-aligned) threads store straight from the accumulators,
// bounds-checked; with D_SWIZZLE = 1 (and no TMA_STORE) they go through a padded shared-memory tile
// and leave as 16-byte row segments (StagedStore). K is zero-padded by TMA either way.
//
// C_TMA (opt-in, bf16 only: a bf16 C added to a bf16 D, DeepGEMM's c.dtype == d.dtype): the TMA-store epilogue
// with C. At the start of each tile math thread 0 waits until the previous tile's TMA store has read the staging
// tile, then TMA-loads the tile's C into it (same boxes and swizzle as D's store: the C descriptor travels in the
// activation-scale slot, which bf16 kernels do not use); the load lands while the main loop runs. The epilogue
// waits on its mbarrier, each thread reads the C pair at exactly the staging offset its D pair goes to, adds it
// in fp32 and writes the bf16 pair back in place (so no thread reads what another writes), and thread 0 stores
// the tile with TMA. The staged copy-out otherwise used for C (an fp32 tile twice the size, then a C round trip
// from global memory after the main loop) costs a pipeline stage or a wave and an exposed C load per tile.
// Same fp32 sum as the staged copy-out (acc + C, one rounding): bitwise equal results.
#pragma once
#include <tilehal/tilehal.cuh>
#include <tilehal/mbarrier.cuh>
#include <tilehal/tma.cuh>
#include <tilehal/wgmma.cuh>

namespace deepgemm {
using namespace tilehal;

enum GemmKind : int { kNormal = 0, kGroupedContiguous = 1, kGroupedMasked = 2 };

constexpr int kSwizzleGroupN = 16;  // n-blocks per rasterization band: neighbours share A and B in L2
// Register split after setmaxnreg. The CTA keeps the registers it launched with (384 threads x 168
// for two math warpgroups, 256 x 232 for one), so what the producer gives back is what the math
// warpgroups may take: (168 - 40) x 128 = 2 x (232 - 168) x 128; with one math warpgroup the
// producer's spare registers let it reach the 256 maximum. (A 24-register producer would give two
// math warpgroups 240, but the grouped schedulers spill at 24.)
template <int NUM_MATH_WG> constexpr int kProducerRegs = 40;
template <int NUM_MATH_WG> constexpr int kMathRegs = NUM_MATH_WG == 1 ? 256 : 232;
// The contiguous grouped kernel with the overlapped promotion needs 8 more math registers (its expert
// lookup): a 24-register producer leaves them (24 x 128 + 240 x 256 = 168 x 384).
// The overlapped contiguous kernel runs a 24-register producer and 240-register math warpgroups (no spills; the
// H200 s26 R3 measured it 1.5-10 % faster than the serial promotion with the producer-fed schedule);
// -DDEEPGEMM_CONTIG_LEAN_PRODUCER=0 keeps the 40 / 232 split (A/B timing).
#ifndef DEEPGEMM_CONTIG_LEAN_PRODUCER
#define DEEPGEMM_CONTIG_LEAN_PRODUCER 1
#endif
// The masked kernel's opt-in TMA-store epilogue with the overlapped promotion spills 72 bytes at 232 math registers
// (ptxas, 4 groups): it takes the same 24 / 240 split.
template <int KIND, bool OVERLAP, bool INFO, bool TMA_STORE = false>
constexpr bool kLeanProducer = DEEPGEMM_CONTIG_LEAN_PRODUCER && OVERLAP &&
                               (KIND == kGroupedContiguous || (KIND == kGroupedMasked && TMA_STORE));
constexpr int kOverlapGroup = 8;  // fp8 K blocks per drained group of the overlapped promotion
// Grouped kernels without multicast: the producer alone walks the tile schedule (expert lookup / masked_m scan)
// and hands each tile's (m_block, n_block, group, row limit + 1) to the math warpgroups in a 16-byte slot per
// pipeline stage, written before the stage's first arrival (the mbarrier's release/acquire orders it); a slot
// with row limit 0 (no TMA bytes, one plain arrival) ends the kernel. The math warps then never load
// m_indices / masked_m (a dependent global load at every tile start) and keep no scheduler state in registers.
#ifndef DEEPGEMM_TILE_INFO
#define DEEPGEMM_TILE_INFO 0
#endif
// With 2-CTA A multicast (contiguous only: the CTAs of a cluster share the m-block, so both producers walk the
// same schedule and each feeds its own math warps) the slots work the same way (opt-in: GemmConfig.tile_info=True
// with multicast; the host never sets the switch for a multicast kernel otherwise).
template <int KIND, int MCAST>
constexpr bool kTileInfo = DEEPGEMM_TILE_INFO && KIND != kNormal && (MCAST == 1 || KIND == kGroupedContiguous);

// Expert-major raster of the contiguous kernel (opt-in, -DDEEPGEMM_EXPERT_RASTER=1, producer-fed schedule only):
// the m-blocks of one expert (a maximal run of blocks whose first row names the same expert) are walked together,
// bands of DEEPGEMM_EXPERT_BAND n-units inside (0: the whole row), so that one expert's B panel and its A rows are
// what the CTAs running at once share; the default raster's bands span every expert, so each A row block is
// re-read from DRAM once per band. Padding blocks (-1 / out of range) take no schedule units at all. The producer
// warpgroup copies each m-block's expert id into a shared-memory table (kExpertTableBlocks m-blocks at most: the
// host keeps larger M on the default raster) at kernel start; its walk then reads only shared memory.
#ifndef DEEPGEMM_EXPERT_RASTER
#define DEEPGEMM_EXPERT_RASTER 0
#endif
#ifndef DEEPGEMM_EXPERT_BAND
#define DEEPGEMM_EXPERT_BAND 0
#endif
#ifndef DEEPGEMM_MASKED_CURSOR
#define DEEPGEMM_MASKED_CURSOR 0
#endif
enum : int { kExpertTableBlocks = 2048 };  // 4 KiB of shared memory (heuristics.EXPERT_TABLE_BYTES); an enum: no PTX global

// BEGIN expert_walk (host-compiled by tests/test_grouped_schedule.py against its Python model)
// The schedule unit -> (m-block, n-unit, expert) of the expert-major raster. A CTA asks for its units in increasing
// order, so it keeps the current segment (first m-block, length, first unit, expert) and only moves forward.
struct ExpertWalk {
  int seg_m0 = 0, seg_len = 0, seg_base = 0, seg_group = -1;

  // The first segment at or after m-block `mb` (false: none left).
  TILEHAL_DEVICE bool seek(const short* ids, int num_m_blocks, int mb) {
    while (mb < num_m_blocks && ids[mb] < 0) ++mb;
    if (mb >= num_m_blocks) return false;
    int end = mb + 1;
    while (end < num_m_blocks && ids[end] == ids[mb]) ++end;
    seg_m0 = mb, seg_len = end - mb, seg_group = ids[mb];
    return true;
  }

  template <int BAND, int NUM_N_UNITS>
  TILEHAL_DEVICE bool locate(const short* ids, int num_m_blocks, int unit, int& m_block, int& n_unit, int& group) {
    if (seg_len == 0 && !seek(ids, num_m_blocks, 0)) return false;  // first call (segments are never empty)
    while (unit >= seg_base + seg_len * NUM_N_UNITS) {
      seg_base += seg_len * NUM_N_UNITS;
      if (!seek(ids, num_m_blocks, seg_m0 + seg_len)) return false;
    }
    int m_in_seg;
    band_tile_coords<BAND, NUM_N_UNITS>(unit - seg_base, seg_len, m_in_seg, n_unit);
    m_block = seg_m0 + m_in_seg;
    group = seg_group;
    return true;
  }
};

// The masked kernels' schedule with a cursor (opt-in: -DDEEPGEMM_MASKED_CURSOR=1; for many groups, e.g. a
// low-latency MoE layout of 32 local experts): the same unit -> (m-unit, n-unit, group) map as the default scan over the groups' tiles in
// order, but a CTA keeps the group its last unit fell in and the units before it (its units only grow), so a call
// reads one masked_m value and carries two integers; the default scan starts from group 0 on every call.
struct MaskedWalk {
  int group = 0, base = 0;

  template <int NUM_GROUPS, int BLOCK_M, bool PAIR_M, int BAND, int NUM_N_UNITS>
  TILEHAL_DEVICE bool locate(const int* masked_m, int shape_m, int unit, int& m_unit, int& n_unit, int& g) {
#pragma unroll 1
    for (; group < NUM_GROUPS; ++group) {
      const int rows = min(max(__ldg(masked_m + group), 0), shape_m);
      const int m_blocks = (rows + BLOCK_M - 1) / BLOCK_M;
      const int m_units = PAIR_M ? (m_blocks + 1) / 2 : m_blocks;
      const int units = m_units * NUM_N_UNITS;
      if (unit - base < units) {
        band_tile_coords<BAND, NUM_N_UNITS>(unit - base, m_units, m_unit, n_unit);
        g = group;
        return true;
      }
      base += units;
    }
    return false;
  }
};
// END expert_walk

// Which output tile a CTA does next. Producer and consumers run identical copies, and so do the
// CTAs of a cluster: they walk the same sequence of "units" (a tile, or a pair of tiles that share
// an operand when MCAST = 2) and take the tile of their rank in each.
// EXPERT (contiguous, producer only): the expert-major raster over `expert_table` (ExpertWalk). CURSOR (masked):
// MaskedWalk instead of the scan from group 0.
template <int KIND, int SHAPE_N, int BLOCK_M, int BLOCK_N, int NUM_GROUPS, int MCAST, bool MCAST_ON_A,
          bool EXPERT = false, bool CURSOR = false>
struct TileScheduler {
  static constexpr int kNumNBlocks = (SHAPE_N + BLOCK_N - 1) / BLOCK_N;
  static constexpr bool kPairN = MCAST > 1 && MCAST_ON_A;   // cluster shares A: neighbouring n-blocks
  static constexpr bool kPairM = MCAST > 1 && !MCAST_ON_A;  // cluster shares B: neighbouring m-blocks
  static constexpr int kNumNUnits = kPairN ? (kNumNBlocks + 1) / 2 : kNumNBlocks;
  static constexpr int kBand = kPairN ? kSwizzleGroupN / 2 : kSwizzleGroupN;
  static_assert(!EXPERT || KIND == kGroupedContiguous, "the expert-major raster is the contiguous kernel's");
  static_assert(MCAST == 1 || MCAST == 2, "1- or 2-CTA clusters");
  // Masked groups pair m-blocks of one group (same B; an odd group's last pair has a phantom block past
  // masked_m, whose rows the epilogue does not write); contiguous neighbours may belong to different experts.
  static_assert(!kPairM || KIND != kGroupedContiguous, "contiguous m-blocks of a pair may use different B");
  int shape_m;
  const int* group_info;  // m_indices (contiguous) or masked_m (masked)
  int next_unit;
  int rank;    // CTA rank in the cluster
  int stride;  // clusters in the grid
  const short* expert_table = nullptr;  // EXPERT: expert of each m-block (-1: skipped), in shared memory
  ExpertWalk walk;
  MaskedWalk masked_walk;  // CURSOR

  TILEHAL_DEVICE TileScheduler(int m, const int* info)
      : shape_m(m), group_info(info), next_unit(blockIdx.x / MCAST), rank(blockIdx.x % MCAST),
        stride(gridDim.x / MCAST) {}

  static TILEHAL_DEVICE void rasterize(int unit, int num_m_units, int& m_unit, int& n_unit) {
    band_tile_coords<kBand, kNumNUnits>(unit, num_m_units, m_unit, n_unit);
  }

  TILEHAL_DEVICE void take(int m_unit, int n_unit, int& m_block, int& n_block) const {
    m_block = kPairM ? m_unit * 2 + rank : m_unit;
    n_block = kPairN ? n_unit * 2 + rank : n_unit;
  }

  TILEHAL_DEVICE bool next(int& m_block, int& n_block, int& group) {
    int m_unit, n_unit;
    if constexpr (KIND == kGroupedMasked) {
      int unit = next_unit;
      next_unit += stride;
      if constexpr (CURSOR) {
        if (!masked_walk.template locate<NUM_GROUPS, BLOCK_M, kPairM, kBand, kNumNUnits>(group_info, shape_m, unit,
                                                                                       m_unit, n_unit, group)) {
          return false;
        }
        take(m_unit, n_unit, m_block, n_block);
        return true;
      } else {
        for (int g = 0; g < NUM_GROUPS; ++g) {
          const int rows = min(max(__ldg(group_info + g), 0), shape_m);
          const int m_blocks = (rows + BLOCK_M - 1) / BLOCK_M;
          const int m_units = kPairM ? (m_blocks + 1) / 2 : m_blocks;
          const int units = m_units * kNumNUnits;
          if (unit < units) {
            rasterize(unit, m_units, m_unit, n_unit);
            take(m_unit, n_unit, m_block, n_block);
            group = g;
            return true;
          }
          unit -= units;
        }
        return false;
      }
    } else if constexpr (EXPERT) {
      const int num_m_blocks = min((shape_m + BLOCK_M - 1) / BLOCK_M, kExpertTableBlocks);
      const int unit = next_unit;
      next_unit += stride;
      constexpr int kExpertBand =
          DEEPGEMM_EXPERT_BAND > 0 && DEEPGEMM_EXPERT_BAND < kNumNUnits ? DEEPGEMM_EXPERT_BAND : kNumNUnits;
      if (!walk.template locate<kExpertBand, kNumNUnits>(expert_table, num_m_blocks, unit, m_unit, n_unit, group)) {
        return false;
      }
      take(m_unit, n_unit, m_block, n_block);  // (no m-block pairs in the contiguous kernel: m_block = m_unit)
      return true;
    } else {
      const int num_m_blocks = (shape_m + BLOCK_M - 1) / BLOCK_M;
      const int num_m_units = kPairM ? (num_m_blocks + 1) / 2 : num_m_blocks;
      while (true) {
        const int unit = next_unit;
        next_unit += stride;
        if (unit >= num_m_units * kNumNUnits) return false;
        rasterize(unit, num_m_units, m_unit, n_unit);
        take(m_unit, n_unit, m_block, n_block);
        group = 0;
        if constexpr (KIND == kGroupedContiguous) {
          // Experts start on BLOCK_M boundaries, so a block's first row names its expert; a
          // negative (padding) or out-of-range index skips the whole block (in both CTAs of a
          // cluster: they share the m-block).
          group = __ldg(group_info + m_block * BLOCK_M);
          if (group < 0 || group >= NUM_GROUPS) continue;
        }
        return true;
      }
    }
  }
};

// K blocks kb0 .. kb0+N-1 of the overlapped fp8 promotion as one unrolled group: block j+1 is
// issued (into the other partial-sum set) before block j is promoted, and the last block is drained
// with wait_group 0. ptxas keeps wgmma asynchronous only when every loop iteration drains (a wgmma
// still in flight across the back edge, with wait_group 1 in the loop, makes it serialize every
// wgmma of the kernel), so the groups are long: all but one promotion per group overlap a wgmma.
// (A template function, not a generic lambda: NVRTC 13.0 treats those as host code.)
template <int N, int PART, typename Issue, typename Retire>
TILEHAL_DEVICE void overlapped_group(int kb0, float (&part)[PART], float (&part2)[PART], float& sc0, float& sc1,
                                     float& sd0, float& sd1, Issue& issue, Retire& retire) {
  issue(part, kb0, sc0, sc1);
#pragma unroll
  for (int j = 0; j < N; j += 2) {
    if (j + 1 < N) {
      issue(part2, kb0 + j + 1, sd0, sd1);
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
    wgmma_fence_operands(part);
    retire(part, kb0 + j, sc0, sc1);
    if (j + 1 < N) {
      if (j + 2 < N) {
        issue(part, kb0 + j + 2, sc0, sc1);
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      wgmma_fence_operands(part2);
      retire(part2, kb0 + j + 1, sd0, sd1);
    }
  }
}

// silu(g) * u of the SwiGLU epilogue, in fp32: exp through ex2.approx and a fast division (a few fp32 ulp,
// far below the bf16 rounding that follows); g < -87 gives exp(-g) = inf and a zero (sign of g) result.
TILEHAL_DEVICE float swiglu(float g, float u) { return __fdividef(g, 1.0f + __expf(-g)) * u; }

// A consumer's release of a multicast stage in the peer CTA (tilehal mbarrier_release_peer): by default a plain remote
// arrival (.release.cta, what CUTLASS's cluster barrier does: the wgmmas that read the stage have completed, so no
// cluster-scope fence is needed before the peer's TMA overwrites it); -DDEEPGEMM_MCAST_RELEASE_CLUSTER=1 uses the
// .release.cluster arrival (A/B timing).
#ifndef DEEPGEMM_MCAST_RELEASE_CLUSTER
#define DEEPGEMM_MCAST_RELEASE_CLUSTER 0
#endif

// std::conditional without <type_traits> (NVRTC ships no C++ standard library).
template <bool C, typename T, typename F> struct Select { using type = T; };
template <typename T, typename F> struct Select<false, T, F> { using type = F; };

// The descriptor of K step k (32 bytes further along the 128-byte row). The 14-bit address field
// cannot carry into the upper word (shared memory is below 256 KiB), whose bits are constants, so
// only the low word is live: one register per descriptor instead of two.
TILEHAL_DEVICE u64 desc_step(u64 desc, int k) {
  return (desc & 0xFFFFFFFF00000000ull) | static_cast<u32>(static_cast<u32>(desc) + k * 2);
}

// Byte offset of the bf16 pair (row r, columns 8j + 2q, +1) in the epilogue staging tile. With
// D_SWIZZLE the tile is BLOCK_N / (D_SWIZZLE / 2) boxes of [BLOCK_M, D_SWIZZLE / 2] as TMA's
// SWIZZLE_{32,64,128}B expects them: the 16-byte unit of a row is XORed with the row's phase.
// A warp writes rows r..r+7 of one 16-byte column unit, and the XOR spreads those rows over all
// 32 banks (plain rows of BLOCK_N * 2 bytes put them 4 to 8 ways on the same banks).
template <int BLOCK_M, int BLOCK_N, int D_SWIZZLE>
TILEHAL_DEVICE int staging_offset(int r, int j, int q) {
  if constexpr (D_SWIZZLE == 0) {
    return (r * BLOCK_N + j * 8) * 2 + q * 4;
  } else {
    constexpr int kBoxN = D_SWIZZLE / 2;
    const int box = j * 8 / kBoxN;
    const int unit = (j * 8 % kBoxN) / 8;
    const int phase = (r / (128 / D_SWIZZLE)) % (D_SWIZZLE / 16);
    return box * BLOCK_M * D_SWIZZLE + r * D_SWIZZLE + ((unit ^ phase) * 16) + q * 4;
  }
}

// The staged copy-out epilogue (masked groups, C, fp32 D): the math warps put their accumulators into
// a shared-memory tile of padded rows (fp32 when C is added or D is fp32, else bf16; the pad makes a
// warp's pair stores hit 32 distinct banks), then every math thread writes whole 16-byte segments of D
// rows (8 bf16 or 4 fp32 columns), adding the matching C segment read the same way, predicated on the
// row limit (masked_m) and N. Direct stores from the accumulators instead write 4-byte pieces of 8 rows
// per warp instruction (the ncu profile: 37 % of masked 1x1024x7168x2048, 2-5x with C).
template <int BLOCK_M, int BLOCK_N, bool F32>
struct StagedStore {
  static constexpr int kElem = F32 ? 4 : 2;
  static constexpr int kRow = BLOCK_N * kElem + (F32 ? 32 : 16);  // bytes per padded row
  static constexpr int kBytes = (BLOCK_M * kRow + 1023) / 1024 * 1024;  // the A/B ring after it stays 1024-aligned

  static TILEHAL_DEVICE void put(unsigned char* s, int r, int col, float x, float y) {
    if constexpr (F32) {
      *reinterpret_cast<float2*>(s + r * kRow + col * 4) = make_float2(x, y);
    } else {
      *reinterpret_cast<unsigned*>(s + r * kRow + col * 2) = float2_to_bf16x2(x, y);
    }
  }

  // C_BF16: `c` points at bf16 values (bf16 accumulation into bf16, DeepGEMM's c.dtype == d.dtype), read
  // in place as 16-byte segments like D's; else fp32.
  template <int SHAPE_N, typename OutT, bool HAS_C, bool C_BF16 = false>
  static TILEHAL_DEVICE void copy_out(const unsigned char* s, int tid, int threads, OutT* d, const float* c, u64 row_base,
                                      int m0, int row_limit, int n0) {
    static_assert(!C_BF16 || (HAS_C && sizeof(OutT) == 2), "a bf16 C goes with a bf16 D");
    constexpr int kVec = 16 / static_cast<int>(sizeof(OutT));  // D columns per 16-byte segment
    constexpr int kUnits = BLOCK_N / kVec;
    constexpr int kTotal = BLOCK_M * kUnits;
    // With C, a thread first loads the C segments of kBatch of its units, then writes their D segments:
    // c may be d, so a C load placed after a D store would issue only once that store's data arrived (one
    // HBM round trip per unit: ~12 in a row for a 128 x 192 tile). Without C, one unit at a time.
    constexpr int kBatch = HAS_C ? 4 : 1;
    for (int u0 = tid; u0 < kTotal; u0 += threads * kBatch) {
      [[maybe_unused]] float cadd[kBatch][kVec];
      if constexpr (HAS_C) {
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int u = u0 + b * threads;
          const int row = m0 + u / kUnits, gcol = n0 + (u % kUnits) * kVec;
          if (u >= kTotal || row >= row_limit || gcol >= SHAPE_N) continue;
          const u64 off = (row_base + row) * static_cast<u64>(SHAPE_N) + gcol;
          if constexpr (C_BF16) {
            const uint4 t = *reinterpret_cast<const uint4*>(reinterpret_cast<const __nv_bfloat16*>(c) + off);
            const unsigned w[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float2 f = bf16x2_to_float2(w[i]);
              cadd[b][2 * i] = f.x, cadd[b][2 * i + 1] = f.y;
            }
          } else {
#pragma unroll
            for (int i = 0; i < kVec; i += 4) {
              const float4 t = *reinterpret_cast<const float4*>(c + off + i);
              cadd[b][i] = t.x, cadd[b][i + 1] = t.y, cadd[b][i + 2] = t.z, cadd[b][i + 3] = t.w;
            }
          }
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int u = u0 + b * threads;
        const int r = u / kUnits, col = (u % kUnits) * kVec;
        const int row = m0 + r, gcol = n0 + col;
        if (u >= kTotal || row >= row_limit || gcol >= SHAPE_N) continue;
        const u64 off = (row_base + row) * static_cast<u64>(SHAPE_N) + gcol;
        const unsigned char* src = s + r * kRow + col * kElem;
        if constexpr (!F32) {  // bf16 staging, bf16 D, no C: a straight copy
          *reinterpret_cast<uint4*>(d + off) = *reinterpret_cast<const uint4*>(src);
        } else {
          float v[kVec];
#pragma unroll
          for (int i = 0; i < kVec; i += 4) {
            const float4 t = *reinterpret_cast<const float4*>(src + i * 4);
            v[i] = t.x, v[i + 1] = t.y, v[i + 2] = t.z, v[i + 3] = t.w;
          }
          if constexpr (HAS_C) {
#pragma unroll
            for (int i = 0; i < kVec; ++i) v[i] += cadd[b][i];
          }
          if constexpr (sizeof(OutT) == 2) {
            uint4 o;
            o.x = float2_to_bf16x2(v[0], v[1]), o.y = float2_to_bf16x2(v[2], v[3]);
            o.z = float2_to_bf16x2(v[4], v[5]), o.w = float2_to_bf16x2(v[6], v[7]);
            *reinterpret_cast<uint4*>(d + off) = o;
          } else {
            *reinterpret_cast<float4*>(d + off) = make_float4(v[0], v[1], v[2], v[3]);
          }
        }
      }
    }
  }
};

template <int SHAPE_N, int SHAPE_K, int BLOCK_M, int BLOCK_N, int STAGES, int KIND, int NUM_GROUPS, bool FP8,
          typename OutT, bool HAS_C, bool TMA_STORE, int D_SWIZZLE, int MCAST, bool MCAST_ON_A, bool OVERLAP,
          bool BIAS = false, bool C_BF16 = false, bool SWIGLU = false, bool C_TMA = false>
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
  constexpr bool kMcastA = MCAST > 1 && MCAST_ON_A;
  constexpr bool kMcastB = MCAST > 1 && !MCAST_ON_A;
  static_assert(BLOCK_M == 64 || BLOCK_M == 128, "one or two math warpgroups");
  static_assert(!OVERLAP || FP8, "only fp8 has a promotion to overlap");
  static_assert(BLOCK_N % 8 == 0 && BLOCK_N <= 256, "wgmma N");
  static_assert(!FP8 || BLOCK_N <= 128 + ((BLOCK_N & -BLOCK_N) < 128 ? (BLOCK_N & -BLOCK_N) : 128),
                "an fp8 tile may span at most two 128-wide scale blocks of B");
  // A multicast half tile must start on a 1024-byte swizzle atom (8 rows of 128 bytes).
  static_assert(!kMcastA || (BLOCK_M / 2) % 8 == 0, "A multicast half tile");
  static_assert(!kMcastB || (BLOCK_N / 2) % 8 == 0, "B multicast half tile");
  // D_SWIZZLE = 1 without TMA_STORE: the staged copy-out epilogue (StagedStore below).
  constexpr bool kStaged = !TMA_STORE && D_SWIZZLE == 1;
  static_assert(D_SWIZZLE == 0 || kStaged || (TMA_STORE && sizeof(OutT) == 2 && BLOCK_N % (D_SWIZZLE / 2) == 0),
                "swizzled staging tile: whole boxes of bf16");
  static_assert(!kStaged || SHAPE_N % (16 / sizeof(OutT)) == 0, "staged copy-out writes 16-byte row segments");
  using Staged = StagedStore<BLOCK_M, BLOCK_N, HAS_C || sizeof(OutT) == 4>;
  using Mma = typename Select<FP8, WgmmaE4M3<BLOCK_N>, WgmmaBF16<BLOCK_N>>::type;

  extern __shared__ unsigned char smem_raw[];
  // Swizzled tiles need 1024-byte aligned bases (the host reserves the slack). Every region
  // below is a multiple of 1024 bytes up to the activation scales.
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  // TMA-store staging passes (heuristics.epilogue_passes: 2 for 256-wide tiles) and their width.
  constexpr int kEpiPasses = TMA_STORE && BLOCK_N == 256 && !SWIGLU && !C_TMA ? 2 : 1;  // C_TMA: the whole C tile
  // SWIGLU: the tile's first BLOCK_N/2 columns are gate rows of B, the rest the matching up rows (the host
  // interleaves B in blocks of BLOCK_N/2: deepgemm.swiglu_interleave); the epilogue writes
  // bf16(silu(gate) * up) of fp32 accumulators, a BLOCK_M x BLOCK_N/2 tile of D [M, SHAPE_N/2].
  static_assert(!SWIGLU || (TMA_STORE && !HAS_C && !BIAS && BLOCK_N % 32 == 0 && SHAPE_N % BLOCK_N == 0),
                "SwiGLU epilogue: TMA store, whole gate|up tile pairs, no C / bias");
  constexpr int kPassN = SWIGLU ? BLOCK_N / 2 : BLOCK_N / kEpiPasses;
  constexpr int kOutN = SWIGLU ? SHAPE_N / 2 : SHAPE_N;  // columns of D
  constexpr int D_BYTES = TMA_STORE ? BLOCK_M * kPassN * static_cast<int>(sizeof(OutT)) : kStaged ? Staged::kBytes : 0;
  static_assert(!TMA_STORE || !HAS_C || C_TMA, "TMA store would write values it must not");
  // Masked groups with TMA_STORE (opt-in; the host's default is the staged copy-out): only blocks wholly inside
  // masked_m leave by TMA store, a group's last, partial block is copied out of the same staging tile row by row.
  static_assert(!TMA_STORE || KIND != kGroupedMasked || (SHAPE_N % 8 == 0 && !SWIGLU && !BIAS),
                "masked TMA-store epilogue: 16-byte rows, plain bf16 D");
  static_assert(!C_TMA || (TMA_STORE && HAS_C && !FP8 && !C_BF16 && !BIAS && !SWIGLU && KIND == kNormal),
                "C_TMA: bf16 C into bf16 D through the TMA-store epilogue (its descriptor in the scale slot)");
  static_assert(!TMA_STORE || sizeof(OutT) == 2, "the staging tile holds bf16");
  // BIAS: `c` holds an fp32 bias [SHAPE_N] added to every row in the TMA-store epilogue (nn.Linear's bias,
  // one rounding to bf16 after it).
  static_assert(!BIAS || (TMA_STORE && !HAS_C), "the bias is added in the TMA-store epilogue, C not added");
  // C_BF16: `c` holds bf16 [M, SHAPE_N], read by the staged copy-out (the direct store takes fp32 C only).
  static_assert(!C_BF16 || (HAS_C && kStaged && sizeof(OutT) == 2), "bf16 C: staged epilogue, bf16 D");
  unsigned char* smem_d = smem;
  unsigned char* smem_a = smem_d + D_BYTES;
  unsigned char* smem_b = smem_a + STAGES * A_BYTES;
  float* smem_sfa = reinterpret_cast<float*>(smem_b + STAGES * B_BYTES);
  u64* full_bar = reinterpret_cast<u64*>(reinterpret_cast<unsigned char*>(smem_sfa) + STAGES * SFA_BYTES);
  u64* empty_bar = full_bar + STAGES;
  int* tile_info = reinterpret_cast<int*>(empty_bar + STAGES);  // [STAGES][4] (grouped kernels: kTileInfo)
  [[maybe_unused]] u64* c_bar = empty_bar + STAGES;  // C_TMA (normal GEMMs only: no tile slots): the C tile landed
  constexpr bool kInfo = kTileInfo<KIND, MCAST>;
  constexpr bool kExpert = DEEPGEMM_EXPERT_RASTER && KIND == kGroupedContiguous;
  static_assert(!kExpert || kInfo, "the expert-major raster runs in the producer: it needs -DDEEPGEMM_TILE_INFO=1");
  static_assert(!kExpert || NUM_GROUPS <= 32767, "expert ids are kept as 16-bit values");
  // kExpert: [kExpertTableBlocks] expert ids after the tile slots
  short* expert_table = reinterpret_cast<short*>(tile_info + 4 * STAGES);

  const int tid = threadIdx.x;
  if (tid == NUM_MATH_THREADS) {
    tma_prefetch_descriptor(&tma_a);
    tma_prefetch_descriptor(&tma_b);
    if constexpr (FP8 || C_TMA) tma_prefetch_descriptor(&tma_sfa);
    if constexpr (TMA_STORE) tma_prefetch_descriptor(&tma_d);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(&full_bar[s], 1);
      mbarrier_init(&empty_bar[s], MCAST * NUM_MATH_WG * 4);  // lane 0 of every math warp of every CTA
    }
    if constexpr (C_TMA) mbarrier_init(c_bar, 1);
    fence_barrier_init();
  }
  if constexpr (MCAST > 1) {
    cluster_sync();  // the peer's multicast and remote arrivals need our barriers initialised
  } else {
    __syncthreads();
  }

  constexpr bool kCursor = KIND == kGroupedMasked && DEEPGEMM_MASKED_CURSOR;
  TileScheduler<KIND, SHAPE_N, BLOCK_M, BLOCK_N, NUM_GROUPS, MCAST, MCAST_ON_A, kExpert, kCursor> sched(shape_m,
                                                                                                     group_info);
  int m_block, n_block, group;

  if (tid >= NUM_MATH_THREADS) {
    // ---------------------------------------------------------------- producer warpgroup
    setmaxnreg_dec<kLeanProducer<KIND, OVERLAP, kInfo, TMA_STORE> ? 24 : kProducerRegs<NUM_MATH_WG>>();
    if constexpr (kExpert) {  // the whole producer warpgroup fills the expert table, then one thread walks it
      const int num_m_blocks = min((shape_m + BLOCK_M - 1) / BLOCK_M, kExpertTableBlocks);
      for (int i = tid - NUM_MATH_THREADS; i < num_m_blocks; i += 128) {
        const int g = __ldg(group_info + i * BLOCK_M);
        expert_table[i] = static_cast<short>(g >= 0 && g < NUM_GROUPS ? g : -1);
      }
      named_barrier_sync(2, 128);
      sched.expert_table = expert_table;
    }
    if (tid != NUM_MATH_THREADS) return;
    const int rank = sched.rank;
    u32 it = 0;
    while (sched.next(m_block, n_block, group)) {
      const int a_row = m_block * BLOCK_M + (KIND == kGroupedMasked ? group * shape_m : 0);
      const int b_row = n_block * BLOCK_N + (KIND == kNormal ? 0 : group * SHAPE_N);
      for (int kb = 0; kb < NUM_K_BLOCKS; ++kb, ++it) {
        const int s = it % STAGES;
        // With multicast this barrier also counts the peer's consumers: our half tile lands in both CTAs.
        mbarrier_wait(&empty_bar[s], ((it / STAGES) & 1) ^ 1);
        if constexpr (kInfo) {
          if (kb == 0) {
            int limit = 1;
            if constexpr (KIND == kGroupedMasked) limit = 1 + min(max(__ldg(group_info + group), 0), shape_m);
            *reinterpret_cast<int4*>(tile_info + 4 * s) = make_int4(m_block, n_block, group, limit);
          }
        }
        mbarrier_arrive_expect_tx(&full_bar[s], A_BYTES + B_BYTES + SFA_BYTES);
        if constexpr (kMcastA) {
          tma_load_2d_multicast(smem_a + s * A_BYTES + rank * (A_BYTES / 2), &tma_a, &full_bar[s], kb * BLOCK_K,
                                a_row + rank * (BLOCK_M / 2), 0x3);
        } else {
          tma_load_2d(smem_a + s * A_BYTES, &tma_a, &full_bar[s], kb * BLOCK_K, a_row);
        }
        if constexpr (kMcastB) {
          tma_load_2d_multicast(smem_b + s * B_BYTES + rank * (B_BYTES / 2), &tma_b, &full_bar[s], kb * BLOCK_K,
                                b_row + rank * (BLOCK_N / 2), 0x3);
        } else {
          tma_load_2d(smem_b + s * B_BYTES, &tma_b, &full_bar[s], kb * BLOCK_K, b_row);
        }
        if constexpr (FP8) {
          const int sf_row = kb + (KIND == kGroupedMasked ? group * SF_K : 0);
          tma_load_2d(smem_sfa + s * BLOCK_M, &tma_sfa, &full_bar[s], m_block * BLOCK_M, sf_row);
        }
      }
    }
    if constexpr (kInfo) {  // the end-of-schedule slot: no loads, one arrival completes the phase
      const int s = it % STAGES;
      mbarrier_wait(&empty_bar[s], ((it / STAGES) & 1) ^ 1);
      *reinterpret_cast<int4*>(tile_info + 4 * s) = make_int4(0, 0, 0, 0);
      mbarrier_arrive(&full_bar[s]);
    }
    if constexpr (MCAST > 1) {
      // Stay alive until both CTAs' consumers released every stage: after that no remote arrival
      // or multicast write can target this CTA's shared memory.
#pragma unroll 1
      for (int i = 0; i < STAGES; ++i, ++it) mbarrier_wait(&empty_bar[it % STAGES], ((it / STAGES) & 1) ^ 1);
    }
    return;
  }

  // ------------------------------------------------------------------ math warpgroups
  setmaxnreg_inc<kLeanProducer<KIND, OVERLAP, kInfo, TMA_STORE> ? 240 : kMathRegs<NUM_MATH_WG>>();
  const int wg = tid / 128;
  const int warp = (tid % 128) / 32;
  const int lane = tid % 32;
  const int row_in_tile = wg * 64 + warp * 16 + lane / 4;  // and +8
  float acc[ACC];
  constexpr int PART = FP8 ? ACC : 1;
  float part[PART];
  float part2[OVERLAP ? PART : 1];  // the second partial-sum set of the overlapped fp8 path
  u32 it = 0;
  [[maybe_unused]] u32 c_tiles = 0;  // C_TMA: tiles done (the C barrier's phase)

  // Hand a stage back to the producer(s): lane i of each warp arrives in CTA i of the cluster.
  auto release = [&](int s) {
    if constexpr (MCAST == 1) {
      if (lane == 0) mbarrier_arrive(&empty_bar[s]);
    } else {
      if (lane < MCAST) mbarrier_release_peer<DEEPGEMM_MCAST_RELEASE_CLUSTER>(&empty_bar[s], lane);
    }
  };

  [[maybe_unused]] int info_limit = 0;  // kInfo, masked: the tile's group's row limit
  auto next_tile = [&]() -> bool {
    if constexpr (kInfo) {
      // The tile's first stage carries its coordinates (waiting again on it in the K loop returns at once).
      const int s0 = it % STAGES;
      mbarrier_wait(&full_bar[s0], (it / STAGES) & 1);
      const int4 info = *reinterpret_cast<const int4*>(tile_info + 4 * s0);
      m_block = info.x, n_block = info.y, group = info.z, info_limit = info.w - 1;
      return info.w != 0;
    } else {
      return sched.next(m_block, n_block, group);
    }
  };
  while (next_tile()) {
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
    const int n0 = n_block * BLOCK_N;
    if constexpr (C_TMA) {
      // This tile's C into the staging tile, once the previous tile's store has read it (phantom tiles: no bytes).
      if (tid == 0) {
        constexpr int kBoxN = D_SWIZZLE ? D_SWIZZLE / 2 : BLOCK_N;
        const int m0 = m_block * BLOCK_M;
        int boxes = 0;
#pragma unroll
        for (int b = 0; b < BLOCK_N / kBoxN; ++b) boxes += m0 < shape_m && n0 + b * kBoxN < SHAPE_N;
        tma_store_wait_read<0>();
        mbarrier_arrive_expect_tx(c_bar, boxes * BLOCK_M * kBoxN * 2);
#pragma unroll
        for (int b = 0; b < BLOCK_N / kBoxN; ++b) {
          if (m0 < shape_m && n0 + b * kBoxN < SHAPE_N)
            tma_load_2d(smem_d + b * BLOCK_M * kBoxN * 2, &tma_sfa, c_bar, n0 + b * kBoxN, m0);
        }
      }
    }
    // A phantom tile (n0 past N, multicast pairs only) reads the last scale block instead.
    const int sf_blk = min(n0 / 128, SF_N - 1);
    const float* sfb_row = sfb + (group * SF_N + sf_blk) * SF_K;
    const bool has_second_sf = sf_blk + 1 < SF_N;
    const int n_off = n0 % 128;
    // Promote one K block: acc += part * sfa[row] * sfb[column block].
    auto promote = [&](const float (&p)[ACC], float sa0, float sa1, float sb0, float sb1) {
#ifdef DEEPGEMM_PROFILE_SKIP_PROMOTION
      // Profiling only (benchmarks/profile_ncu.py): time the kernel without the promotion's FMAs.
      // The wgmmas stay (asm volatile); the result is wrong.
      if (sa0 == 12345.f) acc[0] += p[0];
      return;
#endif
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) {
        const float sb = (n_off + j * 8 >= 128) ? sb1 : sb0;
        const float s0 = sa0 * sb, s1 = sa1 * sb;
        acc[4 * j + 0] += p[4 * j + 0] * s0;
        acc[4 * j + 1] += p[4 * j + 1] * s0;
        acc[4 * j + 2] += p[4 * j + 2] * s1;
        acc[4 * j + 3] += p[4 * j + 3] * s1;
      }
    };

    if constexpr (FP8 && OVERLAP) {
      // Two partial-sum sets in turn: block kb+1's wgmma is issued before block kb is promoted,
      // so the promotion's FMAs run while the tensor cores work (wait_group 1 retires only kb).
      // Each block's weight scales are loaded when the block is issued, one block ahead.
      const u32 it0 = it;
      auto issue = [&](float (&p)[PART], int kb, float& b0, float& b1) {
        b0 = __ldg(sfb_row + kb);
        b1 = has_second_sf ? __ldg(sfb_row + SF_K + kb) : b0;
        const int s = (it0 + kb) % STAGES;
        mbarrier_wait(&full_bar[s], ((it0 + kb) / STAGES) & 1);
        const u64 desc_a = make_smem_desc_k128b(smem_a + s * A_BYTES + wg * 64 * 128);
        const u64 desc_b = make_smem_desc_k128b(smem_b + s * B_BYTES);
        wgmma_fence_operands(p);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BLOCK_K / K_STEP; ++k) Mma::mma(p, desc_step(desc_a, k), desc_step(desc_b, k), k > 0);
        wgmma_commit();
      };
      // Block kb is retired (all its wgmmas done): free its stage, promote it.
      auto retire = [&](const float (&cur)[PART], int kb, float b0, float b1) {
        const int s = (it0 + kb) % STAGES;
        const float sa0 = smem_sfa[s * BLOCK_M + row_in_tile];
        const float sa1 = smem_sfa[s * BLOCK_M + row_in_tile + 8];
        promote(cur, sa0, sa1, b0, b1);
        wgmma_fence_operands(acc);
        __syncwarp();
        release(s);
      };
      float sc0, sc1, sd0, sd1;
      constexpr int kGroup = NUM_K_BLOCKS < kOverlapGroup ? NUM_K_BLOCKS : kOverlapGroup;
      constexpr int kFullGroups = NUM_K_BLOCKS / kGroup;
#pragma unroll 1
      for (int g = 0; g < kFullGroups; ++g) {
        overlapped_group<kGroup>(g * kGroup, part, part2, sc0, sc1, sd0, sd1, issue, retire);
      }
      if constexpr (NUM_K_BLOCKS % kGroup != 0) {
        overlapped_group<NUM_K_BLOCKS % kGroup>(kFullGroups * kGroup, part, part2, sc0, sc1, sd0, sd1, issue, retire);
      }
      it += NUM_K_BLOCKS;
    } else if constexpr (FP8) {
      for (int kb = 0; kb < NUM_K_BLOCKS; ++kb, ++it) {
        const int s = it % STAGES;
        // Issued before the wait so the load latency hides behind it.
        const float sb0 = __ldg(sfb_row + kb);
        const float sb1 = has_second_sf ? __ldg(sfb_row + SF_K + kb) : sb0;
        mbarrier_wait(&full_bar[s], (it / STAGES) & 1);
        wgmma_block_k128b_sync<Mma, BLOCK_K / K_STEP>(part, smem_a + s * A_BYTES + wg * 64 * 128, smem_b + s * B_BYTES);
        const float sa0 = smem_sfa[s * BLOCK_M + row_in_tile];
        const float sa1 = smem_sfa[s * BLOCK_M + row_in_tile + 8];
        __syncwarp();
        release(s);
        promote(part, sa0, sa1, sb0, sb1);
      }
    } else {
      // With 4+ stages one K block stays in flight: issue block kb, then wait for block kb-1 and
      // free its stage. With fewer, holding two stages would starve the producer, so each block
      // is waited for (the other math warpgroup keeps the tensor cores busy meanwhile).
      constexpr int kInFlight = STAGES >= 4 ? 1 : 0;
      for (int kb = 0; kb < NUM_K_BLOCKS; ++kb, ++it) {
        const int s = it % STAGES;
        mbarrier_wait(&full_bar[s], (it / STAGES) & 1);
        const u64 desc_a = make_smem_desc_k128b(smem_a + s * A_BYTES + wg * 64 * 128);
        const u64 desc_b = make_smem_desc_k128b(smem_b + s * B_BYTES);
        wgmma_fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BLOCK_K / K_STEP; ++k) Mma::mma(acc, desc_a + k * 2, desc_b + k * 2, 1);
        wgmma_commit();
        wgmma_wait<kInFlight>();
        wgmma_fence_operands(acc);
        if (kb >= kInFlight) {
          __syncwarp();
          release((it + STAGES - kInFlight) % STAGES);
        }
      }
      if constexpr (kInFlight) {
        wgmma_wait<0>();
        wgmma_fence_operands(acc);
        __syncwarp();
        release((it + STAGES - 1) % STAGES);
      }
    }

    // ---------------------------------------------------------------- epilogue
#ifdef DEEPGEMM_PROFILE_SKIP_EPILOGUE
    // Profiling only (benchmarks/profile_ncu.py): no stores, so the epilogue's share can be timed. Every
    // accumulator stays live (else the promotion's FMAs would be dead code and vanish with the stores).
    {
      float keep = 0.f;
#pragma unroll
      for (int i = 0; i < ACC; ++i) keep += acc[i];
      if (keep == 12345.f) store_pair(d, keep, keep, false, false);
    }
    continue;
#endif
    if constexpr (TMA_STORE) {
      // 256-wide tiles are staged in two 128-column passes: the half-size staging tile frees a pipeline
      // stage (bf16 128x256: 4 stages instead of 3). Each pass waits until the previous TMA store has read
      // the staging tile before overwriting it.
      const int m0 = m_block * BLOCK_M;
      [[maybe_unused]] int masked_limit = 0;  // masked: the group's rows (masked_m clamped to M_max)
      if constexpr (KIND == kGroupedMasked) {
        masked_limit = kInfo ? info_limit : min(max(__ldg(group_info + group), 0), shape_m);
      }
#pragma unroll
      for (int pass = 0; pass < kEpiPasses; ++pass) {
        if constexpr (C_TMA) {
          mbarrier_wait(c_bar, c_tiles & 1);  // C has landed (its load waited for the previous store's read)
          ++c_tiles;
        } else {
          if (tid == 0) tma_store_wait_read<0>();
          named_barrier_sync(1, NUM_MATH_THREADS);
        }
#pragma unroll
        for (int jj = 0; jj < kPassN / 8; ++jj) {
          const int j = pass * (kPassN / 8) + jj;  // SWIGLU: gate columns j, up columns j + kPassN / 8
          [[maybe_unused]] float bias0 = 0.f, bias1 = 0.f;
          if constexpr (BIAS) {
            const int col = n0 + j * 8 + (lane % 4) * 2;  // columns past N are clipped by the store: read none
            if (col < SHAPE_N) bias0 = __ldg(c + col);
            if (col + 1 < SHAPE_N) bias1 = __ldg(c + col + 1);
          }
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int off = staging_offset<BLOCK_M, kPassN, D_SWIZZLE>(row_in_tile + 8 * half, jj, lane % 4);
            float x = acc[4 * j + 2 * half], y = acc[4 * j + 2 * half + 1];
            if constexpr (BIAS) x += bias0, y += bias1;  // (no `+ 0.f` otherwise: it would turn -0 into +0)
            if constexpr (SWIGLU) {
              x = swiglu(x, acc[4 * (j + kPassN / 8) + 2 * half]);
              y = swiglu(y, acc[4 * (j + kPassN / 8) + 2 * half + 1]);
            }
            if constexpr (C_TMA) {  // the C pair this thread's D pair replaces
              const float2 cv = bf16x2_to_float2(*reinterpret_cast<const unsigned*>(smem_d + off));
              x += cv.x, y += cv.y;
            }
            *reinterpret_cast<unsigned*>(smem_d + off) = float2_to_bf16x2(x, y);
          }
        }
        fence_proxy_async_shared();  // make these generic-proxy writes visible to the TMA engine
        named_barrier_sync(1, NUM_MATH_THREADS);
        constexpr int kBoxN = D_SWIZZLE ? D_SWIZZLE / 2 : kPassN;
        if constexpr (KIND == kGroupedMasked) {
          const int row0 = group * shape_m + m0;  // D is [G * M_max, N]
          if (m0 + BLOCK_M <= masked_limit) {
            if (tid == 0) {
#pragma unroll
              for (int b = 0; b < kPassN / kBoxN; ++b) {
                const int col = n0 + pass * kPassN + b * kBoxN;
                if (col < kOutN) tma_store_2d(&tma_d, smem_d + b * BLOCK_M * kBoxN * 2, col, row0);
              }
              tma_store_commit();
            }
          } else {  // the partial block (or a phantom one past masked_m: no rows): 16-byte units of rows < masked_m
            constexpr int kUnits = kPassN / 8;
            for (int u = tid; u < (masked_limit - m0) * kUnits; u += NUM_MATH_THREADS) {
              const int r = u / kUnits, jj = u % kUnits;
              const int col = n0 + pass * kPassN + jj * 8;
              if (col < SHAPE_N) {
                *reinterpret_cast<uint4*>(d + static_cast<u64>(row0 + r) * SHAPE_N + col) =
                    *reinterpret_cast<const uint4*>(smem_d + staging_offset<BLOCK_M, kPassN, D_SWIZZLE>(r, jj, 0));
              }
            }
          }
        } else if (tid == 0 && m0 < shape_m) {  // phantom tiles (past M or N) store nothing
#pragma unroll
          for (int b = 0; b < kPassN / kBoxN; ++b) {
            const int col = (SWIGLU ? n0 / 2 : n0) + pass * kPassN + b * kBoxN;
            if (col < kOutN) tma_store_2d(&tma_d, smem_d + b * BLOCK_M * kBoxN * 2, col, m0);
          }
          tma_store_commit();
        }
      }
      continue;
    }
    int row_limit = shape_m;
    u64 row_base = 0;
    if constexpr (KIND == kGroupedMasked) {
      row_limit = kInfo ? info_limit : min(max(__ldg(group_info + group), 0), shape_m);
      row_base = static_cast<u64>(group) * shape_m;
    }
    if constexpr (kStaged) {
      // Registers -> padded staging rows (conflict free) -> 16-byte row segments of D, C added in fp32.
      named_barrier_sync(1, NUM_MATH_THREADS);  // the previous tile's copy-out has read the staging tile
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          Staged::put(smem_d, row_in_tile + 8 * half, j * 8 + (lane % 4) * 2, acc[4 * j + 2 * half],
                      acc[4 * j + 2 * half + 1]);
        }
      }
      named_barrier_sync(1, NUM_MATH_THREADS);
      Staged::template copy_out<SHAPE_N, OutT, HAS_C, C_BF16>(smem_d, tid, NUM_MATH_THREADS, d, c, row_base,
                                                       m_block * BLOCK_M, row_limit, n0);
      continue;
    }
    store_acc_direct<SHAPE_N, BLOCK_N, HAS_C, true>(acc, d, c, row_base, m_block * BLOCK_M + row_in_tile, row_limit,
                                                 n0, lane);
  }
  if constexpr (TMA_STORE) {
    if (tid == 0) tma_store_wait<0>();  // shared memory must outlive the last store
  }
}

}  // namespace deepgemm
