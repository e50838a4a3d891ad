// Paged prefill attention on Hopper warpgroup MMA (wgmma), FlashAttention-3 style.
//
// Same contract as paged_prefill.cuh (new tokens of each sequence attend causally to the cached
// prefix and to each other; q packed by sequence through cu_seqlens_q; K/V read through the block
// table; the host lists the query tiles longest-first), on sm_90a tensor cores:
//
// - CTA = NWG consumer warpgroups (64 query rows each, kBM = 64 * NWG rows of one (sequence, q head))
//   + PW producer warps. The producers gather kv tiles of BN tokens through the block table with
//   16-byte cp.async into an ST-stage ring of K and V tiles. A stage's `full` mbarrier completes
//   when every producer thread's copies into it landed (cp.async.mbarrier.arrive.noinc: no producer
//   ever waits for its copies, so it runs up to ST tiles ahead); each consumer fences the async proxy
//   after the wait (wgmma reads shared memory through it, cp.async wrote through the generic one)
//   and every consumer warp hands the stage back on its `empty` mbarrier once its warpgroup's last
//   wgmma on it retired. (A first form published a stage by cp.async.wait_group + fence + arrive in
//   the producer: on the H200 the fence waited for the copies still in flight, so one tile of
//   copies was in flight at a time: 80.8 ms at 32K with two producer warps, 48.7 with four. R3
//   measured that publication without the producer's fence at 52.8 ms (four producer warps): the
//   fence was not the cause.)
// - TMA (template flag, opt-in): one producer warp issues cp.async.bulk.tensor copies instead. The
//   layer's cache is seen as a 3-D tensor [slots = num_blocks * block_size, kv_heads * D / 64, 64]
//   (tilehal.tma descriptors built by cuda_prefill.py, SWIZZLE_128B), and one box is min(block_size,
//   BN) tokens x 64 channels of one kv head: a page's run of slots, swizzled exactly as below. Lane i
//   of the producer warp reads the block table entry of box i of a tile (the next tile's entries are
//   loaded while this tile's copies are issued) and issues its boxes of K and of V; an unmapped block
//   gets a slot coordinate below zero, which TMA zero-fills; boxes past the last visible key are not
//   issued (the expected bytes count the issued boxes). K and V have their own `full` barriers
//   (expect_tx), so S = Q K^T of a tile starts before its V lands. The last tile's V rows past the
//   last visible key hold a partly used page's other slots (an earlier owner's values) or whatever
//   the stage held before: the producer zeroes them once the tile landed and releases them on a
//   `tail` barrier, so a 0 probability never meets a non-finite value (the cp.async loader
//   zero-fills those rows); K there is masked by assignment. The host requires block_size % 8 == 0 and BN % block_size == 0 or
//   block_size % BN == 0 (box starts 1024-byte aligned, pages never straddle a tile).
// - Shared tiles are 128-byte-swizzled atoms of 64 channels (8 x 16-byte chunks per row, chunk c of
//   row r at c ^ (r % 8)), the layout TMA's SWIZZLE_128B writes: Q and K are K-major operands
//   (S = Q K^T), and the very same V tile is the MN-major B operand of O = P V (transpose bit).
// - Per kv tile and warpgroup: S = Q K^T (m64nBNk16, both operands in shared memory), online softmax
//   in registers (exp2, scale folded in; the causal mask only on tiles that cross the diagonal), P
//   packed to 16 bits as the register A operand of O += P V (m64nDk16). The warpgroup issues S of
//   tile t before O += P V of tile t - 1 and waits for S only, so the softmax of tile t overlaps
//   the P V product of tile t - 1 on the tensor cores (FA3's intra-warpgroup overlap).
// Requires head_dim 64 or 128 (host checks).
#pragma once
#include "paged_prefill_common.cuh"
#include <tilehal/mbarrier.cuh>
#include <tilehal/tma.cuh>
#include <tilehal/wgmma.cuh>
#include <tilehal/wgmma16_ops.cuh>

