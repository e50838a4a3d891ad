// The pool's write path as one kernel: K and V of T new tokens stored at their slots, and the
// per-block, per-channel key summaries (kmin / kmax) widened to cover them.
//
// Grid (T), 256 threads; a thread owns channel pairs (h, c..c+1) of one token: it converts K and
// V to the pool dtype (round to nearest even, as torch's .to), stores them as 32-bit words, and
// folds the stored K pair into the summary words with a compare-and-swap loop (both channels of
// a 32-bit word at once; tokens of one block race only on their summary, never on data).
// Summaries are in the pool dtype (bf16/fp16), as KVStorage keeps them.
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

template <typename TIn, typename T>
__global__ void __launch_bounds__(256) kv_write_kernel(
    const TIn* __restrict__ k, const TIn* __restrict__ v,  // [T, H, D] contiguous
    const long long* __restrict__ slots,                    // [T]
    int heads, int head_dim, int block_size,
    T* __restrict__ k_cache, T* __restrict__ v_cache,      // [num_blocks * block_size, H, D] (one layer)
    T* __restrict__ kmin, T* __restrict__ kmax) {          // [num_blocks, H, D] (one layer)
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
    fold_pair<T, true>(reinterpret_cast<unsigned*>(kmin + sum0) + p, ks.x, ks.y);
    fold_pair<T, false>(reinterpret_cast<unsigned*>(kmax + sum0) + p, ks.x, ks.y);
  }
}

}  // namespace kvpool
