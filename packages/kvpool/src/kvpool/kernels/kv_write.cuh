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

}  // namespace kvpool
