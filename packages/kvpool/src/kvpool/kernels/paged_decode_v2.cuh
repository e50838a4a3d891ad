// Paged decode, variant 2 (compile-tested; awaiting GPU validation, not the default yet).
//
// Same contract and math as paged_decode_kernel (paged_decode.cuh). Two changes aimed at the
// memory pipeline, which v1 leaves partly idle (2.1-2.3 TB/s on an H200):
//  1. The CTA's block list (physical id and valid-token count per block) is staged in shared
//     memory once, so issuing a tile's cp.async no longer waits on dependent global loads of
//     block_indices and block_table (v1 did those on the critical path of every tile).
//  2. Tile size and pipeline depth are template parameters (v1: 64 tokens x 2 stages); the next
//     tiles are issued before the current one is computed, keeping STAGES-1 tiles in flight.
// The host guarantees a CTA's share of blocks fits the shared table (kMaxItems).
#pragma once
#include "paged_decode.cuh"

namespace kvpool {

constexpr int kMaxItems = 512;  // blocks one CTA may own (host picks splits accordingly)

template <typename T, int D, int G, int TILE, int STAGES>
struct DecodeSmemV2 {
  static constexpr int kTileBytes = TILE * D * int(sizeof(T));
  static constexpr int kBytes = 2 * STAGES * kTileBytes   // K and V stages
                                + TILE * G * 4             // probabilities [token][g]
                                + 2 * kMaxItems * 4        // block table share: id, valid tokens
                                + 4 * G * 4;               // running m, l, alpha
};

template <typename T, int D, int G, int TILE, int STAGES>
__global__ void __launch_bounds__(kThreads) paged_decode_v2_kernel(
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_table, int table_stride, const int* __restrict__ seq_lens,
    const int* __restrict__ block_idx, int idx_b_stride, int idx_h_stride, int num_idx,
    T* __restrict__ out, float* __restrict__ o_part, float* __restrict__ ml_part,
    float scale_log2, int block_size) {
  using S = DecodeSmemV2<T, D, G, TILE, STAGES>;
  constexpr int kChunks = D / 8;
  constexpr int kDotChunks = kChunks / 8;
  constexpr int kPairs = D / 2;
  constexpr int kTG = kThreads / kPairs;
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  static_assert(TILE % 32 == 0 && TILE * kChunks % kThreads == 0, "TILE must be a multiple of 32");
  static_assert(STAGES >= 2, "at least two stages");
  static_assert(kTG * G * D * 4 <= 2 * S::kTileBytes * STAGES, "split reduction must fit the K/V stages");

  extern __shared__ __align__(16) unsigned char smem[];
  T* k_s = reinterpret_cast<T*>(smem);
  T* v_s = reinterpret_cast<T*>(smem + STAGES * S::kTileBytes);
  float* p_s = reinterpret_cast<float*>(smem + 2 * STAGES * S::kTileBytes);
  int* blk_s = reinterpret_cast<int*>(p_s + TILE * G);
  int* ntok_s = blk_s + kMaxItems;
  float* m_s = reinterpret_cast<float*>(ntok_s + kMaxItems);
  float* l_s = m_s + G;
  float* alpha_s = l_s + G;

  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int H = gridDim.y, splits = gridDim.x, tid = threadIdx.x;
  const int seq_len = seq_lens[b];
  const int seq_blocks = min((seq_len + block_size - 1) / block_size, table_stride);
  const int* idx = block_idx ? block_idx + (long long)b * idx_b_stride + (long long)h * idx_h_stride : nullptr;
  const int items = idx ? num_idx : seq_blocks;
  const int per_split = (items + splits - 1) / splits;
  const int item0 = split * per_split;
  const int n_items = max(0, min(items, item0 + per_split) - item0);
  const int num_tokens = n_items * block_size;
  const int num_tiles = (num_tokens + TILE - 1) / TILE;
  const long long row_stride = (long long)H * D;
  const int* table = block_table + (long long)b * table_stride;

  if (tid < G) { m_s[tid] = -INFINITY; l_s[tid] = 0.f; }
  for (int i = tid; i < n_items; i += kThreads) {
    const int lb = idx ? idx[item0 + i] : item0 + i;
    const int phys = lb >= 0 && lb < seq_blocks ? table[lb] : -1;
    blk_s[i] = max(phys, 0);
    ntok_s[i] = phys >= 0 ? min(block_size, seq_len - lb * block_size) : 0;
  }
  __syncthreads();

  auto row_of = [&](int t) -> long long {  // physical token row, or -1
    if (t >= num_tokens) return -1;
    const int i = t / block_size, off = t - i * block_size;
    return off < ntok_s[i] ? (long long)blk_s[i] * block_size + off : -1;
  };

  auto load_tile = [&](int tile, int stage) {
    T* ks = k_s + stage * TILE * D;
    T* vs = v_s + stage * TILE * D;
#pragma unroll
    for (int i = 0; i < TILE * kChunks / kThreads; ++i) {
      const int c = tid + i * kThreads, t = c / kChunks, col = c % kChunks;
      const long long row = row_of(tile * TILE + t);
      const long long off = row < 0 ? 0 : row * row_stride + (long long)h * D + col * 8;
      tilehal::cp_async_16(ks + t * D + col * 8, k_cache + off, row >= 0);
      tilehal::cp_async_16(vs + t * D + col * 8, v_cache + off, row >= 0);
    }
  };

  const int qk_tok = tid / 8, qk_lane = tid % 8;
  float qr[G][kDotChunks][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* qp = q + ((long long)b * H * G + h * G + g) * D;
#pragma unroll
    for (int j = 0; j < kDotChunks; ++j) {
      int4 raw = *reinterpret_cast<const int4*>(qp + (j * 8 + qk_lane) * 8);
      const unsigned* u = reinterpret_cast<const unsigned*>(&raw);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float2 f = to_float2<T>(u[e]);
        qr[g][j][2 * e] = f.x * scale_log2;
        qr[g][j][2 * e + 1] = f.y * scale_log2;
      }
    }
  }