namespace kvpool {

template <typename T> struct WgmmaTag;
template <> struct WgmmaTag<__nv_bfloat16> { using type = tilehal::WgBF16; };
template <> struct WgmmaTag<__half> { using type = tilehal::WgF16; };

template <typename T, int D, int NWG, int BN, int ST, bool TMA = false>
struct PrefillWgmmaSmem {
  static constexpr int kBM = 64 * NWG;
  static constexpr int kQBytes = kBM * D * int(sizeof(T));
  static constexpr int kTileBytes = BN * D * int(sizeof(T));  // one stage of K (or V)
  static constexpr int kBarOffset = kQBytes + 2 * ST * kTileBytes;
  // full / empty per stage (TMA: + full_v per stage and the tail barrier)
  static constexpr int kBarriers = TMA ? 3 * ST + 1 : 2 * ST;
  // Q, K x ST, V x ST, the barriers, and up to 1 KB to align the base to 1024 bytes
  static constexpr int kBytes = kBarOffset + kBarriers * 8 + 1024;
};

// One arrival on `bar` once every cp.async this thread issued so far has landed, without the thread
// waiting (.noinc: the arrival counts against the barrier's expected count, here one per producer
// thread and tile).
TILEHAL_DEVICE void cp_async_arrive_noinc(tilehal::u64* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(tilehal::smem_addr(bar)) : "memory");
}

// The TMA producer (one warp, lane = its lane): see the header comment. kv tile t's box i covers keys
// [t * BN + i * bt, + bt) of the sequence, bt = min(block_size, BN) tokens.
template <typename T, int D, int BN, int ST>
__device__ __forceinline__ void tma_producer(const tilehal::TmaDescriptor& tma_k, const tilehal::TmaDescriptor& tma_v,
                                             unsigned char* k_s, unsigned char* v_s, tilehal::u64* full,
                                             tilehal::u64* full_v, tilehal::u64* empty, tilehal::u64* tail,
                                             const int* __restrict__ table, int table_stride, int kv_end,
                                             int block_size, int num_kv_tiles, int hkv, int lane) {
  constexpr int kAtoms = D / 64;
  constexpr int kTileBytes = BN * D * int(sizeof(T));  // one stage of K (or V)
  const int bt = min(block_size, BN);
  const int boxes = BN / bt;  // per atom and tile (<= BN / 8: lanes 0 .. boxes - 1 issue)
  // Whether this lane has a box in tile t (boxes past kv_end are not issued: the bytes expected count
  // only the issued ones, and the rows they would fill are masked (K) or zeroed below (V)), and its
  // slot coordinate: the page's first slot plus the offset in it, or -bt for an unmapped block (the
  // whole box out of bounds: TMA zero-fills it and counts its bytes).
  auto has_box = [&](int t) { return lane < boxes && t * BN + lane * bt < kv_end; };
  auto slot_of = [&](int t) {
    if (!has_box(t)) return 0;
    const int j0 = t * BN + lane * bt, lb = j0 / block_size;
    const int phys = lb < table_stride ? __ldg(table + lb) : -1;
    return phys >= 0 ? phys * block_size + (j0 - lb * block_size) : -bt;
  };
  if (lane == 0) {
    tilehal::tma_prefetch_descriptor(&tma_k);
    tilehal::tma_prefetch_descriptor(&tma_v);
  }
  int next = slot_of(0);
  for (int t = 0; t < num_kv_tiles; ++t) {
    const int s = t % ST, slot = next;
    if (t + 1 < num_kv_tiles) next = slot_of(t + 1);  // in flight while this tile waits and issues
    if (t >= ST) tilehal::mbarrier_wait(&empty[s], ((t / ST) - 1) & 1);
    const bool mine = has_box(t);  // box 0 always (t * BN < kv_end): never an empty phase
    const unsigned bytes = __popc(__ballot_sync(0xffffffffu, mine)) * unsigned(kAtoms * bt * 128);
    if (lane == 0) {
      tilehal::mbarrier_arrive_expect_tx(&full[s], bytes);
      tilehal::mbarrier_arrive_expect_tx(&full_v[s], bytes);
    }
    __syncwarp();
    if (mine) {
      unsigned char* ks = k_s + s * kTileBytes + lane * bt * 128;
      unsigned char* vs = v_s + s * kTileBytes + lane * bt * 128;
#pragma unroll
      for (int a = 0; a < kAtoms; ++a) tilehal::tma_load_3d(ks + a * BN * 128, &tma_k, &full[s], 0, hkv * kAtoms + a, slot);
#pragma unroll
      for (int a = 0; a < kAtoms; ++a) tilehal::tma_load_3d(vs + a * BN * 128, &tma_v, &full_v[s], 0, hkv * kAtoms + a, slot);
    }
  }
  // The last tile: wait for its K and V (no copy outlives the producer), zero V rows >= kv_end.
  const int last = num_kv_tiles - 1, s = last % ST;
  tilehal::mbarrier_wait(&full[s], (last / ST) & 1);
  tilehal::mbarrier_wait(&full_v[s], (last / ST) & 1);
  const int r_from = kv_end - last * BN;  // 1 .. BN
  const int n_chunks = (BN - r_from) * 8;  // 16-byte chunks per atom (the swizzle permutes within a row)
  for (int i = lane; i < kAtoms * n_chunks; i += 32) {
    const int a = i / n_chunks, rem = i - a * n_chunks;
    *reinterpret_cast<uint4*>(v_s + s * kTileBytes + a * BN * 128 + r_from * 128 + rem * 16) = make_uint4(0, 0, 0, 0);
  }
  tilehal::fence_proxy_async_shared();  // generic zero stores before the consumers' wgmma (async proxy) reads
  tilehal::mbarrier_arrive(tail);        // every lane (count 32): each releases its own stores
}

