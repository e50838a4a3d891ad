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
  __shared__ int chunk_rows[DEEPEP_MAX_RANKS];
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
      st_release(reinterpret_cast<u64*>(a.peer_sig[tid]) + a.me, tagged(a.epoch, 0));
    }
  }
  if (tid < a.R) chunk_rows[tid] = 0;
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
        }
      }
    }
    __syncthreads();
    if (tid < a.R) {
      __threadfence_system();
      u64* flags = reinterpret_cast<u64*>(a.peer_sig[tid]) + a.sig_chunks + (long long)a.me * a.max_chunks;
      st_release(flags + c, tagged(a.epoch, chunk_rows[tid]));
      chunk_rows[tid] = 0;
    }
    __syncthreads();
  }
}

__device__ void dispatch_recv(const DispatchArgs& a, u64 deadline) {
  __shared__ int rows_from[DEEPEP_MAX_RANKS], base[DEEPEP_MAX_RANKS + 1];
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
    if (!wait_flag(my_sig + tid, a.epoch, deadline, a.err, kDispatchCounts, tid, nullptr)) abort_flag = 1;
    else rows_from[tid] = __ldcg(counts + tid * msg);
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
  int done = 0;
  for (int c = 0; done < rows_from[s]; ++c) {
    if (tid == 0) {
      u32 n = 0;
      if (c >= a.max_chunks || !wait_flag(flags + c, a.epoch, deadline, a.err, kDispatchData, s, &n)) abort_flag = 1;
      chunk_n = n;
    }
    __syncthreads();
    if (abort_flag) return;
    const int n = int(chunk_n);
    if (c % per_src == j) {
      for (int i = warp; i < n; i += num_warps) {
        const int p = done + i, out = base[s] + p;
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
    done += n;
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
  volatile int* err;
  u64 timeout_ns;
  int T, k, H, R, me, E, epr, M, use_fp8, row_bytes, num_senders;
};

__device__ __forceinline__ u32 ll_epoch(const LLArgs& a) { return *reinterpret_cast<volatile unsigned*>(a.state) + 1; }

// The last block to finish publishes the new epoch (graph replays then keep counting on device).
__device__ __forceinline__ void ll_finish(const LLArgs& a, u32 epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned done = atomicAdd(a.state + 1, 1u);
    if (done == gridDim.x - 1) {
      a.state[1] = 0;
      __threadfence();
      *reinterpret_cast<volatile unsigned*>(a.state) = epoch;
    }
  }
}

// Cast a bf16 row to fp8 e4m3, one 128-channel group per step of the whole warp (4 channels a
// lane, coalesced 8-byte loads): scale = max(amax, 1e-4) / 448, as deepep.fp8 does; values are
// multiplied by the reciprocal (DeepEP's choice; within one rounding of torch's division).
__device__ __forceinline__ void cast_row_fp8(const __nv_bfloat16* src, __nv_fp8_e4m3* dst, float* scales, int H,
                                             int lane) {
  for (int g = 0; g < H / 128; ++g) {
    const uint2 raw = reinterpret_cast<const uint2*>(src + g * 128)[lane];
    const float2 a = tilehal::bf16x2_to_float2(raw.x), b = tilehal::bf16x2_to_float2(raw.y);
    float amax = fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y)));
    amax = tilehal::warp_max(amax);
    const float sc = fmaxf(amax, 1e-4f) / 448.f, inv = 1.f / sc;
    __nv_fp8x4_e4m3 q(make_float4(a.x * inv, a.y * inv, b.x * inv, b.y * inv));
    reinterpret_cast<__nv_fp8x4_e4m3*>(dst + g * 128)[lane] = q;
    if (lane == 0) scales[g] = sc;
  }
}

