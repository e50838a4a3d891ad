"""Expert-parallel mixture-of-experts: deepep moves the tokens, deepgemm runs the experts.

The two peers never import each other; they meet here through tensors:

    router (softmax top-k)
      -> deepep Buffer.get_dispatch_layout + dispatch         (tokens to the ranks owning their experts)
      -> contiguous grouped layout (rows grouped per local expert, each group padded to
         deepgemm.get_m_alignment_for_contiguous_layout(), m_indices int32 with -1 on padding)
      -> deepgemm m_grouped_{bf16,fp8}_gemm_nt_contiguous       (gate/up, SiLU * up, down)
      -> un-permute, weighted by recv_topk_weights              (one row per received token)
      -> deepep combine                                         (rows back to their source, summed)

With `group=None` (and no `buffer`) the module runs on one process and every expert is local, so no
token moves: the (token, expert) pairs are sorted per expert on the device into a contiguous layout of
static size (`build_local_layout`: every group padded to the alignment, the worst case known on the host),
the rows are gathered, the grouped GEMMs run (padding blocks skipped by the kernels), and a weighted
gather-sum in fp32 combines the k rows of each token. Nothing is read back to the host, so the step is
CUDA-graph capturable. `buffer=deepep.Buffer(None, transport="local")` sends the same step through
deepep's one-rank engine instead (the multi-rank code path; same result).
Inference only: the GEMMs write into preallocated outputs and record no autograd graph.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import deepgemm
import torch
import torch.nn.functional as F
from tilehal import ArgumentError, check_choice, check_int, expect

from . import _args, ops

log = logging.getLogger("tilestack.moe")

XTensor = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _fused_swiglu_allowed() -> bool:
    """TILESTACK_MOE_SWIGLU=0 keeps the fp8 experts on the unfused gate|up GEMM + silu_mul cast (A/B timing; the
    default puts SwiGLU into the gate|up GEMM's epilogue)."""
    import os

    return os.environ.get("TILESTACK_MOE_SWIGLU", "1") != "0"


# ----------------------------------------------------------------------------- routing


def softmax_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx int64 [T, k], topk_weights float32 [T, k]) from router logits [T, E].

    Softmax over all experts in fp32, then the k largest; `norm_topk_prob` renormalizes the k
    weights to sum to 1 (Mixtral / DeepSeek-V2 style).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return idx.to(torch.int64), weights.float()


