// Low-latency dispatch/combine over NVLink (fixed buffers, one kernel per call, CUDA-graph safe).
//
// Bytes decide the time here, so each token crosses the link once per destination rank, not
// once per (token, expert) pair as in DeepEP's RDMA low-latency kernels:
// - dispatch: the source casts a token to fp8 once and writes one row (payload, scales, its
//   top-k ids and per-expert slots) to each rank that owns one of its experts; the receiver
//   fans the row out to its local experts' packed rows.
// - combine: the owner of the experts first reduces a token's local expert outputs with the
//   top-k weights (sent ahead by the source, 4 bytes per pair) and returns one bf16 row per
//   (token, rank); the source adds those partial sums to its own.
// With top-8 of 256 experts that is ~4x fewer bytes over the link each way on 2 ranks (a token
// meets ~4 experts on the peer), ~1.5x on 8 ranks.
//
// Every call owns one of two parities of each region (chosen by the epoch kept on the device,
// so graph replays alternate too); flags carry the epoch and are never reset.
//
// Rank masking (DeepEP's shrink mode): `mask` [R] (device int32, 1 = masked) is read when a call
// starts. A masked rank is sent nothing and waited for by nobody: its tokens are not received
// and its experts' outputs count as zeros in the combine. With `shrink` set, a wait on a peer that
// passes its deadline masks that peer (atomicExch, as DeepEP's kernels do) and the call finishes
// for the live ranks; without it the kernel records (stage, peer) and stops, and the host raises.
// `call_mask` [R] (zeroed per dispatch) records the ranks a dispatch left out; its combine leaves
// them out too (it sent them nothing, so they have nothing to return).
#include "sync.cuh"

namespace deepep {

struct LLArgs {
  const __nv_bfloat16* x;     // dispatch: [T, H]
  const long long* topk_idx;  // [T, k]
  const float* topk_w;        // combine: [T, k]
  const __nv_bfloat16* y;     // combine: [E_l, R * M, H] expert outputs
  int* tok_rows;              // [R, M, k]: row (le * R * M + i) of recv_x that got (source, token, j), or -1
  int* src_tokens;            // [R]: tokens each source had in the dispatch
  void* recv_x;               // [E_l, R * M, H] fp8 or bf16
  float* recv_scales;         // [E_l, R * M, H / 128] column-major: (e, row, g) at (e * G + g) * scale_pad + row
  int* recv_src;              // [E_l, R * M]: source token of each row
  int* recv_count;            // [E_l]
  __nv_bfloat16* out;         // combine: [T, H]
  const u64* peer_data;       // [2 * R] both parities
  const u64* peer_sig;        // [2 * R]
  unsigned* state;            // [0] epoch, [1] blocks done
  volatile int* err;
  int* mask;                  // [R] or null: 1 = masked (see the top of this file)
  int* call_mask;             // [R]: the ranks the dispatch left out (dispatch writes, combine reads)
  u64 timeout_ns;
  int T, k, H, R, me, E, epr, M, use_fp8;
  int phases;                 // kSend | kReceive: both in one launch, or one each (return_recv_hook)
  int row_bytes;              // dispatch: bytes of one staged row; combine: bytes of one partial row (2H)
  int payload_bytes;          // dispatch: fp8 + scales or bf16 bytes, then ids[k], slots[k] (int32)
  int sig_tokens;             // u64 offset of the per-token flags [R][M]
  int sig_msg;                // u64 offset of the counts messages (dispatch, int32 [R][epr])
  int scale_pad;              // dispatch fp8: R * M rounded up to 4 (a TMA-aligned column of scales)
  int shrink;                 // 1: a peer past its deadline is masked and the call goes on
  long long data_rows;        // combine: byte offset of the partial rows (after the weights [R][M][k])
};

enum Phase { kSend = 1, kReceive = 2 };

// A call's epoch is the device counter + 1 in both of its launches: only the receive launch's
// last block bumps it (ll_finish), so a send-only launch leaves it for its receive launch.
__device__ __forceinline__ u32 ll_epoch(const LLArgs& a) { return *reinterpret_cast<volatile unsigned*>(a.state) + 1; }
__device__ __forceinline__ u64* sig_of(const LLArgs& a, int par, int rank) {
  return reinterpret_cast<u64*>(a.peer_sig[par * a.R + rank]);
}
__device__ __forceinline__ char* data_of(const LLArgs& a, int par, int rank) {
  return reinterpret_cast<char*>(a.peer_data[par * a.R + rank]);
}

__device__ __forceinline__ bool ll_masked(const LLArgs& a, int r) {
  return a.mask != nullptr && *reinterpret_cast<volatile int*>(a.mask + r) != 0;
}
// A peer missed its deadline: with shrink, mask it (and note it for this call's combine); true
// means the call goes on without it, false that the kernel must stop (error recorded by wait_flag).
__device__ __forceinline__ bool ll_drop_peer(const LLArgs& a, int r) {
  if (!a.shrink || a.mask == nullptr) return false;
  atomicExch(a.mask + r, 1);
  a.call_mask[r] = 1;
  a.err[0] = 0;  // wait_flag recorded the timeout; in shrink mode it is a mask, not an error
  __threadfence_system();
  return true;
}
// Send-side view of the mask: masked now, or left out by the dispatch this combine answers.
__device__ __forceinline__ bool ll_skip(const LLArgs& a, int r) { return ll_masked(a, r) || a.call_mask[r] != 0; }

// The last block to finish publishes the new epoch (graph replays then keep counting on device).
__device__ __forceinline__ void ll_finish(const LLArgs& a, u32 epoch) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(a.state + 1, 1u) == gridDim.x - 1;
    if (last) {
      a.state[1] = 0;
      __threadfence();
      *reinterpret_cast<volatile unsigned*>(a.state) = epoch;
    }
  }
}

