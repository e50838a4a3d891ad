// NVLink dispatch/combine for the GPUs of one host (DeepEP's intranode idea, our own code).
//
// Every rank owns IPC-shared buffers that its peers write into directly: one data region per
// source rank, a signal area of epoch-tagged flags. Each kernel has sender blocks, which push
// rows into the peers' buffers and raise a flag per chunk of rows, and receiver blocks, which
// wait for those flags and copy rows out of the local buffer. Regions alternate between two
// parities from call to call, so a call never overwrites what a slow peer may still be reading
// (a peer cannot be two calls behind: each call waits for a flag from every peer).
//
// Flags are u64: high 32 bits = the call's epoch, low 32 bits = a payload (a row count).
// Every spin-wait has an absolute deadline (globaltimer, ns); on expiry the kernel records
// (stage, peer) in host-mapped memory and returns, so the host raises instead of hanging.
#include <tilehal/tilehal.cuh>

using tilehal::u64;
using tilehal::u32;

#define DEEPEP_MAX_RANKS 16

namespace deepep {

enum Stage { kDispatchCounts = 1, kDispatchData = 2, kCombineHello = 3, kCombineData = 4, kLLDispatch = 5, kLLCombine = 6 };

__device__ __forceinline__ u64 now_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 tagged(u32 epoch, u32 payload) { return (u64(epoch) << 32) | payload; }

// Spin until the flag carries `epoch`; false (and the error recorded) past the deadline.
__device__ __forceinline__ bool wait_flag(const u64* p, u32 epoch, u64 deadline, volatile int* err, int stage,
                                          int peer, u32* payload) {
  while (true) {
    u64 v = ld_acquire(p);
    if (u32(v >> 32) == epoch) {
      if (payload) *payload = u32(v);
      return true;
    }
    __nanosleep(32);  // hundreds of warps may poll at once: leave L2 to the incoming writes
    if (now_ns() > deadline) {
      err[1] = peer;
      err[0] = stage;
      __threadfence_system();
      return false;
    }
  }
}

// Copy n 16-byte words with the lanes of a warp, four loads in flight per lane before the
// stores (the loop otherwise waits out one load latency per word). kPeerWritten loads bypass
// L1 (`cg`): the source was written by a peer over NVLink since this SM may last have looked.
template <bool kPeerWritten>
__device__ __forceinline__ int4 load16(const int4* p) {
  if constexpr (kPeerWritten) return __ldcg(p);
  else return *p;
}
template <bool kPeerWritten>
__device__ __forceinline__ void copy_row(int4* dst, const int4* src, int n, int lane) {
  int i = lane;
  for (; i + 96 < n; i += 128) {
    const int4 a = load16<kPeerWritten>(src + i), b = load16<kPeerWritten>(src + i + 32);
    const int4 c = load16<kPeerWritten>(src + i + 64), d = load16<kPeerWritten>(src + i + 96);
    dst[i] = a;
    dst[i + 32] = b;
    dst[i + 64] = c;
    dst[i + 96] = d;
  }
  for (; i < n; i += 32) dst[i] = load16<kPeerWritten>(src + i);
}
__device__ __forceinline__ void warp_copy16(int4* dst, const int4* src, int n, int lane) {
  copy_row<true>(dst, src, n, lane);
}

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
__device__ __forceinline__ void add_vec(float* acc, int4 v);
template <>
__device__ __forceinline__ void add_vec<__nv_bfloat16>(float* acc, int4 v) {
  const unsigned* u = reinterpret_cast<const unsigned*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = tilehal::bf16x2_to_float2(u[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}
template <>
__device__ __forceinline__ void add_vec<float>(float* acc, int4 v) {
  const float* f = reinterpret_cast<const float*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] += f[i];
}
template <typename T> struct VecElems;
template <> struct VecElems<__nv_bfloat16> { static constexpr int n = 8; };
template <> struct VecElems<float> { static constexpr int n = 4; };

template <typename T>
__device__ __forceinline__ int4 pack_vec(const float* acc);
template <>
__device__ __forceinline__ int4 pack_vec<__nv_bfloat16>(const float* acc) {
  int4 r;
  unsigned* u = reinterpret_cast<unsigned*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) u[i] = tilehal::float2_to_bf16x2(acc[2 * i], acc[2 * i + 1]);
  return r;
}
template <>
__device__ __forceinline__ int4 pack_vec<float>(const float* acc) {
  return *reinterpret_cast<const int4*>(acc);
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

// Routing layout and send positions in one single-block launch, no host synchronization:
// per token a bitmask of destination ranks; per destination a running position (ballot +
// popc inside a warp, a scan over the warps of the block, a carry across tiles of tokens).
// With topk_idx it also writes is_token_in_rank and the per-rank/per-expert counts; without,
// it reads is_token_in_rank and copies the given per-expert counts. Bad expert ids are
// reported through host-mapped memory (err[2] = 1, err[3] = the value), checked by the host
// at its next read of the dispatch counts.
struct LayoutArgs {
  const long long* topk_idx;  // [T, k] or null
  unsigned char* in_rank;     // [T, R] bool: written with topk_idx, read without
  const int* per_expert_in;   // [E] when topk_idx is null
  int* per_rank;              // [R] or null
  int* per_expert;            // [E] or null (written with topk_idx)
  int* send_pos;              // [T, R]: row index in the destination's list, -1 if not sent
  int* counts_msg;            // [R, 1 + epr]: rows and per-expert counts for each destination
  volatile int* err;          // host-mapped
  int T, k, R, E, epr, smem_counts;
  int has_topk;               // 1: count from topk_idx; 0: read in_rank and per_expert_in (an empty
                              // tensor may have a null pointer, so the mode is not taken from it)
};

extern "C" __global__ void __launch_bounds__(1024) deepep_layout(LayoutArgs a) {
  extern __shared__ int expert_cnt[];  // [E] when smem_counts, else counts go to global memory
  __shared__ int warp_base[32][DEEPEP_MAX_RANKS];
  __shared__ int carry[DEEPEP_MAX_RANKS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, num_warps = blockDim.x >> 5;
  int* cnt = a.smem_counts ? expert_cnt : a.per_expert;
  if (a.has_topk)
    for (int e = tid; e < a.E; e += blockDim.x) cnt[e] = 0;
  if (tid < a.R) carry[tid] = 0;
  __syncthreads();
  for (int t0 = 0; t0 < a.T; t0 += blockDim.x) {
    const int t = t0 + tid;
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
      const unsigned b = __ballot_sync(0xffffffffu, (mask >> r) & 1u);
      below[r] = __popc(b & lt);
      if (lane == 0) warp_base[warp][r] = __popc(b);
    }
    __syncthreads();
    if (tid < a.R) {  // exclusive scan over the warps of this tile, plus the carry of earlier tiles
      int run = carry[tid];
      for (int w = 0; w < num_warps; ++w) {
        const int c = warp_base[w][tid];
        warp_base[w][tid] = run;
        run += c;
      }
      carry[tid] = run;
    }
    __syncthreads();
    if (t < a.T) {
#pragma unroll
      for (int r = 0; r < DEEPEP_MAX_RANKS; ++r) {
        if (r >= a.R) break;
        a.send_pos[(long long)t * a.R + r] = ((mask >> r) & 1u) ? warp_base[warp][r] + below[r] : -1;
      }
    }
    __syncthreads();
  }
  const int msg = 1 + a.epr;
  if (tid < a.R) {
    if (a.per_rank) a.per_rank[tid] = carry[tid];
    a.counts_msg[tid * msg] = carry[tid];
  }
  for (int e = tid; e < a.E; e += blockDim.x) {
    const int c = a.has_topk ? cnt[e] : a.per_expert_in[e];
    if (a.has_topk && a.smem_counts) a.per_expert[e] = c;
    a.counts_msg[(e / a.epr) * msg + 1 + e % a.epr] = c;
  }
}

// ------------------------------------------------------------------ low latency

struct LLArgs {
  const __nv_bfloat16* x;     // dispatch: [T, H]
  const long long* topk_idx;  // [T, k]
  const float* topk_w;        // combine: [T, k]
  const __nv_bfloat16* y;     // combine: [E_l, R * M, H] expert outputs
  int* pair_slot;             // [T, k]: the slot each (token, expert) got (dispatch writes, combine reads)
  int* ll_counts;             // [E_l, R]: rows from each source per local expert (dispatch writes)
  void* recv_x;               // [E_l, R * M, H] fp8 or bf16
  float* recv_scales;         // [E_l, R * M, H / 128]
  int* recv_src;              // [E_l, R * M]
  int* recv_count;            // [E_l]
  __nv_bfloat16* out;         // combine: [T, H]
  const u64* peer_data;       // [2 * R] both parities
  const u64* peer_sig;        // [2 * R]
  unsigned* state;            // [0] epoch, [1] blocks done
  int* expert_sent;           // dispatch: [E] tokens written per expert in this call (zeroed at the end)
  volatile int* err;
  u64 timeout_ns;
  int T, k, H, R, me, E, epr, M, use_fp8, row_bytes, num_senders;
};

__device__ __forceinline__ u32 ll_epoch(const LLArgs& a) { return *reinterpret_cast<volatile unsigned*>(a.state) + 1; }

// The last block to finish publishes the new epoch (graph replays then keep counting on device)
// and zeroes the per-call counters (every other block is past its last use of them).
__device__ __forceinline__ void ll_finish(const LLArgs& a, u32 epoch, int* reset, int reset_n) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(a.state + 1, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  for (int i = threadIdx.x; i < reset_n; i += blockDim.x) reset[i] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    a.state[1] = 0;
    __threadfence();
    *reinterpret_cast<volatile unsigned*>(a.state) = epoch;
  }
}

// Copy n 16-byte words with the threads of a block, four loads in flight per thread.
__device__ __forceinline__ void block_copy16(int4* dst, const int4* src, int n) {
  int i = threadIdx.x;
  const int s = blockDim.x;
  for (; i + 3 * s < n; i += 4 * s) {
    const int4 v0 = __ldcg(src + i), v1 = __ldcg(src + i + s), v2 = __ldcg(src + i + 2 * s), v3 = __ldcg(src + i + 3 * s);
    dst[i] = v0;
    dst[i + s] = v1;
    dst[i + 2 * s] = v2;
    dst[i + 3 * s] = v3;
  }
  for (; i < n; i += s) dst[i] = __ldcg(src + i);
}

// Copy `rows` rows of x16 16-byte words between strided row arrays (strides in 16-byte words),
// the whole block over the flattened (row, word) range, four loads in flight per thread.
__device__ __forceinline__ void block_copy_rows16(int4* dst, long long dst_stride, const int4* src,
                                                  long long src_stride, int rows, int x16) {
  const int n = rows * x16, s = blockDim.x;
  int i = threadIdx.x;
  for (; i + 3 * s < n; i += 4 * s) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int idx = i + u * s, q = idx / x16, w = idx - q * x16;
      v[u] = __ldcg(src + q * src_stride + w);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int idx = i + u * s, q = idx / x16, w = idx - q * x16;
      dst[q * dst_stride + w] = v[u];
    }
  }
  for (; i < n; i += s) {
    const int q = i / x16, w = i - q * x16;
    dst[q * dst_stride + w] = __ldcg(src + q * src_stride + w);
  }
}