def grouped_sigmoid_topk(logits: torch.Tensor, top_k: int, score_bias: torch.Tensor | None = None,
                         n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: (topk_idx int64 [T, k], topk_weights float32 [T, k]) from logits [T, E].

    Scores are sigmoid(logits); the choice adds `score_bias` (the load-balancing correction) and,
    with `n_group > 1`, keeps only the `topk_group` groups of E/n_group experts whose two best
    biased scores sum highest. The weights are the unbiased scores of the chosen experts,
    renormalized (denominator + 1e-20) with `norm_topk_prob`.
    """
    t, e = logits.shape
    scores = logits.float().sigmoid()
    choice = scores if score_bias is None else scores + score_bias.float()
    if n_group > 1:
        expect(e % n_group == 0 and e // n_group >= 2, "n_group", f"a divisor of {e} leaving >= 2 experts a group",
               n_group)
        per_group = choice.view(t, n_group, e // n_group)
        group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, torch.topk(group_scores, topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e),
                                    float("-inf"))
    idx = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return idx.to(torch.int64), weights


# ----------------------------------------------------------------------------- contiguous layout


class ContiguousLayout:
    """Where each received (token, expert) pair sits in deepgemm's contiguous grouped layout.

    m_indices: int32 [M_sum], the local expert of each row, -1 on padding rows.
    pair_src / pair_dst: int64 [N_recv * k], every (token, slot) in expert order (received order inside an
      expert, then the -1 slots): its received token, and its row in the grouped layout, or M_sum (a
      scratch row past the layout) for a -1 slot. Built without reading device data: no host sync.
    gather_rows: int64 [N_recv * k], for every (token, slot) of recv_topk_idx its row in the grouped
      layout, or M_sum (a zero row) where the slot is -1: the un-permute reads through it.
    src_rows / dst_rows: the same as pair_src / pair_dst for the pairs with an expert only (P of them;
      computed on first use: their length is data-dependent, so reading them synchronizes).
    """

    m_indices: torch.Tensor
    pair_src: torch.Tensor
    pair_dst: torch.Tensor
    gather_rows: torch.Tensor
    num_recv_tokens: int
    top_k: int

    def __init__(self, m_indices, pair_src, pair_dst, gather_rows, num_recv_tokens, top_k) -> None:
        self.m_indices, self.pair_src, self.pair_dst = m_indices, pair_src, pair_dst
        self.gather_rows, self.num_recv_tokens, self.top_k = gather_rows, num_recv_tokens, top_k

    @property
    def m_sum(self) -> int:
        return int(self.m_indices.numel())

    @property
    def src_rows(self) -> torch.Tensor:
        return self.pair_src[self.pair_dst < self.m_sum]

    @property
    def dst_rows(self) -> torch.Tensor:
        return self.pair_dst[self.pair_dst < self.m_sum]


def build_contiguous_layout(recv_topk_idx: torch.Tensor, num_recv_tokens_per_expert_list: list[int],
                            num_local_experts: int, alignment: int | None = None) -> ContiguousLayout:
    """Group the received (token, expert) pairs per local expert, each group padded to `alignment`.

    `num_recv_tokens_per_expert_list` is deepep's list from a dispatch with
    `expert_alignment=alignment`: its entries are the padded group sizes, so M_sum is known on the
    host without another device synchronization (and nothing here reads device data: a stable sort
    with the -1 slots keyed past the last expert, counts by scatter_add). Pairs keep their received
    order inside a group.
    """
    align = alignment or deepgemm.get_m_alignment_for_contiguous_layout()
    expect(recv_topk_idx.dim() == 2, "recv_topk_idx", "a 2-D tensor [N_recv, k]", tuple(recv_topk_idx.shape))
    expect(len(num_recv_tokens_per_expert_list) == num_local_experts, "num_recv_tokens_per_expert_list",
           f"{num_local_experts} entries (one per local expert)", len(num_recv_tokens_per_expert_list))
    sizes = [int(s) for s in num_recv_tokens_per_expert_list]
    expect(all(s >= 0 and s % align == 0 for s in sizes), "num_recv_tokens_per_expert_list",
           f"multiples of {align} (dispatch with expert_alignment={align})", sizes)
    dev = recv_topk_idx.device
    n_recv, k = recv_topk_idx.shape
    e = num_local_experts
    flat = recv_topk_idx.reshape(-1).to(torch.int64)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, e))        # -1 slots sort after every expert
    order = torch.sort(key, stable=True).indices                        # stable: received order per expert
    experts = key[order]
    counts = torch.zeros(e + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    if not recv_topk_idx.is_cuda:
        # On the host this costs nothing; on CUDA it would add a synchronization per call.
        padded = ((counts[:e] + align - 1) // align * align).tolist()
        expect(padded == sizes, "num_recv_tokens_per_expert_list",
               f"{padded} (the aligned pair counts of recv_topk_idx)", sizes)
    m_sum = sum(sizes)
    starts = [0]
    for sz in sizes:
        starts.append(starts[-1] + sz)                                   # starts[e] = M_sum: the scratch row
    group_start = torch.tensor(starts, dtype=torch.int64, device=dev)
    first_pair = torch.cumsum(counts, 0) - counts                       # first sorted pair of each expert
    rank_in_group = torch.arange(experts.numel(), device=dev) - first_pair[experts]
    valid = experts < e
    dst = torch.where(valid, group_start[experts] + rank_in_group, torch.full_like(experts, m_sum))
    m_indices = torch.full((m_sum + 1,), -1, dtype=torch.int32, device=dev)
    m_indices[dst] = torch.where(valid, experts, torch.full_like(experts, -1)).to(torch.int32)
    gather_rows = torch.empty((n_recv * k,), dtype=torch.int64, device=dev)
    gather_rows[order] = dst
    return ContiguousLayout(m_indices[:m_sum], order // k, dst, gather_rows, n_recv, k)


class LocalLayout:
    """The one-process grouped layout of every (token, slot) pair, built on the device with a static size.

    m_cap: rows of the layout, ceil((T * k + E * (align - 1)) / align) * align: enough for every expert's
      group padded to `align` whatever the routing, so it is known on the host without reading device
      data (no synchronization; CUDA-graph safe). Rows past the last group are padding.
    m_indices: int32 [m_cap], the expert of each row, -1 on padding (whole padding blocks are skipped by
      deepgemm's contiguous kernels).
    src_rows: int64 [m_cap], the token each row reads (token 0 on padding rows: finite values whose
      results are never read).
    pair_rows: int64 [T * k], the row of every (token, slot), or m_cap (the zero row past the layout
      that the combine reads) for a -1 slot.
    """

    def __init__(self, m_cap: int, m_indices: torch.Tensor, src_rows: torch.Tensor, pair_rows: torch.Tensor,
                 num_tokens: int, top_k: int) -> None:
        self.m_cap, self.m_indices, self.src_rows, self.pair_rows = m_cap, m_indices, src_rows, pair_rows
        self.num_tokens, self.top_k = num_tokens, top_k


def local_layout_rows(num_pairs: int, num_experts: int, alignment: int) -> int:
    """Rows of the static one-process layout: every expert's group padded to `alignment`, worst case."""
    return -(-(num_pairs + num_experts * (alignment - 1)) // alignment) * alignment if num_pairs else 0


def build_local_layout(topk_idx: torch.Tensor, num_experts: int, alignment: int | None = None) -> LocalLayout:
    """Group every (token, slot) pair of topk_idx [T, k] (-1 = no expert) per expert, each group starting on
    a multiple of `alignment`, in token order inside a group: one stable sort and scatters on the device,
    no value read back (see LocalLayout). On CUDA one kernel of one CTA computes the same rows (_layout_on_device).

    (A sort-free variant, a running count over the [T*k, E+1] one-hot of the experts with cumsum along
    dim 0, measured 1.3 ms per layer on the H200 at T*k = 8192, E = 8 (torch's outer-dim scan runs one
    thread per column), against 0.07 ms for this sort: not used.)"""
    align = alignment or deepgemm.get_m_alignment_for_contiguous_layout()
    expect(topk_idx.dim() == 2, "topk_idx", "a 2-D tensor [T, k]", tuple(topk_idx.shape))
    fused = _layout_on_device(topk_idx, num_experts, align)
    if fused is not None:
        return fused
    t, k = topk_idx.shape
    e = num_experts
    dev = topk_idx.device
    n = t * k
    m_cap = local_layout_rows(n, e, align)
    flat = topk_idx.reshape(-1).to(torch.int64)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, e))        # -1 slots sort after every expert
    experts, order = torch.sort(key, stable=True)
    counts = torch.zeros(e + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:e] + align - 1) // align * align
    group_start = torch.cumsum(padded, 0) - padded                      # [E]: each group's first row
    first_pair = torch.cumsum(counts, 0) - counts                       # [E + 1]: each expert's first sorted pair
    valid = experts < e
    rank_in_group = torch.arange(n, device=dev) - first_pair[experts]
    dst = torch.where(valid, group_start[experts.clamp(max=e - 1)] + rank_in_group,
                      torch.full_like(experts, m_cap))                  # -1 slots: the scratch row m_cap
    m_indices = torch.full((m_cap + 1,), -1, dtype=torch.int32, device=dev)
    m_indices.scatter_(0, dst, torch.where(valid, experts, torch.full_like(experts, -1)).to(torch.int32))
    src_rows = torch.zeros((m_cap + 1,), dtype=torch.int64, device=dev)
    src_rows.scatter_(0, dst, torch.where(valid, order // k, torch.zeros_like(order)))
    pair_rows = torch.empty((n,), dtype=torch.int64, device=dev).scatter_(0, order, dst)
    return LocalLayout(m_cap, m_indices[:m_cap], src_rows[:m_cap], pair_rows, t, k)


LAYOUT_SOURCE = r"""
#include <tilehal/tilehal.cuh>

namespace tilestack {

// build_local_layout in one CTA (THREADS threads): the same rows as its stable sort + scatters.
// pairs p = t * k + j of topk_idx [T * k] (an id outside [0, E) is an empty slot), experts' groups padded to
// `align` and placed in expert order; inside a group pairs keep their order p. Rows: m_indices (int32, -1 on
// padding), src_rows (token, 0 on padding); pair_rows[p]: the pair's row, m_cap for an empty slot.
// Shared memory: counts [E] + group starts [E] + one count per (warp, expert) of a THREADS-pair chunk.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) moe_local_layout(const long long* __restrict__ topk_idx, int n, int k,
                                                            int e, int align, int m_cap, int* __restrict__ m_indices,
                                                            long long* __restrict__ src_rows,
                                                            long long* __restrict__ pair_rows) {
  constexpr int kWarps = THREADS / 32;
  extern __shared__ int smem[];
  int* count = smem;             // [e] pairs per expert, then the running rank base while placing
  int* start = smem + e;         // [e] first row of each expert's group
  int* wcount = smem + 2 * e;    // [kWarps][e] pairs of each expert in each warp of the current chunk
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int i = tid; i < e * (2 + kWarps); i += THREADS) smem[i] = 0;
  for (int r = tid; r < m_cap; r += THREADS) {
    m_indices[r] = -1;
    src_rows[r] = 0;
  }
  __syncthreads();
  for (int p = tid; p < n; p += THREADS) {
    const long long x = topk_idx[p];
    if (x >= 0 && x < e) atomicAdd(&count[x], 1);
  }
  __syncthreads();
  if (tid == 0) {
    int row = 0;
    for (int x = 0; x < e; ++x) {
      start[x] = row;
      row += (count[x] + align - 1) / align * align;
      count[x] = 0;  // from here on: pairs of x already placed
    }
  }
  __syncthreads();
  for (int base = 0; base < n; base += THREADS) {
    const int p = base + tid;
    const long long x = p < n ? topk_idx[p] : -1;
    const bool valid = x >= 0 && x < e;
    const int ex = valid ? static_cast<int>(x) : -1;
    // lanes of this warp with the same expert, and this lane's rank among them
    const unsigned peers = __match_any_sync(0xffffffffu, ex);
    const int rank_in_warp = __popc(peers & ((1u << lane) - 1u));
    if (valid && rank_in_warp == 0) wcount[warp * e + ex] = __popc(peers);
    __syncthreads();
    if (p < n) {
      if (valid) {
        int rank = count[ex] + rank_in_warp;
        for (int w = 0; w < warp; ++w) rank += wcount[w * e + ex];
        const int row = start[ex] + rank;
        m_indices[row] = ex;
        src_rows[row] = p / k;
        pair_rows[p] = row;
      } else {
        pair_rows[p] = m_cap;
      }
    }
    __syncthreads();
    for (int x = tid; x < e; x += THREADS) {
      int add = 0;
      for (int w = 0; w < kWarps; ++w) {
        add += wcount[w * e + x];
        wcount[w * e + x] = 0;
      }
      count[x] += add;
    }
    __syncthreads();
  }
}

}  // namespace tilestack
"""
LAYOUT_THREADS = 1024
LAYOUT_MAX_EXPERTS = 1024  # shared memory: (2 + 32) x E ints = 136 KiB at most


def layout_expression() -> str:
    return f"tilestack::moe_local_layout<{LAYOUT_THREADS}>"


def compile_layout():
    """NVRTC module of the one-CTA layout kernel (sm_90a; cached on disk by content, no GPU needed)."""
    import tilehal

    return tilehal.compile_cuda(LAYOUT_SOURCE, arch="sm_90a", name="tilestack_moe_layout", options=("-std=c++17",),
                                name_expressions=[layout_expression()])


@functools.lru_cache(maxsize=1)
def _layout_kernel():
    return compile_layout().get_kernel(layout_expression())


def _layout_on_device(topk_idx: torch.Tensor, e: int, align: int) -> LocalLayout | None:
    """build_local_layout's result from the one-CTA kernel (one launch instead of a sort and ~20 torch ops), or
    None where it does not apply (DEBUG says why)."""
    import os

    why = None
    if not topk_idx.is_cuda:
        why = "not a CUDA tensor"
    elif e > LAYOUT_MAX_EXPERTS:
        why = f"{e} experts > {LAYOUT_MAX_EXPERTS}"
    elif topk_idx.numel() >= 2**31:
        why = "2^31 pairs or more"
    elif os.environ.get("TILESTACK_MOE_LAYOUT", "kernel") == "torch":
        why = "TILESTACK_MOE_LAYOUT=torch"
    if why is not None:
        log.debug("MoE layout: torch ops instead of the one-CTA kernel (%s)", why)
        return None
    t, k = topk_idx.shape
    n = t * k
    m_cap = local_layout_rows(n, e, align)
    dev = topk_idx.device
    m_indices = torch.empty((m_cap,), dtype=torch.int32, device=dev)
    src_rows = torch.empty((m_cap,), dtype=torch.int64, device=dev)
    pair_rows = torch.empty((n,), dtype=torch.int64, device=dev)
    if n:
        _layout_kernel().launch(1, LAYOUT_THREADS, (topk_idx.to(torch.int64).contiguous(), n, k, e, align, m_cap,
                                                    m_indices, src_rows, pair_rows),
                                smem_bytes=4 * e * (2 + LAYOUT_THREADS // 32))
    return LocalLayout(m_cap, m_indices, src_rows, pair_rows, t, k)


COMBINE_SOURCE = r"""
#include <tilehal/tilehal.cuh>

namespace tilestack {

// out[t, :] = bf16(sum_j w[t, j] * y[rows[t * K + j], :]), j = 0..K-1 in order, fp32 products and sums without
// FMA contraction (the torch ops' roundings for K <= 2). One CTA per token; rows[] == skip_row (the zero row of
// -1 slots) is not read. VEC: 16-byte loads/stores (h % 8 == 0, aligned bases).
template <int THREADS, bool VEC>
__global__ void __launch_bounds__(THREADS) moe_combine_bf16(const __nv_bfloat16* __restrict__ y,
                                                            const long long* __restrict__ rows,
                                                            const float* __restrict__ w,
                                                            __nv_bfloat16* __restrict__ out, int tokens, int k,
                                                            int h, long long skip_row) {
  const int t = blockIdx.x;
  if (t >= tokens) return;
  for (int col = threadIdx.x * 8; col < h; col += THREADS * 8) {
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    for (int j = 0; j < k; ++j) {
      const long long r = rows[static_cast<long long>(t) * k + j];
      if (r == skip_row) continue;
      const float wj = w[static_cast<long long>(t) * k + j];
      float v[8];
      tilehal::load8<__nv_bfloat16, VEC>(y + r * h, col, h, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(v[i], wj));
    }
    tilehal::store8<__nv_bfloat16, VEC>(out + static_cast<long long>(t) * h, col, h, acc);
  }
}

}  // namespace tilestack
"""
COMBINE_THREADS = 256


def combine_expression(vec: bool) -> str:
    return f"tilestack::moe_combine_bf16<{COMBINE_THREADS}, {'true' if vec else 'false'}>"


def compile_combine(expressions: tuple[str, ...] | None = None):
    """NVRTC module of the combine kernel (sm_90a; cached on disk by content, no GPU needed)."""
    import tilehal

    return tilehal.compile_cuda(COMBINE_SOURCE, arch="sm_90a", name="tilestack_moe_combine", options=("-std=c++17",),
                                name_expressions=list(expressions or (combine_expression(True),
                                                                      combine_expression(False))))


@functools.lru_cache(maxsize=4)
def _combine_kernel(vec: bool):
    return compile_combine((combine_expression(vec),)).get_kernel(combine_expression(vec))


def weighted_combine(y_ext: torch.Tensor, pair_rows: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y_ext[pair_rows[t * k + j]] in fp32, j in slot order, rounded to bf16 -> [T, H]
    (a gather then a fixed-order sum: deterministic on GPUs, unlike index_add). The last row of y_ext is the
    zero row of the -1 slots. CUDA bf16: one kernel (one read of each chosen row, one write); elsewhere the
    torch ops (the same values for k <= 2)."""
    t, k = topk_weights.shape
    h = y_ext.shape[1]
    if y_ext.is_cuda and y_ext.dtype is torch.bfloat16 and y_ext.is_contiguous() and t:
        import tilehal

        w = topk_weights.float().contiguous()
        rows = pair_rows.contiguous()
        out = torch.empty((t, h), dtype=torch.bfloat16, device=y_ext.device)
        vec = h % 8 == 0 and y_ext.data_ptr() % 16 == 0
        _combine_kernel(vec).launch(t, COMBINE_THREADS, (y_ext, rows, w, out, t, k, h,
                                                         tilehal.Arg.i64(y_ext.shape[0] - 1)))
        return out
    rows = y_ext.index_select(0, pair_rows).view(t, k, h)
    return (rows * topk_weights.float().unsqueeze(-1)).sum(dim=1).to(torch.bfloat16)


def _scatter_rows(src: torch.Tensor, layout: ContiguousLayout) -> torch.Tensor:
    """[N_recv, C] received rows -> [M_sum, C] grouped rows (zeros on padding; -1 slots land in a scratch row)."""
    out = torch.zeros((layout.m_sum + 1, src.shape[1]), dtype=src.dtype, device=src.device)
    if src.dtype == torch.float8_e4m3fn:
        # index_put has no fp8 kernel; move the bytes instead.
        out.view(torch.uint8)[layout.pair_dst] = src.view(torch.uint8)[layout.pair_src]
    else:
        out[layout.pair_dst] = src[layout.pair_src]
    return out[: layout.m_sum]


def unpermute(y: torch.Tensor, layout: ContiguousLayout, recv_topk_weights: torch.Tensor) -> torch.Tensor:
    """sum_j w[t, j] * y[row of (t, j)] for every received token t, in fp32 -> [N_recv, H].

    A gather over the k slots (a zero row for -1) then a sum, rather than index_add: the order of
    the sum is fixed, so the result is deterministic on GPUs too.
    """
    h = y.shape[1]
    if y.shape[0] == layout.m_sum + 1:
        y_ext = y  # experts_forward's output already ends in the zero row the -1 slots read
    else:
        y_ext = torch.cat([y, torch.zeros((1, h), dtype=y.dtype, device=y.device)])
    rows = y_ext[layout.gather_rows].view(layout.num_recv_tokens, layout.top_k, h).float()
    return (rows * recv_topk_weights.float().unsqueeze(-1)).sum(dim=1)


# ----------------------------------------------------------------------------- the module


class ExpertParallelMoE(torch.nn.Module):
    """A SwiGLU mixture-of-experts layer whose experts are spread over the ranks of `group`.

    Rank r owns experts [r * E/R, (r + 1) * E/R); the router is replicated. Parameters:
    `router_weight [E, hidden]` (fp32), `w13 [E_local, 2 * ffn_hidden, hidden]` (gate rows, then
    up rows) and `w2 [E_local, hidden, ffn_hidden]` in `dtype` (bf16). With `use_fp8` the
    activations travel and multiply as e4m3 with 1x128 scales and the weights are cast per
    128x128 block (cached until the weights change).

    `group=None`: one process, no torch.distributed (deepep's local engine). With a group, a deepep
    `Buffer` is created on the first forward (a collective: every rank calls forward), or pass
    `buffer=` to share one between layers.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int, group: Any = None,
                 dtype: torch.dtype = torch.bfloat16, use_fp8: bool = False, *, norm_topk_prob: bool = False,
                 buffer: Any = None, device: torch.device | str | None = None, scoring: str = "softmax",
                 n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 router_in_input_dtype: bool = False, weights_in_input_dtype: bool = False,
                 shared_expert: torch.nn.Module | None = None,
                 shared_expert_gate: torch.nn.Module | None = None) -> None:
        super().__init__()
        hidden, ffn_hidden = _args.features(hidden, "hidden"), _args.features(ffn_hidden, "ffn_hidden")
        num_experts = _args.features(num_experts, "num_experts")
        top_k = check_int(top_k, "top_k", lo=1, hi=num_experts)
        use_fp8, norm_topk_prob = _args.flag(use_fp8, "use_fp8"), _args.flag(norm_topk_prob, "norm_topk_prob")
        dtype, device = _args.dtype(dtype, allow_none=False), _args.device(device)
        check_choice(scoring, "scoring", ("softmax", "sigmoid"))
        if not (isinstance(n_group, int) and n_group >= 1 and num_experts % n_group == 0):
            raise ArgumentError(f"n_group: expected a positive divisor of num_experts ({num_experts}), got {n_group!r}")
        if not (isinstance(topk_group, int) and 1 <= topk_group <= n_group):
            raise ArgumentError(f"topk_group: expected an int in [1, n_group={n_group}], got {topk_group!r}")
        self.scoring, self.n_group, self.topk_group = scoring, n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.router_in_input_dtype, self.weights_in_input_dtype = router_in_input_dtype, weights_in_input_dtype
        # Kept as they are (their Linears may be swapped on their own): added to the routed output.
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        for name, v in (("hidden", hidden), ("ffn_hidden", ffn_hidden), ("num_experts", num_experts),
                        ("top_k", top_k)):
            if not isinstance(v, int) or v < 1:
                raise ArgumentError(f"{name}: expected a positive int, got {v!r}")
        if top_k > num_experts:
            raise ArgumentError(f"top_k: expected <= num_experts ({num_experts}), got {top_k}")
        if dtype != torch.bfloat16:
            raise ArgumentError(f"dtype: expected torch.bfloat16 (deepgemm's grouped GEMMs take bf16 or fp8), got {dtype}")
        self.group, self._buffer = group, buffer
        if group is None and buffer is None:
            self.rank, self.world_size = 0, 1
        else:
            import torch.distributed as dist

            if buffer is not None:
                self.rank, self.world_size = buffer.rank, buffer.group_size
            else:
                self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if num_experts % self.world_size:
            raise ArgumentError(f"num_experts: expected a multiple of the group size {self.world_size}, got {num_experts}")
        self.hidden, self.ffn_hidden, self.num_experts, self.top_k = hidden, ffn_hidden, num_experts, top_k
        self.num_local_experts = num_experts // self.world_size
        self.use_fp8, self.norm_topk_prob = use_fp8, norm_topk_prob
        self.router_weight, self.w13, self.w2 = _args.allocate(lambda: (
            torch.nn.Parameter(torch.empty(num_experts, hidden, device=device)),
            torch.nn.Parameter(torch.empty(self.num_local_experts, 2 * ffn_hidden, hidden, dtype=dtype, device=device)),
            torch.nn.Parameter(torch.empty(self.num_local_experts, hidden, ffn_hidden, dtype=dtype, device=device))),
            "hidden/ffn_hidden/num_experts", (self.num_local_experts, 2 * ffn_hidden, hidden))
        if scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, device=device))
        self._fp8_cache: dict[str, tuple[Any, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._router_cache: tuple[Any, torch.Tensor] | None = None
        self.reset_parameters()
        ops.handle_of(self)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        ops.handle_of(self)      # a copy gets its own handle

    def reset_parameters(self) -> None:
        for p in (self.router_weight, self.w13, self.w2):
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)

    @property
    def local_experts(self) -> range:
        return range(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)

    @torch.no_grad()
    def load_experts(self, router_weight: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                     down_weight: torch.Tensor) -> ExpertParallelMoE:
        """Copy global weights in; this rank keeps its own experts.

        router_weight [E, hidden]; gate_weight, up_weight [E, ffn_hidden, hidden]; down_weight
        [E, hidden, ffn_hidden] (nn.Linear's [out, in] per expert).
        """
        e, h, f = self.num_experts, self.hidden, self.ffn_hidden
        for name, t, shape in (("router_weight", router_weight, (e, h)), ("gate_weight", gate_weight, (e, f, h)),
                               ("up_weight", up_weight, (e, f, h)), ("down_weight", down_weight, (e, h, f))):
            expect(tuple(t.shape) == shape, name, f"shape {shape}", tuple(t.shape))
        mine = slice(self.local_experts.start, self.local_experts.stop)
        self.router_weight.copy_(router_weight)
        self.w13.copy_(torch.cat([gate_weight[mine], up_weight[mine]], dim=1))
        self.w2.copy_(down_weight[mine])
        return self

    @classmethod
    def from_module(cls, module: torch.nn.Module, group: Any = None, use_fp8: bool = False,
                    buffer: Any = None) -> ExpertParallelMoE:
        """Build from a compatible MoE block (see `moe_block_parts`), keeping this rank's experts.

        The block's routing (softmax or DeepSeek-V3 grouped sigmoid top-k, renormalization, scaling
        factor, score-correction bias) and its shared expert(s) come along; the shared expert modules
        are the block's own (not copied).
        """
        parts = moe_block_parts(module)
        if isinstance(parts, str):
            raise ArgumentError(f"module: expected an MoE block ExpertParallelMoE can take, got "
                            f"{type(module).__name__} ({parts})")
        e, h = parts.router.shape
        moe = cls(h, parts.gate.shape[1], e, parts.top_k, group=group, use_fp8=use_fp8,
                  norm_topk_prob=parts.norm_topk_prob, buffer=buffer, device=parts.router.device,
                  shared_expert=parts.shared_expert, shared_expert_gate=parts.shared_expert_gate, **parts.routing)
        if parts.score_bias is not None:
            with torch.no_grad():
                moe.e_score_correction_bias.copy_(parts.score_bias.float())
        return moe.load_experts(parts.router.float(), parts.gate, parts.up, parts.down)

    # ------------------------------------------------------------------ forward pieces

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_idx, topk_weights) of x [T, hidden]: softmax top-k, or grouped sigmoid top-k (`scoring`).

        Logits in fp32, or in x's dtype with `router_in_input_dtype` (then scored in fp32, as
        Mixtral / Qwen-MoE do); weights times `routed_scaling_factor`, rounded to x's dtype with
        `weights_in_input_dtype` (Qwen-MoE).
        """
        if self.router_in_input_dtype:
            logits = F.linear(x, self._router_in(x.dtype)).float()
        else:
            logits = x.float() @ self.router_weight.float().T
        if self.scoring == "softmax":
            idx, w = softmax_topk(logits, self.top_k, self.norm_topk_prob)
        else:
            idx, w = grouped_sigmoid_topk(logits, self.top_k, self.e_score_correction_bias, self.n_group,
                                          self.topk_group, self.norm_topk_prob)
        if self.routed_scaling_factor != 1.0:
            w = w * self.routed_scaling_factor
        if self.weights_in_input_dtype:
            w = w.to(x.dtype).float()
        return idx, w

    def _router_in(self, dtype: torch.dtype) -> torch.Tensor:
        """router_weight in `dtype`, cast once per weight version (not on every call)."""
        w = self.router_weight
        if torch.compiler.is_compiling():
            return w.to(dtype)
        key = (w.data_ptr(), w._version, w.device, dtype)
        hit = self._router_cache
        if hit is None or hit[0] != key:
            hit = self._router_cache = (key, w.detach().to(dtype))
        return hit[1]

    def _exchange(self) -> Any:
        if self._buffer is None:
            import deepep

            if self.group is None:  # one process: the one-rank engine, whatever torch.distributed's state
                self._buffer = deepep.Buffer(None, transport="local", hidden=self.hidden)
            else:
                self._buffer = deepep.Buffer(self.group, hidden=self.hidden)
        return self._buffer

    def _fp8_weight(self, name: str, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3, 128 x 128 scales) of a weight, cast once per weight version; `swiglu`: w13's gate|up rows
        interleaved first (deepgemm.swiglu_interleave), what the SwiGLU-epilogue GEMM reads."""
        w = getattr(self, name)
        key = (w.data_ptr(), w._version, w.device)
        slot = f"{name}_swiglu" if swiglu else name
        hit = self._fp8_cache.get(slot)
        if hit is None or hit[0] != key:
            src = deepgemm.swiglu_interleave(w.detach()) if swiglu else w.detach()
            hit = (key, deepgemm.per_block_cast_to_fp8(src))
            self._fp8_cache[slot] = hit
        return hit[1]

    def _swiglu_epilogue(self) -> bool:
        """Whether the fp8 gate|up GEMM takes SwiGLU into its epilogue (ffn_hidden a multiple of 64, CUDA weights:
        the CPU keeps the unfused ops, which round gate|up to bf16 as transformers does)."""
        f = self.ffn_hidden
        if not self.w13.is_cuda or f % deepgemm.SWIGLU_INTERLEAVE or not _fused_swiglu_allowed():
            log.debug("fp8 experts: unfused silu_mul (%s)", "CPU weights" if not self.w13.is_cuda else
                      f"ffn_hidden {f} % {deepgemm.SWIGLU_INTERLEAVE}" if f % deepgemm.SWIGLU_INTERLEAVE else
                      "TILESTACK_MOE_SWIGLU=0")
            return False
        return True

    def experts_forward(self, recv_x: XTensor, layout: ContiguousLayout) -> torch.Tensor:
        """The local experts on the grouped rows: [M_sum + 1, hidden] bf16, the last row zeros (what unpermute
        reads for -1 slots, so it needs no concatenated copy); padding rows unspecified."""
        if self.use_fp8:
            x8, sx = recv_x if isinstance(recv_x, tuple) else deepgemm.per_token_cast_to_fp8(recv_x)
            a: XTensor = (_scatter_rows(x8, layout), _scatter_rows(sx, layout))
        else:
            expect(not isinstance(recv_x, tuple), "recv_x", "a bf16 tensor (use_fp8=False)", "an fp8 pair")
            a = _scatter_rows(recv_x.to(torch.bfloat16), layout)
        return self._grouped_experts(a, layout.m_indices)

    def _grouped_experts(self, a: XTensor, m_indices: torch.Tensor) -> torch.Tensor:
        """gate/up GEMM, silu(gate) * up, down GEMM on rows grouped per expert (m_indices, -1 on padding):
        [M + 1, hidden] bf16 whose last row is zeros; padding rows unspecified."""
        m, f, h = m_indices.numel(), self.ffn_hidden, self.hidden
        dev = self.w13.device
        y_ext = torch.empty((m + 1, h), dtype=torch.bfloat16, device=dev)
        y_ext[m].zero_()
        if m == 0:
            return y_ext
        y = y_ext[:m]
        # silu(gate) * up in fp32, rounded to bf16 or cast to fp8 per token: one fused kernel on CUDA (the fp32
        # product is never stored), the same values as the torch ops on CPU.
        if self.use_fp8 and self._swiglu_epilogue():
            # silu(gate) * up in the gate|up GEMM's epilogue (fp32 accumulators -> bf16 [M, F]: no [M, 2F]
            # intermediate), then one per-token cast for the down GEMM.
            act = torch.empty((m, f), dtype=torch.bfloat16, device=dev)
            deepgemm.m_grouped_fp8_gemm_nt_contiguous_swiglu(a, self._fp8_weight("w13", swiglu=True), act, m_indices)
            act8 = deepgemm.per_token_cast_to_fp8(act, tma_aligned_sf=act.is_cuda)
            deepgemm.m_grouped_fp8_gemm_nt_contiguous(act8, self._fp8_weight("w2"), y, m_indices)
        elif self.use_fp8:
            gate_up = torch.empty((m, 2 * f), dtype=torch.bfloat16, device=dev)
            deepgemm.m_grouped_fp8_gemm_nt_contiguous(a, self._fp8_weight("w13"), gate_up, m_indices)
            act8 = deepgemm.silu_mul_cast_to_fp8(gate_up, tma_aligned_sf=gate_up.is_cuda)
            deepgemm.m_grouped_fp8_gemm_nt_contiguous(act8, self._fp8_weight("w2"), y, m_indices)
        else:
            gate_up = torch.empty((m, 2 * f), dtype=torch.bfloat16, device=dev)
            deepgemm.m_grouped_bf16_gemm_nt_contiguous(a, self.w13, gate_up, m_indices)
            deepgemm.m_grouped_bf16_gemm_nt_contiguous(deepgemm.silu_mul(gate_up), self.w2, y, m_indices)
        return y_ext

    def _routed_local(self, x2: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """One process, every expert local: no exchange. Pairs sorted per expert on the device into a layout
        of static size (build_local_layout), rows gathered, the grouped GEMMs, a weighted gather-sum back:
        no host synchronization, so the step is also CUDA-graph capturable."""
        t = x2.shape[0]
        if t == 0:
            return x2.new_zeros((0, self.hidden), dtype=torch.bfloat16)
        lay = build_local_layout(topk_idx, self.num_local_experts)
        if self.use_fp8:
            # Cast the T tokens once, then gather their bytes and scales (half the bytes of gathering bf16).
            x8, sx = deepgemm.per_token_cast_to_fp8(x2.to(torch.bfloat16).contiguous(), tma_aligned_sf=x2.is_cuda)
            # The scales are gathered along the M-major layout the kernel reads ([SK, rows] in memory), so the
            # GEMM takes them as they are (a row-major gather would cost it a transposing copy).
            sfa = sx.t().index_select(1, lay.src_rows).t() if x2.is_cuda else sx.index_select(0, lay.src_rows)
            a: XTensor = (x8.view(torch.uint8).index_select(0, lay.src_rows).view(torch.float8_e4m3fn), sfa)
        else:
            a = x2.to(torch.bfloat16).index_select(0, lay.src_rows)
        y_ext = self._grouped_experts(a, lay.m_indices)
        return weighted_combine(y_ext, lay.pair_rows, topk_w)

    def forward(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden] in x's dtype.

        `routing=(topk_idx int64 [T, k], topk_weights float32 [T, k])` replaces the router (-1 = no
        expert), e.g. for group-limited routing computed elsewhere.
        """
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise RuntimeError("ExpertParallelMoE is inference-only (deepgemm records no autograd graph): run it "
                               "under torch.no_grad() / torch.inference_mode(), or set requires_grad=False")
        with torch.no_grad():
            return self._forward(x, routing)

    def _forward(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        expect(isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] == self.hidden, "x",
               f"a tensor [..., {self.hidden}]", tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__)
        expect(x.dtype in (torch.bfloat16, torch.float16, torch.float32), "x.dtype",
               "bfloat16, float16 or float32", x.dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden)
        if routing is None:
            topk_idx, topk_w = self.route(x2)
        else:
            topk_idx, topk_w = routing
            expect(topk_idx.dim() == 2 and topk_idx.shape[0] == x2.shape[0], "routing[0] (topk_idx)",
                   f"shape [{x2.shape[0]}, k]", tuple(topk_idx.shape))
            expect(tuple(topk_w.shape) == tuple(topk_idx.shape), "routing[1] (topk_weights)",
                   f"shape {tuple(topk_idx.shape)}", tuple(topk_w.shape))
            expect(bool(((topk_idx >= -1) & (topk_idx < self.num_experts)).all()), "routing[0] (topk_idx)",
                   f"expert ids in [-1, {self.num_experts})", "an id outside it")
            topk_idx, topk_w = topk_idx.to(torch.int64), topk_w.float()
        if torch.compiler.is_compiling():
            # One opaque node for torch.compile (tilestack.ops): deepep's data-dependent shapes stay inside.
            out = torch.ops.tilestack.moe_experts(x2, topk_idx, topk_w, self.w13, self.w2, self._tilestack_handle)
        else:
            out = self._routed(x2, topk_idx, topk_w)
        out = out.to(x.dtype)
        if self.shared_expert is not None:
            shared = self.shared_expert(x2)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x2)) * shared
            out = out + shared
        return out.reshape(*lead, self.hidden)

    def _routed(self, x2: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """Dispatch, the local experts, combine: x2 [T, hidden] -> bf16 [T, hidden] (routed experts only).
        One process without a group or buffer: no exchange at all (_routed_local)."""
        if self.group is None and self._buffer is None:
            return self._routed_local(x2, topk_idx, topk_w)
        buf = self._exchange()
        align = deepgemm.get_m_alignment_for_contiguous_layout()
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, self.num_experts)
        x_in: XTensor = deepgemm.per_token_cast_to_fp8(x2) if self.use_fp8 else x2.to(torch.bfloat16)
        recv_x, recv_idx, recv_w, per_local, handle, _ = buf.dispatch(
            x_in, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_w, expert_alignment=align)
        layout = build_contiguous_layout(recv_idx, per_local, self.num_local_experts, align)
        y = self.experts_forward(recv_x, layout)
        recv_out = unpermute(y, layout, recv_w).to(torch.bfloat16)
        out, _, _ = buf.combine(recv_out, handle)
        return out

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, local_experts={self.local_experts.start}..{self.local_experts.stop - 1}, "
                f"world_size={self.world_size}, use_fp8={self.use_fp8}, scoring={self.scoring}"
                + (f", n_group={self.n_group}, topk_group={self.topk_group}" if self.n_group > 1 else "")
                + (f", routed_scaling_factor={self.routed_scaling_factor}" if self.routed_scaling_factor != 1.0 else ""))


# ----------------------------------------------------------------------------- compatible blocks + reference


_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass
class MoEBlockParts:
    """What ExpertParallelMoE takes from an MoE block (global weights, before the rank split).

    router [E, H]; gate, up [E, F, H]; down [E, H, F]; routing: ExpertParallelMoE keyword arguments
    (scoring, n_group, topk_group, routed_scaling_factor, router_in_input_dtype, weights_in_input_dtype);
    score_bias: DeepSeek-V3's e_score_correction_bias [E] or None; shared_expert (+ its sigmoid gate):
    modules kept as they are; consumed: the block's children the replacement absorbs; exact: the
    replacement computes what the block's own forward computes (transformers blocks), so it may be
    swapped without being named in `include`.
    """

    router: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    top_k: int
    norm_topk_prob: bool
    routing: dict[str, Any]
    score_bias: torch.Tensor | None
    shared_expert: torch.nn.Module | None
    shared_expert_gate: torch.nn.Module | None
    consumed: tuple[str, ...]
    exact: bool
    kind: str


def _is_silu(act: Any) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


# transformers 5 blocks whose forward ExpertParallelMoE reproduces. router class -> how it routes;
# block class -> its shared-expert attributes (expert, sigmoid gate) and how they are combined.
_HF_ROUTERS = {
    "MixtralTopKRouter": "softmax_norm",
    "Qwen2MoeTopKRouter": "softmax_qwen",
    "Qwen3MoeTopKRouter": "softmax_qwen",
    "DeepseekV3TopkRouter": "grouped_sigmoid",
}
_HF_BLOCKS = {
    "MixtralSparseMoeBlock": (None, None),
    "Qwen3MoeSparseMoeBlock": (None, None),
    "Qwen2MoeSparseMoeBlock": ("shared_expert", "shared_expert_gate"),
    "DeepseekV3MoE": ("shared_experts", None),
}


def _hf_block_parts(module: torch.nn.Module, router: torch.nn.Module, experts: torch.nn.Module
                    ) -> MoEBlockParts | str:
    """A transformers 5 block: router module + experts with fused gate_up_proj / down_proj tensors."""
    block, rname = type(module).__name__, type(router).__name__
    if block not in _HF_BLOCKS:
        return (f"{block} has fused expert tensors but is not a block whose forward is known "
                f"(known: {', '.join(sorted(_HF_BLOCKS))})")
    style = _HF_ROUTERS.get(rname)
    if style is None:
        return f"router {rname} routes in a way not reproduced (known: {', '.join(sorted(_HF_ROUTERS))})"
    gu, dn = experts.gate_up_proj, experts.down_proj
    for flag, want in (("has_bias", False), ("is_transposed", False), ("has_gate", True), ("is_concatenated", True),
                       ("has_post_expert_norm", False)):
        if getattr(experts, flag, want) != want:
            return f"experts.{flag} is {getattr(experts, flag)} (ExpertParallelMoE takes {flag}={want})"
    if not _is_silu(getattr(experts, "act_fn", None)):
        return f"experts.act_fn is {type(getattr(experts, 'act_fn', None)).__name__}, ExpertParallelMoE computes SiLU"
    w = router.weight
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return "router has no 2-D weight [E, H]"
    e, h = w.shape
    if gu.dim() != 3 or gu.shape[0] != e or gu.shape[2] != h or gu.shape[1] % 2:
        return f"experts.gate_up_proj has shape {tuple(gu.shape)}, expected [{e}, 2 * F, {h}]"
    f = gu.shape[1] // 2
    if tuple(dn.shape) != (e, h, f):
        return f"experts.down_proj has shape {tuple(dn.shape)}, expected {(e, h, f)}"
    top_k = getattr(router, "top_k", None)
    if not isinstance(top_k, int):
        return "router has no integer top_k"
    score_bias = None
    if style == "softmax_norm":
        norm, routing = True, {"router_in_input_dtype": True}
    elif style == "softmax_qwen":
        norm = bool(router.norm_topk_prob)
        routing = {"router_in_input_dtype": True, "weights_in_input_dtype": True}
    else:
        norm = bool(router.norm_topk_prob)
        n_group, topk_group = int(router.num_group), int(router.topk_group)
        if n_group > 1 and (e % n_group or e // n_group < 2):
            return f"n_group={n_group} does not split {e} experts into groups of >= 2"
        routing = {"scoring": "sigmoid", "n_group": n_group, "topk_group": topk_group,
                   "routed_scaling_factor": float(router.routed_scaling_factor)}
        score_bias = router.e_score_correction_bias.detach()
    shared_name, gate_name = _HF_BLOCKS[block]
    shared = getattr(module, shared_name) if shared_name else None
    shared_gate = getattr(module, gate_name) if gate_name else None
    names = [n for n, c in module.named_children() if c is router or c is experts or c is shared_gate]
    return MoEBlockParts(w.detach(), gu[:, :f].detach(), gu[:, f:].detach(), dn.detach(), top_k, norm, routing,
                         score_bias, shared, shared_gate, tuple(names), True, f"{block} ({rname})")


def moe_block_parts(module: torch.nn.Module) -> MoEBlockParts | str:
    """What ExpertParallelMoE takes from `module`, or why it cannot take it.

    Compatible:
    - transformers 5 blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3): a router module with
      `weight [E, H]` and `top_k`, experts with fused `gate_up_proj [E, 2F, H]` / `down_proj [E, H, F]`
      tensors and SiLU, plus the block's shared expert(s). Same outputs as the block (`exact`).
    - a `gate` or `router` nn.Linear(H, E, bias=False) and `experts`, an nn.ModuleList of E SwiGLU
      experts with bias-free `gate_proj/up_proj/down_proj` (or Mixtral's `w1/w3/w2`) Linears;
      `top_k` or `num_experts_per_tok`; optional `norm_topk_prob`. The block's forward must map
      [..., H] to a tensor [..., H] with softmax top-k routing (what ExpertParallelMoE computes);
      that cannot be checked, so these are swapped only when named (`exact` False).
    """
    router = getattr(module, "router", None)
    router = router if isinstance(router, torch.nn.Module) else getattr(module, "gate", None)
    experts = getattr(module, "experts", None)
    if not isinstance(router, torch.nn.Module) or not isinstance(experts, torch.nn.Module):
        return f"{type(module).__name__} is not an nn.Linear and not an MoE block (no `gate`/`router` and `experts`)"
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor) and \
            isinstance(getattr(experts, "down_proj", None), torch.Tensor):
        return _hf_block_parts(module, router, experts)
    if not isinstance(router, torch.nn.Linear) or router.bias is not None:
        return f"router {type(router).__name__} is not a bias-free nn.Linear"
    if not isinstance(experts, torch.nn.ModuleList) or len(experts) != router.out_features:
        return f"no `experts` nn.ModuleList of {router.out_features} experts (the router's outputs)"
    top_k = getattr(module, "top_k", getattr(module, "num_experts_per_tok", None))
    if not isinstance(top_k, int):
        return "no integer `top_k` / `num_experts_per_tok`"
    gates, ups, downs = [], [], []
    for i, ex in enumerate(experts):
        names = next((n for n in _PROJ_NAMES if all(isinstance(getattr(ex, a, None), torch.nn.Linear) for a in n)),
                     None)
        if names is None:
            return f"expert {i} lacks gate_proj/up_proj/down_proj (or w1/w3/w2) nn.Linear layers"
        g, u, d = (getattr(ex, a) for a in names)
        if any(lin.bias is not None for lin in (g, u, d)):
            return f"expert {i} has biased projections"
        gates.append(g.weight)
        ups.append(u.weight)
        downs.append(d.weight)
    shapes = {(tuple(g.shape), tuple(u.shape), tuple(d.shape)) for g, u, d in zip(gates, ups, downs)}
    if len(shapes) != 1:
        return "experts of different shapes"
    names = tuple(n for n, c in module.named_children() if c is router or c is experts)
    return MoEBlockParts(router.weight.detach(), torch.stack(gates).detach(), torch.stack(ups).detach(),
                         torch.stack(downs).detach(), top_k, bool(getattr(module, "norm_topk_prob", False)), {},
                         None, None, None, names, False, "gate Linear + ModuleList of SwiGLU experts")


class SwiGLUExpert(torch.nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, ffn_hidden, bias=False, dtype=dtype)
        self.up_proj = torch.nn.Linear(hidden, ffn_hidden, bias=False, dtype=dtype)
        self.down_proj = torch.nn.Linear(ffn_hidden, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ReferenceMoE(torch.nn.Module):
    """A plain MoE block (the layout `moe_block_parts` accepts): router, then a dense loop over experts.

    Computes in its parameters' dtype (use float64 for a reference). `forward(x, routing=None)`
    routes with fp32 softmax top-k like ExpertParallelMoE, or takes the given routing.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        hidden, ffn_hidden = _args.features(hidden, "hidden"), _args.features(ffn_hidden, "ffn_hidden")
        num_experts = _args.features(num_experts, "num_experts")
        top_k = check_int(top_k, "top_k", lo=1, hi=num_experts)
        norm_topk_prob, dtype = _args.flag(norm_topk_prob, "norm_topk_prob"), _args.dtype(dtype, allow_none=False)
        self.gate, self.experts = _args.allocate(
            lambda: (torch.nn.Linear(hidden, num_experts, bias=False, dtype=dtype),
                     torch.nn.ModuleList(SwiGLUExpert(hidden, ffn_hidden, dtype) for _ in range(num_experts))),
            "hidden/ffn_hidden/num_experts", (num_experts, ffn_hidden, hidden))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        lead, h = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, h)
        if routing is None:
            # Router in fp32 like ExpertParallelMoE, so both pick the same experts.
            routing = softmax_topk(x2.float() @ self.gate.weight.float().T, self.top_k, self.norm_topk_prob)
        idx, w = routing
        out = torch.zeros_like(x2)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, expert(x2[tok]) * w[tok, slot].to(x2.dtype).unsqueeze(-1))
        return out.reshape(*lead, h)
