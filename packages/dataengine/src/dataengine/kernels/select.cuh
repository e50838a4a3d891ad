// Sparse-attention block selection on the GPU: Quest upper bounds, then a per-row top-k.
//
// Two kernels, no host synchronization between or inside them (CUDA-graph capturable):
//
// quest_score_kernel  grid (ceil(table_stride / 256), kv_heads, B), 256 threads, CUDA cores.
//   The CTA's 256 table entries are staged in shared memory first (one dependent load, not one
//   per step). D/8 lanes own one logical block (8 channels each: one 16-byte load of kmax and one
//   of kmin for 2-byte summaries, 8 bytes for fp8), so a warp scores 32/(D/8) blocks per step.
//   Per q head of the GQA group: sum(q+ * kmax) + sum(q- * kmin) over the channels (the
//   reference's two matmuls, the same IEEE special cases: any inf/NaN in a summary row makes the
//   bound non-finite), reduced over the lanes; a non-finite head bound becomes -inf; the group
//   reduces by max/sum/mean. Writes raw[b, h, pos] for every table position (float32). Holes (-1)
//   read block 0, as the reference does (its clamp); ids >= num_blocks score -inf, never read.
//
// quest_score_mma_kernel  the same scores on tensor cores (bf16 q; bf16 or fp8 summaries; D 64
//   or 128; G <= 8): a warp takes 16 blocks as the rows of an m16n8k16 A tile ([kmax | kmin]
//   channels along k) against B = [q+ ; q-] of the group's heads (n = head, 8 columns, G used).
//   bf16 x bf16 products are exact in fp32, so bounds differ from the reference's only by the
//   order of the fp32 sums (none on integer inputs). Channels are assigned to k slots so that a
//   lane's A registers come from one contiguous 16-byte (bf16) / 8-byte (fp8) load per row.
//
// fp8 summaries (e4m3, kvpool's summary_dtype=float8_e4m3fn) are rounded outward by their
//   writer (kmin down, kmax up), so the bound stays an upper bound. The two NaN codes are the
//   open ends: in kmax 0x7F = "a key above 448" (read as 2^100: the block stays a candidate) and
//   0xFF = nothing written (-inf); in kmin 0xFF = "a key below -448" (-2^100), 0x7F = nothing
//   written (+inf). select.py's reference decodes the same way.
//
// topk_select_kernel  grid (rows), 512 threads, one row of N scores each. Order key per
//   position: invalid (pos >= n_valid) 0; forced (sink/local) 0xffffffff; otherwise the float's
//   order-preserving bit pattern (-0 -> +0, NaN -> -inf). The kernel finds the width-th largest
//   key T by a 4 x 8-bit radix select (shared-memory histograms), then walks the row in position
//   order: keys > T are taken, keys == T are taken in position order until width is reached
//   (the documented tie rule: higher score first, then lower position), and only keys above
//   -inf's (chosen = forced or finite / +inf score) are written, ascending, -1 padded.
#pragma once
#include <tilehal/tilehal.cuh>

// Programmatic dependent launch: builds with -DDATAENGINE_PDL (cuda_select launches them with pdl=True) wait
// for the stream's previous kernel to finish, its writes visible, before reading anything, then let the
// next kernel's CTAs launch (which wait in turn). Without the macro both are absent (the default PTX).
#if defined(DATAENGINE_PDL)
#define DATAENGINE_PDL_ENTRY()                                      \
  do {                                                              \
    asm volatile("griddepcontrol.wait;" ::: "memory");              \
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
  } while (0)
#else
#define DATAENGINE_PDL_ENTRY() \
  do {                         \
  } while (0)
#endif

namespace dataengine {

constexpr int kScoreThreads = 256;
constexpr int kScoreUnroll = 4;  // block groups per warp step (loads in flight per lane)
constexpr int kTopkThreads = 512;
constexpr int kTopkItems = 8;  // consecutive positions per thread in the ordered walk
constexpr unsigned kKeyNegInf = 0x007fffffu;  // order key of -inf
constexpr unsigned kKeyForced = 0xffffffffu;

enum Reduce { kMax = 0, kSum = 1, kMean = 2 };

constexpr int kScoreChunk = 256;  // table positions per score CTA (staged in shared memory)
constexpr float kUnbounded = 1.2676506002282294e30f;  // 2^100: an fp8 summary's open end

// fp8 (e4m3) summary codes -> float, by role (see the header): the NaN codes are the open ends.
__device__ __forceinline__ float e4m3_summary(unsigned byte, bool is_max) {
  if ((byte & 0x7fu) == 0x7fu) {
    const bool top = byte == 0x7fu;
    return is_max ? (top ? kUnbounded : -INFINITY) : (top ? INFINITY : -kUnbounded);
  }
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3);
  return __half2float(__half(h));
}
// Any byte of w a NaN code (0x7F / 0xFF)?
__device__ __forceinline__ bool has_e4m3_nan(unsigned w) {
  return (((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0u;
}
// Two e4m3 codes (low 16 bits of w >> shift) -> float2, ordinary values only.
__device__ __forceinline__ float2 e4m3x2_to_float2(unsigned w, int shift) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>((w >> shift) & 0xffffu),
                                                    __NV_E4M3);
  return __half22float2(__half2(h));
}
// 8 fp8 codes (w.x: channels 0-3, w.y: 4-7) -> floats, by role.
__device__ __forceinline__ void e4m3x8_to_float(const int2& w, float (&x)[8], bool is_max) {
  const unsigned u[2] = {unsigned(w.x), unsigned(w.y)};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float2 a = e4m3x2_to_float2(u[i], 0), b = e4m3x2_to_float2(u[i], 16);
    x[4 * i] = a.x; x[4 * i + 1] = a.y; x[4 * i + 2] = b.x; x[4 * i + 3] = b.y;
  }
  if (has_e4m3_nan(u[0]) || has_e4m3_nan(u[1])) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const unsigned byte = (u[c / 4] >> (8 * (c % 4))) & 0xffu;
      if ((byte & 0x7fu) == 0x7fu) x[c] = e4m3_summary(byte, is_max);
    }
  }
}

TILEHAL_DEVICE int2 load_nc_v2(const int2* ptr) {
  int2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.s32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(ptr));
  return r;
}

// 8 summary channels: loaded raw (16 B for 2-byte types, 32 B for float, 8 B for fp8), converted
// on use (`get<true>` for kmax, `get<false>` for kmin: only fp8 codes differ by role).
template <typename T> struct Chan8 {
  static constexpr int kWords = sizeof(T) / 2;  // int4 words per 8 channels
  int4 w[kWords];
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = tilehal::load_nc_v4(reinterpret_cast<const int4*>(p) + i);
  }
  template <bool IS_MAX> __device__ __forceinline__ void get(float (&x)[8]) const;
};
template <> struct Chan8<__nv_fp8_e4m3> {
  int2 w;
  __device__ __forceinline__ void load(const __nv_fp8_e4m3* p) { w = load_nc_v2(reinterpret_cast<const int2*>(p)); }
  template <bool IS_MAX> __device__ __forceinline__ void get(float (&x)[8]) const { e4m3x8_to_float(w, x, IS_MAX); }
};
__device__ __forceinline__ void unpack16(const int4& r, float (&x)[8], bool bf16) {
  const unsigned u[4] = {unsigned(r.x), unsigned(r.y), unsigned(r.z), unsigned(r.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = bf16 ? tilehal::bf16x2_to_float2(u[i]) : tilehal::half2_to_float2(u[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}
template <> template <bool M> __device__ __forceinline__ void Chan8<__nv_bfloat16>::get(float (&x)[8]) const {
  unpack16(w[0], x, true);
}
template <> template <bool M> __device__ __forceinline__ void Chan8<__half>::get(float (&x)[8]) const {
  unpack16(w[0], x, false);
}
template <> template <bool M> __device__ __forceinline__ void Chan8<float>::get(float (&x)[8]) const {
  x[0] = __int_as_float(w[0].x); x[1] = __int_as_float(w[0].y); x[2] = __int_as_float(w[0].z); x[3] = __int_as_float(w[0].w);
  x[4] = __int_as_float(w[1].x); x[5] = __int_as_float(w[1].y); x[6] = __int_as_float(w[1].z); x[7] = __int_as_float(w[1].w);
}

__device__ __forceinline__ bool finite(float x) { return fabsf(x) <= 3.402823466e38f; }  // false for inf, NaN

// Stage the CTA's table entries: phys id, or -1 for ids >= num_blocks (scored -inf, never read);
// holes (-1) read block 0 like the reference's clamp. Ends with __syncthreads.
__device__ __forceinline__ void stage_table(int* phys_s, const int* table, int pos0, int n_here, int num_blocks) {
  for (int i = threadIdx.x; i < kScoreChunk; i += blockDim.x) {
    int p = i < n_here ? table[pos0 + i] : 0;
    p = max(p, 0);
    phys_s[i] = p < num_blocks ? p : -1;
  }
  __syncthreads();
}

// q [B, Hq, D] (TQ), kmin/kmax [num_blocks, H, D] (TS), block_table [B, table_stride] int32;
// raw [B, H, table_stride] float32. Grid x = ceil(table_stride / kScoreChunk).
template <typename TQ, typename TS, int D, int G, int REDUCE>
__global__ void __launch_bounds__(kScoreThreads, (G <= 4 && sizeof(TS) <= 2) ? 2 : 1) quest_score_kernel(
    const TQ* __restrict__ q, const TS* __restrict__ kmin, const TS* __restrict__ kmax,
    const int* __restrict__ block_table, int table_stride, int num_blocks, float* __restrict__ raw) {
  constexpr int kLanes = D / 8;           // lanes per logical block
  constexpr int kPerWarp = 32 / kLanes;   // blocks per warp and group step
  constexpr int kPerStep = kPerWarp * kScoreUnroll;
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  __shared__ int phys_s[kScoreChunk];
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / kLanes, cl = lane % kLanes;
  const int warps = kScoreThreads / 32;
  const int pos0 = blockIdx.x * kScoreChunk;
  const int n_here = min(kScoreChunk, table_stride - pos0);
  stage_table(phys_s, block_table + (long long)b * table_stride, pos0, n_here, num_blocks);

  // This lane's 8 channels of every q head of the group; small groups keep q+ and q- apart
  // (two FMAs per channel), large ones split on the fly (registers).
  constexpr bool kSplitQ = G <= 4;
  float qv[G][8], qn[kSplitQ ? G : 1][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const TQ* qr = q + ((long long)b * H * G + (long long)h * G + g) * D + cl * 8;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const float x = tilehal::to_float(qr[c]);
      if constexpr (kSplitQ) {
        qv[g][c] = fmaxf(x, 0.f);
        qn[g][c] = fminf(x, 0.f);
      } else {
        qv[g][c] = x;
      }
    }
  }
  const long long row_stride = (long long)H * D;
  float* out = raw + ((long long)b * H + h) * table_stride + pos0;

  for (int base = warp * kPerStep; base < n_here; base += warps * kPerStep) {
    Chan8<TS> rx[kScoreUnroll], rn[kScoreUnroll];
    bool ok[kScoreUnroll];
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      const int i = base + u * kPerWarp + sub;
      const int phys = i < n_here ? phys_s[i] : -1;
      ok[u] = phys >= 0;
      const long long off = (ok[u] ? (long long)phys : 0ll) * row_stride + (long long)h * D + cl * 8;
      rx[u].load(kmax + off);
      rn[u].load(kmin + off);
    }
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      float kx[8], kn[8];
      rx[u].template get<true>(kx);
      rn[u].template get<false>(kn);
      float score = REDUCE == kMax ? -INFINITY : 0.f;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float sp = 0.f, sn = 0.f;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const float qp = kSplitQ ? qv[g][c] : fmaxf(qv[g][c], 0.f);
          const float qm = kSplitQ ? qn[kSplitQ ? g : 0][c] : fminf(qv[g][c], 0.f);
          sp = fmaf(qp, kx[c], sp);
          sn = fmaf(qm, kn[c], sn);
        }
        float s = sp + sn;
#pragma unroll
        for (int off = kLanes / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        s = finite(s) ? s : -INFINITY;
        if (REDUCE == kMax) score = fmaxf(score, s);
        else score += s;
      }
      if (REDUCE == kMean) score = score / float(G);
      const int i = base + u * kPerWarp + sub;
      if (cl == 0 && i < n_here) out[i] = ok[u] ? score : -INFINITY;
    }
  }
}