// Keep u32 operand registers (the P fragments an in-flight wgmma reads) alive and unmoved until here.
template <int R>
TILEHAL_DEVICE void wgmma_fence_regs(unsigned (&r)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}

// tma_k / tma_v: descriptors of the layer's K / V cache (read only with TMA; the cp.async forms get
// zero bytes, so one launch argument list serves both).
template <typename T, int D, int NWG, int BN, int ST, int PW, bool PP = false, bool TMA = false>
__global__ void __launch_bounds__(128 * NWG + 32 * PW, 1) paged_prefill_wgmma_kernel(
    KVPOOL_PREFILL_PARAMS(T), const __grid_constant__ tilehal::TmaDescriptor tma_k,
    const __grid_constant__ tilehal::TmaDescriptor tma_v) {
  using S = PrefillWgmmaSmem<T, D, NWG, BN, ST, TMA>;
  using Tag = typename tilehal::MmaTag<T>::type;
  using WTag = typename WgmmaTag<T>::type;
  using MmaS = tilehal::Wgmma16<BN>;  // S: m64 x BN tokens
  using MmaO = tilehal::Wgmma16<D>;   // O: m64 x D channels
  constexpr int kBM = S::kBM;
  constexpr int kAtoms = D / 64;      // 128-byte swizzle atoms along head_dim
  constexpr int kChunks = D / 8;      // 16-byte chunks per K/V row
  constexpr int kProducers = 32 * PW;
  constexpr int kConsumers = 128 * NWG;
  constexpr int kLoads = BN * kChunks / kProducers;  // chunks of K (and of V) per producer thread
  // Registers are allocated per warpgroup: producer warps cost a whole one anyway. With a full
  // producer warpgroup (PW = 4) it hands registers over to the consumers (setmaxnreg).
  constexpr bool kHandOver = PW == 4;
  constexpr int kProducerRegs = 56, kConsumerRegs = NWG == 2 ? 224 : 160;
  static_assert(!kHandOver || 128 * (kProducerRegs + NWG * kConsumerRegs) <= 65536, "register file");
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  static_assert(BN == 64 || BN == 96 || BN == 128, "64, 96 or 128 kv tokens per stage");
  static_assert(ST >= 2, "at least two stages");
  static_assert(NWG >= 1 && NWG <= 3 && PW >= 1 && PW <= 4, "consumer warpgroups / producer warps");
  static_assert(TMA || (kLoads * kProducers == BN * kChunks && kProducers % kChunks == 0), "tile must split evenly");
  static_assert(!PP || NWG == 2, "ping-pong takes two consumer warpgroups");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (tilehal::smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* q_s = smem;
  unsigned char* k_s = smem + S::kQBytes;
  unsigned char* v_s = k_s + ST * S::kTileBytes;
  tilehal::u64* full = reinterpret_cast<tilehal::u64*>(smem + S::kBarOffset);
  tilehal::u64* empty = full + ST;
  tilehal::u64* full_v = empty + ST;  // TMA only: V of each stage, and the last tile's zeroed V
  tilehal::u64* tail = full_v + ST;

  const PrefillTile pt = prefill_tile<kBM>(tiles, seq_lens, cu_seqlens_q, kv_heads);
  const int hq = pt.hq, Hq = gridDim.x, b = pt.b, i0 = pt.i0, q0 = pt.q0, P = pt.P, rows = pt.rows, kv_end = pt.kv_end;
  if (rows <= 0) return;
  const int num_kv_tiles = (kv_end + BN - 1) / BN;
  const int tid = threadIdx.x;
  const long long q_row_stride = (long long)Hq * D;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < ST; ++s) {
      tilehal::mbarrier_init(&full[s], TMA ? 1 : kProducers);  // TMA: one expect_tx arrival
      tilehal::mbarrier_init(&empty[s], 4 * NWG);  // one arrival per consumer warp
      if constexpr (TMA) tilehal::mbarrier_init(&full_v[s], 1);
    }
    if constexpr (TMA) tilehal::mbarrier_init(tail, 32);
    tilehal::fence_barrier_init();
  }
  __syncthreads();

  if (tid >= kConsumers) {
    // ------------------------------------------------------------------ producer warps
    if constexpr (kHandOver) tilehal::setmaxnreg_dec<kProducerRegs>();
    if constexpr (TMA) {
      if (tid - kConsumers < 32) {
        tma_producer<T, D, BN, ST>(tma_k, tma_v, k_s, v_s, full, full_v, empty, tail, block_table + (long long)b * table_stride,
                     table_stride, kv_end, block_size, num_kv_tiles, pt.hkv, tid % 32);
      }
      return;
    }
    const int ptid = tid - kConsumers;
    const int col = ptid % kChunks, atom = col / 8, cc = col % 8;
    const int r_first = ptid / kChunks;
    constexpr int kRowStep = kProducers / kChunks;
    const long long kv_row_stride = (long long)kv_heads * D;
    const int* table = block_table + (long long)b * table_stride;
    const long long head_off = (long long)pt.hkv * D + col * 8;
    for (int t = 0; t < num_kv_tiles; ++t) {
      const int s = t % ST;
      if (t >= ST) tilehal::mbarrier_wait(&empty[s], ((t / ST) - 1) & 1);
      unsigned char* ks = k_s + s * S::kTileBytes + atom * BN * 128;
      unsigned char* vs = v_s + s * S::kTileBytes + atom * BN * 128;
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int r = r_first + i * kRowStep;
        long long off;
        const bool ok = paged_row(table, table_stride, t * BN + r, kv_end, block_size, kv_row_stride, head_off, off);
        const int soff = r * 128 + ((cc ^ (r & 7)) << 4);
        tilehal::cp_async_16(ks + soff, k_cache + off, ok);
        tilehal::cp_async_16(vs + soff, v_cache + off, ok);
      }
      cp_async_arrive_noinc(&full[s]);  // arrives once this thread's copies so far have landed
    }
    // Stay until the last stages completed: a thread that exits with copies in flight may lose the
    // arrivals they owe (R2 on the H200: every CTA hung on its last tiles when the producers left
    // right after issuing them).
    asm volatile("cp.async.wait_all;" ::: "memory");
    for (int t = max(0, num_kv_tiles - ST); t < num_kv_tiles; ++t) tilehal::mbarrier_wait(&full[t % ST], (t / ST) & 1);
    return;
  }

  // -------------------------------------------------------------------- consumer warpgroups
  if constexpr (kHandOver) tilehal::setmaxnreg_inc<kConsumerRegs>();
  const int wg = tid / 128, wtid = tid % 128, warp = wtid / 32, lane = tid % 32;
  {  // this warpgroup's 64 rows of Q (zero past the end)
    constexpr int kQLoads = 64 * kChunks / 128;
#pragma unroll
    for (int i = 0; i < kQLoads; ++i) {
      const int c = wtid + i * 128, r = c / kChunks, col = c % kChunks;
      const int row = wg * 64 + r;
      const bool ok = row < rows;
      const T* src = q + (ok ? (long long)(q0 + i0 + row) * q_row_stride : 0ll) + (long long)hq * D + col * 8;
      tilehal::cp_async_16(q_s + (col / 8) * kBM * 128 + row * 128 + (((col % 8) ^ (r & 7)) << 4), src, ok);
    }
    tilehal::cp_async_commit();
    tilehal::cp_async_wait<0>();
    tilehal::fence_proxy_async_shared();
    tilehal::named_barrier_sync(1 + wg, 128);
  }
  tilehal::u64 desc_q[kAtoms];
