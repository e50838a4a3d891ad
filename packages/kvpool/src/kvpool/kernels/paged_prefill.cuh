// Paged prefill attention (FlashAttention-2 style, mma.sync m16n8k16 tensor cores).
//
// New tokens of each sequence attend causally to the sequence's cached prefix and to each
// other; their K/V are already in the pool. q is packed by sequence ([total, Hq, D], offsets
// cu_seqlens_q); sequence b's new tokens are its last n_b positions of seq_lens[b].
//
// Grid (Hq, num_tiles), 32 * W threads. A CTA owns kBM = 16 * MR * W query rows of one
// (sequence, q head); the host lists the tiles (b, first row) longest-first so the causal
// triangle balances. Each warp owns MR blocks of 16 query rows (MR = 1: Q fragments held in
// registers; MR = 2: re-read from shared memory per k-step, and every K/V fragment loaded
// from shared memory feeds two MMAs, halving ldmatrix traffic per MMA, as FlashAttention-2
// does with 4 warps x 32 rows) and
// streams the kv head's K/V in kBN-token tiles through a two-stage cp.async pipeline in shared
// memory (XOR-swizzled 16-byte chunks: chunk ^ (row & 7), conflict-free ldmatrix). Per tile:
// S = Q K^T (ldmatrix K), online softmax in registers (exp2, scale folded in), P kept in
// registers as the A operand of O += P V (ldmatrix.trans V). Only tiles that cross the diagonal
// apply the causal mask. Requires head_dim 64 or 128 (host checks).
#pragma once
#include "paged_prefill_common.cuh"

namespace kvpool {

constexpr int kPrefillBN = 64;  // default kv tokens per pipeline stage

template <typename T, int D, int W, int BN = kPrefillBN, int ST = 2>
struct PrefillSmem {
  static constexpr int kRowBytes = D * int(sizeof(T));
  static constexpr int kQBytes = 16 * W * kRowBytes;  // W blocks of 16 query rows
  static constexpr int kKVBytes = BN * kRowBytes;  // one stage of K (or V)
  static constexpr int kBytes = kQBytes + 2 * ST * kKVBytes;  // Q, K x ST stages, V x ST stages
};

// BN: kv tokens per stage; 32 keeps the S tile of two row blocks (MR = 2) in registers at d128.
// ST: pipeline stages (tiles in flight: ST - 1 ahead of the one computed).
template <typename T, int D, int W, int MR, int BN = kPrefillBN, int ST = 2>
__global__ void __launch_bounds__(32 * W) paged_prefill_kernel(
    KVPOOL_PREFILL_PARAMS(T)) {
  using S = PrefillSmem<T, D, W * MR, BN, ST>;
  static_assert(ST >= 2, "at least two stages");
  constexpr int kPrefillBN = BN;  // shadows the namespace default below
  using Tag = typename tilehal::MmaTag<T>::type;
  constexpr int kThreads = 32 * W;
  constexpr int kRowsPerWarp = 16 * MR;
  constexpr int kPrefillBM = kRowsPerWarp * W;
  constexpr bool kQInRegs = MR == 1;          // one row block: Q fragments stay in registers
  constexpr int kChunks = D / 8;              // 16-byte chunks per row
  constexpr int kKSteps = D / 16;             // QK k-steps
  constexpr int kSTiles = kPrefillBN / 8;     // S n-tiles (8 tokens each)
  constexpr int kOTiles = D / 8;              // O n-tiles (8 channels each)
  constexpr int kKVLoads = kPrefillBN * kChunks / kThreads;
  constexpr int kQLoads = kPrefillBM * kChunks / kThreads;
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  static_assert(MR == 1 || MR == 2, "one or two 16-row blocks per warp");
  static_assert(kKVLoads * kThreads == kPrefillBN * kChunks, "tile must split evenly over threads");

  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* q_s = smem;
  unsigned char* k_s = smem + S::kQBytes;                       // ST stages
  unsigned char* v_s = smem + S::kQBytes + ST * S::kKVBytes;    // ST stages
  const unsigned q_sa = static_cast<unsigned>(__cvta_generic_to_shared(q_s));
  const unsigned k_sa = static_cast<unsigned>(__cvta_generic_to_shared(k_s));
  const unsigned v_sa = static_cast<unsigned>(__cvta_generic_to_shared(v_s));

  const PrefillTile pt = prefill_tile<kPrefillBM>(tiles, seq_lens, cu_seqlens_q, kv_heads);
  const int hq = pt.hq, Hq = gridDim.x, hkv = pt.hkv, b = pt.b, i0 = pt.i0, q0 = pt.q0, P = pt.P;
  const int rows = pt.rows, kv_end = pt.kv_end;
  if (rows <= 0) return;
  const int num_kv_tiles = (kv_end + kPrefillBN - 1) / kPrefillBN;
  const int first_masked = (P + i0) / kPrefillBN;  // tiles from here on cross the diagonal
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const long long q_row_stride = (long long)Hq * D;
  const long long kv_row_stride = (long long)kv_heads * D;
  const int* table = block_table + (long long)b * table_stride;

  // ---- Q tile -> shared (zero rows past the end)
#pragma unroll
  for (int i = 0; i < kQLoads; ++i) {
    const int c = tid + i * kThreads, r = c / kChunks, col = c % kChunks;
    const bool ok = r < rows;
    const T* src = q + (ok ? (long long)(q0 + i0 + r) * q_row_stride : 0ll) + (long long)hq * D + col * 8;
    tilehal::cp_async_16(q_s + r * S::kRowBytes + ((col ^ (r & 7)) << 4), src, ok);
  }
  tilehal::cp_async_commit();

  auto load_kv = [&](int t, int stage) {
    unsigned char* ks = k_s + stage * S::kKVBytes;
    unsigned char* vs = v_s + stage * S::kKVBytes;
#pragma unroll
    for (int i = 0; i < kKVLoads; ++i) {
      const int c = tid + i * kThreads, r = c / kChunks, col = c % kChunks;
      long long off;
      const bool ok = paged_row(table, table_stride, t * kPrefillBN + r, kv_end, block_size, kv_row_stride,
                                (long long)hkv * D + col * 8, off);
      const int soff = r * S::kRowBytes + ((col ^ (r & 7)) << 4);
      tilehal::cp_async_16(ks + soff, k_cache + off, ok);
      tilehal::cp_async_16(vs + soff, v_cache + off, ok);
    }
  };
  load_kv(0, 0);
  tilehal::cp_async_commit();
#pragma unroll
  for (int st = 1; st < ST - 1; ++st) {
    if (st < num_kv_tiles) load_kv(st, st);
    tilehal::cp_async_commit();
  }
  tilehal::cp_async_wait<ST - 1>();  // Q landed (tiles 0 .. ST - 2 may still be in flight)
  __syncthreads();

  // ---- Q fragments (A operand) of row block mr of this warp, k-step kk
  const int q_r = lane & 15, q_half = lane >> 4;
  auto load_q = [&](unsigned (&a)[4], int mr, int kk) {
    const int r = warp * kRowsPerWarp + mr * 16 + q_r;
    tilehal::ldmatrix_x4(a, q_sa + r * S::kRowBytes + (((2 * kk + q_half) ^ (r & 7)) << 4));
  };
  unsigned qa[kQInRegs ? kKSteps : 1][4];
  if constexpr (kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) load_q(qa[kk], 0, kk);
  }