  const int pv_pair = tid % kPairs, pv_group = tid / kPairs;
  float acc[G][2];
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = 0.f;

  // Prologue: STAGES-1 tiles in flight (empty groups keep the wait count uniform).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_tiles) load_tile(s, s);
    tilehal::cp_async_commit();
  }
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile % STAGES;
    // The stage refilled here was consumed in the previous iteration (closed by a barrier).
    const int next = tile + STAGES - 1;
    if (next < num_tiles) load_tile(next, next % STAGES);
    tilehal::cp_async_commit();
    tilehal::cp_async_wait<STAGES - 1>();
    __syncthreads();
    const T* ks = k_s + stage * TILE * D;
    const T* vs = v_s + stage * TILE * D;

#pragma unroll
    for (int pass = 0; pass < TILE / (kThreads / 8); ++pass) {
      const int t = pass * (kThreads / 8) + qk_tok;
      float s[G];
#pragma unroll
      for (int g = 0; g < G; ++g) s[g] = 0.f;
#pragma unroll
      for (int j = 0; j < kDotChunks; ++j) {
        int4 raw = *reinterpret_cast<const int4*>(ks + t * D + (j * 8 + qk_lane) * 8);
        const unsigned* u = reinterpret_cast<const unsigned*>(&raw);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float2 f = to_float2<T>(u[e]);
#pragma unroll
          for (int g = 0; g < G; ++g) s[g] += qr[g][j][2 * e] * f.x + qr[g][j][2 * e + 1] * f.y;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) s[g] = tilehal::warp_sum<float, 8>(s[g]);
      if (qk_lane == 0) {
        const bool ok = row_of(tile * TILE + t) >= 0;
#pragma unroll
        for (int g = 0; g < G; ++g) p_s[t * G + g] = ok ? s[g] : -INFINITY;
      }
    }
    __syncthreads();

    for (int g = tilehal::warp_id(); g < G; g += kThreads / 32) {
      const int lane = tilehal::lane_id();
      float mx = -INFINITY;
#pragma unroll
      for (int t = lane; t < TILE; t += 32) mx = fmaxf(mx, p_s[t * G + g]);
      const float m_old = m_s[g];
      const float m_new = fmaxf(m_old, tilehal::warp_max(mx));
      const float base = m_new == -INFINITY ? 0.f : m_new;
      float sum = 0.f;
#pragma unroll
      for (int t = lane; t < TILE; t += 32) {
        const float e = exp2f(p_s[t * G + g] - base);
        p_s[t * G + g] = e;
        sum += e;
      }
      sum = tilehal::warp_sum(sum);
      if (lane == 0) {
        const float alpha = exp2f(m_old - base);
        m_s[g] = m_new;
        l_s[g] = l_s[g] * alpha + sum;
        alpha_s[g] = alpha;
      }
    }
    __syncthreads();

#pragma unroll
    for (int g = 0; g < G; ++g) { acc[g][0] *= alpha_s[g]; acc[g][1] *= alpha_s[g]; }
#pragma unroll 4
    for (int t = pv_group; t < TILE; t += kTG) {
      float2 v = to_float2<T>(*reinterpret_cast<const unsigned*>(vs + t * D + 2 * pv_pair));
      float p[G];
      if constexpr (G % 4 == 0) {
#pragma unroll
        for (int g = 0; g < G; g += 4) {
          float4 p4 = *reinterpret_cast<const float4*>(p_s + t * G + g);
          p[g] = p4.x; p[g + 1] = p4.y; p[g + 2] = p4.z; p[g + 3] = p4.w;
        }
      } else {
#pragma unroll
        for (int g = 0; g < G; ++g) p[g] = p_s[t * G + g];
      }
#pragma unroll
      for (int g = 0; g < G; ++g) { acc[g][0] += p[g] * v.x; acc[g][1] += p[g] * v.y; }
    }
    __syncthreads();
  }
  tilehal::cp_async_wait<0>();  // only empty groups can remain; drain before reusing smem
  __syncthreads();

  float* red = reinterpret_cast<float*>(smem);
  if (kTG > 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      red[(pv_group * G + g) * D + 2 * pv_pair] = acc[g][0];
      red[(pv_group * G + g) * D + 2 * pv_pair + 1] = acc[g][1];
    }
    __syncthreads();
  }
  if (pv_group == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float a0 = acc[g][0], a1 = acc[g][1];
      for (int tg = 1; tg < kTG; ++tg) {
        a0 += red[(tg * G + g) * D + 2 * pv_pair];
        a1 += red[(tg * G + g) * D + 2 * pv_pair + 1];
      }
      const long long head = (long long)b * H * G + h * G + g;
      if (splits == 1) {
        const float inv = l_s[g] > 0.f ? 1.f / l_s[g] : 0.f;
        out[head * D + 2 * pv_pair] = tilehal::from_float<T>(a0 * inv);
        out[head * D + 2 * pv_pair + 1] = tilehal::from_float<T>(a1 * inv);
      } else {
        float* op = o_part + (head * splits + split) * D;
        op[2 * pv_pair] = a0;
        op[2 * pv_pair + 1] = a1;
        if (pv_pair == 0) {
          ml_part[(head * splits + split) * 2] = m_s[g];
          ml_part[(head * splits + split) * 2 + 1] = l_s[g];
        }
      }
    }
  }
}

}  // namespace kvpool
