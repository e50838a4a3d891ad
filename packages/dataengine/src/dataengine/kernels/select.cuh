// Sparse-attention block selection on the GPU: Quest upper bounds, then a per-row top-k.
//
// Two kernels, no host synchronization between or inside them (CUDA-graph capturable):
//
// quest_score_kernel  grid (chunks, kv_heads, B), 256 threads. D/8 lanes own one logical
//   block (8 channels each, one 16-byte load of kmax and one of kmin for 2-byte summaries), so a
//   warp scores 32/(D/8) blocks per step and every load is a full 16 B. Per q head of the GQA
//   group: sum(q+ * kmax) + sum(q- * kmin) over the channels (the reference's two matmuls, the
//   same IEEE special cases: any inf/NaN in a summary row makes the bound non-finite), reduced
//   over the lanes; a non-finite head bound becomes -inf; the group reduces by max/sum/mean.
//   Writes raw[b, h, pos] for every table position (float32). Holes (-1) read block 0, as the
//   reference does (its clamp); ids >= num_blocks score -inf and are never read.
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

namespace dataengine {

constexpr int kScoreThreads = 256;
constexpr int kScoreUnroll = 4;  // block groups per warp step (loads in flight per lane)
constexpr int kTopkThreads = 512;
constexpr int kTopkItems = 8;  // consecutive positions per thread in the ordered walk
constexpr unsigned kKeyNegInf = 0x007fffffu;  // order key of -inf
constexpr unsigned kKeyForced = 0xffffffffu;

enum Reduce { kMax = 0, kSum = 1, kMean = 2 };

// 8 summary channels: loaded raw (16 B for 2-byte types, 32 B for float), converted on use.
template <typename T> struct Chan8 {
  static constexpr int kWords = sizeof(T) / 2;  // int4 words per 8 channels
  int4 w[kWords];
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = tilehal::load_nc_v4(reinterpret_cast<const int4*>(p) + i);
  }
  __device__ __forceinline__ void get(float (&x)[8]) const;
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
template <> __device__ __forceinline__ void Chan8<__nv_bfloat16>::get(float (&x)[8]) const { unpack16(w[0], x, true); }
template <> __device__ __forceinline__ void Chan8<__half>::get(float (&x)[8]) const { unpack16(w[0], x, false); }
template <> __device__ __forceinline__ void Chan8<float>::get(float (&x)[8]) const {
  x[0] = __int_as_float(w[0].x); x[1] = __int_as_float(w[0].y); x[2] = __int_as_float(w[0].z); x[3] = __int_as_float(w[0].w);
  x[4] = __int_as_float(w[1].x); x[5] = __int_as_float(w[1].y); x[6] = __int_as_float(w[1].z); x[7] = __int_as_float(w[1].w);
}

__device__ __forceinline__ bool finite(float x) { return fabsf(x) <= 3.402823466e38f; }  // false for inf, NaN

// q [B, Hq, D] (TQ), kmin/kmax [num_blocks, H, D] (TS), block_table [B, table_stride] int32;
// raw [B, H, table_stride] float32.
template <typename TQ, typename TS, int D, int G, int REDUCE>
__global__ void __launch_bounds__(kScoreThreads, (G <= 4 && sizeof(TS) <= 2) ? 2 : 1) quest_score_kernel(
    const TQ* __restrict__ q, const TS* __restrict__ kmin, const TS* __restrict__ kmax,
    const int* __restrict__ block_table, int table_stride, int num_blocks, float* __restrict__ raw) {
  constexpr int kLanes = D / 8;           // lanes per logical block
  constexpr int kPerWarp = 32 / kLanes;   // blocks per warp and group step
  constexpr int kPerStep = kPerWarp * kScoreUnroll;
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / kLanes, cl = lane % kLanes;
  const int warps = kScoreThreads / 32;

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
  const int* table = block_table + (long long)b * table_stride;
  const long long row_stride = (long long)H * D;
  const int chunk = (table_stride + gridDim.x - 1) / gridDim.x;
  const int pos0 = blockIdx.x * chunk, pos1 = min(table_stride, pos0 + chunk);
  float* out = raw + ((long long)b * H + h) * table_stride;

  for (int base = pos0 + warp * kPerStep; base < pos1; base += warps * kPerStep) {
    Chan8<TS> rx[kScoreUnroll], rn[kScoreUnroll];
    bool ok[kScoreUnroll];
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      const int pos = base + u * kPerWarp + sub;
      int phys = pos < pos1 ? table[pos] : 0;
      phys = max(phys, 0);  // holes read block 0, like the reference's clamp
      ok[u] = pos < pos1 && phys < num_blocks;
      const long long off = (ok[u] ? (long long)phys : 0ll) * row_stride + (long long)h * D + cl * 8;
      rx[u].load(kmax + off);
      rn[u].load(kmin + off);
    }
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      float kx[8], kn[8];
      rx[u].get(kx);
      rn[u].get(kn);
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
      const int pos = base + u * kPerWarp + sub;
      if (cl == 0 && pos < pos1) out[pos] = ok[u] ? score : -INFINITY;
    }
  }
}

