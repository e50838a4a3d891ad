// Paged decode attention on CUDA cores (SIMT): one query token per sequence against its K/V blocks.
//
// Contract, grid and split partials: paged_decode_common.cuh. The CTA serves all GROUP query
// heads of its kv head from a single pass over K and V. Tiles of 64 tokens stream global ->
// shared with 16-byte cp.async (zero-filled past the end) in a two-stage pipeline; QK uses 8
// threads per token (16-byte shared loads, q in registers), PV gives each thread a pair of
// channels. Serves any block size (paged_decode_mma.cuh needs a power of two).
#pragma once
#include "paged_decode_common.cuh"

namespace kvpool {

constexpr int kSimtTile = 64;    // tokens per pipeline stage (cuda_decode.TILE)
constexpr int kSimtStages = 2;   // cuda_decode.STAGES

template <typename T, int D, int G>
struct DecodeSmemSimt {
  static constexpr int kRowBytes = D * int(sizeof(T));
  static constexpr int kTileBytes = kSimtTile * kRowBytes;
  static constexpr int kBytes = 2 * kSimtStages * kTileBytes      // K and V stages
                                + kSimtTile * G * 4                 // probabilities [token][g]
                                + kSimtStages * kSimtTile * 4       // token valid flags
                                + 4 * G * 4;                        // running m, l, alpha
};

template <typename T, int D, int G>
__global__ void __launch_bounds__(kThreads) paged_decode_simt_kernel(
    const T* __restrict__ q,              // [B, H * G, D]
    const T* __restrict__ k_cache,        // [num_blocks, block_size, H, D] (one layer)
    const T* __restrict__ v_cache,
    const int* __restrict__ block_table,  // [B, table_stride]
    int table_stride,
    const int* __restrict__ seq_lens,     // [B]
    const int* __restrict__ block_idx,    // nullable; [B, (H|1), num_idx]
    int idx_b_stride, int idx_h_stride, int num_idx,
    T* __restrict__ out,                  // [B, H * G, D]; used when gridDim.x == 1
    float* __restrict__ o_part,           // [B, H * G, splits, D]
    float* __restrict__ ml_part,          // [B, H * G, splits, 2]
    float scale_log2, int block_size) {
  using S = DecodeSmemSimt<T, D, G>;
  constexpr int kChunks = D / 8;          // 16-byte chunks per K/V row
  constexpr int kDotChunks = kChunks / 8; // per QK thread (8 threads per token)
  constexpr int kPairs = D / 2;
  constexpr int kTG = kThreads / kPairs;  // token groups in the PV phase
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");

  extern __shared__ __align__(16) unsigned char smem[];
  T* k_s = reinterpret_cast<T*>(smem);
  T* v_s = reinterpret_cast<T*>(smem + kSimtStages * S::kTileBytes);
  float* p_s = reinterpret_cast<float*>(smem + 2 * kSimtStages * S::kTileBytes);
  int* valid_s = reinterpret_cast<int*>(p_s + kSimtTile * G);
  float* m_s = reinterpret_cast<float*>(valid_s + kSimtStages * kSimtTile);
  float* l_s = m_s + G;
  float* alpha_s = l_s + G;

  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int H = gridDim.y, splits = gridDim.x, tid = threadIdx.x;
  const DecodeShare share = decode_share(seq_lens, block_table, table_stride, block_idx, idx_b_stride, idx_h_stride,
                                         num_idx, block_size);
  const int num_tokens = share.n_items * block_size;
  const int num_tiles = (num_tokens + kSimtTile - 1) / kSimtTile;
  const long long row_stride = (long long)H * D;  // elements between consecutive tokens

  if (tid < G) { m_s[tid] = -INFINITY; l_s[tid] = 0.f; }

  // Physical token row for CTA-local token t, or -1 (padding, unselected, past the end).
  auto row_of = [&](int t) -> long long {
    if (t >= num_tokens) return -1;
    const int item = share.item0 + t / block_size, off = t % block_size;
    const int lb = share.idx ? share.idx[item] : item;
    if (lb < 0 || lb >= share.seq_blocks || lb * block_size + off >= share.seq_len) return -1;
    const int phys = share.table[lb];
    return phys < 0 ? -1 : (long long)phys * block_size + off;
  };

  auto load_tile = [&](int tile, int stage) {
    T* ks = k_s + stage * kSimtTile * D;
    T* vs = v_s + stage * kSimtTile * D;
#pragma unroll
    for (int i = 0; i < kSimtTile * kChunks / kThreads; ++i) {
      const int c = tid + i * kThreads, t = c / kChunks, col = c % kChunks;
      const long long row = row_of(tile * kSimtTile + t);
      const long long off = row < 0 ? 0 : row * row_stride + (long long)h * D + col * 8;
      tilehal::cp_async_16(ks + t * D + col * 8, k_cache + off, row >= 0);
      tilehal::cp_async_16(vs + t * D + col * 8, v_cache + off, row >= 0);
      if (col == 0) valid_s[stage * kSimtTile + t] = row >= 0;
    }
    tilehal::cp_async_commit();
  };

  // q of this thread's channels (QK phase), pre-scaled so exp2 gives the softmax.
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
        float2 f = tilehal::to_float2<T>(u[e]);
        qr[g][j][2 * e] = f.x * scale_log2;
        qr[g][j][2 * e + 1] = f.y * scale_log2;
      }
    }
  }

  const int pv_pair = tid % kPairs, pv_group = tid / kPairs;
  float acc[G][2];
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = 0.f;

  if (num_tiles > 0) load_tile(0, 0);
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile % kSimtStages;
    if (tile + 1 < num_tiles) {
      load_tile(tile + 1, (tile + 1) % kSimtStages);
      tilehal::cp_async_wait<1>();
    } else {
      tilehal::cp_async_wait<0>();
    }
    __syncthreads();
    const T* ks = k_s + stage * kSimtTile * D;
    const T* vs = v_s + stage * kSimtTile * D;

    // ---- scores: 8 threads per token, 16 tokens per pass