#pragma unroll
  for (int a = 0; a < kAtoms; ++a) desc_q[a] = tilehal::make_smem_desc_k128b(q_s + a * kBM * 128 + wg * 64 * 128);

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float sc[BN / 2];
  unsigned p[BN / 16][4];
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const int r0 = warp * 16 + lane / 4, t2 = (lane % 4) * 2;
  const int qpos0 = P + i0 + wg * 64 + r0;     // position of the thread's first row (the second: + 8)
  const int first_masked = (P + i0 + wg * 64) / BN;  // this warpgroup's tiles from here on cross the diagonal

  auto issue_s = [&](int stage) {
    const unsigned char* kt = k_s + stage * S::kTileBytes;
    tilehal::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const tilehal::u64 dk = tilehal::make_smem_desc_k128b(kt + (kk / 4) * BN * 128);
      MmaS::template ss<0, 0>(WTag(), sc, tilehal::desc_advance(desc_q[kk / 4], 2 * (kk % 4)),
                              tilehal::desc_advance(dk, 2 * (kk % 4)), kk > 0);
    }
    tilehal::wgmma_commit();
  };
  auto issue_pv = [&](int stage) {
    const tilehal::u64 dv = tilehal::make_smem_desc_mn128b(v_s + stage * S::kTileBytes, BN);
    tilehal::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      MmaO::template rs<1>(WTag(), o, p[kk], tilehal::desc_advance(dv, kk * 128), 1);
    tilehal::wgmma_commit();
  };
  // Softmax of the S tile of kv tile t in sc (scaled, masked, exponentiated in place); returns the
  // rescale factors of the running rows and updates m_run.
  auto softmax = [&](int t, float (&alpha)[2], float (&rs)[2]) {
    const bool masked = t >= first_masked;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int c = 0; c < BN / 8; ++c) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = sc[4 * c + e] * scale_log2;
        if (masked && t * BN + c * 8 + t2 + (e & 1) > qpos0 + (e >> 1) * 8) x = -INFINITY;
        sc[4 * c + e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m_run[r], mx[r]);
      base[r] = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = exp2f(m_run[r] - base[r]);
      m_run[r] = m_new;
      rs[r] = 0.f;
    }