__device__ __forceinline__ unsigned fp8x4(float a, float b, float c, float d) {
  __nv_fp8x4_e4m3 q(make_float4(a, b, c, d));
  return *reinterpret_cast<const unsigned*>(&q);
}

// Which (source, token) the i-th receive item is; sources' tokens back to back.
__device__ __forceinline__ bool item_of(int i, const int* src_T, int R, int* s, int* t) {
  for (int q = 0; q < R; ++q) {
    if (i < src_T[q]) {
      *s = q;
      *t = i;
      return true;
    }
    i -= src_T[q];
  }
  return false;
}

// Block 0 counts this rank's pairs per expert and sends every rank its experts' counts (the
// receivers place rows with them), then the token flags' expected number (T) with the flag.
__device__ void ll_send_counts(const LLArgs& a, u32 epoch, int par, int* cnt) {
  const int tid = threadIdx.x;
  for (int e = tid; e < a.E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int i = tid; i < a.T * a.k; i += blockDim.x) {
    const long long e = a.topk_idx[i];
    if (e >= 0 && e < a.E) {
      atomicAdd(&cnt[e], 1);
    } else if (e != -1) {  // bad id: skipped, reported to the host
      a.err[3] = int(e);
      a.err[2] = 1;
    }
  }
  __syncthreads();
  for (int e = tid; e < a.E; e += blockDim.x) {
    const int d = e / a.epr;
    if (ll_masked(a, d)) continue;
    int* msg = reinterpret_cast<int*>(sig_of(a, par, d) + a.sig_msg);
    msg[a.me * a.epr + e % a.epr] = cnt[e];
  }
  __syncthreads();
  if (tid < a.R && !ll_masked(a, tid)) {
    __threadfence_system();
    st_release(sig_of(a, par, tid) + a.me, tagged(epoch, u32(a.T)));
  }
}

