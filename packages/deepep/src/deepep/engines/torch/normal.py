"""The torch engine: dispatch/combine over one torch.distributed group (counts all-to-all, then
one row all-to-all).

Works on any backend and any number of ranks; the reference against which the hierarchical and
NVLink engines are tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tilehal import ShapeError

from ...dispatcher import (
    DispatchInput,
    DispatchOutput,
    EngineOptions,
    HandleTuple,
    align_counts,
    check_combine_meta,
    check_meta,
    combine_meta,
    dispatch_format,
    layout_meta,
    pack_dispatch,
    pad_rows,
    send_order,
    to_local_experts,
)
from ...layout import Layout, compute_layout
from ...packing import RowFormat
from ...transport.torch_dist import TorchDistTransport

if TYPE_CHECKING:
    from ...config import Config

@dataclass
class TorchHandle(HandleTuple):
    """What combine (and a cached dispatch) needs to repeat a dispatch's layout."""
    _TUPLE_LEN = 6  # as_tuple()'s length

    num_tokens: int
    hidden: int
    is_token_in_rank: torch.Tensor  # [T, R] bool
    send_token_idx: torch.Tensor  # [sum(send_counts)] int64, grouped by destination rank
    send_counts: list[int]
    recv_counts: list[int]  # rows from each source rank
    num_recv_tokens_per_expert_list: list[int]
    recv_src_idx: torch.Tensor  # [num_recv] int64: the token's index on its source rank
    num_worst_tokens: int = 0
    experts_per_rank: int = 1
    meta: tuple[int, ...] = ()  # layout_meta of the dispatch that made it (all ranks agreed on it)
    rank: int = 0
    count_matrix: torch.Tensor | None = None  # [R (source), R (destination)] rows, every rank's sends

    @property
    def num_recv_tokens(self) -> int:
        return sum(self.recv_counts)

    def as_tuple(self) -> tuple:
        """DeepEP's intranode handle: (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
        recv_src_idx, is_token_in_rank, send_head). rank_prefix_matrix [R, R] int32: [i][j] = rows ranks
        0..i send to rank j; one "channel" per rank pair here, so channel_prefix_matrix [R, 1] = rows sent
        to each rank and recv_channel_prefix_matrix [R, 1] = rows received from each; send_head [T, R] int32
        = a token's row among those sent to a rank (-1: not sent)."""
        dev = self.is_token_in_rank.device
        r = self.is_token_in_rank.shape[1]
        mat = self.count_matrix if self.count_matrix is not None else torch.zeros(r, r, dtype=torch.int64)
        rank_prefix = torch.cumsum(mat, 0).to(torch.int32).to(dev)
        chan = torch.tensor(self.send_counts, dtype=torch.int32, device=dev).view(r, 1)
        recv_chan = torch.tensor(self.recv_counts, dtype=torch.int32, device=dev).view(r, 1)
        head = torch.cumsum(self.is_token_in_rank.to(torch.int32), 0) - 1
        head = torch.where(self.is_token_in_rank, head, torch.full_like(head, -1)).to(torch.int32)
        return rank_prefix, chan, recv_chan, self.recv_src_idx, self.is_token_in_rank, head