// ----------------------------------------------------------------------------- tensor-core scores
// A lane's 8 channels of one summary row as 4 bf16x2 words (channel pairs 0-1, 2-3, 4-5, 6-7).
template <typename TS> struct RowA;
template <> struct RowA<__nv_bfloat16> {
  int4 w;
  __device__ __forceinline__ void load(const __nv_bfloat16* p) { w = tilehal::load_nc_v4(reinterpret_cast<const int4*>(p)); }
  template <bool IS_MAX> __device__ __forceinline__ void words(unsigned (&o)[4]) const {
    o[0] = unsigned(w.x); o[1] = unsigned(w.y); o[2] = unsigned(w.z); o[3] = unsigned(w.w);
  }
};
template <> struct RowA<__nv_fp8_e4m3> {
  int2 w;
  __device__ __forceinline__ void load(const __nv_fp8_e4m3* p) { w = load_nc_v2(reinterpret_cast<const int2*>(p)); }
  template <bool IS_MAX> __device__ __forceinline__ void words(unsigned (&o)[4]) const {
    // e4m3 -> bf16 is exact (3 mantissa bits, exponents within bf16's), as is 2^100.
    float x[8];
    e4m3x8_to_float(w, x, IS_MAX);
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = tilehal::float2_to_bf16x2(x[2 * i], x[2 * i + 1]);
  }
};

TILEHAL_DEVICE unsigned bf16x2_max0(unsigned w) {  // max(x, 0) per half, NaN kept (torch.clamp)
  const __nv_bfloat162 r = __hmax2_nan(*reinterpret_cast<const __nv_bfloat162*>(&w), __float2bfloat162_rn(0.f));
  return *reinterpret_cast<const unsigned*>(&r);
}
TILEHAL_DEVICE unsigned bf16x2_min0(unsigned w) {  // min(x, 0) per half, NaN kept
  const __nv_bfloat162 r = __hmin2_nan(*reinterpret_cast<const __nv_bfloat162*>(&w), __float2bfloat162_rn(0.f));
  return *reinterpret_cast<const unsigned*>(&r);
}
TILEHAL_DEVICE unsigned load_nc_u32(const void* p) {
  unsigned r;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

// int4 summary rows (kvpool's summary_dtype="int4"): per (block, kv head) D/2 bytes of 4-bit
// codes (channel 2i in the low nibble of byte i) then, per 32-channel group, a bf16 origin lo and
// a bf16 step: value = lo + code * step (fp32; code * step is exact). The writer rounds outward,
// so the decoded kmin <= every key <= the decoded kmax, channel by channel.
struct Q4 {};
template <typename T> struct IsQ4 { static constexpr bool value = false; };
template <> struct IsQ4<Q4> { static constexpr bool value = true; };
template <int D> struct Q4Row {
  static constexpr int kCodeBytes = D / 2, kGroups = D / 32, kBytes = D / 2 + 4 * (D / 32);
};

// Lane l = 4r + t. k slot assignment per 8-channel group j (channels 32j + 8t + 0..7 of this lane):
// k-step (j, hh) uses channels 32j + 8t + 4hh + {0,1} as k rows 2t, 2t+1 and + {2,3} as 2t+8, 2t+9;
// the A rows are blocks (r and r + 8 of the warp's 16), the B columns heads (n = r). The two
// k-steps of j cover exactly channels 32j .. 32j + 31 (one int4 group).
// PAIRS4 (int4 rows): word i of group (j, t) holds channels i and i + 4 instead of
// 2i and 2i + 1, the order in which that kernel widens the codes.
template <int D, int G, bool SUMS, bool PAIRS4 = false>
struct MmaQ {
  static constexpr int kJ = D / 32;
  unsigned qp[kJ][4], qn[kJ][4];                    // B fragments: head r's q+ / q- at this lane's channels
  float sp[SUMS ? kJ : 1][2], sn[SUMS ? kJ : 1][2];  // int4 rows: sum of q+ / q- over group j, heads 2t + e
  __device__ __forceinline__ void load(const __nv_bfloat16* q, long long head0, int r, int t) {
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      float fp = 0.f, fn = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        unsigned w = 0u;
        if constexpr (PAIRS4) {  // channels i (low half) and i + 4 (high half)
          if (r < G) {
            const unsigned* qw = reinterpret_cast<const unsigned*>(q + (head0 + r) * D) + (32 * j + 8 * t) / 2;
            w = __byte_perm(qw[i / 2], qw[2 + i / 2], (i % 2) ? 0x7632u : 0x5410u);
          }
        } else {
          if (r < G) w = reinterpret_cast<const unsigned*>(q + (head0 + r) * D)[(32 * j + 8 * t) / 2 + i];
        }
        qp[j][i] = bf16x2_max0(w);
        qn[j][i] = bf16x2_min0(w);
        if constexpr (SUMS) {
          const float2 a = tilehal::bf16x2_to_float2(qp[j][i]), c = tilehal::bf16x2_to_float2(qn[j][i]);
          fp += a.x + a.y;
          fn += c.x + c.y;
        }
      }
      if constexpr (SUMS) {
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
          fp += __shfl_xor_sync(0xffffffffu, fp, off);
          fn += __shfl_xor_sync(0xffffffffu, fn, off);
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // the quad of head 2t + e holds its sums
          sp[j][e] = __shfl_sync(0xffffffffu, fp, 4 * (2 * t + e));
          sn[j][e] = __shfl_sync(0xffffffffu, fn, 4 * (2 * t + e));
        }
      }
    }
  }
};

// The two k-steps of 32-channel group j: acc += [A rows r / r + 8: words al / ah] x the bound's q
// columns (q+ for kmax, q- for kmin).
template <bool IS_MAX, typename QF>
__device__ __forceinline__ void mma_group(const QF& Q, int j, const unsigned (&al)[4], const unsigned (&ah)[4],
                                          float (&acc)[4]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const tilehal::u32 a[4] = {al[2 * hh], ah[2 * hh], al[2 * hh + 1], ah[2 * hh + 1]};
    const tilehal::u32 bq[2] = {IS_MAX ? Q.qp[j][2 * hh] : Q.qn[j][2 * hh],
                                IS_MAX ? Q.qp[j][2 * hh + 1] : Q.qn[j][2 * hh + 1]};
    tilehal::mma_m16n8k16(tilehal::MmaBF16{}, acc, a, bq);
  }
}

// One bound (kmax or kmin) of one 16-block tile, loaded raw: the lane's rows r (lo) and r + 8 (hi).
// Loading and computing are separate so the next tile's loads go out while this one computes.
template <typename TS, int D> struct Half {
  static constexpr int kJ = D / 32;
  RowA<TS> l[kJ], h[kJ];
  __device__ __forceinline__ void load(const TS* __restrict__ p, long long o_lo, long long o_hi, int) {
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      l[j].load(p + o_lo + 32 * j);
      h[j].load(p + o_hi + 32 * j);
    }
  }
  // acc += [this bound's rows] x B (q+ for kmax, q- for kmin)
  template <bool IS_MAX, int G, bool S>
  __device__ __forceinline__ void mma(const MmaQ<D, G, S>& Q, float (&acc)[4]) const {
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      unsigned al[4], ah[4];
      l[j].template words<IS_MAX>(al);
      h[j].template words<IS_MAX>(ah);
      mma_group<IS_MAX>(Q, j, al, ah, acc);
    }
  }
};

// int4 rows (load: o_lo / o_hi byte offsets of the lane's rows; smem_fill: from shared memory): the
// 8 codes of a lane's word enter the MMA as 16 + code (bf16 0x4180 | code << 3: exponent 2^4,
// mantissa step 1/8 x 8 = 1: exact), channels i and i + 4
// sharing a word (one shift and one LOP3 per word: bits 4i, 4i + 16 -> 3, 19), against
// MmaQ<PAIRS4> columns. Per 32-channel group j: bound += step * A + (lo - 16 * step) * sum(q), A
// the MMA's group sum (= 16 sum(q) + sum(q * code)). (An earlier version ran 0x4300, 128 + 8 * code,
// with a 128 in the correction: wrong bounds, caught by the exactness test.)
template <int D> struct Half<Q4, D> {
  static constexpr int kJ = D / 32;
  unsigned c[2][kJ], pr[2][kJ];  // code words, (lo, step) bf16 pairs; [0] row r, [1] row r + 8
  static __device__ __forceinline__ void words(unsigned w, unsigned (&o)[4]) {  // bf16 16 + code
    o[0] = ((w << 3) & 0x00780078u) | 0x41804180u;
    o[1] = ((w >> 1) & 0x00780078u) | 0x41804180u;
    o[2] = ((w >> 5) & 0x00780078u) | 0x41804180u;
    o[3] = ((w >> 9) & 0x00780078u) | 0x41804180u;
  }
  __device__ __forceinline__ void load(const unsigned char* __restrict__ p, long long o_lo, long long o_hi, int t) {
    const long long rows[2] = {o_lo, o_hi};
#pragma unroll
    for (int s = 0; s < 2; ++s) {
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        c[s][j] = load_nc_u32(p + rows[s] + 16 * j + 4 * t);
        pr[s][j] = load_nc_u32(p + rows[s] + Q4Row<D>::kCodeBytes + 4 * j);
      }
    }
  }
  template <bool IS_MAX, int G, bool S, bool P4>
  __device__ __forceinline__ void mma(const MmaQ<D, G, S, P4>& Q, float (&acc)[4]) const {
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      unsigned al[4], ah[4];
      words(c[0][j], al);
      words(c[1][j], ah);
      float a[4] = {0.f, 0.f, 0.f, 0.f};
      mma_group<IS_MAX>(Q, j, al, ah, a);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const float2 ls = tilehal::bf16x2_to_float2(pr[s][j]);  // (lo, step)
        const float c0 = fmaf(-16.f, ls.y, ls.x);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float Ssum = IS_MAX ? Q.sp[j][e] : Q.sn[j][e];
          acc[2 * s + e] = fmaf(ls.y, a[2 * s + e], fmaf(c0, Ssum, acc[2 * s + e]));
        }
      }
    }
  }
};
template <int D>
__device__ __forceinline__ void smem_fill(Half<Q4, D>& X, const unsigned char* lo, const unsigned char* hi, int t) {
  const unsigned char* rows[2] = {lo, hi};
#pragma unroll
  for (int s = 0; s < 2; ++s) {
#pragma unroll
    for (int j = 0; j < D / 32; ++j) X.c[s][j] = *reinterpret_cast<const unsigned*>(rows[s] + 16 * j + 4 * t);
    // the row's (lo, step) pairs: D / 32 words, 16-byte aligned (row pitch and code bytes are)
    if constexpr (D == 128) {
      const uint4 w = *reinterpret_cast<const uint4*>(rows[s] + Q4Row<D>::kCodeBytes);
      X.pr[s][0] = w.x; X.pr[s][1] = w.y; X.pr[s][2] = w.z; X.pr[s][3] = w.w;
    } else {
      const uint2 w = *reinterpret_cast<const uint2*>(rows[s] + Q4Row<D>::kCodeBytes);
      X.pr[s][0] = w.x; X.pr[s][1] = w.y;
    }
  }
}
// Summary element pointers / row offsets per summary type.
template <typename TS, int D> struct Rows {
  using ptr = const TS*;
  static __device__ __forceinline__ long long lane_off(int phys, int h, int H, int t) {
    return (long long)phys * H * D + (long long)h * D + 8 * t;
  }
};
template <int D> struct Rows<Q4, D> {
  using ptr = const unsigned char*;
  static __device__ __forceinline__ long long lane_off(int phys, int h, int H, int) {
    return ((long long)phys * H + h) * Q4Row<D>::kBytes;
  }
};