__device__ __forceinline__ unsigned fp8x4(float a, float b, float c, float d) {
  __nv_fp8x4_e4m3 q(make_float4(a, b, c, d));
  return *reinterpret_cast<const unsigned*>(&q);
}

// LL dispatch. Every block first counts this rank's (token, expert) pairs per expert, then
// takes whole tokens: the slot of (t, e) is the number of earlier tokens routed to e (so slots
// are deterministic, no atomics on slots), the token is cast to fp8 once with 8 lanes per
// 128-channel group (a 3-step shuffle amax, one 16-byte load pair and one 16-byte store per
// lane and destination), and written into slot (e, me, slot) of e's owner. A per-expert
// counter tells the block that wrote an expert's last row to raise the (expert, me) flag with
// the count; experts this rank sends nothing raise theirs at once. Then the blocks become
// receivers, one local expert each: wait for every source's flag, pack the rows by source.
// Sending never waits, so blocks need not be co-resident.
extern "C" __global__ void __launch_bounds__(512) deepep_ll_dispatch(LLArgs a) {
  extern __shared__ int cnt[];  // [E] pairs of this rank per expert
  __shared__ long long tok_e[32];
  __shared__ int tok_slot[32];
  __shared__ int n_from[DEEPEP_MAX_RANKS], base_from[DEEPEP_MAX_RANKS + 1];
  __shared__ int abort_flag;
  const u32 epoch = ll_epoch(a);
  const int par = epoch & 1;
  const u64 deadline = now_ns() + a.timeout_ns;
  const int tid = threadIdx.x;
  const int H = a.H, G = H / 128;
  const int payload = a.use_fp8 ? H + G * 4 : H * 2;  // src token index follows the payload
  for (int e = tid; e < a.E; e += blockDim.x) cnt[e] = 0;
  if (tid == 0) abort_flag = 0;
  __syncthreads();
  for (int i = tid; i < a.T * a.k; i += blockDim.x) {
    const long long e = a.topk_idx[i];
    if (e >= 0 && e < a.E) {
      atomicAdd(&cnt[e], 1);
    } else if (e != -1 && blockIdx.x == 0) {  // bad id: skipped, reported to the host
      a.err[3] = int(e);
      a.err[2] = 1;
    }
  }
  __syncthreads();
  for (int e = blockIdx.x * blockDim.x + tid; e < a.E; e += gridDim.x * blockDim.x) {
    if (cnt[e] == 0) {
      const int d = e / a.epr, le = e % a.epr;
      st_release(reinterpret_cast<u64*>(a.peer_sig[par * a.R + d]) + le * a.R + a.me, tagged(epoch, 0));
    }
  }
  const int grp = tid >> 3, sub = tid & 7, groups_per_pass = blockDim.x >> 3;
  for (int t = blockIdx.x; t < a.T; t += gridDim.x) {
    if (tid < a.k) {
      const long long e = a.topk_idx[(long long)t * a.k + tid];
      tok_e[tid] = e < a.E ? e : -1;
      tok_slot[tid] = 0;
    }
    __syncthreads();
    for (int i = tid; i < t * a.k; i += blockDim.x) {
      const long long e = a.topk_idx[i];
      if (e < 0 || e >= a.E) continue;
      for (int j = 0; j < a.k; ++j)
        if (tok_e[j] == e) atomicAdd(&tok_slot[j], 1);
    }
    __syncthreads();
    const __nv_bfloat16* xs = a.x + (long long)t * H;
    for (int g0 = 0; g0 < G; g0 += groups_per_pass) {
      const int g = g0 + grp;
      const bool act = g < G;  // every lane takes part in the shuffles below
      int4 raw[2] = {make_int4(0, 0, 0, 0), make_int4(0, 0, 0, 0)};
      if (act) {
        const int4* src = reinterpret_cast<const int4*>(xs + g * 128 + sub * 16);
        raw[0] = src[0];
        raw[1] = src[1];
      }
      if (a.use_fp8) {
        float f[16];
        const unsigned* u = reinterpret_cast<const unsigned*>(raw);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const float2 v = tilehal::bf16x2_to_float2(u[q]);
          f[2 * q] = v.x;
          f[2 * q + 1] = v.y;
        }
        float amax = 0.f;
#pragma unroll
        for (int q = 0; q < 16; ++q) amax = fmaxf(amax, fabsf(f[q]));
        amax = tilehal::warp_max<float, 8>(amax);
        const float sc = fmaxf(amax, 1e-4f) / 448.f, inv = 1.f / sc;
        int4 packed;
        packed.x = int(fp8x4(f[0] * inv, f[1] * inv, f[2] * inv, f[3] * inv));
        packed.y = int(fp8x4(f[4] * inv, f[5] * inv, f[6] * inv, f[7] * inv));
        packed.z = int(fp8x4(f[8] * inv, f[9] * inv, f[10] * inv, f[11] * inv));
        packed.w = int(fp8x4(f[12] * inv, f[13] * inv, f[14] * inv, f[15] * inv));
        if (act)
          for (int j = 0; j < a.k; ++j) {
            const long long e = tok_e[j];
            if (e < 0) continue;
            const int d = int(e / a.epr), le = int(e % a.epr);
            char* row = reinterpret_cast<char*>(a.peer_data[par * a.R + d]) +
                        ((long long)(le * a.R + a.me) * a.M + tok_slot[j]) * a.row_bytes;
            *reinterpret_cast<int4*>(row + g * 128 + sub * 16) = packed;
            if (sub == 0) reinterpret_cast<float*>(row + H)[g] = sc;
          }
      } else if (act) {
        for (int j = 0; j < a.k; ++j) {
          const long long e = tok_e[j];
          if (e < 0) continue;
          const int d = int(e / a.epr), le = int(e % a.epr);
          char* row = reinterpret_cast<char*>(a.peer_data[par * a.R + d]) +
                      ((long long)(le * a.R + a.me) * a.M + tok_slot[j]) * a.row_bytes;
          int4* dst = reinterpret_cast<int4*>(row + (g * 128 + sub * 16) * 2);
          dst[0] = raw[0];
          dst[1] = raw[1];
        }
      }
    }
    if (tid < a.k) {
      const long long e = tok_e[tid];
      a.pair_slot[(long long)t * a.k + tid] = e >= 0 ? tok_slot[tid] : -1;
      if (e >= 0) {
        const int d = int(e / a.epr), le = int(e % a.epr);
        char* row = reinterpret_cast<char*>(a.peer_data[par * a.R + d]) +
                    ((long long)(le * a.R + a.me) * a.M + tok_slot[tid]) * a.row_bytes;
        *reinterpret_cast<int*>(row + payload) = t;
      }
    }
    __syncthreads();  // every row of token t is written
    if (tid < a.k) {
      const long long e = tok_e[tid];
      if (e >= 0) {
        __threadfence_system();
        const int old = atomicAdd(a.expert_sent + e, 1);
        if (old + 1 == cnt[e]) {  // the last row of expert e from this rank: raise its flag
          __threadfence_system();
          const int d = int(e / a.epr), le = int(e % a.epr);
          st_release(reinterpret_cast<u64*>(a.peer_sig[par * a.R + d]) + le * a.R + a.me, tagged(epoch, cnt[e]));
        }
      }
    }
    __syncthreads();
  }
  // Receive: one local expert per block, rows packed by source rank then slot.
  const u64* sig = reinterpret_cast<const u64*>(a.peer_sig[par * a.R + a.me]);
  const char* mine = reinterpret_cast<const char*>(a.peer_data[par * a.R + a.me]);
  for (int le = blockIdx.x; le < a.epr; le += gridDim.x) {
    if (tid < a.R) {
      u32 n = 0;
      if (!wait_flag(sig + le * a.R + tid, epoch, deadline, a.err, kLLDispatch, tid, &n)) abort_flag = 1;
      n_from[tid] = int(n);
    }
    __syncthreads();
    if (abort_flag) break;
    if (tid == 0) {
      base_from[0] = 0;
      for (int s = 0; s < a.R; ++s) base_from[s + 1] = base_from[s] + n_from[s];
      a.recv_count[le] = base_from[a.R];
    }
    if (tid < a.R) a.ll_counts[le * a.R + tid] = n_from[tid];
    __syncthreads();
    for (int s = 0; s < a.R; ++s) {
      const int n = n_from[s];
      if (n == 0) continue;
      const long long slot0 = (long long)le * a.R * a.M + base_from[s];
      const char* rows = mine + (long long)(le * a.R + s) * a.M * a.row_bytes;
      const int x16 = a.use_fp8 ? H / 16 : H / 8;
      // rows are row_bytes apart in the buffer but H (fp8) or 2H bytes apart in recv_x
      block_copy_rows16(reinterpret_cast<int4*>(a.recv_x) + slot0 * x16, x16, reinterpret_cast<const int4*>(rows),
                        a.row_bytes / 16, n, x16);
      for (int i = tid; i < n * (a.use_fp8 ? G : 0); i += blockDim.x) {
        const int q = i / G, g = i % G;
        a.recv_scales[(slot0 + q) * G + g] =
            __ldcg(reinterpret_cast<const float*>(rows + (long long)q * a.row_bytes + H) + g);
      }
      for (int q = tid; q < n; q += blockDim.x)
        a.recv_src[slot0 + q] = __ldcg(reinterpret_cast<const int*>(rows + (long long)q * a.row_bytes + payload));
    }
    __syncthreads();
  }
  ll_finish(a, epoch, a.expert_sent, a.E);
}