  float o[MR][kOTiles][4];
#pragma unroll
  for (int mr = 0; mr < MR; ++mr)
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) o[mr][n][0] = o[mr][n][1] = o[mr][n][2] = o[mr][n][3] = 0.f;
  float m_run[MR][2], l_run[MR][2];  // rows g and g + 8 of each row block
#pragma unroll
  for (int mr = 0; mr < MR; ++mr) {
    m_run[mr][0] = m_run[mr][1] = -INFINITY;
    l_run[mr][0] = l_run[mr][1] = 0.f;
  }
  const int g = lane >> 2, t2 = (lane & 3) * 2;
  const int qpos0 = P + i0 + warp * kRowsPerWarp + g;  // position of row g of row block 0
  const int k_tok = (lane >> 4) * 8 + (lane & 7), k_half = (lane >> 3) & 1;
  const int v_tok = ((lane >> 3) & 1) * 8 + (lane & 7), v_half = lane >> 4;

  for (int t = 0; t < num_kv_tiles; ++t) {
    const int stage = ST == 2 ? (t & 1) : t % ST;
    if constexpr (ST == 2) {
      if (t + 1 < num_kv_tiles) {
        load_kv(t + 1, stage ^ 1);
        tilehal::cp_async_commit();
        tilehal::cp_async_wait<1>();
      } else {
        tilehal::cp_async_wait<0>();
      }
    } else {  // refill the stage consumed at t - 1 (the loop's last barrier), one group per step
      if (t + ST - 1 < num_kv_tiles) load_kv(t + ST - 1, (t + ST - 1) % ST);
      tilehal::cp_async_commit();
      tilehal::cp_async_wait<ST - 1>();
    }
    __syncthreads();
    const unsigned ks = k_sa + stage * S::kKVBytes;
    const unsigned vs = v_sa + stage * S::kKVBytes;

    // ---- S = Q K^T (each K fragment serves every row block)
    float s[MR][kSTiles][4];
#pragma unroll
    for (int mr = 0; mr < MR; ++mr)
#pragma unroll
      for (int n = 0; n < kSTiles; ++n) s[mr][n][0] = s[mr][n][1] = s[mr][n][2] = s[mr][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      unsigned qf[MR][4];
      if constexpr (kQInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) qf[0][e] = qa[kk][e];
      } else {
#pragma unroll
        for (int mr = 0; mr < MR; ++mr) load_q(qf[mr], mr, kk);
      }
#pragma unroll
      for (int np = 0; np < kSTiles / 2; ++np) {
        const int r = np * 16 + k_tok;
        unsigned bk[4];
        tilehal::ldmatrix_x4(bk, ks + r * S::kRowBytes + (((2 * kk + k_half) ^ (r & 7)) << 4));
#pragma unroll
        for (int mr = 0; mr < MR; ++mr) {
          tilehal::mma_m16n8k16(Tag(), s[mr][2 * np], qf[mr], {bk[0], bk[1]});
          tilehal::mma_m16n8k16(Tag(), s[mr][2 * np + 1], qf[mr], {bk[2], bk[3]});
        }
      }
    }

    // ---- online softmax (rows g and g + 8 of each row block; 4 lanes share a row); P is
    // packed to the MMA type at once (C layout == A layout), so S dies before P @ V
    const bool masked = t >= first_masked;
    unsigned pa[MR][kPrefillBN / 16][4];