// acc -> the reduced scores of rows r (s_lo) and r + 8 (s_hi), on every lane of the quad.
template <int G, int REDUCE>
__device__ __forceinline__ void reduce_heads(const float (&acc)[4], int t, float& s_lo, float& s_hi) {
  s_lo = REDUCE == kMax ? -INFINITY : 0.f;
  s_hi = s_lo;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (2 * t + e < G) {
      const float lo = finite(acc[e]) ? acc[e] : -INFINITY, hi = finite(acc[2 + e]) ? acc[2 + e] : -INFINITY;
      if (REDUCE == kMax) { s_lo = fmaxf(s_lo, lo); s_hi = fmaxf(s_hi, hi); }
      else { s_lo += lo; s_hi += hi; }
    }
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    const float ol = __shfl_xor_sync(0xffffffffu, s_lo, off), oh = __shfl_xor_sync(0xffffffffu, s_hi, off);
    if (REDUCE == kMax) { s_lo = fmaxf(s_lo, ol); s_hi = fmaxf(s_hi, oh); }
    else { s_lo += ol; s_hi += oh; }
  }
  if (REDUCE == kMean) { s_lo = s_lo / float(G); s_hi = s_hi / float(G); }
}

// Tensor-core scores of the CTA's positions: dst(i, score) for i in [0, n_here). Each warp walks
// its tiles with the next tile's kmax loads issued after this tile's kmax MMAs and its kmin loads
// after the kmin MMAs (one tile ahead, no extra registers).
template <typename TS, int D, int G, int REDUCE, typename Dst>
__device__ __forceinline__ void mma_scores(const __nv_bfloat16* __restrict__ q, typename Rows<TS, D>::ptr kmin,
                                           typename Rows<TS, D>::ptr kmax, const int* phys_s, int n_here, Dst dst) {
  static_assert(D == 64 || D == 128, "mma scores: head_dim 64 or 128");
  static_assert(G >= 1 && G <= 8, "mma scores: at most 8 q heads per kv head");
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / 4, t = lane % 4;
  const int stride = (blockDim.x / 32) * 16;
  MmaQ<D, G, IsQ4<TS>::value, IsQ4<TS>::value> Q;
  Q.load(q, (long long)b * H * G + (long long)h * G, r, t);
  int tile = warp * 16;
  if (tile >= n_here) return;
  auto phys_of = [&](int i) { return i < n_here ? phys_s[i] : -1; };
  auto off_of = [&](int p) { return Rows<TS, D>::lane_off(max(p, 0), h, H, t); };
  int p_lo = phys_of(tile + r), p_hi = phys_of(tile + r + 8);
  Half<TS, D> X, N;
  X.load(kmax, off_of(p_lo), off_of(p_hi), t);
  N.load(kmin, off_of(p_lo), off_of(p_hi), t);
  for (;;) {
    const int next = tile + stride;
    const bool more = next < n_here;
    const int q_lo = more ? phys_of(next + r) : -1, q_hi = more ? phys_of(next + r + 8) : -1;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    X.template mma<true>(Q, acc);
    if (more) X.load(kmax, off_of(q_lo), off_of(q_hi), t);
    N.template mma<false>(Q, acc);
    if (more) N.load(kmin, off_of(q_lo), off_of(q_hi), t);
    float s_lo, s_hi;
    reduce_heads<G, REDUCE>(acc, t, s_lo, s_hi);
    if (t == 0) {
      if (tile + r < n_here) dst(tile + r, p_lo >= 0 ? s_lo : -INFINITY);
      if (tile + r + 8 < n_here) dst(tile + r + 8, p_hi >= 0 ? s_hi : -INFINITY);
    }
    if (!more) break;
    tile = next;
    p_lo = q_lo;
    p_hi = q_hi;
  }
}

// TS: __nv_bfloat16, __nv_fp8_e4m3 or Q4 (then kmin / kmax are int4 rows, passed as bytes).
// Grid x = ceil(table_stride / chunk), chunk <= kMmaMaxChunk positions per CTA (the host sizes it
// so that the grid is about one wave).
constexpr int kMmaMaxChunk = 4096;
template <typename TS, int D, int G, int REDUCE>
__global__ void __launch_bounds__(kScoreThreads, 2) quest_score_mma_kernel(
    const __nv_bfloat16* __restrict__ q, const void* __restrict__ kmin, const void* __restrict__ kmax,
    const int* __restrict__ block_table, int table_stride, int num_blocks, float* __restrict__ raw, int chunk) {
  __shared__ int phys_s[kMmaMaxChunk];
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const int pos0 = blockIdx.x * chunk;
  const int n_here = min(chunk, table_stride - pos0);
  const int* table = block_table + (long long)b * table_stride;
  for (int i = threadIdx.x; i < n_here; i += blockDim.x) {
    int p = max(table[pos0 + i], 0);  // holes read block 0 like the reference's clamp
    phys_s[i] = p < num_blocks ? p : -1;
  }
  __syncthreads();
  float* out = raw + ((long long)b * H + h) * table_stride + pos0;
  using P = typename Rows<TS, D>::ptr;
  mma_scores<TS, D, G, REDUCE>(q, static_cast<P>(kmin), static_cast<P>(kmax), phys_s, n_here,
                               [&](int i, float s) { out[i] = s; });
}

// ----------------------------------------------------------------------------- top-k
__device__ __forceinline__ unsigned float_key(float s) {
  if (s != s) s = -INFINITY;  // NaN is never chosen
  if (s == 0.f) s = 0.f;      // -0 ties with +0, as in the reference's comparison
  const unsigned u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The order key of position p of a row with n_valid valid positions: 0 past them (never taken),
// kKeyForced for the first `sink` and last `local` ones (taken first), else the score's order key.
__device__ __forceinline__ unsigned select_key(long long p, long long n_valid, int sink, int local, float s) {
  if (p >= n_valid) return 0u;
  if (p < sink || p >= n_valid - local) return kKeyForced;
  return float_key(s);
}
// n_valid of batch entry b, modes 0-2: 0 N; 1 nv[b]; 2 ceil(seq_lens[b] / block_size).
__device__ __forceinline__ long long mode_n_valid(int mode, int b, int N, const int* __restrict__ nv,
                                                  const int* __restrict__ seq_lens, int block_size) {
  if (mode == 1) return nv[b];
  if (mode == 2) return ((long long)seq_lens[b] + block_size - 1) / block_size;
  return N;
}

// Exclusive prefix sum over the CTA; `total` gets the sum. Contains two __syncthreads.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  int x = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  // every warp scans the (<= 32) warp sums itself: one load per lane, five shuffles
  const int ws = lane < nw ? warp_sums[lane] : 0;
  int inc = ws;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, inc, off);
    if (lane >= off) inc += y;
  }
  const int before = __shfl_sync(0xffffffffu, inc - ws, warp);
  total = __shfl_sync(0xffffffffu, inc, nw - 1);
  __syncthreads();  // warp_sums is reused by the next scan
  return before + x - v;
}

// The row's n_valid (the modes of topk_select_kernel below), the same on every thread of the CTA.
// Scratch: warp_sums (mode 3's count), s_nvalid. Contains __syncthreads.
template <int THREADS>
__device__ __forceinline__ long long row_n_valid(int N, int b, int mode, const int* __restrict__ nv,
                                                 const int* __restrict__ seq_lens, const int* __restrict__ table,
                                                 int block_size, int* warp_sums, long long& s_nvalid) {
  const int tid = threadIdx.x;
  if (mode == 3) {
    int c = 0;
    for (int p = tid; p < N; p += THREADS) c += table[(long long)b * N + p] >= 0;
    int total;
    block_exclusive_scan(c, warp_sums, total);
    if (tid == 0) s_nvalid = seq_lens[b] > 0 ? total : 0;
  } else if (tid == 0) {
    s_nvalid = mode_n_valid(mode, b, N, nv, seq_lens, block_size);
  }
  __syncthreads();
  return s_nvalid;
}