// Send token t: one row to each rank owning one of its experts, then a flag to every rank
// (payload 1 = a row came, 0 = none) so receivers know each of our tokens' fate.
__device__ void ll_send_token(const LLArgs& a, u32 epoch, int par, int t, long long* tok_e, int* tok_slot) {
  const int tid = threadIdx.x;
  const int H = a.H, G = H / 128;
  if (tid < a.k) {
    const long long e = a.topk_idx[(long long)t * a.k + tid];
    tok_e[tid] = (e >= 0 && e < a.E) ? e : -1;
    tok_slot[tid] = 0;
  }
  __syncthreads();
  // Slot of (t, j) among expert e's rows from this rank: the pairs routed to e before it.
  for (int i = tid; i < t * a.k; i += blockDim.x) {
    const long long e = a.topk_idx[i];
    if (e < 0 || e >= a.E) continue;
    for (int j = 0; j < a.k; ++j)
      if (tok_e[j] == e) atomicAdd(&tok_slot[j], 1);
  }
  __syncthreads();
  unsigned mask = 0;  // destination ranks, the same in every thread (masked ranks get nothing)
  for (int j = 0; j < a.k; ++j)
    if (tok_e[j] >= 0 && !ll_masked(a, int(tok_e[j] / a.epr))) mask |= 1u << int(tok_e[j] / a.epr);
  if (tid < a.k && tok_e[tid] >= 0)  // a token listing an expert twice gets two rows
    for (int j = 0; j < tid; ++j)
      if (tok_e[j] == tok_e[tid]) ++tok_slot[tid];
  __syncthreads();
  const long long row_off = ((long long)a.me * a.M + t) * a.row_bytes;
  const int grp = tid >> 3, sub = tid & 7, groups_per_pass = blockDim.x >> 3;
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
        for (int d = 0; d < a.R; ++d) {
          if (!((mask >> d) & 1u)) continue;
          char* row = data_of(a, par, d) + row_off;
          *reinterpret_cast<int4*>(row + g * 128 + sub * 16) = packed;
          if (sub == 0) reinterpret_cast<float*>(row + H)[g] = sc;
        }
    } else if (act) {
      for (int d = 0; d < a.R; ++d) {
        if (!((mask >> d) & 1u)) continue;
        int4* dst = reinterpret_cast<int4*>(data_of(a, par, d) + row_off + (g * 128 + sub * 16) * 2);
        dst[0] = raw[0];
        dst[1] = raw[1];
      }
    }
  }
  if (tid < a.k)
    for (int d = 0; d < a.R; ++d) {
      if (!((mask >> d) & 1u)) continue;
      int* meta = reinterpret_cast<int*>(data_of(a, par, d) + row_off + a.payload_bytes);
      meta[tid] = int(tok_e[tid]);
      meta[a.k + tid] = tok_slot[tid];
    }
  __syncthreads();  // every row of token t is written
  if (tid < a.R && !ll_masked(a, tid)) {
    __threadfence_system();
    st_release(sig_of(a, par, tid) + a.sig_tokens + a.me * a.M + t, tagged(epoch, (mask >> tid) & 1u));
  }
  __syncthreads();  // tok_e / tok_slot are reused by the next token
}