#pragma unroll
    for (int mr = 0; mr < MR; ++mr) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mr][n][e] * scale_log2;
          if (masked) {
            const int j = t * kPrefillBN + n * 8 + t2 + (e & 1);
            if (j > qpos0 + mr * 16 + (e >> 1) * 8) x = -INFINITY;
          }
          s[mr][n][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      }
      float alpha[2], base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(m_run[mr][r], mx[r]);
        base[r] = m_new == -INFINITY ? 0.f : m_new;
        alpha[r] = exp2f(m_run[mr][r] - base[r]);
        m_run[mr][r] = m_new;
      }
      float rs[2] = {0.f, 0.f};
#pragma unroll
      for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = exp2f(s[mr][n][e] - base[e >> 1]);
          s[mr][n][e] = p;
          rs[e >> 1] += p;
        }
      }
#pragma unroll
      for (int kk = 0; kk < kPrefillBN / 16; ++kk) {
        pa[mr][kk][0] = tilehal::pack2(Tag(), s[mr][2 * kk][0], s[mr][2 * kk][1]);
        pa[mr][kk][1] = tilehal::pack2(Tag(), s[mr][2 * kk][2], s[mr][2 * kk][3]);
        pa[mr][kk][2] = tilehal::pack2(Tag(), s[mr][2 * kk + 1][0], s[mr][2 * kk + 1][1]);
        pa[mr][kk][3] = tilehal::pack2(Tag(), s[mr][2 * kk + 1][2], s[mr][2 * kk + 1][3]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) l_run[mr][r] = l_run[mr][r] * alpha[r] + rs[r];
#pragma unroll
      for (int n = 0; n < kOTiles; ++n) {
        o[mr][n][0] *= alpha[0]; o[mr][n][1] *= alpha[0];
        o[mr][n][2] *= alpha[1]; o[mr][n][3] *= alpha[1];
      }
    }

    // ---- O += P V (each V fragment serves every row block)
#pragma unroll
    for (int kk = 0; kk < kPrefillBN / 16; ++kk) {
      const int r = kk * 16 + v_tok;
#pragma unroll
      for (int n = 0; n < kOTiles; n += 2) {
        unsigned bv[4];
        tilehal::ldmatrix_x4_trans(bv, vs + r * S::kRowBytes + (((n + v_half) ^ (r & 7)) << 4));
#pragma unroll
        for (int mr = 0; mr < MR; ++mr) {
          tilehal::mma_m16n8k16(Tag(), o[mr][n], pa[mr][kk], {bv[0], bv[1]});
          tilehal::mma_m16n8k16(Tag(), o[mr][n + 1], pa[mr][kk], {bv[2], bv[3]});
        }
      }
    }
    __syncthreads();  // this stage is refilled by the next iteration's prefetch
  }

  // ---- normalize and store rows < rows
#pragma unroll
  for (int mr = 0; mr < MR; ++mr) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_run[mr][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = warp * kRowsPerWarp + mr * 16 + g + r * 8;
      if (row >= rows) continue;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* dst = out + (long long)(q0 + i0 + row) * q_row_stride + (long long)hq * D + t2;
#pragma unroll
      for (int n = 0; n < kOTiles; ++n)
        *reinterpret_cast<unsigned*>(dst + n * 8) = tilehal::pack2(Tag(), o[mr][n][2 * r] * inv, o[mr][n][2 * r + 1] * inv);
    }
  }
}

}  // namespace kvpool