// The top-k of every selection kernel, as a CTA-wide device function over any key source: the
// radix select of the width-th largest key T (4 x 8-bit digits, shared-memory histograms), then the
// ordered walk. key_at(i) for i in [0, N), in position order; emit(slot, i) for the taken ones
// (ascending i), slots [0, count). Returns the count (on every thread). Shared scratch: hist[256],
// warp_sums[THREADS / 32], s_digit, s_need. MATCH = false: one shared atomic per key; MATCH = true:
// lanes of a warp with the same digit add once (__match_any_sync; the loop's trip count is warp-uniform).
template <int THREADS, int ITEMS, bool MATCH = false, typename KeyAt, typename Emit>
__device__ __forceinline__ int block_topk(int N, int width, KeyAt key_at, Emit emit, int* hist, int* warp_sums,
                                          int& s_digit, int& s_need) {
  const int tid = threadIdx.x, lane = tid % 32;
  // ---- radix select: T = the width-th largest key, need = how many keys == T to take
  unsigned prefix = 0u, mask = 0u;
  int need = width;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += THREADS) hist[i] = 0;
    __syncthreads();
    if constexpr (MATCH) {
      for (int base = 0; base < N; base += THREADS) {  // warp-uniform trip count (match_any)
        const int p = base + tid;
        const unsigned k = p < N ? key_at(p) : 0u;
        const bool m = p < N && (k & mask) == prefix;
        const unsigned d = (k >> shift) & 255u;
        const unsigned peers = __match_any_sync(0xffffffffu, m ? d : 256u);
        if (m && lane == __ffs(peers) - 1) atomicAdd(&hist[d], __popc(peers));
      }
    } else {
      for (int p = tid; p < N; p += THREADS) {
        const unsigned k = key_at(p);
        if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1);
      }
    }
    __syncthreads();
    if (tid < 32) {
      // lane l owns bins 255 - 8l ... 248 - 8l (descending key order)
      int c[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) { c[j] = hist[255 - 8 * tid - j]; sum += c[j]; }
      int incl = sum;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, off);
        if (tid >= off) incl += y;
      }
      const int excl = incl - sum;
      if (excl < need && need <= incl) {
        int cum = excl;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (cum + c[j] >= need) { s_digit = 255 - 8 * tid - j; s_need = need - cum; break; }
          cum += c[j];
        }
      }
    }
    __syncthreads();
    prefix |= unsigned(s_digit) << shift;
    mask |= 255u << shift;
    need = s_need;
    __syncthreads();  // s_digit / s_need / hist are rewritten by the next pass
  }
  const unsigned T = prefix;

  // ---- ordered walk: take keys > T, the first `need` keys == T, keep the chosen ones
  int eq_carry = 0, out_carry = 0;
  for (int t0 = 0; t0 < N; t0 += THREADS * ITEMS) {
    unsigned k[ITEMS];
    int eq = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int p = t0 + tid * ITEMS + i;
      k[i] = p < N ? key_at(p) : 0u;
      eq += p < N && k[i] == T;
    }
    int eq_total;
    int eq_rank = eq_carry + block_exclusive_scan(eq, warp_sums, eq_total);
    bool take[ITEMS];
    int n_take = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int p = t0 + tid * ITEMS + i;
      bool tk = false;
      if (p < N) {
        if (k[i] > T) tk = true;
        else if (k[i] == T) { tk = eq_rank < need; ++eq_rank; }
      }
      take[i] = tk && k[i] > kKeyNegInf;
      n_take += take[i];
    }
    int out_total;
    int slot = out_carry + block_exclusive_scan(n_take, warp_sums, out_total);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (take[i]) emit(slot++, t0 + tid * ITEMS + i);
    }
    eq_carry += eq_total;
    out_carry += out_total;
  }
  return out_carry;
}

// scores [rows, N] float32 (row-major, row stride N). n_valid per batch entry b = row / rows_per_b:
//   mode 0: N; mode 1: nv[b]; mode 2: ceil(seq_lens[b] / block_size);
//   mode 3: count(table[b, :] >= 0) if seq_lens[b] > 0 else 0 (table stride N).
// out [rows, width] int32.
// STAGED = false: every pass recomputes the keys from the scores (L2) and counts with one shared
//   atomic per key (the variant measured on the H200, the default).
// STAGED = true: the row's keys are computed once into dynamic shared memory (4 * N bytes, host
//   checks the size) and lanes of a warp with the same digit add once (__match_any_sync):
//   fewer L2 round trips and no serialized atomics on a crowded bin. Not yet measured on a GPU.
template <bool STAGED>
__global__ void __launch_bounds__(kTopkThreads) topk_select_kernel(
    const float* __restrict__ scores, int N, int rows_per_b, int mode, const int* __restrict__ nv,
    const int* __restrict__ seq_lens, const int* __restrict__ table, int block_size,
    int sink, int local, int width, int* __restrict__ out) {
  DATAENGINE_PDL_ENTRY();
  extern __shared__ unsigned keys_s[];
  __shared__ int hist[256];
  __shared__ int warp_sums[kTopkThreads / 32];
  __shared__ int s_digit, s_need;
  __shared__ long long s_nvalid;
  const int row = blockIdx.x, b = row / rows_per_b, tid = threadIdx.x;
  const float* srow = scores + (long long)row * N;
  int* orow = out + (long long)row * width;

  const long long n_valid = row_n_valid<kTopkThreads>(N, b, mode, nv, seq_lens, table, block_size, warp_sums, s_nvalid);
  auto key_of = [&](int p) -> unsigned { return p >= n_valid ? 0u : select_key(p, n_valid, sink, local, srow[p]); };
  if constexpr (STAGED) {
#pragma unroll 4
    for (int p = tid; p < N; p += kTopkThreads) keys_s[p] = key_of(p);
    __syncthreads();
  }
  auto key_at = [&](int p) -> unsigned {
    if constexpr (STAGED) return keys_s[p];
    else return key_of(p);
  };

  const int n_out = block_topk<kTopkThreads, kTopkItems, STAGED>(
      N, width, key_at, [&](int slot, int p) { orow[slot] = p; }, hist, warp_sums, s_digit, s_need);
  for (int s = n_out + tid; s < width; s += kTopkThreads) orow[s] = -1;
}

// ----------------------------------------------------------------------------- fast top-k
// cta_topk<THREADS, ITEMS>: the `width` largest keys of a CTA's THREADS x ITEMS keys in registers
//   (thread t holds positions t*ITEMS .. t*ITEMS + ITEMS - 1, in position order), by the total
//   order key descending, then position ascending. Keys: 0 invalid (never taken), kKeyForced
//   forced (taken first, by position), others order keys (float_key); keys <= kKeyNegInf (-inf,
//   NaN) are never taken. Forced and invalid keys are counted, not ranked; among the free keys
//   the radix select skips the bits all of them share (AND / OR over the CTA) and takes 12-bit
//   digits (kFastBins-bin histograms): two passes for scores within a factor of two of each other,
//   three at most. The walk ranks forced keys and keys == T in position order with one packed
//   scan. Returns the bit mask of the taken items; `slot` gets the output slot of the thread's
//   first taken item, `total` the count (every thread). `hist`: kFastBins ints of shared memory.
//   Used by topk_fast_kernel and by the chunked selection kernel (per chunk, then the merge).
constexpr int kFastThreads = 1024;
constexpr int kFastBins = 4096;

template <int THREADS> struct TopkScratch {
  int warp_sums[THREADS / 32];
  unsigned red_and[THREADS / 32], red_or[THREADS / 32];
  unsigned red_cnt[THREADS / 32];
  int digit, need;
};

// EARLY (the fastx / fast512 / fast256 top-k variants): a pass whose chosen bin holds exactly the keys
// still needed ends the radix select there: every key of the bin is taken, so T = the prefix so far
// (lower bits 0; keys of the bin are >= T, keys == T number at most `need`, all taken) picks the same
// keys. Spread-out scores often resolve in one 12-bit pass instead of two or three; ties keep passing.
// When the search so ends (or every free key fits) and the forced keys fit the budget, the walk needs
// no ranks: its packed scan is skipped.
template <int THREADS, int ITEMS, bool EARLY = false>
__device__ __forceinline__ unsigned cta_topk(const unsigned (&key)[ITEMS], int width, int* hist,
                                             TopkScratch<THREADS>& sc, int& slot, int& total) {
  static_assert(ITEMS <= 32 && THREADS * ITEMS <= 32768, "cta_topk: packed 16-bit counts, 32-bit take mask");
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  constexpr int kWarps = THREADS / 32;
  // ---- counts (forced << 16 | free) and the bits every free key shares, one CTA reduction
  unsigned a = 0xffffffffu, o = 0u, cnt = 0u;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const bool forced = key[i] == kKeyForced, free_ = key[i] != 0u && !forced;
    cnt += (forced ? 1u << 16 : 0u) + unsigned(free_);
    if (free_) { a &= key[i]; o |= key[i]; }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    a &= __shfl_xor_sync(0xffffffffu, a, off);
    o |= __shfl_xor_sync(0xffffffffu, o, off);
    cnt += __shfl_xor_sync(0xffffffffu, cnt, off);
  }
  if (lane == 0) { sc.red_and[warp] = a; sc.red_or[warp] = o; sc.red_cnt[warp] = cnt; }
  for (int i = tid; i < kFastBins; i += THREADS) hist[i] = 0;  // each pass leaves the bins zero again
  __syncthreads();
  // every warp reduces the (<= 32) warp results itself
  a = lane < kWarps ? sc.red_and[lane] : 0xffffffffu;
  o = lane < kWarps ? sc.red_or[lane] : 0u;
  cnt = lane < kWarps ? sc.red_cnt[lane] : 0u;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    a &= __shfl_xor_sync(0xffffffffu, a, off);
    o |= __shfl_xor_sync(0xffffffffu, o, off);
    cnt += __shfl_xor_sync(0xffffffffu, cnt, off);
  }
  const int n_forced = int(cnt >> 16), n_free = int(cnt & 0xffffu);
  const int need_free = max(width - n_forced, 0);

  // ---- T: the need_free-th largest free key (need: how many keys == T to take)
  unsigned T = 0u;
  int need = 0;
  bool whole_bin = false;  // EARLY: the search ended on a bin that is taken whole (every key >= T taken)
  if (need_free > 0 && need_free < n_free) {
    const unsigned diff = a ^ o;
    unsigned prefix = a & o, mask = ~diff;  // bits every free key shares
    need = need_free;
    int top = diff ? 31 - __clz(diff) : -1;
    while (top >= 0) {
      const int width_bits = min(12, top + 1);
      const int shift = top + 1 - width_bits;
      const unsigned dmask = (1u << width_bits) - 1u;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (key[i] != 0u && key[i] != kKeyForced && (key[i] & mask) == prefix)
          atomicAdd(&hist[(key[i] >> shift) & dmask], 1);
      }
      __syncthreads();
      // thread j owns bins kFastBins - 1 - kPer * j .. (descending digits): reads them, zeroes them
      constexpr int kPer = kFastBins / THREADS;
      int c[kPer], sum = 0;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        c[i] = hist[kFastBins - 1 - kPer * tid - i];
        hist[kFastBins - 1 - kPer * tid - i] = 0;
        sum += c[i];
      }
      int tot;
      const int excl = block_exclusive_scan(sum, sc.warp_sums, tot);
      if (excl < need && need <= excl + sum) {
        int cum = excl;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          if (cum + c[i] >= need) {
            sc.digit = kFastBins - 1 - kPer * tid - i;
            // EARLY: the bin's count in the high 16 bits (counts <= 32768)
            sc.need = EARLY ? int(unsigned(need - cum) | (unsigned(c[i]) << 16)) : need - cum;
            break;
          }
          cum += c[i];
        }
      }
      __syncthreads();
      // (the next pass writes sc.digit / sc.need only after two more barriers)
      prefix |= unsigned(sc.digit) << shift;
      mask |= dmask << shift;
      top = shift - 1;
      if constexpr (EARLY) {
        const unsigned packed_need = unsigned(sc.need);
        need = int(packed_need & 0xffffu);
        if (int(packed_need >> 16) == need) {  // the whole bin is taken: T = prefix
          whole_bin = true;
          break;
        }
      } else {
        need = sc.need;
      }
    }
    T = prefix;
  }
  const bool all_free = need_free >= n_free;  // every free key is within the budget

  // ---- EARLY, every forced key and every free key >= T within the budget: no ranks needed, no scan
  if (EARLY && (all_free || whole_bin) && n_forced <= width) {
    unsigned take = 0u;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const bool tk = key[i] == kKeyForced ||
                      (key[i] != 0u && need_free > 0 && (all_free || key[i] >= T) && key[i] > kKeyNegInf);
      take |= unsigned(tk) << i;
    }
    slot = block_exclusive_scan(__popc(take), sc.warp_sums, total);
    return take;
  }
  // ---- walk: forced ranks and ranks among keys == T in position order, one packed scan
  int packed = 0;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
    packed += (key[i] == kKeyForced ? 1 << 16 : 0) + (key[i] != kKeyForced && key[i] != 0u && !all_free && key[i] == T);
  int packed_total;
  const int before = block_exclusive_scan(packed, sc.warp_sums, packed_total);
  int f_rank = before >> 16, e_rank = before & 0xffff;
  unsigned take = 0u;  // bit i: position t*ITEMS + i is taken
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    bool tk = false;
    if (key[i] == kKeyForced) {
      tk = f_rank < width;
      ++f_rank;
    } else if (key[i] != 0u && need_free > 0) {
      if (all_free || key[i] > T) tk = true;
      else if (key[i] == T) { tk = e_rank < need; ++e_rank; }
      tk = tk && key[i] > kKeyNegInf;  // -inf (or NaN) scores are never chosen
    }
    take |= unsigned(tk) << i;
  }
  slot = block_exclusive_scan(__popc(take), sc.warp_sums, total);
  return take;
}

