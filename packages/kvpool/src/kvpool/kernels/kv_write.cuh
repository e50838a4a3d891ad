// The pool's write path as one kernel: K and V of T new tokens stored at their slots, and the
// per-block, per-channel key summaries (kmin / kmax) widened to cover them.
//
// Grid (T), 256 threads; a thread owns channel pairs (h, c..c+1) of one token: it converts K and
// V to the pool dtype (round to nearest even, as torch's .to), stores them as 32-bit words, and
// folds the stored K pair into the summary words with a compare-and-swap loop (both channels of
// a 32-bit word at once; tokens of one block race only on their summary, never on data).
// Summaries are in the pool dtype (bf16/fp16), as KVStorage keeps them, or (FP8_SUM) e4m3 codes
// rounded outward (kmin down, kmax up) and folded in code order, whose NaN codes are the open
// ends 0xFF (lowest) and 0x7F (highest) — storage.py's fp8_round_outward / fp8_order, byte for byte.
#pragma once
#include <tilehal/tilehal.cuh>

namespace kvpool {

template <typename T, bool IS_MIN>
__device__ __forceinline__ void fold_pair(unsigned* addr, float x0, float x1) {
  unsigned old = *reinterpret_cast<volatile unsigned*>(addr), assumed;
  do {
    assumed = old;
    const float2 cur = tilehal::to_float2<T>(assumed);
    const float n0 = IS_MIN ? (x0 < cur.x ? x0 : cur.x) : (x0 > cur.x ? x0 : cur.x);
    const float n1 = IS_MIN ? (x1 < cur.y ? x1 : cur.y) : (x1 > cur.y ? x1 : cur.y);
    const unsigned nw = tilehal::from_float2<T>(n0, n1);  // exact: n0, n1 are values of T
    if (nw == assumed) return;
    old = atomicCAS(addr, assumed, nw);
  } while (old != assumed);
}

// ---- e4m3 summary codes
__device__ __forceinline__ unsigned e4m3_order(unsigned c) { return c < 128u ? c + 128u : 255u - c; }
__device__ __forceinline__ unsigned e4m3_unorder(unsigned o) { return o >= 128u ? o - 128u : 255u - o; }
__device__ __forceinline__ float e4m3_value(unsigned c) {  // ordinary codes only
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3);
  return __half2float(__half(h));
}
// The smallest code >= x (UP) or the largest code <= x; beyond +-448 the open ends; NaN: the end.
template <bool UP> __device__ __forceinline__ unsigned e4m3_round_outward(float x) {
  if (x != x) return UP ? 0x7fu : 0xffu;
  const unsigned c = __nv_cvt_float_to_fp8(fminf(fmaxf(x, -448.f), 448.f), __NV_SATFINITE, __NV_E4M3);
  unsigned o = e4m3_order(c);
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // nearest is at most one code away, two across the signed zeros
    if (o == 0u || o == 255u) break;
    const float v = e4m3_value(e4m3_unorder(o));
    if (UP ? v < x : v > x) o += UP ? 1u : 0xffffffffu;
  }
  return e4m3_unorder(o);
}
// Fold the codes of channels (e, e + 1) into the 32-bit summary word holding them (byte lane
// `byte0` = 0 or 2), in code order.
template <bool IS_MIN>
__device__ __forceinline__ void fold_pair_fp8(unsigned* word, int byte0, unsigned c0, unsigned c1) {
  const unsigned o0 = e4m3_order(c0), o1 = e4m3_order(c1);
  unsigned old = *reinterpret_cast<volatile unsigned*>(word), assumed;
  do {
    assumed = old;
    const unsigned b0 = (assumed >> (8 * byte0)) & 0xffu, b1 = (assumed >> (8 * byte0 + 8)) & 0xffu;
    const unsigned p0 = e4m3_order(b0), p1 = e4m3_order(b1);
    const unsigned n0 = e4m3_unorder(IS_MIN ? min(p0, o0) : max(p0, o0));
    const unsigned n1 = e4m3_unorder(IS_MIN ? min(p1, o1) : max(p1, o1));
    const unsigned nw = (assumed & ~(0xffffu << (8 * byte0))) | ((n0 | (n1 << 8)) << (8 * byte0));
    if (nw == assumed) return;
    old = atomicCAS(word, assumed, nw);
  } while (old != assumed);
}