class TorchDispatcher:
    """The torch engine (any backend, any number of ranks); see deepep.dispatcher.Dispatcher."""

    handle_type = TorchHandle
    device_layout = False

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.t = TorchDistTransport(options.group, options.timeout_s)

    @property
    def rank(self) -> int:
        return self.t.rank

    @property
    def num_ranks(self) -> int:
        return self.t.num_ranks

    def dispatch(self, inp: DispatchInput, handle: TorchHandle | None, is_token_in_rank: torch.Tensor | None,
                 num_tokens_per_expert: torch.Tensor | None, experts_per_rank: int, expert_alignment: int,
                 num_worst_tokens: int, config: Config | None = None) -> DispatchOutput:
        r = self.num_ranks
        fmt = dispatch_format(inp)
        meta = layout_meta(fmt, inp, experts_per_rank)
        if handle is None:
            send_idx, send_counts = send_order(is_token_in_rank)
            # Header all-to-all, fixed width: the layout every rank must agree on, then the row counts.
            head = torch.zeros(r, len(meta) + 1, dtype=torch.int64)
            head[:, : len(meta)] = torch.tensor(meta, dtype=torch.int64)
            head[:, len(meta)] = torch.tensor(send_counts, dtype=torch.int64)
            recv_head = self.t.exchange_counts(head, "dispatch/counts")
            check_meta(meta, recv_head, self.rank, "dispatch")
            recv_counts = recv_head[:, len(meta)].tolist()
            # Then the receiver's local experts' token counts (now known to be the same width everywhere).
            epr = experts_per_rank
            counts = torch.zeros(r, 1 + epr, dtype=torch.int64)
            counts[:, 0] = torch.tensor(send_counts, dtype=torch.int64)
            counts[:, 1:] = num_tokens_per_expert.detach().to("cpu", torch.int64).view(r, epr)
            # An all-gather (not an all-to-all) of the same few integers: every rank also learns every rank's
            # sends, the handle's rank_prefix_matrix (DeepEP's handle[0]).
            gathered = self.t.gather_counts(counts, "dispatch/expert_counts")
            count_matrix = gathered[:, :, 0]
            per_expert = align_counts(gathered[:, self.rank, 1:].sum(0).tolist(), expert_alignment)
            is_in = is_token_in_rank
        else:
            # A cached dispatch may carry a new x layout (DeepEP's tuning replays one handle with fp8 and
            # bf16 x) as long as every rank does the same. The fixed-width header exchange of a fresh
            # dispatch (one tiny all-to-all) checks that on every rank before any row moves.
            head = torch.tensor([meta], dtype=torch.int64).repeat(r, 1)
            check_meta(meta, self.t.exchange_counts(head, "dispatch/cached_layout"), self.rank,
                       "dispatch (cached)")
            send_idx, send_counts, recv_counts = handle.send_token_idx, handle.send_counts, handle.recv_counts
            per_expert = handle.num_recv_tokens_per_expert_list
            is_in = handle.is_token_in_rank
            count_matrix = handle.count_matrix
        num_recv = sum(recv_counts)
        if num_worst_tokens and num_recv > num_worst_tokens:
            raise ShapeError(f"num_worst_tokens: expected >= the {num_recv} tokens rank {self.rank} receives, "
                             f"got {num_worst_tokens}")
        rows = pack_dispatch(fmt, inp, send_idx)
        got = self.t.exchange_rows(rows, send_counts, recv_counts, "dispatch/data")
        out = self._unpack(fmt, got, inp, send_idx, send_counts, recv_counts, per_expert, is_in, num_worst_tokens,
                           experts_per_rank, count_matrix)
        out.handle.meta = tuple(meta)
        return out

    def _unpack(self, fmt, got, inp, send_idx, send_counts, recv_counts, per_expert, is_in, num_worst_tokens,
                experts_per_rank, count_matrix=None):
        rows_out = num_worst_tokens or got.shape[0]
        recv_x = pad_rows(fmt.unpack(got, "x"), rows_out)
        recv_scales = pad_rows(fmt.unpack(got, "scales"), rows_out) if inp.scales is not None else None
        recv_topk_idx = recv_topk_weights = None
        if inp.topk_idx is not None:
            recv_topk_idx = to_local_experts(fmt.unpack(got, "topk_idx"), self.rank, experts_per_rank)
            recv_topk_idx = pad_rows(recv_topk_idx, rows_out, -1)
        if inp.topk_weights is not None:
            w = fmt.unpack(got, "topk_weights")
            if recv_topk_idx is not None:
                w = torch.where(recv_topk_idx[: w.shape[0]] >= 0, w, torch.zeros_like(w))
            recv_topk_weights = pad_rows(w, rows_out)
        handle = TorchHandle(
            num_tokens=inp.num_tokens, hidden=inp.x.shape[1], is_token_in_rank=is_in, send_token_idx=send_idx,
            send_counts=list(send_counts), recv_counts=list(recv_counts),
            num_recv_tokens_per_expert_list=list(per_expert), recv_src_idx=fmt.unpack(got, "src").view(-1),
            num_worst_tokens=num_worst_tokens, experts_per_rank=experts_per_rank, rank=self.rank,
            count_matrix=count_matrix)
        return DispatchOutput(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, handle)

    def layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        return compute_layout(topk_idx, num_experts, self.num_ranks, self.options.num_ranks_per_node)

    def low_latency(self) -> None:
        return None  # Buffer runs engines/torch/low_latency.py over the group

    def destroy(self) -> None:
        self.t.close()  # outstanding works waited for; the caller's group is let go

    def combine(self, x: torch.Tensor, handle: TorchHandle, topk_weights: torch.Tensor | None,
                config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = handle.num_recv_tokens
        # Every rank's row layout first (one tiny all-to-all): rows of different widths must never reach the
        # transport as mismatched byte counts (Gloo aborts the process).
        meta = combine_meta(x, topk_weights)
        head = torch.tensor([meta], dtype=torch.int64).repeat(self.num_ranks, 1)
        check_combine_meta(meta, self.t.exchange_counts(head, "combine/layout"), self.rank)
        fields = [("x", x.dtype, x.shape[1])]
        parts = {"x": x[:n]}
        if topk_weights is not None:
            fields.append(("w", torch.float32, topk_weights.shape[1]))
            parts["w"] = topk_weights[:n].float()
        fmt = RowFormat(fields)
        rows = fmt.pack(parts, n, x.device)
        back = self.t.exchange_rows(rows, handle.recv_counts, handle.send_counts, "combine/data")
        return reduce_back(fmt, back, handle.send_token_idx, handle.num_tokens, x, topk_weights)


def reduce_back(fmt: RowFormat, back: torch.Tensor, token_idx: torch.Tensor, num_tokens: int, x: torch.Tensor,
                topk_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum the rows that came back for each token (fp32 accumulation, cast to x's dtype)."""
    acc = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    acc.index_add_(0, token_idx, fmt.unpack(back, "x").float())
    combined_w = None
    if topk_weights is not None:
        combined_w = torch.zeros(num_tokens, topk_weights.shape[1], dtype=torch.float32, device=x.device)
        combined_w.index_add_(0, token_idx, fmt.unpack(back, "w"))
    return acc.to(x.dtype), combined_w