// topk_fast_kernel<ITEMS, THREADS>  grid (rows), THREADS threads (default 1024), N <= THREADS * ITEMS:
//   the same rows as topk_select_kernel (same modes, same tie rule), faster: the keys in registers
//   (one load), cta_topk. X (cuda_select's fastx / fast512 / fast256 variants): float4 loads and
//   cta_topk's EARLY exit; fewer THREADS hold more keys each (512 x 16 or 256 x 32 for 8192 keys):
//   fewer warps to reduce and scan at each barrier, more atomics and bins per thread.
template <int ITEMS, int THREADS = kFastThreads, bool X = false>
__global__ void __launch_bounds__(THREADS) topk_fast_kernel(
    const float* __restrict__ scores, int N, int rows_per_b, int mode, const int* __restrict__ nv,
    const int* __restrict__ seq_lens, const int* __restrict__ table, int block_size,
    int sink, int local, int width, int* __restrict__ out) {
  DATAENGINE_PDL_ENTRY();
  __shared__ int hist[kFastBins];
  __shared__ TopkScratch<THREADS> sc;
  __shared__ long long s_nvalid;
  const int row = blockIdx.x, b = row / rows_per_b, tid = threadIdx.x;
  const float* srow = scores + (long long)row * N;
  int* orow = out + (long long)row * width;

  // n_valid may exceed N (mode 1): the forced suffix then starts past it. X: modes 0-2 read on every
  // thread (no barrier); mode 3 counts the table with the CTA
  const long long n_valid = (X && mode != 3) ? mode_n_valid(mode, b, N, nv, seq_lens, block_size)
                                             : row_n_valid<THREADS>(N, b, mode, nv, seq_lens, table, block_size,
                                                                    sc.warp_sums, s_nvalid);
  unsigned key[ITEMS];
  const int p0 = tid * ITEMS;
  if (X && ITEMS % 4 == 0 && N % 4 == 0) {
    // X: a thread's ITEMS consecutive scores as float4 loads (16-byte aligned: rows of N % 4 == 0
    // floats, the host aligns the base; a float4 lies wholly inside or past the row); the default
    // keeps its scalar loads as measured
#pragma unroll
    for (int i = 0; i < ITEMS; i += 4) {
      const int p = p0 + i;
      const float4 v = p < N ? __ldcg(reinterpret_cast<const float4*>(srow + p)) : make_float4(0.f, 0.f, 0.f, 0.f);
      const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) key[i + c] = p < N ? select_key(p + c, n_valid, sink, local, f[c]) : 0u;
    }
  } else {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int p = p0 + i;
      key[i] = p < N ? select_key(p, n_valid, sink, local, srow[p]) : 0u;
    }
  }
  int slot, total;
  const unsigned take = cta_topk<THREADS, ITEMS, X>(key, width, hist, sc, slot, total);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if ((take >> i) & 1u) orow[slot++] = p0 + i;
  }
  for (int s2 = total + tid; s2 < width; s2 += THREADS) orow[s2] = -1;
}

// ----------------------------------------------------------------------------- fp8 scores on f16 tensor cores
// fp8 (e4m3) summaries enter an f16 MMA as they are: one cvt.rn.f16x2.e4m3x2 per two codes
// (e4m3 -> f16 is exact, subnormals included). q is bf16, so the warp scales the group's q by a
// power of two 2^s (max |q| * 2^s in [2^14, 2^15)) and checks that every scaled value is an f16
// normal (or zero) holding it exactly; the products are then 2^s times the bf16 ones, exact in
// fp32, and the accumulators times 2^-s are the bounds. Where the check fails (a q element below
// 2^-28 of the head's largest, NaN, inf), or a tile holds one of the NaN codes (the open ends /
// unwritten blocks: the f16 MMA turns them into NaN rows, seen after the MMAs), the tile is
// recomputed exactly like quest_score_mma_kernel: codes decoded by role to bf16 (2^100, +-inf),
// bf16 q, bf16 MMA.
// Tiles stream through a per-warp cp.async ring in shared memory (Ring<TS, D>::kStages 16-block
// tiles of both bounds, no CTA barrier): rows of D bytes, the 16-byte chunks of odd rows XOR-swizzled
// by 4 (D 128) so that a quarter warp's reads (rows r, r + 1, four lanes each) hit 32 distinct banks.
// Lane (r, t) of k-step (j, m) (j < D/64, m < 4) holds channels 64j + 16t + 4m + {0,1} (k 2t, 2t+1)
// and + {2,3} (k 2t + 8, 2t + 9): word m of its 16-byte chunk 4j + t.
// int4 rows (D 128: 80 bytes) take the same rings (80-byte row pitch: the 32-bit code reads of a warp
// hit 32 distinct banks, the parameter reads are broadcasts) and the streamed kernel's arithmetic
// (Half<Q4>: 16 + code against MmaQ<PAIRS4> columns).
template <typename TS, int D> struct Ring;
template <int D> struct Ring<__nv_fp8_e4m3, D> {
  static constexpr int kRow = D, kStages = 3;
  static __device__ __forceinline__ int chunk_at(int row, int c) { return D == 128 ? (c ^ (4 * (row & 1))) : c; }
};
template <int D> struct Ring<Q4, D> {
  static_assert(Q4Row<D>::kBytes % 16 == 0, "int4 rings: rows of whole 16-byte chunks (head_dim 128)");
  static constexpr int kRow = Q4Row<D>::kBytes, kStages = 4;
  static __device__ __forceinline__ int chunk_at(int, int c) { return c; }
};
template <typename TS, int D> struct RingSize {
  static constexpr int kRow = Ring<TS, D>::kRow, kChunks = kRow / 16, kBound = 16 * kRow, kTile = 2 * kBound;
  static constexpr int kWarpBytes = Ring<TS, D>::kStages * kTile;
};
constexpr int kFp8Stages = Ring<__nv_fp8_e4m3, 128>::kStages;
constexpr int kQ4Stages = Ring<Q4, 128>::kStages;

TILEHAL_DEVICE unsigned e4m3x2_to_f16x2(unsigned short w) {
  unsigned d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(w));
  return d;
}
// The two codes in the high half of w -> f16x2: the half is named in the PTX (mov.b32 {lo, hi}) so
// ptxas reads it as R.H1 instead of shifting it down first (32 SHF fewer per fp8 tile).
TILEHAL_DEVICE unsigned e4m3x2_hi_to_f16x2(unsigned w) {
  unsigned d;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(d) : "r"(w));
  return d;
}
// Two codes (low 16 bits of w) -> bf16x2, by role, the NaN codes as the open ends (exact).
__device__ __forceinline__ unsigned e4m3x2_to_bf16x2_role(unsigned w, bool is_max) {
  float2 f = e4m3x2_to_float2(w, 0);
  const unsigned b0 = w & 0xffu, b1 = (w >> 8) & 0xffu;
  if ((b0 & 0x7fu) == 0x7fu) f.x = e4m3_summary(b0, is_max);
  if ((b1 & 0x7fu) == 0x7fu) f.y = e4m3_summary(b1, is_max);
  return tilehal::float2_to_bf16x2(f.x, f.y);
}

// The group's q as f16 B fragments, scaled by 2^s (see above); ok: warp-uniform, false when the
// scaled values are not all exact f16 normals (then every tile takes the bf16 path).
template <int D, int G> struct Fp8Q {
  static constexpr int kJ = D / 64;
  unsigned qp[kJ][8], qn[kJ][8];
  float inv;  // 2^-s
  bool ok;
  __device__ __forceinline__ void load(const __nv_bfloat16* q, long long head0, int r, int t) {
    unsigned w[kJ][8];
    float mx = 0.f;
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        w[j][i] = r < G ? reinterpret_cast<const unsigned*>(q + (head0 + r) * D)[32 * j + 8 * t + i] : 0u;
        const float2 f = tilehal::bf16x2_to_float2(w[j][i]);
        mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const int e = int((__float_as_uint(mx) >> 23) & 0xffu);
    const int s = mx == 0.f ? 0 : 141 - e;  // mx * 2^s in [2^14, 2^15)
    bool good = mx == 0.f || (e != 0 && e != 255 && s >= -100 && s <= 100);
    const int sc = good ? s : 0;
    const float scale = __uint_as_float(unsigned(127 + sc) << 23);
    inv = __uint_as_float(unsigned(127 - sc) << 23);
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 f = tilehal::bf16x2_to_float2(w[j][i]);
        const float x0 = f.x * scale, x1 = f.y * scale;
        const __half h0 = __float2half_rn(x0), h1 = __float2half_rn(x1);
        good = good && __half2float(h0) == x0 && __half2float(h1) == x1 &&
               (f.x == 0.f || fabsf(x0) >= 6.103515625e-05f) && (f.y == 0.f || fabsf(x1) >= 6.103515625e-05f);
        const __half2 hh = __halves2half2(h0, h1);
        const __half2 z = __float2half2_rn(0.f);
        const __half2 p = __hmax2(hh, z), n = __hmin2(hh, z);
        qp[j][i] = *reinterpret_cast<const unsigned*>(&p);
        qn[j][i] = *reinterpret_cast<const unsigned*>(&n);
      }
    }
    ok = __all_sync(0xffffffffu, good);
  }
};

// The fp8 tile's fragments from a ring slot (kmax rows, then kmin rows): f(bound, j, m, wl, wh)
// for every k-step (j, m), wl / wh the words of rows r / r + 8 (word m: codes of k 2t, 2t+1 low, 2t+8, 2t+9 high).
// PITCH / BOUND: bytes between rows / between the kmax and kmin rows (the per-warp rings: D and 16 D;
// the record tiles: a block record's pitch, 16 of them).
template <int D, int PITCH = D, int BOUND = RingSize<__nv_fp8_e4m3, D>::kBound, typename F>
__device__ __forceinline__ void fp8_tile_walk(const unsigned char* slot, int r, int t, F f) {
  using R = Ring<__nv_fp8_e4m3, D>;
#pragma unroll
  for (int bound = 0; bound < 2; ++bound) {
    const unsigned char* base = slot + bound * BOUND;
#pragma unroll
    for (int j = 0; j < D / 64; ++j) {
      const uint4 lo = *reinterpret_cast<const uint4*>(base + r * PITCH + 16 * R::chunk_at(r, 4 * j + t));
      const uint4 hi = *reinterpret_cast<const uint4*>(base + (r + 8) * PITCH + 16 * R::chunk_at(r + 8, 4 * j + t));
      const unsigned wl[4] = {lo.x, lo.y, lo.z, lo.w}, wh[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int m = 0; m < 4; ++m) f(bound, j, m, wl[m], wh[m]);
    }
  }
}