#pragma unroll
    for (int c = 0; c < BN / 8; ++c) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pv = exp2f(sc[4 * c + e] - base[e >> 1]);
        sc[4 * c + e] = pv;
        rs[e >> 1] += pv;
      }
    }
  };
  // P (16-bit A fragments of m64nDk16: the accumulator layout of S is the A layout), the running
  // sums, and O rescaled, once the P V product that read the previous P and O has retired.
  auto pack_and_rescale = [&](const float (&alpha)[2], const float (&rs)[2]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      p[kk][0] = tilehal::pack2(Tag(), sc[8 * kk + 0], sc[8 * kk + 1]);
      p[kk][1] = tilehal::pack2(Tag(), sc[8 * kk + 2], sc[8 * kk + 3]);
      p[kk][2] = tilehal::pack2(Tag(), sc[8 * kk + 4], sc[8 * kk + 5]);
      p[kk][3] = tilehal::pack2(Tag(), sc[8 * kk + 6], sc[8 * kk + 7]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + rs[r];
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
      o[4 * c + 0] *= alpha[0]; o[4 * c + 1] *= alpha[0];
      o[4 * c + 2] *= alpha[1]; o[4 * c + 3] *= alpha[1];
    }
  };
  auto release = [&](int t) {
    __syncwarp();
    if (lane == 0) tilehal::mbarrier_arrive(&empty[t % ST]);
  };
  // PP (ping-pong): the two warpgroups take turns issuing their wgmma batches (named barriers 3 and 4,
  // 256 threads: the owner syncs, the other warpgroup arrives), so one's softmax runs while the
  // other's products occupy the tensor cores. Warpgroup 1 lets warpgroup 0 go first and skips its
  // last hand-back, so every barrier phase completes.
  auto my_turn = [&]() {
    if constexpr (PP) tilehal::named_barrier_sync(3 + wg, 256);
  };
  auto your_turn = [&](bool last) {
    if constexpr (PP) {
      if (!(last && wg == 1)) tilehal::named_barrier_arrive(3 + (wg ^ 1), 256);
    }
  };
  if constexpr (PP) {
    if (wg == 1) tilehal::named_barrier_arrive(3, 256);
  }

  {
    float alpha[2], rs[2];
    tilehal::mbarrier_wait(&full[0], 0);
    // the producers' cp.async data (generic proxy) before wgmma reads it (TMA writes through the async proxy)
    if constexpr (!TMA) tilehal::fence_proxy_async_shared();
    my_turn();
    issue_s(0);
    your_turn(false);
    tilehal::wgmma_wait<0>();
    tilehal::wgmma_fence_operands(sc);
    softmax(0, alpha, rs);
    pack_and_rescale(alpha, rs);
  }
  for (int t = 1; t < num_kv_tiles; ++t) {
    float alpha[2], rs[2];
    tilehal::mbarrier_wait(&full[t % ST], (t / ST) & 1);
    if constexpr (TMA) {
      tilehal::mbarrier_wait(&full_v[(t - 1) % ST], ((t - 1) / ST) & 1);  // V of tile t - 1
    } else {
      tilehal::fence_proxy_async_shared();
    }
    my_turn();
    issue_s(t % ST);         // S of tile t ...
    issue_pv((t - 1) % ST);  // ... then O += P V of tile t - 1
    your_turn(false);
    tilehal::wgmma_wait<1>();  // S landed; P V may still run
    tilehal::wgmma_fence_operands(sc);
    softmax(t, alpha, rs);
    tilehal::wgmma_wait<0>();
    tilehal::wgmma_fence_operands(o);
    wgmma_fence_regs(p);
    release(t - 1);
    pack_and_rescale(alpha, rs);
  }
  if constexpr (TMA) tilehal::mbarrier_wait(tail, 0);  // the last tile's V, rows past kv_end zeroed
  my_turn();
  issue_pv((num_kv_tiles - 1) % ST);
  your_turn(true);
  tilehal::wgmma_wait<0>();
  tilehal::wgmma_fence_operands(o);
  wgmma_fence_regs(p);

  // ---- normalize and store rows < rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = wg * 64 + r0 + r * 8;
    if (row >= rows) continue;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* dst = out + (long long)(q0 + i0 + row) * q_row_stride + (long long)hq * D + t2;
#pragma unroll
    for (int c = 0; c < D / 8; ++c)
      *reinterpret_cast<unsigned*>(dst + c * 8) = tilehal::pack2(Tag(), o[4 * c + 2 * r] * inv, o[4 * c + 2 * r + 1] * inv);
  }
}

}  // namespace kvpool
