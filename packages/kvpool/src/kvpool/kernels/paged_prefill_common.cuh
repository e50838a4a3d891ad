// What the paged prefill kernels share (paged_prefill.cuh: mma.sync; paged_prefill_wgmma.cuh: wgmma):
// the CTA's query tile and the gather of one kv token's row through the block table.
//
// Contract: grid (q heads, num_tiles); tiles[2 * blockIdx.y] = (sequence b, first new-token row i0),
// listed longest-first by the host. q / out are packed by sequence ([total, Hq, D], offsets
// cu_seqlens_q); sequence b's new tokens are its last n_new positions of seq_lens[b], after a cached
// prefix of P = seq_lens[b] - n_new tokens.
#pragma once
#include <tilehal/tilehal.cuh>

// The kernels' parameters (one launch argument list in cuda_prefill.py serves every prefill kernel):
//   q [total, Hq, D]; k_cache, v_cache [num_blocks, block_size, H, D] (one layer); block_table
//   [B, table_stride]; seq_lens [B]; cu_seqlens_q [B + 1]; tiles [num_tiles, 2]: (b, first new-token
//   row); out [total, Hq, D]; kv_heads; scale_log2 = softmax scale * log2(e); block_size.
#define KVPOOL_PREFILL_PARAMS(T)                                                                         \
  const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,                \
      const int* __restrict__ block_table, int table_stride, const int* __restrict__ seq_lens,          \
      const int* __restrict__ cu_seqlens_q, const int* __restrict__ tiles, T* __restrict__ out, int kv_heads, \
      float scale_log2, int block_size

namespace kvpool {

struct PrefillTile {
  int hq, hkv;      // q head, its kv head
  int b, i0;        // sequence, first new-token row of the tile
  int q0, P;        // the sequence's first row in q / out, its cached prefix length
  int rows;         // rows of this tile (<= BM; <= 0: nothing to do)
  int kv_end;       // keys [0, kv_end) are visible to some row of the tile
};

template <int BM>
__device__ __forceinline__ PrefillTile prefill_tile(const int* tiles, const int* seq_lens, const int* cu_seqlens_q,
                                                    int kv_heads) {
  PrefillTile p;
  p.hq = blockIdx.x;
  p.hkv = p.hq / (gridDim.x / kv_heads);
  p.b = tiles[2 * blockIdx.y];
  p.i0 = tiles[2 * blockIdx.y + 1];
  p.q0 = cu_seqlens_q[p.b];
  const int n_new = cu_seqlens_q[p.b + 1] - p.q0;
  p.P = seq_lens[p.b] - n_new;
  p.rows = min(BM, n_new - p.i0);
  p.kv_end = p.P + p.i0 + p.rows;
  return p;
}

// Whether kv token j's row is read: not past kv_end and its block mapped; `off` is then its element
// offset (plus head_off) in a [num_blocks, block_size, H, D] cache through the sequence's table row,
// else 0 (the caller zero-fills the row).
__device__ __forceinline__ bool paged_row(const int* table, int table_stride, int j, int kv_end, int block_size,
                                          long long kv_row_stride, long long head_off, long long& off) {
  int phys = -1;
  if (j < kv_end) {
    const int lb = j / block_size;
    phys = lb < table_stride ? table[lb] : -1;
  }
  const bool ok = phys >= 0;
  off = ok ? ((long long)phys * block_size + (j % block_size)) * kv_row_stride + head_off : 0ll;
  return ok;
}

}  // namespace kvpool