// acc = the tile's bounds on f16 tensor cores, q scaled: the kmax and kmin halves accumulate in two
// independent MMA chains (half the dependent latency), added at the end.
// H1 (DATAENGINE_RING_FP8=h1): the high code pairs through e4m3x2_hi_to_f16x2.
template <int D, int G, int PITCH = D, int BOUND = RingSize<__nv_fp8_e4m3, D>::kBound, bool H1 = false>
__device__ __forceinline__ void fp8_tile_f16(const Fp8Q<D, G>& Q, const unsigned char* slot, int r, int t,
                                             float (&acc)[4]) {
  float part[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  fp8_tile_walk<D, PITCH, BOUND>(slot, r, t, [&](int bound, int j, int m, unsigned wl, unsigned wh) {
    const tilehal::u32 a[4] = {e4m3x2_to_f16x2((unsigned short)wl), e4m3x2_to_f16x2((unsigned short)wh),
                               H1 ? e4m3x2_hi_to_f16x2(wl) : e4m3x2_to_f16x2((unsigned short)(wl >> 16)),
                               H1 ? e4m3x2_hi_to_f16x2(wh) : e4m3x2_to_f16x2((unsigned short)(wh >> 16))};
    const tilehal::u32 bq[2] = {bound == 0 ? Q.qp[j][2 * m] : Q.qn[j][2 * m],
                                bound == 0 ? Q.qp[j][2 * m + 1] : Q.qn[j][2 * m + 1]};
    tilehal::mma_m16n8k16(tilehal::MmaF16{}, part[bound], a, bq);
  });
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] = part[0][e] + part[1][e];
}

// The same tile exactly as quest_score_mma_kernel computes it (codes decoded by role, bf16 q
// read again: the rare path).
template <int D, int G, int PITCH = D, int BOUND = RingSize<__nv_fp8_e4m3, D>::kBound>
__device__ __noinline__ float4 fp8_tile_bf16(const __nv_bfloat16* __restrict__ q, long long head0,
                                             const unsigned char* slot, int r, int t) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const unsigned* qw = reinterpret_cast<const unsigned*>(q + (head0 + r) * D);
  fp8_tile_walk<D, PITCH, BOUND>(slot, r, t, [&](int bound, int j, int m, unsigned wl, unsigned wh) {
    const bool mx = bound == 0;
    const tilehal::u32 a[4] = {e4m3x2_to_bf16x2_role(wl, mx), e4m3x2_to_bf16x2_role(wh, mx),
                               e4m3x2_to_bf16x2_role(wl >> 16, mx), e4m3x2_to_bf16x2_role(wh >> 16, mx)};
    const unsigned q0 = r < G ? qw[32 * j + 8 * t + 2 * m] : 0u, q1 = r < G ? qw[32 * j + 8 * t + 2 * m + 1] : 0u;
    const tilehal::u32 bq[2] = {mx ? bf16x2_max0(q0) : bf16x2_min0(q0), mx ? bf16x2_max0(q1) : bf16x2_min0(q1)};
    tilehal::mma_m16n8k16(tilehal::MmaBF16{}, acc, a, bq);
  });
  return make_float4(acc[0], acc[1], acc[2], acc[3]);
}


// ----------------------------------------------------------------------------- int4 rows, paired groups
// int4 rows with G <= 4 q heads per kv head (D 128) use half of the m16n8 accumulator's columns, so
// the per-group epilogue (bound += step * A + (lo - 16 step) * sum(q), per 32-channel group) ran
// on accumulators half of whose columns are unused. Paired groups (DATAENGINE_RING_Q4=pairs): one
// accumulator holds group p in columns 0-3 (B = q of heads 0-3 on lanes r < 4, zero on r >= 4) and
// group p + 2 in columns 4-7 (B = q of heads 0-3 on lanes r >= 4, zero on r < 4), so each lane's
// four accumulators are all used: lane t < 2 owns group p, t >= 2 group p + 2 (heads 2 (t % 2) + e).
// Same MMAs (4 per pair and bound), half the epilogue; the partial bounds of lanes t and t ^ 2 are
// added once per tile. Only the order of the float32 sums differs from the grouped path (exact on
// the exactness tests' dyadic grids).
template <int D, int G> struct PairQ {
  static_assert(D == 128 && G >= 1 && G <= 4, "paired int4 groups: head_dim 128, at most 4 q heads per kv head");
  static constexpr int kJ = D / 32, kP = kJ / 2;  // groups; pairs (p, p + kP)
  unsigned bp[kP][2][4], bn[kP][2][4];  // B words of pair p, sub s (group p + kP s): q+ / q-, zero unless s == r / 4
  float sp[kP][2], sn[kP][2];           // sums of q+ / q- over group p + kP (t / 2), head 2 (t % 2) + e
  __device__ __forceinline__ void load(const __nv_bfloat16* q, long long head0, int r, int t) {
    const int hr = r & 3, mine = r >> 2;
    float fp[kJ], fn[kJ];
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      fp[j] = 0.f;
      fn[j] = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // channels i (low half) and i + 4 (high half), as MmaQ<PAIRS4>
        unsigned w = 0u;
        if (hr < G) {
          const unsigned* qw = reinterpret_cast<const unsigned*>(q + (head0 + hr) * D) + (32 * j + 8 * t) / 2;
          w = __byte_perm(qw[i / 2], qw[2 + i / 2], (i % 2) ? 0x7632u : 0x5410u);
        }
        const unsigned wp = bf16x2_max0(w), wn = bf16x2_min0(w);
        const float2 a = tilehal::bf16x2_to_float2(wp), c = tilehal::bf16x2_to_float2(wn);
        fp[j] += a.x + a.y;
        fn[j] += c.x + c.y;
        bp[j % kP][j / kP][i] = j / kP == mine ? wp : 0u;
        bn[j % kP][j / kP][i] = j / kP == mine ? wn : 0u;
      }
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {  // over the quad: group j's sums of head hr
        fp[j] += __shfl_xor_sync(0xffffffffu, fp[j], off);
        fn[j] += __shfl_xor_sync(0xffffffffu, fn[j], off);
      }
    }
#pragma unroll
    for (int p = 0; p < kP; ++p) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // quad 2 (t % 2) + e holds that head's sums
        const int src = 4 * (2 * (t & 1) + e);
        const float p0 = __shfl_sync(0xffffffffu, fp[p], src), p1 = __shfl_sync(0xffffffffu, fp[p + kP], src);
        const float n0 = __shfl_sync(0xffffffffu, fn[p], src), n1 = __shfl_sync(0xffffffffu, fn[p + kP], src);
        sp[p][e] = t >= 2 ? p1 : p0;
        sn[p][e] = t >= 2 ? n1 : n0;
      }
    }
  }
};

// One bound of a 16-block tile from the ring (rows r at lo, r + 8 at hi): acc (this lane's groups)
// += step * A + (lo - 16 step) * sum(q), A the MMA's sum of q * (16 + code) over the group.
// m78: 0x00780078 held in a register (words() as ((w << 3) & m78) | 0x41804180: ptxas otherwise
// rematerializes the second constant of each LOP3, ~46 IMAD.MOV per tile).
template <int D>
__device__ __forceinline__ void q4_words(unsigned w, unsigned m78, unsigned (&o)[4]) {  // as Half<Q4, D>::words
  o[0] = ((w << 3) & m78) | 0x41804180u;
  o[1] = ((w >> 1) & m78) | 0x41804180u;
  o[2] = ((w >> 5) & m78) | 0x41804180u;
  o[3] = ((w >> 9) & m78) | 0x41804180u;
}
template <bool IS_MAX, int D, int G>
__device__ __forceinline__ void q4_pairs_bound(const PairQ<D, G>& Q, const unsigned char* lo, const unsigned char* hi,
                                               int t, unsigned m78, float (&acc)[4]) {
  constexpr int kP = PairQ<D, G>::kP;
  // this lane's (lo, step) pairs of rows r / r + 8: groups kP (t / 2) + p, adjacent words
  const uint2 plo = *reinterpret_cast<const uint2*>(lo + Q4Row<D>::kCodeBytes + 4 * kP * (t >> 1));
  const uint2 phi = *reinterpret_cast<const uint2*>(hi + Q4Row<D>::kCodeBytes + 4 * kP * (t >> 1));
  const unsigned pr[2][2] = {{plo.x, plo.y}, {phi.x, phi.y}};
#pragma unroll
  for (int p = 0; p < kP; ++p) {
    float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int sub = 0; sub < 2; ++sub) {
      const int j = p + kP * sub;
      unsigned al[4], ah[4];
      q4_words<D>(*reinterpret_cast<const unsigned*>(lo + 16 * j + 4 * t), m78, al);
      q4_words<D>(*reinterpret_cast<const unsigned*>(hi + 16 * j + 4 * t), m78, ah);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const tilehal::u32 af[4] = {al[2 * hh], ah[2 * hh], al[2 * hh + 1], ah[2 * hh + 1]};
        const tilehal::u32 bq[2] = {IS_MAX ? Q.bp[p][sub][2 * hh] : Q.bn[p][sub][2 * hh],
                                    IS_MAX ? Q.bp[p][sub][2 * hh + 1] : Q.bn[p][sub][2 * hh + 1]};
        tilehal::mma_m16n8k16(tilehal::MmaBF16{}, a, af, bq);
      }
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const float2 ls = tilehal::bf16x2_to_float2(pr[s][p]);  // (lo, step)
      const float c0 = fmaf(-16.f, ls.y, ls.x);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float ssum = IS_MAX ? Q.sp[p][e] : Q.sn[p][e];
        acc[2 * s + e] = fmaf(ls.y, a[2 * s + e], fmaf(c0, ssum, acc[2 * s + e]));
      }
    }
  }
}

template <typename TS, int D, int G> struct RingQ { using type = Fp8Q<D, G>; };
template <int D, int G> struct RingQ<Q4, D, G> { using type = MmaQ<D, G, true, true>; };
template <typename TS, int D, int G, bool PAIRS> struct RingQSel { using type = typename RingQ<TS, D, G>::type; };
template <int D, int G> struct RingQSel<Q4, D, G, true> { using type = PairQ<D, G>; };