// LL dispatch: one warp per expert scans the tokens in order (slots are deterministic), writes
// each selected token into slot (expert, me, slot) of the owner's buffer, then raises the
// (expert, me) flag carrying the count. Receivers pack the sources' rows in rank order.
extern "C" __global__ void __launch_bounds__(512) deepep_ll_dispatch(LLArgs a) {
  const u32 epoch = ll_epoch(a);
  const int par = epoch & 1;
  const u64 deadline = now_ns() + a.timeout_ns;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, num_warps = blockDim.x >> 5;
  const int H = a.H, G = H / 128;
  const int payload = a.use_fp8 ? H + G * 4 : H * 2;  // src token index follows the payload
  if ((int)blockIdx.x < a.num_senders) {
    for (int e = blockIdx.x * num_warps + warp; e < a.E; e += a.num_senders * num_warps) {
      const int d = e / a.epr, le = e % a.epr;
      char* region = reinterpret_cast<char*>(a.peer_data[par * a.R + d]) +
                     ((long long)(le * a.R + a.me) * a.M) * a.row_bytes;
      int count = 0;
      for (int t0 = 0; t0 < a.T; t0 += 32) {
        const int t = t0 + lane;
        int slot_j = -1;
        if (t < a.T)
          for (int j = 0; j < a.k; ++j)
            if (a.topk_idx[(long long)t * a.k + j] == e) slot_j = j;
        unsigned hits = __ballot_sync(0xffffffffu, slot_j >= 0);
        if (slot_j >= 0) a.pair_slot[(long long)t * a.k + slot_j] = count + __popc(hits & ((1u << lane) - 1));
        while (hits) {
          const int b = __ffs(hits) - 1;
          hits &= hits - 1;
          const int tt = t0 + b;
          char* row = region + (long long)count * a.row_bytes;
          const __nv_bfloat16* xs = a.x + (long long)tt * H;
          if (a.use_fp8) {
            cast_row_fp8(xs, reinterpret_cast<__nv_fp8_e4m3*>(row), reinterpret_cast<float*>(row + H), H, lane);
          } else {
            copy_row<false>(reinterpret_cast<int4*>(row), reinterpret_cast<const int4*>(xs), H / 8, lane);
          }
          if (lane == 0) *reinterpret_cast<int*>(row + payload) = tt;
          ++count;
        }
      }
      __syncwarp();
      if (lane == 0) {
        __threadfence_system();
        st_release(reinterpret_cast<u64*>(a.peer_sig[par * a.R + d]) + le * a.R + a.me, tagged(epoch, count));
      }
    }
  } else {
    const int rb = blockIdx.x - a.num_senders, nrb = gridDim.x - a.num_senders;
    const u64* sig = reinterpret_cast<const u64*>(a.peer_sig[par * a.R + a.me]);
    const char* mine = reinterpret_cast<const char*>(a.peer_data[par * a.R + a.me]);
    for (int le = rb * num_warps + warp; le < a.epr; le += nrb * num_warps) {
      u32 n = 0;
      bool ok = true;
      if (lane < a.R) ok = wait_flag(sig + le * a.R + lane, epoch, deadline, a.err, kLLDispatch, lane, &n);
      if (__any_sync(0xffffffffu, !ok)) break;
      // exclusive prefix over sources with shuffles: rows of source s start at base
      int incl = int(n);
      for (int off = 1; off < 32; off <<= 1) {
        int v = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += v;
      }
      const int total = __shfl_sync(0xffffffffu, incl, a.R - 1);
      if (lane < a.R) a.ll_counts[le * a.R + lane] = int(n);
      if (lane == 0) a.recv_count[le] = total;
      for (int s = 0; s < a.R; ++s) {
        const int ns = __shfl_sync(0xffffffffu, int(n), s);
        const int base = __shfl_sync(0xffffffffu, incl - int(n), s);
        for (int q = 0; q < ns; ++q) {
          const char* row = mine + ((long long)(le * a.R + s) * a.M + q) * a.row_bytes;
          const long long slot = (long long)le * a.R * a.M + base + q;
          if (a.use_fp8) {
            warp_copy16(reinterpret_cast<int4*>(reinterpret_cast<char*>(a.recv_x) + slot * H),
                        reinterpret_cast<const int4*>(row), H / 16, lane);
            for (int g = lane; g < G; g += 32)
              a.recv_scales[slot * G + g] = __ldcg(reinterpret_cast<const float*>(row + H) + g);
          } else {
            warp_copy16(reinterpret_cast<int4*>(reinterpret_cast<char*>(a.recv_x) + slot * H * 2),
                        reinterpret_cast<const int4*>(row), H / 8, lane);
          }
          if (lane == 0) a.recv_src[slot] = __ldcg(reinterpret_cast<const int*>(row + payload));
        }
      }
    }
  }
  ll_finish(a, epoch);
}

