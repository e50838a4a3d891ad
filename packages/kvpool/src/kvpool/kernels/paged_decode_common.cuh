// What the paged decode kernels share: the launch shape, the contract, each CTA's share of a
// sequence's blocks, and the merge of split partials.
//
// Contract of every decode kernel (paged_decode_simt.cuh, paged_decode_mma.cuh,
// paged_decode_fp8.cuh): grid (num_splits, kv_heads, batch), kThreads threads. A CTA owns one
// (sequence b, kv head h) and one contiguous share of that sequence's items: its blocks in table
// order (dense), or the selected logical blocks block_idx[b, h] (sparse). With one split it
// writes the normalized output; with several, each writes an unnormalized partial (acc, m, l)
// and paged_decode_combine merges them.
#pragma once
#include <tilehal/tilehal.cuh>

namespace kvpool {

constexpr int kThreads = 128;  // every decode kernel's CTA (cuda_decode.THREADS)

// Programmatic dependent launch: builds with -DKVPOOL_PDL (cuda_decode launches them with pdl=True) wait
// for the stream's previous kernel to finish, its writes visible, before reading anything, then let the
// next kernel's CTAs launch (which wait in turn). Without the macro both are absent (the default PTX).
#if defined(KVPOOL_PDL)
#define KVPOOL_PDL_ENTRY()                                 \
  do {                                                     \
    asm volatile("griddepcontrol.wait;" ::: "memory");     \
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
  } while (0)
#else
#define KVPOOL_PDL_ENTRY() \
  do {                     \
  } while (0)
#endif

// The share of a sequence's items that split `split` of `splits` owns: [begin, begin + count).
// The items are the selected blocks idx[0, num_idx) when idx is given (sparse), else the
// sequence's seq_blocks blocks in table order (dense). Contiguous shares of ceil(items /
// splits); trailing splits may own none.
struct SplitRange {
  int begin, count;
};
__device__ __forceinline__ SplitRange split_range(const int* idx, int num_idx, int seq_blocks, int split, int splits) {
  const int items = idx ? num_idx : seq_blocks;
  const int per_split = (items + splits - 1) / splits;
  const int begin = split * per_split;
  return {begin, max(0, min(items, begin + per_split) - begin)};
}

// What a decode CTA (split blockIdx.x, kv head blockIdx.y, sequence blockIdx.z) owns: its sequence's
// length and block count (positions past the table are ignored, as in the reference, never read out
// of bounds), its selected blocks (sparse; nullptr: dense), its block-table row, and its share
// [item0, item0 + n_items) of the items.
struct DecodeShare {
  int seq_len, seq_blocks, item0, n_items;
  const int* idx;
  const int* table;
};
__device__ __forceinline__ DecodeShare decode_share(const int* seq_lens, const int* block_table, int table_stride,
                                                    const int* block_idx, int idx_b_stride, int idx_h_stride,
                                                    int num_idx, int block_size) {
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  DecodeShare s;
  s.seq_len = seq_lens[b];
  s.seq_blocks = min((s.seq_len + block_size - 1) / block_size, table_stride);
  s.idx = block_idx ? block_idx + (long long)b * idx_b_stride + (long long)h * idx_h_stride : nullptr;
  const SplitRange range = split_range(s.idx, num_idx, s.seq_blocks, split, gridDim.x);
  s.item0 = range.begin;
  s.n_items = range.count;
  s.table = block_table + (long long)b * table_stride;
  return s;
}

// Entry i of a CTA's staged block list (kernels that stage it in shared memory): the physical
// block of the share's item i (0 for a hole or an out-of-range selection) and how many of its
// tokens are valid (0 then). Returns the physical block, or -1.
__device__ __forceinline__ int stage_block(int i, const DecodeShare& s, int block_size, int* blk_s, int* ntok_s) {
  const int lb = s.idx ? s.idx[s.item0 + i] : s.item0 + i;
  const int phys = lb >= 0 && lb < s.seq_blocks ? s.table[lb] : -1;
  blk_s[i] = max(phys, 0);
  ntok_s[i] = phys >= 0 ? min(block_size, s.seq_len - lb * block_size) : 0;
  return phys;
}

// Channel d of q head `head` once a CTA has its (acc, m, l): the normalized output when the
// sequence has one split, else this split's unnormalized partial for paged_decode_combine.
template <typename T, int D>
__device__ __forceinline__ void store_channel(T* __restrict__ out, float* __restrict__ o_part,
                                              float* __restrict__ ml_part, long long head, int split, int splits,
                                              int d, float acc, float m, float l) {
  if (splits == 1) {
    out[head * D + d] = tilehal::from_float<T>(l > 0.f ? acc / l : 0.f);
  } else {
    o_part[(head * splits + split) * D + d] = acc;
    if (d == 0) {
      ml_part[(head * splits + split) * 2] = m;
      ml_part[(head * splits + split) * 2 + 1] = l;
    }
  }
}

// Merge split partials: grid (B * H * G), one thread per channel.
template <typename T, int D>
__global__ void paged_decode_combine(const float* __restrict__ o_part, const float* __restrict__ ml_part,
                                     T* __restrict__ out, int splits) {
  KVPOOL_PDL_ENTRY();
  const long long head = blockIdx.x;
  const int d = threadIdx.x;
  const float* ml = ml_part + head * splits * 2;
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, ml[2 * s]);
  const float base = m == -INFINITY ? 0.f : m;
  float num = 0.f, den = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float w = exp2f(ml[2 * s] - base);
    den += w * ml[2 * s + 1];
    num += w * o_part[(head * splits + s) * D + d];
  }
  out[head * D + d] = tilehal::from_float<T>(den > 0.f ? num / den : 0.f);
}

// Merge split partials inside the decode kernel: with `tickets` (one per (sequence, kv head), zero
// between launches), the last of a (b, h)'s split CTAs to finish reads every split's partial (from
// L2) and writes the normalized output of the group's G q heads, then re-arms the ticket: the same
// arithmetic as paged_decode_combine, one launch fewer. Every thread of the CTA calls it.
template <typename T, int D>
__device__ __forceinline__ void combine_if_last(const float* __restrict__ o_part, const float* __restrict__ ml_part,
                                                T* __restrict__ out, unsigned* __restrict__ tickets, int b, int h,
                                                int H, int G, int splits) {
  __shared__ bool s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&tickets[b * H + h], 1u) == unsigned(splits - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
    const int g = e / D, d = e % D;
    const long long head = ((long long)b * H + h) * G + g;
    const float* ml = ml_part + head * splits * 2;
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, __ldcg(&ml[2 * s]));
    const float base = m == -INFINITY ? 0.f : m;
    float num = 0.f, den = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float w = exp2f(__ldcg(&ml[2 * s]) - base);
      den += w * __ldcg(&ml[2 * s + 1]);
      num += w * __ldcg(&o_part[(head * splits + s) * D + d]);
    }
    out[head * D + d] = tilehal::from_float<T>(den > 0.f ? num / den : 0.f);
  }
  if (threadIdx.x == 0) tickets[b * H + h] = 0u;
}

}  // namespace kvpool