// One 16-block tile's bounds (acc, before the head reduction) from shared memory: rows r / r + 8 of
// kmax at slot + r * PITCH / slot + (r + 8) * PITCH, kmin BOUND bytes further (the per-warp rings and
// the record tiles differ only in these two). PAIRS, the session-28 tile code: int4 rows, paired
// groups (PairQ); fp8, the high code pairs read as R.H1 (fp8_tile_f16<..., H1>).
template <typename TS, int D, int G, bool PAIRS, int PITCH, int BOUND, typename QT>
__device__ __forceinline__ void ring_tile(const QT& Q, const __nv_bfloat16* __restrict__ q, long long head0,
                                          const unsigned char* slot, int r, int t, unsigned m78, float (&acc)[4]) {
  if constexpr (PAIRS && IsQ4<TS>::value) {
    const unsigned char* lo = slot + r * PITCH;
    const unsigned char* hi = slot + (r + 8) * PITCH;
    q4_pairs_bound<true>(Q, lo, hi, t, m78, acc);
    q4_pairs_bound<false>(Q, lo + BOUND, hi + BOUND, t, m78, acc);
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], 2);  // groups p and p + 2
  } else if constexpr (IsQ4<TS>::value) {
    Half<Q4, D> X, N;
    smem_fill(X, slot + r * PITCH, slot + (r + 8) * PITCH, t);
    smem_fill(N, slot + BOUND + r * PITCH, slot + BOUND + (r + 8) * PITCH, t);
    X.template mma<true>(Q, acc);
    N.template mma<false>(Q, acc);
  } else {
    bool slow = !Q.ok;
    if (Q.ok) {
      fp8_tile_f16<D, G, PITCH, BOUND, PAIRS>(Q, slot, r, t, acc);
      slow = __any_sync(0xffffffffu, !(finite(acc[0]) && finite(acc[1]) && finite(acc[2]) && finite(acc[3])));
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] *= Q.inv;
    }
    if (slow) {
      const float4 a = fp8_tile_bf16<D, G, PITCH, BOUND>(q, head0, slot, r, t);
      acc[0] = a.x; acc[1] = a.y; acc[2] = a.z; acc[3] = a.w;
    }
  }
}

// Scores of the CTA's positions from fp8 summaries or int4 rows through the rings: dst(i, score)
// for i in [0, n_here); `ring_all`: kScoreThreads / 32 warps x RingSize<TS, D>::kWarpBytes of
// shared memory.
// This warp scores kv head h of sequence b (H kv heads) at the CTA's positions first, first +
// stride, ... (16-block tiles).
template <typename TS, int D, int G, int REDUCE, bool PAIRS = false, int STAGES = 0, typename Dst>
__device__ __forceinline__ void ring_scores(const __nv_bfloat16* __restrict__ q, const unsigned char* __restrict__ kmin,
                                            const unsigned char* __restrict__ kmax, const int* phys_s, int n_here,
                                            unsigned char* ring_all, Dst dst, int h, int b, int H, int first,
                                            int stride) {
  static_assert(D == 64 || D == 128, "ring scores: head_dim 64 or 128");
  static_assert(G >= 1 && G <= 8, "ring scores: at most 8 q heads per kv head");
  using R = Ring<TS, D>;
  using S = RingSize<TS, D>;
  constexpr int kStages = STAGES > 0 ? STAGES : R::kStages;  // STAGES: the heads kernel's OCC = 3 rings
  static_assert(kStages >= 2, "ring scores: at least two stages");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, t = lane % 4;
  const int n_tiles = first < n_here ? (n_here - first + stride - 1) / stride : 0;
  if (n_tiles == 0) return;
  unsigned char* ring = ring_all + warp * (kStages * S::kTile);
  const long long head0 = (long long)b * H * G + (long long)h * G;
  // 16 rows x kChunks 16-byte chunks per bound; copy e = lane + 32 u = (row, chunk) of both bounds.
  // Per lane, everything but the rows' block ids is fixed: the rows, the chunk, the ring offsets.
  // Source rows in 16-byte units (32-bit: pools up to 64 GB of summaries per bound).
  constexpr int kCopies = 16 * S::kChunks, kU = (kCopies + 31) / 32, kRow16 = S::kRow / 16;
  const unsigned blk16 = unsigned(H) * kRow16, head16 = unsigned(h) * kRow16;
  int row_u[kU], dst_u[kU];
  unsigned chunk_u[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int e = lane + 32 * u, i = e / S::kChunks, c = e % S::kChunks;
    row_u[u] = (kCopies % 32 == 0 || e < kCopies) ? i : -1;
    dst_u[u] = i * S::kRow + 16 * R::chunk_at(i, c);
    chunk_u[u] = head16 + unsigned(c);
  }
  const uint4* kmax16 = reinterpret_cast<const uint4*>(kmax);
  const uint4* kmin16 = reinterpret_cast<const uint4*>(kmin);
  int issue_slot = 0;  // ring slot of the next tile issued (k % kStages, kept incrementally)
  auto issue = [&](int k) {
    if (k < n_tiles) {
      unsigned char* slot = ring + issue_slot * S::kTile;
      const int tile = first + k * stride;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (row_u[u] >= 0) {
          const int p = tile + row_u[u] < n_here ? phys_s[tile + row_u[u]] : -1;
          const unsigned o = unsigned(max(p, 0)) * blk16 + chunk_u[u];
          tilehal::cp_async_16(slot + dst_u[u], kmax16 + o, p >= 0);  // zero rows for ids scored -inf
          tilehal::cp_async_16(slot + S::kBound + dst_u[u], kmin16 + o, p >= 0);
        }
      }
    }
    issue_slot = issue_slot == kStages - 1 ? 0 : issue_slot + 1;
    tilehal::cp_async_commit();
  };
#pragma unroll
  for (int k = 0; k < kStages - 1; ++k) issue(k);
  typename RingQSel<TS, D, G, PAIRS>::type Q;
  Q.load(q, head0, r, t);
  // paired int4 groups: the code mask from a value ptxas cannot fold (n_tiles > 0), so it stays in one register
  const unsigned m78 = 0x00780078u | (unsigned(n_tiles) >> 31);
  int read_slot = 0;
  for (int k = 0; k < n_tiles; ++k) {
    tilehal::cp_async_wait<kStages - 2>();
    __syncwarp();  // tile k visible to the warp; tile k - 1's slot free
    issue(k + kStages - 1);
    const unsigned char* slot = ring + read_slot * S::kTile;
    read_slot = read_slot == kStages - 1 ? 0 : read_slot + 1;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    ring_tile<TS, D, G, PAIRS, S::kRow, S::kBound>(Q, q, head0, slot, r, t, m78, acc);
    float s_lo, s_hi;
    reduce_heads<G, REDUCE>(acc, t, s_lo, s_hi);
    const int tile = first + k * stride;
    if (t == 0) {
      const int i_lo = tile + r, i_hi = tile + r + 8;
      if (i_lo < n_here) dst(i_lo, phys_s[i_lo] >= 0 ? s_lo : -INFINITY);
      if (i_hi < n_here) dst(i_hi, phys_s[i_hi] >= 0 ? s_hi : -INFINITY);
    }
  }
  tilehal::cp_async_wait<0>();
}

// True on every thread of the CTA that arrives last of `count` CTAs sharing tickets[idx] (their
// global writes before the call visible to it); that CTA resets the ticket for the next launch.
__device__ __forceinline__ bool last_cta(unsigned* tickets, long long idx, int count, bool& s_flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(&tickets[idx], 1u) == unsigned(count - 1);
    if (last) tickets[idx] = 0u;
    s_flag = last;
  }
  __syncthreads();
  if (s_flag) __threadfence();
  return s_flag;
}

// ----------------------------------------------------------------------------- chunked selection
// quest_select_chunk_kernel  grid (ceil(table_stride / chunk), kv_heads, B), 256 threads, chunk <=
//   kChunkMax positions per CTA (the host sizes the grid to about one wave: long-lived CTAs).
//   Scores: RING (fp8 summaries, int4 rows at head_dim 128) through ring_scores, else mma_scores
//   (bf16, fp8, int4 rows). PAIRS (int4 rows, RING, G <= 4): the paired-groups epilogue (PairQ).
//   FUSED = false: the scores go to raw[b, h, :] (the score launch of the two-launch path).
//   FUSED = true: they stay in shared memory; the CTA's top-min(width, chunk) keys (keys as in
//   topk_select_kernel; cta_topk over 8 keys per thread) go out as (key, position) candidates, in
//   position order, key 0 padded; the row's last CTA (last_cta) merges the row's chunks x wc
//   candidates (<= kChunkMax, the host checks) with cta_topk again. Every global winner is a winner
//   of its chunk (the order is total) and the candidates lie in position order, so the rows equal
//   topk_select_kernel's (modes 0-2: n_valid N, nv[b], ceil(seq_lens[b] / block_size)).
constexpr int kChunkMax = 2048;
constexpr int kChunkItems = kChunkMax / kScoreThreads;

template <typename TS, int D, int G, int REDUCE, bool FUSED, bool RING, bool PAIRS = false>
__global__ void __launch_bounds__(kScoreThreads, 2) quest_select_chunk_kernel(
    const __nv_bfloat16* __restrict__ q, const void* __restrict__ kmin, const void* __restrict__ kmax,
    const int* __restrict__ block_table, int table_stride, int num_blocks, int chunk, float* __restrict__ raw,
    int mode, const int* __restrict__ nv, const int* __restrict__ seq_lens, int block_size, int sink, int local,
    int width, uint2* __restrict__ cand, unsigned* __restrict__ tickets, int* __restrict__ out) {
  static_assert(!RING || sizeof(TS) == 1 || IsQ4<TS>::value, "the ring scorer is for fp8 summaries and int4 rows");
  extern __shared__ __align__(16) unsigned char dsm[];  // RING: the warps' rings; FUSED: also the histogram
  __shared__ int phys_s[kChunkMax];
  __shared__ float score_s[FUSED ? kChunkMax : 1];
  __shared__ TopkScratch<kScoreThreads> sc;
  __shared__ bool s_last;
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y, chunks = gridDim.x, tid = threadIdx.x;
  const int pos0 = blockIdx.x * chunk;
  const int n_here = min(chunk, table_stride - pos0);
  const int* table = block_table + (long long)b * table_stride;
  for (int i = tid; i < n_here; i += kScoreThreads) {
    const int p = max(table[pos0 + i], 0);  // holes read block 0 like the reference's clamp
    phys_s[i] = p < num_blocks ? p : -1;
  }
  __syncthreads();
  float* rrow = raw + ((long long)b * H + h) * table_stride + pos0;
  auto dst = [&](int i, float s) {
    if constexpr (FUSED) score_s[i] = s;
    else rrow[i] = s;
  };
  if constexpr (RING) {
    ring_scores<TS, D, G, REDUCE, PAIRS>(q, static_cast<const unsigned char*>(kmin),
                                         static_cast<const unsigned char*>(kmax), phys_s, n_here, dsm, dst, h, b, H,
                                         (tid / 32) * 16, (kScoreThreads / 32) * 16);
  } else {
    using P = typename Rows<TS, D>::ptr;
    mma_scores<TS, D, G, REDUCE>(q, static_cast<P>(kmin), static_cast<P>(kmax), phys_s, n_here, dst);
  }
  if constexpr (FUSED) {
    __syncthreads();  // every warp's scores in score_s; the rings are free for the histogram
    int* hist = reinterpret_cast<int*>(dsm);
    const long long n_valid = mode_n_valid(mode, b, table_stride, nv, seq_lens, block_size);
    const int wc = min(width, chunk);
    unsigned key[kChunkItems];
#pragma unroll
    for (int i = 0; i < kChunkItems; ++i) {
      const int li = tid * kChunkItems + i;
      key[i] = li < n_here ? select_key(pos0 + li, n_valid, sink, local, score_s[li]) : 0u;
    }
    int slot, total;
    unsigned take = cta_topk<kScoreThreads, kChunkItems>(key, wc, hist, sc, slot, total);
    const long long row = (long long)b * H + h;
    int* orow = out + row * width;
    if (chunks == 1) {  // the row in one chunk: its top-width is the answer (wc == width)
#pragma unroll
      for (int i = 0; i < kChunkItems; ++i) {
        if ((take >> i) & 1u) orow[slot++] = pos0 + tid * kChunkItems + i;
      }
      for (int s2 = total + tid; s2 < width; s2 += kScoreThreads) orow[s2] = -1;
      return;
    }
    uint2* crow = cand + (row * chunks + blockIdx.x) * wc;
#pragma unroll
    for (int i = 0; i < kChunkItems; ++i) {
      if ((take >> i) & 1u) crow[slot++] = make_uint2(key[i], unsigned(pos0 + tid * kChunkItems + i));
    }
    for (int s2 = total + tid; s2 < wc; s2 += kScoreThreads) crow[s2] = make_uint2(0u, 0u);
    if (!last_cta(tickets, row, chunks, s_last)) return;
    // ---- merge: the row's chunks x wc candidates, in position order
    const uint2* call = cand + row * chunks * wc;
    const int n_all = chunks * wc;
    unsigned pos[kChunkItems];
#pragma unroll
    for (int i = 0; i < kChunkItems; ++i) {
      const int ci = tid * kChunkItems + i;
      const uint2 kp = ci < n_all ? __ldcg(&call[ci]) : make_uint2(0u, 0u);
      key[i] = kp.x;
      pos[i] = kp.y;
    }
    take = cta_topk<kScoreThreads, kChunkItems>(key, width, hist, sc, slot, total);
#pragma unroll
    for (int i = 0; i < kChunkItems; ++i) {
      if ((take >> i) & 1u) orow[slot++] = int(pos[i]);
    }
    for (int s2 = total + tid; s2 < width; s2 += kScoreThreads) orow[s2] = -1;
  }
}

