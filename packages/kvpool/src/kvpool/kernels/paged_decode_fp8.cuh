// Paged decode over an fp8 (e4m3) pool: K/V stored as e4m3 with one fp32 scale per (block, kv head).
//
// Contract, grid and split partials: paged_decode_common.cuh, plus the two scale tensors; q and
// out are bf16/fp16/fp32 (the model's dtype). The CTA's share of blocks (physical id, valid
// tokens, K and V scale) is staged in shared memory; warp w takes blocks w, w+4, ...; inside a
// block, D/8 lanes own one token (8 channels = 8 bytes of K and of V per lane), so a warp reads
// 32/(D/8) tokens per step, and kF8Unroll steps are loaded before they are used. Scores of a
// batch of tokens update the online softmax once (one rescale per batch). The lane groups' and
// warps' partial (m, l, O) merge at the end (shuffles, then shared memory).
#pragma once
#include "paged_decode_common.cuh"

namespace kvpool {

constexpr int kF8Warps = kThreads / 32;
constexpr int kF8MaxItems = 512;  // blocks one CTA may own; the host picks splits accordingly (FP8_MAX_ITEMS)
constexpr int kF8Unroll = 4;

// 8 e4m3 values (8 bytes) -> floats
__device__ __forceinline__ void e4m3x8_to_float(uint2 raw, float (&x)[8]) {
  const unsigned w[2] = {raw.x, raw.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)((w[i] >> (16 * j)) & 0xffffu);
      __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
      __half2 h = *reinterpret_cast<__half2*>(&hr);
      const float2 f = __half22float2(h);
      x[4 * i + 2 * j] = f.x;
      x[4 * i + 2 * j + 1] = f.y;
    }
  }
}