// LL combine. Blocks first send, one local expert each: the rows of source s (packed at
// base_s in y) go back to slot (expert, q) of s's buffer, then the (expert) flag at s carries
// the count. Then blocks receive, one token each: wait for the flags of the token's experts
// and take sum_j w[t, j] * y(expert j, slot j) in fp32, all k rows' loads in flight at once.
extern "C" __global__ void __launch_bounds__(512) deepep_ll_combine(LLArgs a) {
  __shared__ int n_from[DEEPEP_MAX_RANKS], base_from[DEEPEP_MAX_RANKS + 1];
  __shared__ long long tok_e[32];
  __shared__ int tok_slot[32];
  __shared__ float tok_w[32];
  __shared__ int abort_flag;
  const u32 epoch = ll_epoch(a);
  const int par = epoch & 1;
  const u64 deadline = now_ns() + a.timeout_ns;
  const int tid = threadIdx.x;
  const int H = a.H, h16 = H / 8;
  if (tid == 0) abort_flag = 0;
  __syncthreads();
  for (int le = blockIdx.x; le < a.epr; le += gridDim.x) {
    if (tid < a.R) n_from[tid] = a.ll_counts[le * a.R + tid];
    __syncthreads();
    if (tid == 0) {
      base_from[0] = 0;
      for (int s = 0; s < a.R; ++s) base_from[s + 1] = base_from[s] + n_from[s];
    }
    __syncthreads();
    const int e = a.me * a.epr + le;
    for (int s = 0; s < a.R; ++s) {
      char* region = reinterpret_cast<char*>(a.peer_data[par * a.R + s]) + (long long)e * a.M * a.row_bytes;
      const int4* src = reinterpret_cast<const int4*>(a.y + ((long long)le * a.R * a.M + base_from[s]) * H);
      // y rows are contiguous (2H bytes) and so are the region's (row_bytes == 2H): one flat copy
      block_copy16(reinterpret_cast<int4*>(region), src, n_from[s] * h16);
    }
    __syncthreads();
    if (tid < a.R) {
      __threadfence_system();
      st_release(reinterpret_cast<u64*>(a.peer_sig[par * a.R + tid]) + e, tagged(epoch, n_from[tid]));
    }
    __syncthreads();
  }
  const u64* sig = reinterpret_cast<const u64*>(a.peer_sig[par * a.R + a.me]);
  const char* mine = reinterpret_cast<const char*>(a.peer_data[par * a.R + a.me]);
  for (int t = blockIdx.x; t < a.T; t += gridDim.x) {
    if (tid < a.k) {
      const long long e = a.topk_idx[(long long)t * a.k + tid] < a.E ? a.topk_idx[(long long)t * a.k + tid] : -1;
      tok_e[tid] = e;
      tok_slot[tid] = a.pair_slot[(long long)t * a.k + tid];
      tok_w[tid] = a.topk_w[(long long)t * a.k + tid];
      if (e >= 0 && !wait_flag(sig + e, epoch, deadline, a.err, kLLCombine, int(e / a.epr), nullptr)) abort_flag = 1;
    }
    __syncthreads();
    if (abort_flag) break;
    for (int i = tid; i < h16; i += blockDim.x) {
      float acc[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = 0.f;
      for (int j0 = 0; j0 < a.k; j0 += 8) {
        int4 v[8];
        float w[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int j = j0 + u;
          w[u] = 0.f;
          v[u] = make_int4(0, 0, 0, 0);
          if (j < a.k && tok_e[j] >= 0) {
            w[u] = tok_w[j];
            v[u] = __ldcg(reinterpret_cast<const int4*>(mine + (tok_e[j] * a.M + tok_slot[j]) * a.row_bytes) + i);
          }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const unsigned* p = reinterpret_cast<const unsigned*>(&v[u]);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float2 f = tilehal::bf16x2_to_float2(p[q]);
            acc[2 * q] += w[u] * f.x;
            acc[2 * q + 1] += w[u] * f.y;
          }
        }
      }
      reinterpret_cast<int4*>(a.out + (long long)t * H)[i] = pack_vec<__nv_bfloat16>(acc);
    }
    __syncthreads();
  }
  ll_finish(a, epoch, nullptr, 0);
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