// ----------------------------------------------------------------------------- top-k
__device__ __forceinline__ unsigned float_key(float s) {
  if (s != s) s = -INFINITY;  // NaN is never chosen
  if (s == 0.f) s = 0.f;      // -0 ties with +0, as in the reference's comparison
  const unsigned u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
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
  int before = 0, all = 0;
  for (int w = 0; w < nw; ++w) {
    const int s = warp_sums[w];
    before += w < warp ? s : 0;
    all += s;
  }
  __syncthreads();  // warp_sums is reused by the next scan
  total = all;
  return before + x - v;
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
  extern __shared__ unsigned keys_s[];
  __shared__ int hist[256];
  __shared__ int warp_sums[kTopkThreads / 32];
  __shared__ int s_digit, s_need;
  __shared__ long long s_nvalid;
  const int row = blockIdx.x, b = row / rows_per_b, tid = threadIdx.x, lane = tid % 32;
  const float* srow = scores + (long long)row * N;
  int* orow = out + (long long)row * width;

  if (mode == 3) {
    int c = 0;
    for (int p = tid; p < N; p += kTopkThreads) c += table[(long long)b * N + p] >= 0;
    int total;
    block_exclusive_scan(c, warp_sums, total);
    if (tid == 0) s_nvalid = seq_lens[b] > 0 ? total : 0;
  } else if (tid == 0) {
    long long n = N;
    if (mode == 1) n = nv[b];
    if (mode == 2) n = ((long long)seq_lens[b] + block_size - 1) / block_size;
    s_nvalid = n;
  }
  __syncthreads();
  const long long n_valid = s_nvalid;
  auto key_of = [&](int p) -> unsigned {
    if (p >= n_valid) return 0u;
    if (p < sink || p >= n_valid - local) return kKeyForced;
    return float_key(srow[p]);
  };
  if constexpr (STAGED) {
#pragma unroll 4
    for (int p = tid; p < N; p += kTopkThreads) keys_s[p] = key_of(p);
    __syncthreads();
  }
  auto key_at = [&](int p) -> unsigned {
    if constexpr (STAGED) return keys_s[p];
    else return key_of(p);
  };

  // ---- radix select: T = the width-th largest key, need = how many keys == T to take
  unsigned prefix = 0u, mask = 0u;
  int need = width;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kTopkThreads) hist[i] = 0;
    __syncthreads();
    if constexpr (STAGED) {
      for (int base = 0; base < N; base += kTopkThreads) {  // warp-uniform trip count (match_any)
        const int p = base + tid;
        const unsigned k = p < N ? key_at(p) : 0u;
        const bool m = p < N && (k & mask) == prefix;
        const unsigned d = (k >> shift) & 255u;
        const unsigned peers = __match_any_sync(0xffffffffu, m ? d : 256u);
        if (m && lane == __ffs(peers) - 1) atomicAdd(&hist[d], __popc(peers));
      }
    } else {
      for (int p = tid; p < N; p += kTopkThreads) {
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
  for (int t0 = 0; t0 < N; t0 += kTopkThreads * kTopkItems) {
    unsigned k[kTopkItems];
    int eq = 0;
#pragma unroll
    for (int i = 0; i < kTopkItems; ++i) {
      const int p = t0 + tid * kTopkItems + i;
      k[i] = p < N ? key_at(p) : 0u;
      eq += p < N && k[i] == T;
    }
    int eq_total;
    int eq_rank = eq_carry + block_exclusive_scan(eq, warp_sums, eq_total);
    bool take[kTopkItems];
    int n_take = 0;
#pragma unroll
    for (int i = 0; i < kTopkItems; ++i) {
      const int p = t0 + tid * kTopkItems + i;
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
    for (int i = 0; i < kTopkItems; ++i) {
      if (take[i]) orow[slot++] = t0 + tid * kTopkItems + i;
    }
    eq_carry += eq_total;
    out_carry += out_total;
  }
  for (int s = out_carry + tid; s < width; s += kTopkThreads) orow[s] = -1;
}

}  // namespace dataengine