#pragma unroll
    for (int pass = 0; pass < kSimtTile / (kThreads / 8); ++pass) {
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
          float2 f = tilehal::to_float2<T>(u[e]);
#pragma unroll
          for (int g = 0; g < G; ++g) s[g] += qr[g][j][2 * e] * f.x + qr[g][j][2 * e + 1] * f.y;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) s[g] = tilehal::warp_sum<float, 8>(s[g]);
      if (qk_lane == 0) {
        const bool ok = valid_s[stage * kSimtTile + t];
#pragma unroll
        for (int g = 0; g < G; ++g) p_s[t * G + g] = ok ? s[g] : -INFINITY;
      }
    }
    __syncthreads();

    // ---- online softmax: one warp per query head
    for (int g = tilehal::warp_id(); g < G; g += kThreads / 32) {
      const int lane = tilehal::lane_id();
      float s0 = p_s[lane * G + g], s1 = p_s[(lane + 32) * G + g];
      const float m_old = m_s[g];
      const float m_new = fmaxf(m_old, tilehal::warp_max(fmaxf(s0, s1)));
      // All -inf so far: keep probabilities at zero instead of exp2(nan).
      const float base = m_new == -INFINITY ? 0.f : m_new;
      const float e0 = exp2f(s0 - base), e1 = exp2f(s1 - base);
      p_s[lane * G + g] = e0;
      p_s[(lane + 32) * G + g] = e1;
      const float sum = tilehal::warp_sum(e0 + e1);
      if (lane == 0) {
        const float alpha = exp2f(m_old - base);
        m_s[g] = m_new;
        l_s[g] = l_s[g] * alpha + sum;
        alpha_s[g] = alpha;
      }
    }
    __syncthreads();

    // ---- P @ V: each thread a channel pair over every kTG-th token
#pragma unroll
    for (int g = 0; g < G; ++g) { acc[g][0] *= alpha_s[g]; acc[g][1] *= alpha_s[g]; }
#pragma unroll 4
    for (int t = pv_group; t < kSimtTile; t += kTG) {
      float2 v = tilehal::to_float2<T>(*reinterpret_cast<const unsigned*>(vs + t * D + 2 * pv_pair));
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
    __syncthreads();  // the stage and p_s are overwritten next
  }

  // ---- reduce the kTG token groups through shared memory (the K stages are free now)
  __syncthreads();  // m_s / l_s visible even when this CTA had no tiles
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