template <typename TQ, int D, int G>
__global__ void __launch_bounds__(kThreads) paged_decode_fp8_kernel(
    const TQ* __restrict__ q, const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,  // [num_blocks, H]
    const int* __restrict__ block_table, int table_stride, const int* __restrict__ seq_lens,
    const int* __restrict__ block_idx, int idx_b_stride, int idx_h_stride, int num_idx,
    TQ* __restrict__ out, float* __restrict__ o_part, float* __restrict__ ml_part,
    float scale_log2, int block_size) {
  constexpr int kLanes = D / 8;            // lanes per token
  constexpr int kTok = 32 / kLanes;        // tokens per warp step
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  __shared__ int blk_s[kF8MaxItems], ntok_s[kF8MaxItems];
  __shared__ float ksc_s[kF8MaxItems], vsc_s[kF8MaxItems];
  __shared__ float red_o[kF8Warps][G][D];
  __shared__ float red_ml[kF8Warps][G][2];

  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int H = gridDim.y, splits = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / kLanes, cl = lane % kLanes;
  const DecodeShare share = decode_share(seq_lens, block_table, table_stride, block_idx, idx_b_stride, idx_h_stride,
                                         num_idx, block_size);

  for (int i = threadIdx.x; i < share.n_items; i += kThreads) {
    const int phys = stage_block(i, share, block_size, blk_s, ntok_s);
    ksc_s[i] = phys >= 0 ? k_scale[(long long)phys * H + h] : 0.f;
    vsc_s[i] = phys >= 0 ? v_scale[(long long)phys * H + h] : 0.f;
  }
  __syncthreads();

  float qr[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const TQ* qp = q + ((long long)b * H * G + (long long)h * G + g) * D + cl * 8;
#pragma unroll
    for (int c = 0; c < 8; ++c) qr[g][c] = tilehal::to_float(qp[c]) * scale_log2;
  }
  float acc[G][8], m_run[G], l_run[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m_run[g] = -INFINITY;
    l_run[g] = 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[g][c] = 0.f;
  }
  const long long row_stride = (long long)H * D;  // bytes between tokens (fp8)

  for (int it = warp; it < share.n_items; it += kF8Warps) {
    const int ntok = ntok_s[it];
    const long long base_row = (long long)blk_s[it] * block_size;
    const float ksc = ksc_s[it], vsc = vsc_s[it];
    for (int t0 = 0; t0 < ntok; t0 += kTok * kF8Unroll) {
      uint2 kr[kF8Unroll], vr[kF8Unroll];
      bool ok[kF8Unroll];
#pragma unroll
      for (int u = 0; u < kF8Unroll; ++u) {
        const int tok = t0 + u * kTok + sub;
        ok[u] = tok < ntok;
        const long long off = (base_row + (ok[u] ? tok : 0)) * row_stride + (long long)h * D + cl * 8;
        kr[u] = ok[u] ? *reinterpret_cast<const uint2*>(k_cache + off) : make_uint2(0u, 0u);
        vr[u] = ok[u] ? *reinterpret_cast<const uint2*>(v_cache + off) : make_uint2(0u, 0u);
      }
      float s[kF8Unroll][G];
#pragma unroll
      for (int u = 0; u < kF8Unroll; ++u) {
        float kf[8];
        e4m3x8_to_float(kr[u], kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float x = 0.f;
#pragma unroll
          for (int c = 0; c < 8; ++c) x = fmaf(qr[g][c], kf[c], x);
#pragma unroll
          for (int off = kLanes / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
          s[u][g] = ok[u] ? x * ksc : -INFINITY;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float mx = m_run[g];
#pragma unroll
        for (int u = 0; u < kF8Unroll; ++u) mx = fmaxf(mx, s[u][g]);
        const float base = mx == -INFINITY ? 0.f : mx;
        const float alpha = exp2f(m_run[g] - base);
        m_run[g] = mx;
        float lsum = 0.f;
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[g][c] *= alpha;
#pragma unroll
        for (int u = 0; u < kF8Unroll; ++u) {
          const float p = exp2f(s[u][g] - base);
          s[u][g] = p * vsc;  // V's scale folded into the weight
          lsum += p;
        }
        l_run[g] = l_run[g] * alpha + lsum;
      }
#pragma unroll
      for (int u = 0; u < kF8Unroll; ++u) {
        float vf[8];
        e4m3x8_to_float(vr[u], vf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int c = 0; c < 8; ++c) acc[g][c] = fmaf(s[u][g], vf[c], acc[g][c]);
        }
      }
    }
  }

  // ---- merge the lane groups of the warp (different tokens, same channels)
#pragma unroll
  for (int off = kLanes; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m_run[g], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l_run[g], off);
      const float mx = fmaxf(m_run[g], mo);
      const float base = mx == -INFINITY ? 0.f : mx;
      const float a = exp2f(m_run[g] - base), ao = exp2f(mo - base);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float other = __shfl_xor_sync(0xffffffffu, acc[g][c], off);
        acc[g][c] = acc[g][c] * a + other * ao;
      }
      l_run[g] = l_run[g] * a + lo * ao;
      m_run[g] = mx;
    }
  }
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int c = 0; c < 8; ++c) red_o[warp][g][cl * 8 + c] = acc[g][c];
      if (cl == 0) {
        red_ml[warp][g][0] = m_run[g];
        red_ml[warp][g][1] = l_run[g];
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < G * D; e += kThreads) {
    const int g = e / D, d = e % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kF8Warps; ++w) m = fmaxf(m, red_ml[w][g][0]);
    const float base = m == -INFINITY ? 0.f : m;
    float a = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < kF8Warps; ++w) {
      const float sc = exp2f(red_ml[w][g][0] - base);
      a += sc * red_o[w][g][d];
      l += sc * red_ml[w][g][1];
    }
    const long long head = (long long)b * H * G + (long long)h * G + g;
    store_channel<TQ, D>(out, o_part, ml_part, head, split, splits, d, a, m, l);
  }
}

}  // namespace kvpool
