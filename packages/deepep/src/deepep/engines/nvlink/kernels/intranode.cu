// NVLink dispatch/combine for the GPUs of one host (DeepEP's intranode idea, our own code).
//
// Every rank owns IPC-shared buffers that its peers write into directly: one data region per
// source rank, a signal area of epoch-tagged flags. Each kernel has sender blocks, which push
// rows into the peers' buffers and raise a flag per chunk of rows, and receiver blocks, which
// wait for those flags and copy rows out of the local buffer. Regions alternate between two
// parities from call to call, so a call never overwrites what a slow peer may still be reading
// (a peer cannot be two calls behind: each call waits for a flag from every peer).
#include "sync.cuh"

namespace deepep {

struct DispatchArgs {
  const int4* x;              // [T, x16] input rows
  const float* scales;        // [T, S] or null
  const long long* topk_idx;  // [T, k] or null
  const float* topk_w;        // [T, k] or null
  const int* send_pos;        // [T, R]: row index in the destination's list, -1 if not sent
  const int* counts_msg;      // [R, 1 + epr]: rows and per-expert counts for each destination
  const u64* peer_data;       // [R]: this parity's data region of each rank
  const u64* peer_sig;        // [R]: this parity's signal area of each rank
  int4* recv_x;               // [*, x16]
  float* recv_scales;         // [*, S]
  long long* recv_topk;       // [*, k]
  float* recv_w;              // [*, k]
  int* recv_src;              // [*]
  int* recv_counts;           // [R] rows from each source (kept for combine)
  volatile int* host_info;    // pinned: [0] epoch, [1] rows received, [2..2+epr) per-expert counts
  volatile int* err;          // pinned: [0] stage, [1] peer
  long long region_bytes;     // bytes of one source's slot block (cap * row_bytes)
  u64 timeout_ns;
  int T, R, me, epr, k, x16, S;
  int row_bytes, off_scales, off_topk, off_w, off_src;
  int chunk, num_senders, max_chunks;
  int num_worst;              // > 0: outputs padded to this many rows, the host reads no counts
  int sig_counts;             // u64 offset of the counts messages in the signal area
  int sig_chunks;             // u64 offset of the chunk flags
  u32 epoch;
};

// Signal area (u64 words): [0, R) count flags by source; counts messages (int32 [R][1+epr]) at
// sig_counts; chunk flags [R][max_chunks] at sig_chunks.
__device__ void dispatch_send(const DispatchArgs& a, u64 deadline) {
  __shared__ int chunk_rows[DEEPEP_MAX_RANKS], chunk_start[DEEPEP_MAX_RANKS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, num_warps = blockDim.x >> 5;
  const int msg = 1 + a.epr;
  if (blockIdx.x == 0) {  // counts first: receivers size their outputs from them
    for (int i = tid; i < a.R * msg; i += blockDim.x) {
      int d = i / msg, j = i % msg;
      int* dst = reinterpret_cast<int*>(reinterpret_cast<u64*>(a.peer_sig[d]) + a.sig_counts);
      dst[a.me * msg + j] = a.counts_msg[i];
    }
    __syncthreads();
    if (tid < a.R) {
      __threadfence_system();
      // the payload is our token count: receivers derive how many chunk flags to expect
      st_release(reinterpret_cast<u64*>(a.peer_sig[tid]) + a.me, tagged(a.epoch, u32(a.T)));
    }
  }
  if (tid < a.R) {
    chunk_rows[tid] = 0;
    chunk_start[tid] = 0x7fffffff;
  }
  __syncthreads();
  const int num_chunks = (a.T + a.chunk - 1) / a.chunk;
  for (int c = blockIdx.x; c < num_chunks; c += a.num_senders) {
    const int t_end = min(a.T, (c + 1) * a.chunk);
    for (int t = c * a.chunk + warp; t < t_end; t += num_warps) {
      for (int j = 1; j < a.R; ++j) {  // peers only: our own rows never leave x
        const int d = (a.me + j) % a.R;
        const int pos = a.send_pos[t * a.R + d];
        if (pos < 0) continue;
        char* row = reinterpret_cast<char*>(a.peer_data[d]) + a.me * a.region_bytes + (long long)pos * a.row_bytes;
        copy_row<false>(reinterpret_cast<int4*>(row), a.x + (long long)t * a.x16, a.x16, lane);
        if (a.scales)
          for (int i = lane; i < a.S; i += 32)
            reinterpret_cast<float*>(row + a.off_scales)[i] = a.scales[(long long)t * a.S + i];
        if (a.topk_idx && lane < a.k) {
          reinterpret_cast<long long*>(row + a.off_topk)[lane] = a.topk_idx[(long long)t * a.k + lane];
          if (a.topk_w) reinterpret_cast<float*>(row + a.off_w)[lane] = a.topk_w[(long long)t * a.k + lane];
        }
        if (lane == 0) {
          *reinterpret_cast<int*>(row + a.off_src) = t;
          atomicAdd(&chunk_rows[d], 1);
          atomicMin(&chunk_start[d], pos);
        }
      }
    }
    __syncthreads();
    if (tid < a.R) {
      __threadfence_system();
      u64* flags = reinterpret_cast<u64*>(a.peer_sig[tid]) + a.sig_chunks + (long long)a.me * a.max_chunks;
      // payload: first row of the chunk (high 20 bits) and its row count (low 12 bits), so a
      // receiver block can copy any chunk without waiting for the ones before it
      const int n = chunk_rows[tid], start = n ? chunk_start[tid] : 0;
      st_release(flags + c, tagged(a.epoch, (u32(start) << 12) | u32(n)));
      chunk_rows[tid] = 0;
      chunk_start[tid] = 0x7fffffff;
    }
    __syncthreads();
  }
}

__device__ void dispatch_recv(const DispatchArgs& a, u64 deadline) {
  __shared__ int rows_from[DEEPEP_MAX_RANKS], tokens_from[DEEPEP_MAX_RANKS], base[DEEPEP_MAX_RANKS + 1];
  __shared__ int abort_flag;
  __shared__ u32 chunk_n;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, num_warps = blockDim.x >> 5;
  const int rb = blockIdx.x - a.num_senders, num_recv_blocks = gridDim.x - a.num_senders;
  const int msg = 1 + a.epr;
  const u64* my_sig = reinterpret_cast<const u64*>(a.peer_sig[a.me]);
  const int* counts = reinterpret_cast<const int*>(my_sig + a.sig_counts);
  if (tid == 0) abort_flag = 0;
  __syncthreads();
  if (tid < a.R) {
    u32 src_tokens = 0;
    if (!wait_flag(my_sig + tid, a.epoch, deadline, a.err, kDispatchCounts, tid, &src_tokens)) abort_flag = 1;
    else rows_from[tid] = __ldcg(counts + tid * msg);
    tokens_from[tid] = int(src_tokens);
  }
  __syncthreads();
  if (abort_flag) return;
  if (tid == 0) {
    base[0] = 0;
    for (int s = 0; s < a.R; ++s) base[s + 1] = base[s] + rows_from[s];
  }
  __syncthreads();
  if (rb == 0) {  // tell the host how much arrives (it sizes the outputs while we copy)
    for (int e = tid; e < a.epr; e += blockDim.x) {
      int sum = 0;
      for (int s = 0; s < a.R; ++s) sum += __ldcg(counts + s * msg + 1 + e);
      a.host_info[2 + e] = sum;
    }
    if (tid < a.R) a.recv_counts[tid] = rows_from[tid];
    if (tid == 0) a.host_info[1] = base[a.R];
    if (a.num_worst) {  // the host does not wait for the counts: pad and check here
      const int n = base[a.R];
      if (tid == 0 && n > a.num_worst) {
        a.err[5] = n;
        a.err[4] = 1;
      }
      for (int i = n * a.k + tid; i < a.num_worst * a.k; i += blockDim.x) {
        if (a.recv_topk) a.recv_topk[i] = -1;
        if (a.recv_w) a.recv_w[i] = 0.f;
      }
    }
    __syncthreads();
    if (tid == 0) {
      __threadfence_system();
      a.host_info[0] = int(a.epoch);
    }
  }
  // Blocks are spread over sources; the blocks of one source take its chunks in turn.
  const int per_src = max(1, num_recv_blocks / a.R);
  if (rb >= per_src * a.R) return;
  const int s = rb % a.R, j = rb / a.R;
  const int lo = a.me * a.epr;
  if (s == a.me) {  // our own tokens: straight from x to their place, no buffer, no flags
    for (int t = j * num_warps + warp; t < a.T; t += per_src * num_warps) {
      const int p = a.send_pos[t * a.R + a.me];
      if (p < 0) continue;
      const int out = base[s] + p;
      copy_row<false>(a.recv_x + (long long)out * a.x16, a.x + (long long)t * a.x16, a.x16, lane);
      if (a.recv_scales)
        for (int q = lane; q < a.S; q += 32) a.recv_scales[(long long)out * a.S + q] = a.scales[(long long)t * a.S + q];
      if (a.recv_topk && lane < a.k) {
        const long long e = a.topk_idx[(long long)t * a.k + lane];
        const bool mine = e >= lo && e < lo + a.epr;
        a.recv_topk[(long long)out * a.k + lane] = mine ? e - lo : -1;
        if (a.recv_w) a.recv_w[(long long)out * a.k + lane] = mine ? a.topk_w[(long long)t * a.k + lane] : 0.f;
      }
      if (lane == 0) a.recv_src[out] = t;
    }
    return;
  }
  const char* region = reinterpret_cast<const char*>(a.peer_data[a.me]) + s * a.region_bytes;
  const u64* flags = my_sig + a.sig_chunks + (long long)s * a.max_chunks;
  // This block's chunks only: each flag says where its rows start.
  const int num_chunks = rows_from[s] ? (tokens_from[s] + a.chunk - 1) / a.chunk : 0;
  for (int c = j; c < num_chunks; c += per_src) {
    if (tid == 0) {
      u32 v = 0;
      if (c >= a.max_chunks || !wait_flag(flags + c, a.epoch, deadline, a.err, kDispatchData, s, &v)) abort_flag = 1;
      chunk_n = v;
    }
    __syncthreads();
    if (abort_flag) return;
    const int n = int(chunk_n & 0xfffu), start = int(chunk_n >> 12);
    {
      for (int i = warp; i < n; i += num_warps) {
        const int p = start + i, out = base[s] + p;
        const char* row = region + (long long)p * a.row_bytes;
        warp_copy16(a.recv_x + (long long)out * a.x16, reinterpret_cast<const int4*>(row), a.x16, lane);
        if (a.recv_scales)
          for (int q = lane; q < a.S; q += 32)
            a.recv_scales[(long long)out * a.S + q] = __ldcg(reinterpret_cast<const float*>(row + a.off_scales) + q);
        if (a.recv_topk && lane < a.k) {
          long long e = __ldcg(reinterpret_cast<const long long*>(row + a.off_topk) + lane);
          const bool mine = e >= lo && e < lo + a.epr;
          a.recv_topk[(long long)out * a.k + lane] = mine ? e - lo : -1;
          if (a.recv_w) {
            float w = __ldcg(reinterpret_cast<const float*>(row + a.off_w) + lane);
            a.recv_w[(long long)out * a.k + lane] = mine ? w : 0.f;
          }
        }
        if (lane == 0) a.recv_src[out] = __ldcg(reinterpret_cast<const int*>(row + a.off_src));
      }
    }
    __syncthreads();
  }
}

struct CombineArgs {
  const int4* x;            // [N, x16] rows received by dispatch (bf16 or fp32)
  const float* w;           // [N, k] or null
  const int* recv_counts;   // [R] rows that came from each source in the dispatch
  const int* send_pos;      // [T, R] from the dispatch
  const u64* peer_data;     // [R] this parity's combine region of each rank
  const u64* peer_sig;      // [R]
  void* out;                // [T, H] like x
  float* out_w;             // [T, k] or null
  volatile int* err;
  long long region_bytes;
  u64 timeout_ns;
  int T, R, me, k, x16, row_bytes, off_w, chunk, num_senders, max_chunks;
  int sig_hello, sig_chunks;
  u32 epoch;
};

__device__ void combine_send(const CombineArgs& a) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, num_warps = blockDim.x >> 5;
  if (blockIdx.x == 0 && tid < a.R) {  // "I am in this call": lets receivers trust the parity
    __threadfence_system();
    st_release(reinterpret_cast<u64*>(a.peer_sig[tid]) + a.sig_hello + a.me, tagged(a.epoch, 0));
  }
  // Work list: chunk c of every peer before chunk c + 1 of any, so all links are busy from the
  // start. Our own rows are not copied: the receiver reads them from x.
  if (a.R == 1) return;
  int max_nc = 0;
  for (int d = 0; d < a.R; ++d) max_nc = max(max_nc, (a.recv_counts[d] + a.chunk - 1) / a.chunk);
  const int peers = a.R - 1;
  for (int g = blockIdx.x; g < max_nc * peers; g += a.num_senders) {
    const int c = g / peers, d = (a.me + 1 + g % peers) % a.R;
    if (c * a.chunk >= a.recv_counts[d]) continue;
    int first = 0;
    for (int q = 0; q < d; ++q) first += a.recv_counts[q];
    const int p0 = c * a.chunk, p1 = min(a.recv_counts[d], p0 + a.chunk);
    char* region = reinterpret_cast<char*>(a.peer_data[d]) + a.me * a.region_bytes;
    for (int p = p0 + warp; p < p1; p += num_warps) {
      char* row = region + (long long)p * a.row_bytes;
      copy_row<false>(reinterpret_cast<int4*>(row), a.x + (long long)(first + p) * a.x16, a.x16, lane);
      if (a.w && lane < a.k) reinterpret_cast<float*>(row + a.off_w)[lane] = a.w[(long long)(first + p) * a.k + lane];
    }
    __syncthreads();
    if (tid == 0) {
      __threadfence_system();
      u64* flags = reinterpret_cast<u64*>(a.peer_sig[d]) + a.sig_chunks + (long long)a.me * a.max_chunks;
      st_release(flags + c, tagged(a.epoch, 0));
    }
    __syncthreads();
  }
}

template <typename T>
__device__ void combine_recv(const CombineArgs& a, u64 deadline) {
  __shared__ int abort_flag;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, num_warps = blockDim.x >> 5;
  const int rb = blockIdx.x - a.num_senders, num_recv_blocks = gridDim.x - a.num_senders;
  const u64* my_sig = reinterpret_cast<const u64*>(a.peer_sig[a.me]);
  if (tid == 0) abort_flag = 0;
  __syncthreads();
  if (tid < a.R && !wait_flag(my_sig + a.sig_hello + tid, a.epoch, deadline, a.err, kCombineHello, tid, nullptr))
    abort_flag = 1;
  __syncthreads();
  if (abort_flag) return;
  const char* my_data = reinterpret_cast<const char*>(a.peer_data[a.me]);
  int first_me = 0;  // our own returned rows sit in x after the rows of lower ranks
  for (int q = 0; q < a.me; ++q) first_me += a.recv_counts[q];
  int seen[DEEPEP_MAX_RANKS];  // highest chunk of each peer known to be complete (tokens only grow)
  for (int d = 0; d < a.R; ++d) seen[d] = -1;
  for (int t = rb * num_warps + warp; t < a.T; t += num_recv_blocks * num_warps) {
    int pos[DEEPEP_MAX_RANKS];
    bool ok = true;
    for (int d = 0; d < a.R; ++d) {
      pos[d] = a.send_pos[t * a.R + d];
      if (pos[d] < 0 || d == a.me) continue;
      const int c = pos[d] / a.chunk;
      if (c > seen[d]) {
        bool got = true;
        if (lane == 0) {
          const u64* f = my_sig + a.sig_chunks + (long long)d * a.max_chunks + c;
          got = wait_flag(f, a.epoch, deadline, a.err, kCombineData, d, nullptr);
        }
        got = __shfl_sync(0xffffffffu, got, 0);
        if (!got) { ok = false; break; }
        seen[d] = c;
      }
    }
    if (!ok) break;
    constexpr int kv = VecElems<T>::n;
    int4* out = reinterpret_cast<int4*>(a.out) + (long long)t * a.x16;
    const int4* rows[DEEPEP_MAX_RANKS];
    int nr = 0;
    for (int d = 0; d < a.R; ++d)
      if (pos[d] >= 0)
        rows[nr++] = d == a.me ? a.x + (long long)(first_me + pos[d]) * a.x16
                               : reinterpret_cast<const int4*>(my_data + d * a.region_bytes + (long long)pos[d] * a.row_bytes);
    // Four words per lane per pass: every peer's loads for them are issued before any add.
    for (int i0 = lane; i0 < a.x16; i0 += 128) {
      float acc[4][kv];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int q = 0; q < kv; ++q) acc[u][q] = 0.f;
      for (int r = 0; r < nr; ++r) {
        int4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (i0 + 32 * u < a.x16) v[u] = __ldcg(rows[r] + i0 + 32 * u);
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (i0 + 32 * u < a.x16) add_vec<T>(acc[u], v[u]);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (i0 + 32 * u < a.x16) out[i0 + 32 * u] = pack_vec<T>(acc[u]);
    }
    if (a.out_w && lane < a.k) {
      float s = 0.f;
      for (int d = 0; d < a.R; ++d) {
        if (pos[d] < 0) continue;
        if (d == a.me) {
          s += a.w[(long long)(first_me + pos[d]) * a.k + lane];
          continue;
        }
        const char* row = my_data + d * a.region_bytes + (long long)pos[d] * a.row_bytes;
        s += __ldcg(reinterpret_cast<const float*>(row + a.off_w) + lane);
      }
      a.out_w[(long long)t * a.k + lane] = s;
    }
  }
}

// ------------------------------------------------------------------ layout

// Routing layout and send positions in one launch, no host synchronization. Each block takes
// a tile of blockDim.x tokens: per token a bitmask of destination ranks and a per-destination
// position inside the tile (ballot + popc in a warp, a scan over the block's warps). A tile
// publishes its per-destination totals with an epoch-tagged flag and adds up the totals of the
// tiles before it (they never wait on later tiles, and blocks start in index order, so the
// look-back always finishes). Tiles also count tokens per expert; the last block to finish
// (a ticket) sums the tiles' counts. With topk_idx it also writes is_token_in_rank and the
// per-rank/per-expert counts; without, it reads is_token_in_rank and copies the given
// per-expert counts. Bad expert ids are reported through host-mapped memory (err[2] = 1,
// err[3] = the value), checked by the host at its next call.
struct LayoutArgs {
  const long long* topk_idx;  // [T, k] or null
  unsigned char* in_rank;     // [T, R] bool: written with topk_idx, read without
  const int* per_expert_in;   // [E] when topk_idx is null
  int* per_rank;              // [R] or null
  int* per_expert;            // [E] or null (written with topk_idx)
  int* send_pos;              // [T, R]: row index in the destination's list, -1 if not sent
  int* counts_msg;            // [R, 1 + epr]: rows and per-expert counts for each destination
  u64* tile_flags;            // [tiles] scratch: epoch-tagged "totals published"
  int* tile_totals;           // [tiles, R] scratch
  int* tile_experts;          // [tiles, E] scratch (with topk_idx)
  unsigned* ticket;           // scratch: blocks finished (the last one resets it)
  volatile int* err;          // host-mapped
  u64 timeout_ns;
  int T, k, R, E, epr, smem_counts;
  int has_topk;               // 1: count from topk_idx; 0: read in_rank and per_expert_in (an empty
                              // tensor may have a null pointer, so the mode is not taken from it)
  u32 epoch;
};

extern "C" __global__ void __launch_bounds__(512) deepep_layout(LayoutArgs a) {
  extern __shared__ int expert_cnt[];  // [E] this tile's tokens per expert, when smem_counts
  __shared__ int warp_base[16][DEEPEP_MAX_RANKS];
  __shared__ int before[DEEPEP_MAX_RANKS], tile_total[DEEPEP_MAX_RANKS];
  __shared__ int last, abort_flag;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, num_warps = blockDim.x >> 5;
  const int b = blockIdx.x, tiles = gridDim.x, t = b * blockDim.x + tid;
  const u64 deadline = now_ns() + a.timeout_ns;
  int* cnt = a.smem_counts ? expert_cnt : a.tile_experts + (long long)b * a.E;
  if (a.has_topk)
    for (int e = tid; e < a.E; e += blockDim.x) cnt[e] = 0;
  if (tid < a.R) before[tid] = 0;
  if (tid == 0) abort_flag = 0;
  __syncthreads();
  unsigned mask = 0;
  if (t < a.T) {
    if (a.has_topk) {
      for (int j = 0; j < a.k; ++j) {
        const long long e = a.topk_idx[(long long)t * a.k + j];
        if (e < 0 || e >= a.E) {
          if (e != -1) {
            a.err[3] = int(e);
            a.err[2] = 1;
          }
          continue;
        }
        mask |= 1u << int(e / a.epr);
        atomicAdd(&cnt[e], 1);
      }
      for (int r = 0; r < a.R; ++r) a.in_rank[(long long)t * a.R + r] = (mask >> r) & 1u;
    } else {
      for (int r = 0; r < a.R; ++r) mask |= (a.in_rank[(long long)t * a.R + r] ? 1u : 0u) << r;
    }
  }
  int below[DEEPEP_MAX_RANKS];
  const unsigned lt = (1u << lane) - 1u;
#pragma unroll
  for (int r = 0; r < DEEPEP_MAX_RANKS; ++r) {
    if (r >= a.R) break;
    const unsigned bal = __ballot_sync(0xffffffffu, (mask >> r) & 1u);
    below[r] = __popc(bal & lt);
    if (lane == 0) warp_base[warp][r] = __popc(bal);
  }
  __syncthreads();
  if (tid < a.R) {  // exclusive scan over the warps of this tile
    int run = 0;
    for (int w = 0; w < num_warps; ++w) {
      const int c = warp_base[w][tid];
      warp_base[w][tid] = run;
      run += c;
    }
    tile_total[tid] = run;
    a.tile_totals[b * a.R + tid] = run;
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    st_release(a.tile_flags + b, tagged(a.epoch, 1));
  }
  for (int q = tid; q < b; q += blockDim.x) {  // look back: the totals of every earlier tile
    if (!wait_flag(a.tile_flags + q, a.epoch, deadline, a.err, kLayoutTiles, q, nullptr)) {
      abort_flag = 1;
      break;
    }
    for (int r = 0; r < a.R; ++r) atomicAdd(&before[r], __ldcg(a.tile_totals + q * a.R + r));
  }
  __syncthreads();
  if (t < a.T && !abort_flag) {
#pragma unroll
    for (int r = 0; r < DEEPEP_MAX_RANKS; ++r) {
      if (r >= a.R) break;
      a.send_pos[(long long)t * a.R + r] = ((mask >> r) & 1u) ? before[r] + warp_base[warp][r] + below[r] : -1;
    }
  }
  if (a.has_topk && a.smem_counts)
    for (int e = tid; e < a.E; e += blockDim.x) a.tile_experts[(long long)b * a.E + e] = cnt[e];
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    last = atomicAdd(a.ticket, 1u) == unsigned(tiles - 1);
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int msg = 1 + a.epr;
  if (tid < a.R) {
    int total = 0;
    for (int q = 0; q < tiles; ++q) total += __ldcg(a.tile_totals + q * a.R + tid);
    if (a.per_rank) a.per_rank[tid] = total;
    a.counts_msg[tid * msg] = total;
  }
  for (int e = tid; e < a.E; e += blockDim.x) {
    int c = 0;
    if (a.has_topk)
      for (int q = 0; q < tiles; ++q) c += __ldcg(a.tile_experts + (long long)q * a.E + e);
    else
      c = a.per_expert_in[e];
    if (a.has_topk) a.per_expert[e] = c;
    a.counts_msg[(e / a.epr) * msg + 1 + e % a.epr] = c;
  }
  if (tid == 0) *a.ticket = 0;
}

}  // namespace deepep

extern "C" __global__ void __launch_bounds__(512) deepep_dispatch(deepep::DispatchArgs a) {
  const u64 deadline = deepep::now_ns() + a.timeout_ns;
  if ((int)blockIdx.x < a.num_senders) deepep::dispatch_send(a, deadline);
  else deepep::dispatch_recv(a, deadline);
}

extern "C" __global__ void __launch_bounds__(512) deepep_combine_bf16(deepep::CombineArgs a) {
  const u64 deadline = deepep::now_ns() + a.timeout_ns;
  if ((int)blockIdx.x < a.num_senders) deepep::combine_send(a);
  else deepep::combine_recv<__nv_bfloat16>(a, deadline);
}

extern "C" __global__ void __launch_bounds__(512) deepep_combine_f32(deepep::CombineArgs a) {
  const u64 deadline = deepep::now_ns() + a.timeout_ns;
  if ((int)blockIdx.x < a.num_senders) deepep::combine_send(a);
  else deepep::combine_recv<float>(a, deadline);
}