template <typename TIn, typename T, bool FP8_SUM>
__global__ void __launch_bounds__(256) kv_write_kernel(
    const TIn* __restrict__ k, const TIn* __restrict__ v,  // [T, H, D] contiguous
    const long long* __restrict__ slots,                    // [T]
    int heads, int head_dim, int block_size,
    T* __restrict__ k_cache, T* __restrict__ v_cache,      // [num_blocks * block_size, H, D] (one layer)
    void* __restrict__ kmin, void* __restrict__ kmax) {    // [num_blocks, H, D] (one layer), T or e4m3 codes
  const int tok = blockIdx.x;
  const long long slot = slots[tok];
  const long long blk = slot / block_size;
  const int pairs = heads * head_dim / 2;
  const long long src0 = (long long)tok * heads * head_dim;
  const long long dst0 = slot * heads * head_dim;
  const long long sum0 = blk * heads * head_dim;
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = 2 * p;  // element index within [H, D]; head_dim is even, so a pair never straddles heads
    const float k0 = tilehal::to_float(k[src0 + e]), k1 = tilehal::to_float(k[src0 + e + 1]);
    const float v0 = tilehal::to_float(v[src0 + e]), v1 = tilehal::to_float(v[src0 + e + 1]);
    const unsigned kw = tilehal::from_float2<T>(k0, k1);
    reinterpret_cast<unsigned*>(k_cache + dst0)[p] = kw;
    reinterpret_cast<unsigned*>(v_cache + dst0)[p] = tilehal::from_float2<T>(v0, v1);
    const float2 ks = tilehal::to_float2<T>(kw);  // the stored (rounded) key, as the reference summarizes
    if constexpr (FP8_SUM) {  // 4 channels per word; the layer's summaries are 4-byte aligned (host checks)
      const long long byte = sum0 + e;
      unsigned* wmin = reinterpret_cast<unsigned*>(kmin) + byte / 4;
      unsigned* wmax = reinterpret_cast<unsigned*>(kmax) + byte / 4;
      const int b0 = int(byte % 4);
      fold_pair_fp8<true>(wmin, b0, e4m3_round_outward<false>(ks.x), e4m3_round_outward<false>(ks.y));
      fold_pair_fp8<false>(wmax, b0, e4m3_round_outward<true>(ks.x), e4m3_round_outward<true>(ks.y));
    } else {
      fold_pair<T, true>(reinterpret_cast<unsigned*>(static_cast<T*>(kmin) + sum0) + p, ks.x, ks.y);
      fold_pair<T, false>(reinterpret_cast<unsigned*>(static_cast<T*>(kmax) + sum0) + p, ks.x, ks.y);
    }
  }
}

// ---- int4 summary rows (storage.py's int4_encode, operation for operation in float32 RN)
// Grid (T), 256 threads. CTA `tok` re-encodes the rows (every head, kmin and kmax) of its slot's
// block, unless the previous token is in the same block (that CTA does it): one warp per
// (head, 32-channel group, bound), lane = channel. Blocks met in two runs are encoded twice, to
// the same bytes. Runs after kv_write_kernel (same stream), so it reads the final summaries.
__device__ __forceinline__ unsigned bf16_bits(__nv_bfloat16 x) { return unsigned(*reinterpret_cast<unsigned short*>(&x)); }
__device__ __forceinline__ float bf16_next_up(float x) {  // the next bf16 above bf16 value x >= 0
  return __uint_as_float((bf16_bits(__float2bfloat16_rn(x)) + 1u) << 16);
}

template <typename T>
__global__ void __launch_bounds__(256) int4_encode_kernel(
    const long long* __restrict__ slots, int heads, int head_dim, int block_size,
    const T* __restrict__ kmin, const T* __restrict__ kmax,                 // [num_blocks, H, D] (one layer)
    unsigned char* __restrict__ qmin, unsigned char* __restrict__ qmax) {  // [num_blocks, H, D/2 + D/8]
  const int tok = blockIdx.x;
  const long long blk = slots[tok] / block_size;
  if (tok > 0 && slots[tok - 1] / block_size == blk) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = head_dim / 32, row_bytes = head_dim / 2 + 4 * groups;
  const int jobs = heads * groups * 2;
  for (int job = warp; job < jobs; job += blockDim.x / 32) {
    const bool up = job & 1;
    const int hg = job >> 1, h = hg / groups, grp = hg % groups;
    const T* src = (up ? kmax : kmin) + (blk * heads + h) * head_dim + grp * 32;
    unsigned char* row = (up ? qmax : qmin) + (blk * heads + h) * row_bytes;
    const float x = tilehal::to_float(src[lane]);
    const bool any_nan = __any_sync(0xffffffffu, x != x);
    const bool all_fin = __all_sync(0xffffffffu, fabsf(x) <= 3.402823466e38f);
    float lo = x, hi = x;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, off));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
    }
    if (any_nan) lo = hi = __int_as_float(0x7fc00000);
    float lo_b = __bfloat162float(__float2bfloat16_rd(all_fin ? lo : 0.f));
    const float d = __fsub_rn(hi, lo_b);
    const bool fin = all_fin && fabsf(d) <= 3.402823466e38f;
    float step = __bfloat162float(__float2bfloat16_ru(__fdiv_rn(fin ? d : 0.f, 15.f)));
#pragma unroll
    for (int i = 0; i < 2; ++i)
      if (fin && __fadd_rn(lo_b, __fmul_rn(15.f, step)) < hi) step = bf16_next_up(step);
    unsigned c = 0u;
    if (fin && step > 0.f) {
      const float qv = __fdiv_rn(__fsub_rn(x, lo_b), step);
      float cf = up ? ceilf(qv) : floorf(qv);
      cf = fminf(fmaxf(cf, 0.f), 15.f);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float v = __fadd_rn(lo_b, __fmul_rn(cf, step));
        if (up && v < x && cf < 15.f) cf += 1.f;
        if (!up && v > x && cf > 0.f) cf -= 1.f;
      }
      c = unsigned(cf);
    }
    if (!fin) {  // the group's own extreme, step 0
      const float ext = up ? hi : lo;
      lo_b = fabsf(ext) <= 3.402823466e38f ? __bfloat162float(up ? __float2bfloat16_ru(ext) : __float2bfloat16_rd(ext)) : ext;
      step = 0.f;
    }
    const unsigned other = __shfl_down_sync(0xffffffffu, c, 1);
    if ((lane & 1) == 0) row[grp * 16 + lane / 2] = (unsigned char)(c | (other << 4));
    if (lane == 0) {
      const unsigned pw = bf16_bits(__float2bfloat16_rn(lo_b)) | (bf16_bits(__float2bfloat16_rn(step)) << 16);
      *reinterpret_cast<unsigned*>(row + head_dim / 2 + 4 * grp) = pw;
    }
  }
}

}  // namespace kvpool