// Blocks send tokens (block 0 sends the counts first, so it takes no tokens when others can),
// then become receivers: every block learns all sources' counts, derives where each source's
// rows start in each local expert, and takes (source, token) items: wait for the token's flag,
// copy its staged row into the packed rows of its local experts, note them for the combine.
// Sending never waits, so blocks need not be co-resident.
extern "C" __global__ void __launch_bounds__(512) deepep_ll_dispatch(LLArgs a) {
  extern __shared__ int smem[];  // block 0: [E] pair counts; then [epr][R + 1] row bases per source
  __shared__ long long tok_e[32];
  __shared__ int tok_slot[32], dst_row[32], src_T[DEEPEP_MAX_RANKS];
  __shared__ int abort_flag, item_sent;
  const u32 epoch = ll_epoch(a);
  const int par = epoch & 1;
  const u64 deadline = now_ns() + a.timeout_ns;
  const int tid = threadIdx.x;
  const int G = a.H / 128;
  if (tid == 0) abort_flag = 0;
  if (a.phases & kSend) {
    if (blockIdx.x == 0) ll_send_counts(a, epoch, par, smem);
    const int senders = gridDim.x > 1 ? gridDim.x - 1 : 1, first = gridDim.x > 1 ? 1 : 0;
    if ((int)blockIdx.x >= first)
      for (int t = blockIdx.x - first; t < a.T; t += senders) ll_send_token(a, epoch, par, t, tok_e, tok_slot);
  }
  __syncthreads();
  if (!(a.phases & kReceive)) return;

  // Counts of every source, then base[le][s] = rows of expert le from sources before s.
  const u64* sig = sig_of(a, par, a.me);
  if (tid < a.R) {
    u32 n = 0;
    if (ll_masked(a, tid)) {  // a masked source: nothing from it (its flag is not waited for)
      a.call_mask[tid] = 1;
    } else if (!wait_flag(sig + tid, epoch, deadline, a.err, kLLDispatchCounts, tid, &n)) {
      n = 0;
      if (!ll_drop_peer(a, tid)) abort_flag = 1;
    }
    src_T[tid] = int(n);
  }
  __syncthreads();
  if (abort_flag) {
    ll_finish(a, epoch);
    return;
  }
  const int* msg = reinterpret_cast<const int*>(sig + a.sig_msg);
  int* base = smem;
  for (int le = tid; le < a.epr; le += blockDim.x) {
    int run = 0;
    for (int s = 0; s < a.R; ++s) {
      base[le * (a.R + 1) + s] = run;
      if (src_T[s] > 0) run += __ldcg(msg + s * a.epr + le);  // a left-out source's message is stale
    }
    base[le * (a.R + 1) + a.R] = run;
  }
  // Entries of tok_rows no item writes (tokens a source did not have, left-out sources) read as
  // "no row" in the handle's layout.
  for (long long q = (long long)blockIdx.x * blockDim.x + tid; q < (long long)a.R * a.M * a.k;
       q += (long long)gridDim.x * blockDim.x) {
    const int s = int(q / ((long long)a.M * a.k)), t = int(q / a.k % a.M);
    if (t >= src_T[s]) a.tok_rows[q] = -1;
  }
  __syncthreads();
  for (int le = blockIdx.x * blockDim.x + tid; le < a.epr; le += gridDim.x * blockDim.x)
    a.recv_count[le] = base[le * (a.R + 1) + a.R];
  if (blockIdx.x == 0 && tid < a.R) a.src_tokens[tid] = src_T[tid];

  const char* staged = data_of(a, par, a.me);
  const int lo = a.me * a.epr, x16 = a.use_fp8 ? a.H / 16 : a.H / 8;  // 16-byte words of one row
  int total = 0;
  for (int s = 0; s < a.R; ++s) total += src_T[s];
  for (int i = blockIdx.x; i < total; i += gridDim.x) {
    int s = 0, t = 0;
    item_of(i, src_T, a.R, &s, &t);
    if (tid == 0) {
      u32 v = 0;
      if (t >= a.M) {
        abort_flag = 1;
      } else if (!wait_flag(sig + a.sig_tokens + s * a.M + t, epoch, deadline, a.err, kLLDispatch, s, &v)) {
        // The source sent its counts, then stopped: with shrink this token is dropped (its rows stay
        // counted but unwritten in this call) and the source masked for the next calls.
        v = 0;
        if (!ll_drop_peer(a, s)) abort_flag = 1;
      }
      item_sent = int(v);
    }
    __syncthreads();
    if (abort_flag) break;
    const char* row = staged + ((long long)s * a.M + t) * a.row_bytes;
    int* rows_out = a.tok_rows + ((long long)s * a.M + t) * a.k;
    if (tid < a.k) {
      int r = -1;
      if (item_sent) {
        const int* meta = reinterpret_cast<const int*>(row + a.payload_bytes);
        const int e = __ldcg(meta + tid), slot = __ldcg(meta + a.k + tid);
        if (e >= lo && e < lo + a.epr) {
          const int le = e - lo;
          r = le * a.R * a.M + base[le * (a.R + 1) + s] + slot;
          a.recv_src[r] = t;
        }
      }
      rows_out[tid] = r;
      dst_row[tid] = r;
    }
    __syncthreads();
    if (item_sent) {
      const int4* src = reinterpret_cast<const int4*>(row);
      int4* dst = reinterpret_cast<int4*>(a.recv_x);
      for (int w = tid; w < x16; w += blockDim.x) {
        const int4 v = __ldcg(src + w);
        for (int j = 0; j < a.k; ++j)
          if (dst_row[j] >= 0) dst[(long long)dst_row[j] * x16 + w] = v;
      }
      if (a.use_fp8) {
        const int cap = a.R * a.M;
        for (int g = tid; g < G; g += blockDim.x) {
          const float sc = __ldcg(reinterpret_cast<const float*>(row + a.H) + g);
          for (int j = 0; j < a.k; ++j)
            if (dst_row[j] >= 0) {
              const int le = dst_row[j] / cap, i = dst_row[j] - le * cap;
              a.recv_scales[((long long)le * G + g) * a.scale_pad + i] = sc;
            }
        }
      }
    }
    __syncthreads();  // dst_row / item_sent are reused by the next item
  }
  ll_finish(a, epoch);
}