// LL combine: each expert rank returns expert outputs into slot (expert, slot) of the source's
// buffer; the source takes sum_j w[t, j] * y(expert j, slot j) in fp32.
extern "C" __global__ void __launch_bounds__(512) deepep_ll_combine(LLArgs a) {
  __shared__ int abort_flag;
  const u32 epoch = ll_epoch(a);
  const int par = epoch & 1;
  const u64 deadline = now_ns() + a.timeout_ns;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, num_warps = blockDim.x >> 5;
  const int H = a.H, h16 = H / 8;
  if ((int)blockIdx.x < a.num_senders) {
    // one warp per (local expert, source) pair
    for (int p = blockIdx.x * num_warps + warp; p < a.epr * a.R; p += a.num_senders * num_warps) {
      const int le = p / a.R, s = p % a.R;
      int base = 0;
      for (int q = 0; q < s; ++q) base += a.ll_counts[le * a.R + q];
      const int n = a.ll_counts[le * a.R + s];
      const int e = a.me * a.epr + le;
      char* region = reinterpret_cast<char*>(a.peer_data[par * a.R + s]) + (long long)e * a.M * a.row_bytes;
      for (int q = 0; q < n; ++q) {
        copy_row<false>(reinterpret_cast<int4*>(region + (long long)q * a.row_bytes),
                        reinterpret_cast<const int4*>(a.y + ((long long)le * a.R * a.M + base + q) * H), h16, lane);
      }
      __syncwarp();
      if (lane == 0) {
        __threadfence_system();
        st_release(reinterpret_cast<u64*>(a.peer_sig[par * a.R + s]) + e, tagged(epoch, n));
      }
    }
  } else {
    const u64* sig = reinterpret_cast<const u64*>(a.peer_sig[par * a.R + a.me]);
    const char* mine = reinterpret_cast<const char*>(a.peer_data[par * a.R + a.me]);
    if (tid == 0) abort_flag = 0;
    __syncthreads();
    for (int e = tid; e < a.E; e += blockDim.x)
      if (!wait_flag(sig + e, epoch, deadline, a.err, kLLCombine, e / a.epr, nullptr)) abort_flag = 1;
    __syncthreads();
    if (!abort_flag) {
      const int rb = blockIdx.x - a.num_senders, nrb = gridDim.x - a.num_senders;
      for (int t = rb * num_warps + warp; t < a.T; t += nrb * num_warps) {
        for (int i = lane; i < h16; i += 32) {
          float acc[8];
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[q] = 0.f;
          for (int j = 0; j < a.k; ++j) {
            const long long e = a.topk_idx[(long long)t * a.k + j];
            if (e < 0) continue;
            const int slot = a.pair_slot[(long long)t * a.k + j];
            const float w = a.topk_w[(long long)t * a.k + j];
            int4 v = __ldcg(reinterpret_cast<const int4*>(mine + (e * a.M + slot) * a.row_bytes) + i);
            const unsigned* u = reinterpret_cast<const unsigned*>(&v);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              float2 f = tilehal::bf16x2_to_float2(u[q]);
              acc[2 * q] += w * f.x;
              acc[2 * q + 1] += w * f.y;
            }
          }
          reinterpret_cast<int4*>(a.out + (long long)t * H)[i] = pack_vec<__nv_bfloat16>(acc);
        }
      }
    }
  }
  ll_finish(a, epoch);
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