// ----------------------------------------------------------------------------- heads-per-CTA ring scores
// quest_score_heads_kernel  grid (ceil(table_stride / chunk), B), 32 * H threads (H <= 8 kv heads),
//   chunk <= kChunkMax: warp h scores kv head h at every position of the CTA's chunk through its
//   ring (ring_scores), so the H rows of a block (one record of H * row bytes in the pool) are
//   requested by the CTA's warps at about the same time, instead of by H CTAs of the chunk kernel.
//   Writes raw[b, h, :] like quest_select_chunk_kernel<..., FUSED = false, RING = true>. PAIRS: as there.
// OCC (default 2): CTAs per SM the kernel is built for (__launch_bounds__: 8 * OCC warps per SM). OCC = 3
// (DATAENGINE_RING_OCC=3): 80 registers (0 spills, sm_90a) and one ring stage fewer (int4 3, fp8 2) so
// that three CTAs fit an SM's shared memory: 24 warps per SM instead of 16 to hide latency.
template <typename TS, int D, int G, int REDUCE, int H, bool PAIRS = false, int OCC = 2>
__global__ void __launch_bounds__(32 * H, 8 * OCC / H) quest_score_heads_kernel(
    const __nv_bfloat16* __restrict__ q, const void* __restrict__ kmin, const void* __restrict__ kmax,
    const int* __restrict__ block_table, int table_stride, int num_blocks, int chunk, float* __restrict__ raw) {
  static_assert(H >= 1 && H <= 8, "heads kernel: one warp per kv head, at most 8");
  DATAENGINE_PDL_ENTRY();
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ int phys_s[kChunkMax];
  const int b = blockIdx.y, h = threadIdx.x / 32;
  const int pos0 = blockIdx.x * chunk;
  const int n_here = min(chunk, table_stride - pos0);
  const int* table = block_table + (long long)b * table_stride;
  for (int i = threadIdx.x; i < n_here; i += 32 * H) {
    const int p = max(table[pos0 + i], 0);  // holes read block 0 like the reference's clamp
    phys_s[i] = p < num_blocks ? p : -1;
  }
  __syncthreads();
  float* rrow = raw + ((long long)b * H + h) * table_stride + pos0;
  static_assert(OCC == 2 || OCC == 3, "heads kernel: 2 or 3 CTAs per SM");
  constexpr int kStages = OCC == 2 ? Ring<TS, D>::kStages : Ring<TS, D>::kStages - 1;
  ring_scores<TS, D, G, REDUCE, PAIRS, kStages>(q, static_cast<const unsigned char*>(kmin),
                                                static_cast<const unsigned char*>(kmax), phys_s, n_here, dsm,
                                                [&](int i, float v) { rrow[i] = v; }, h, b, H, 0, 16);
}

// ----------------------------------------------------------------------------- record-tile ring scores
// quest_score_records_kernel  the heads grid (grid (ceil(table_stride / chunk), B), 32 * H threads, warp h =
//   kv head h) with one ring for the CTA instead of one per warp (DATAENGINE_RING_GRID=records): a stage
//   holds a 16-block tile's whole records (kmax, then kmin: per block its H rows, contiguous in the pool),
//   copied by all the CTA's threads in 16-byte pieces that follow the records (a warp's copy instruction
//   covers 512 contiguous bytes, a record is fetched at once), one __syncthreads per tile; warp h scores
//   its rows (pitch = a record) exactly as ring_scores does (ring_tile). Records of int4 rows with even H
//   are padded by 16 bytes in shared memory (an odd number of words modulo 8: the code reads of rows r =
//   0..7 hit distinct banks); fp8 rows keep the rings' XOR swizzle of odd rows. OCC: CTAs per SM (2: the
//   rings' stages, fp8 3 / int4 4; 3: one stage fewer, 80 registers: int4 rows with PAIRS only, the
//   others spill).
template <typename TS, int D, int H> struct RecordTile {
  static constexpr int kRow = Ring<TS, D>::kRow, kChunks = kRow / 16, kRecChunks = H * kChunks;
  static constexpr int kPad = (IsQ4<TS>::value && H % 2 == 0) ? 16 : 0;
  static constexpr int kPitch = H * kRow + kPad, kBound = 16 * kPitch, kTile = 2 * kBound;
};

template <typename TS, int D, int G, int REDUCE, int H, bool PAIRS = false, int OCC = 2>
__global__ void __launch_bounds__(32 * H, 8 * OCC / H) quest_score_records_kernel(
    const __nv_bfloat16* __restrict__ q, const void* __restrict__ kmin, const void* __restrict__ kmax,
    const int* __restrict__ block_table, int table_stride, int num_blocks, int chunk, float* __restrict__ raw) {
  static_assert(H >= 1 && H <= 8, "records kernel: one warp per kv head, at most 8");
  static_assert(OCC == 2 || OCC == 3, "records kernel: 2 or 3 CTAs per SM");
  static_assert(D == 128 || !IsQ4<TS>::value, "records kernel: int4 rows of head_dim 128");
  using R = Ring<TS, D>;
  using RT = RecordTile<TS, D, H>;
  constexpr int kStages = OCC == 2 ? R::kStages : R::kStages - 1;
  constexpr int kThreads = 32 * H, kCopies = 16 * RT::kRecChunks, kU = (kCopies + kThreads - 1) / kThreads;
  DATAENGINE_PDL_ENTRY();
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ int phys_s[kChunkMax];
  const int b = blockIdx.y, tid = threadIdx.x, h = tid / 32, lane = tid % 32, r = lane / 4, t = lane % 4;
  const int pos0 = blockIdx.x * chunk;
  const int n_here = min(chunk, table_stride - pos0);
  const int* table = block_table + (long long)b * table_stride;
  for (int i = tid; i < n_here; i += kThreads) {
    const int p = max(table[pos0 + i], 0);  // holes read block 0 like the reference's clamp
    phys_s[i] = p < num_blocks ? p : -1;
  }
  __syncthreads();
  const int n_tiles = (n_here + 15) / 16;
  // copy u of this thread: piece e = tid + kThreads u of the tile's records, block row_u = e / kRecChunks,
  // 16-byte chunk c = e - row_u kRecChunks of its record; only the block index is held (registers: OCC 3)
  int row_u[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int e = tid + kThreads * u;
    row_u[u] = (kCopies % kThreads == 0 || e < kCopies) ? e / RT::kRecChunks : -1;
  }
  const unsigned rec16 = unsigned(RT::kRecChunks);  // a block record in 16-byte units
  const uint4* kmax16 = static_cast<const uint4*>(kmax);
  const uint4* kmin16 = static_cast<const uint4*>(kmin);
  int issue_slot = 0;
  auto issue = [&](int k) {
    if (k < n_tiles) {
      unsigned char* slot = dsm + issue_slot * RT::kTile;
      const int tile = 16 * k;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (row_u[u] >= 0) {
          const int i = row_u[u], c = tid + kThreads * u - i * RT::kRecChunks;
          const int dst = i * RT::kPitch + (c / RT::kChunks) * RT::kRow + 16 * R::chunk_at(i, c % RT::kChunks);
          const int p = tile + i < n_here ? phys_s[tile + i] : -1;
          const unsigned o = unsigned(max(p, 0)) * rec16 + unsigned(c);
          tilehal::cp_async_16(slot + dst, kmax16 + o, p >= 0);  // zero rows for ids scored -inf
          tilehal::cp_async_16(slot + RT::kBound + dst, kmin16 + o, p >= 0);
        }
      }
    }
    issue_slot = issue_slot == kStages - 1 ? 0 : issue_slot + 1;
    tilehal::cp_async_commit();
  };
#pragma unroll
  for (int k = 0; k < kStages - 1; ++k) issue(k);
  const long long head0 = (long long)b * H * G + (long long)h * G;
  typename RingQSel<TS, D, G, PAIRS>::type Q;
  Q.load(q, head0, r, t);
  const unsigned m78 = 0x00780078u | (unsigned(n_tiles) >> 31);  // as in ring_scores
  float* rrow = raw + ((long long)b * H + h) * table_stride + pos0;
  int read_slot = 0;
  for (int k = 0; k < n_tiles; ++k) {
    tilehal::cp_async_wait<kStages - 2>();
    __syncthreads();  // tile k visible to the CTA; every warp is done with tile k - 1's slot
    issue(k + kStages - 1);
    const unsigned char* slot = dsm + read_slot * RT::kTile + h * RT::kRow;
    read_slot = read_slot == kStages - 1 ? 0 : read_slot + 1;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    ring_tile<TS, D, G, PAIRS, RT::kPitch, RT::kBound>(Q, q, head0, slot, r, t, m78, acc);
    float s_lo, s_hi;
    reduce_heads<G, REDUCE>(acc, t, s_lo, s_hi);
    if (t == 0) {
      const int i_lo = 16 * k + r, i_hi = 16 * k + r + 8;
      if (i_lo < n_here) rrow[i_lo] = phys_s[i_lo] >= 0 ? s_lo : -INFINITY;
      if (i_hi < n_here) rrow[i_hi] = phys_s[i_hi] >= 0 ? s_hi : -INFINITY;
    }
  }
  tilehal::cp_async_wait<0>();
}

}  // namespace dataengine