// Weighted sum of a token's rows in y (fp32), 8 bf16 per 16-byte word; rows[j] < 0 are skipped.
__device__ __forceinline__ void weighted_rows(float* acc, const __nv_bfloat16* y, const int* rows, const float* w, int k,
                                              int h16, int word) {
  for (int j0 = 0; j0 < k; j0 += 8) {
    int4 v[8];
    float wj[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int j = j0 + u;
      wj[u] = 0.f;
      v[u] = make_int4(0, 0, 0, 0);
      if (j < k && rows[j] >= 0) {
        wj[u] = w[j];
        v[u] = __ldg(reinterpret_cast<const int4*>(y) + (long long)rows[j] * h16 + word);
      }
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const unsigned* p = reinterpret_cast<const unsigned*>(&v[u]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = tilehal::bf16x2_to_float2(p[q]);
        acc[2 * q] += wj[u] * f.x;
        acc[2 * q + 1] += wj[u] * f.y;
      }
    }
  }
}

// Combine. Block 0 first sends this rank's top-k weights to every peer. Then items, in order:
// (1) for each peer s and each of its tokens that came here, the weighted sum of this rank's
// expert outputs for it, written as one bf16 row into s's region, with a flag; (2) for each
// own token, wait for the partial rows of the ranks that own its other experts and add them to
// the local part. Items of kind (1) never wait on kind (2), so the order cannot deadlock.
extern "C" __global__ void __launch_bounds__(512) deepep_ll_combine(LLArgs a) {
  __shared__ int rows[32], src_T[DEEPEP_MAX_RANKS];
  __shared__ float wts[32];
  __shared__ unsigned need;
  __shared__ int abort_flag, have_w, dead_w;
  const u32 epoch = ll_epoch(a);
  const int par = epoch & 1;
  const u64 deadline = now_ns() + a.timeout_ns;
  const int tid = threadIdx.x, h16 = a.H / 8;
  if (tid == 0) {
    abort_flag = 0;
    have_w = 0;
    dead_w = 0;
  }
  // Masked peers (now, or left out by the dispatch) neither get our weights nor partial sums.
  if (tid < a.R) src_T[tid] = (tid == a.me || ll_skip(a, tid)) ? 0 : a.src_tokens[tid];
  if ((a.phases & kSend) && blockIdx.x == 0 && a.R > 1) {
    for (int d = 0; d < a.R; ++d) {
      if (d == a.me || ll_skip(a, d)) continue;
      float* dst = reinterpret_cast<float*>(data_of(a, par, d)) + (long long)a.me * a.M * a.k;
      for (int i = tid; i < a.T * a.k; i += blockDim.x) dst[i] = a.topk_w[i];
    }
    __syncthreads();
    if (tid < a.R && tid != a.me && !ll_skip(a, tid)) {
      __threadfence_system();
      st_release(sig_of(a, par, tid) + a.me, tagged(epoch, u32(a.T)));
    }
  }
  __syncthreads();
  const u64* sig = sig_of(a, par, a.me);
  const char* mine = data_of(a, par, a.me);
  int remote = 0;
  for (int s = 0; s < a.R; ++s) remote += src_T[s];
  const int lo = a.me * a.epr;
  // The send phase is the peers' partial sums, the receive phase our own tokens.
  const int first_item = (a.phases & kSend) ? 0 : remote, end_item = (a.phases & kReceive) ? remote + a.T : remote;
  for (int i = first_item + blockIdx.x; i < end_item; i += gridDim.x) {
    if (i < remote) {  // (1) partial sum for a peer's token
      int s = 0, t = 0;
      item_of(i, src_T, a.R, &s, &t);
      if (tid == 0 && !(((have_w | dead_w) >> s) & 1)) {
        if (wait_flag(sig + s, epoch, deadline, a.err, kLLCombineWeights, s, nullptr)) have_w |= 1 << s;
        else if (ll_drop_peer(a, s)) dead_w |= 1 << s;  // it stopped: no partial sums for it
        else abort_flag = 1;
      }
      if (tid < a.k) {
        rows[tid] = a.tok_rows[((long long)s * a.M + t) * a.k + tid];
      }
      __syncthreads();
      if (abort_flag) break;
      if ((dead_w >> s) & 1) {
        __syncthreads();
        continue;
      }
      if (tid < a.k)
        wts[tid] = rows[tid] >= 0 ? __ldcg(reinterpret_cast<const float*>(mine) + ((long long)s * a.M + t) * a.k + tid)
                                  : 0.f;
      __syncthreads();
      bool any = false;
      for (int j = 0; j < a.k; ++j) any |= rows[j] >= 0;
      if (any) {  // the source waits for this row exactly when one of the token's experts is ours
        int4* dst = reinterpret_cast<int4*>(data_of(a, par, s) + a.data_rows + ((long long)a.me * a.M + t) * a.row_bytes);
        for (int w = tid; w < h16; w += blockDim.x) {
          float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
          weighted_rows(acc, a.y, rows, wts, a.k, h16, w);
          dst[w] = pack_vec<__nv_bfloat16>(acc);
        }
        __syncthreads();
        if (tid == 0) {
          __threadfence_system();
          st_release(sig_of(a, par, s) + a.sig_tokens + a.me * a.M + t, tagged(epoch, 1));
        }
      }
    } else {  // (2) an own token: local experts here, the other ranks' partial rows from the region
      const int t = i - remote;
      if (tid == 0) need = 0;
      __syncthreads();
      if (tid < a.k) {
        const long long e = a.topk_idx[(long long)t * a.k + tid];
        const bool ok = e >= 0 && e < a.E;
        const bool local = ok && e >= lo && e < lo + a.epr;
        rows[tid] = local ? a.tok_rows[((long long)a.me * a.M + t) * a.k + tid] : -1;
        wts[tid] = local ? a.topk_w[(long long)t * a.k + tid] : 0.f;
        // Experts of a left-out rank count as zeros: nothing is waited for from it.
        if (ok && !local && !ll_skip(a, int(e / a.epr))) atomicOr(&need, 1u << int(e / a.epr));
      }
      __syncthreads();
      if (tid < a.R && ((need >> tid) & 1u) &&
          !wait_flag(sig + a.sig_tokens + tid * a.M + t, epoch, deadline, a.err, kLLCombine, tid, nullptr)) {
        if (ll_drop_peer(a, tid)) atomicAnd(&need, ~(1u << tid));  // its partial sum counts as zero
        else abort_flag = 1;
      }
      __syncthreads();
      if (abort_flag) break;
      int4* dst = reinterpret_cast<int4*>(a.out) + (long long)t * h16;
      for (int w = tid; w < h16; w += blockDim.x) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        weighted_rows(acc, a.y, rows, wts, a.k, h16, w);
        for (int r = 0; r < a.R; ++r)
          if ((need >> r) & 1u)
            add_vec<__nv_bfloat16>(acc, __ldcg(reinterpret_cast<const int4*>(mine + a.data_rows +
                                                                             ((long long)r * a.M + t) * a.row_bytes) + w));
        dst[w] = pack_vec<__nv_bfloat16>(acc);
      }
    }
    __syncthreads();  // rows / wts / need are reused by the next item
  }
  if (a.phases & kReceive) ll_finish(a, epoch);
}

}  // namespace deepep
