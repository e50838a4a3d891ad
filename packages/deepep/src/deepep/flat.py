"""Dispatch/combine over one torch.distributed group: counts all-to-all, then one row all-to-all.

Works on any backend and any number of ranks; the reference against which the hierarchical and
NVLink paths are tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .packing import RowFormat
from .transport.torch_dist import TorchDistTransport


@dataclass
class FlatHandle:
    """What combine (and a cached dispatch) needs to repeat a dispatch's layout."""

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

    @property
    def num_recv_tokens(self) -> int:
        return sum(self.recv_counts)


def send_order(is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Token indices grouped by destination rank (token order within a rank) and the group sizes."""
    dest, tok = is_token_in_rank.t().nonzero(as_tuple=True)
    counts = torch.bincount(dest, minlength=is_token_in_rank.shape[1]).tolist()
    return tok, counts


def to_local_experts(recv_topk_idx: torch.Tensor, rank: int, experts_per_rank: int) -> torch.Tensor:
    lo = rank * experts_per_rank
    local = recv_topk_idx - lo
    ok = (recv_topk_idx >= lo) & (recv_topk_idx < lo + experts_per_rank)
    return torch.where(ok, local, torch.full_like(local, -1))


def align_counts(counts: list[int], alignment: int) -> list[int]:
    return [(c + alignment - 1) // alignment * alignment for c in counts]


def pad_rows(t: torch.Tensor, rows: int, fill: float | int = 0) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


@dataclass
class DispatchInput:
    x: torch.Tensor
    scales: torch.Tensor | None
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]


@dataclass
class DispatchOutput:
    recv_x: torch.Tensor
    recv_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    handle: object
    extra: dict = field(default_factory=dict)


def dispatch_format(inp: DispatchInput) -> RowFormat:
    fields = [("x", inp.x.dtype, inp.x.shape[1]), ("src", torch.int64, 1)]
    if inp.scales is not None:
        fields.append(("scales", inp.scales.dtype, inp.scales.shape[1]))
    if inp.topk_idx is not None:
        fields.append(("topk_idx", torch.int64, inp.topk_idx.shape[1]))
    if inp.topk_weights is not None:
        fields.append(("topk_weights", torch.float32, inp.topk_weights.shape[1]))
    return RowFormat(fields)


def pack_dispatch(fmt: RowFormat, inp: DispatchInput, token_idx: torch.Tensor) -> torch.Tensor:
    parts = {"x": inp.x.index_select(0, token_idx), "src": token_idx}
    if inp.scales is not None:
        parts["scales"] = inp.scales.index_select(0, token_idx)
    if inp.topk_idx is not None:
        parts["topk_idx"] = inp.topk_idx.index_select(0, token_idx)
    if inp.topk_weights is not None:
        parts["topk_weights"] = inp.topk_weights.index_select(0, token_idx)
    return fmt.pack(parts, token_idx.numel(), inp.x.device)


class FlatDispatcher:
    handle_type = FlatHandle
    def __init__(self, transport: TorchDistTransport) -> None:
        self.t = transport

    @property
    def rank(self) -> int:
        return self.t.rank

    @property
    def num_ranks(self) -> int:
        return self.t.num_ranks

    def dispatch(self, inp: DispatchInput, handle: FlatHandle | None, is_token_in_rank: torch.Tensor | None,
                 num_tokens_per_expert: torch.Tensor | None, experts_per_rank: int, expert_alignment: int,
                 num_worst_tokens: int) -> DispatchOutput:
        r = self.num_ranks
        if handle is None:
            send_idx, send_counts = send_order(is_token_in_rank)
            # Counts all-to-all: column 0 = rows, then the receiver's local experts' token counts.
            epr = experts_per_rank
            counts = torch.zeros(r, 1 + epr, dtype=torch.int64)
            counts[:, 0] = torch.tensor(send_counts, dtype=torch.int64)
            counts[:, 1:] = num_tokens_per_expert.detach().to("cpu", torch.int64).view(r, epr)
            recv = self.t.exchange_counts(counts, "dispatch/counts")
            recv_counts = recv[:, 0].tolist()
            per_expert = align_counts(recv[:, 1:].sum(0).tolist(), expert_alignment)
            is_in = is_token_in_rank
        else:
            send_idx, send_counts, recv_counts = handle.send_token_idx, handle.send_counts, handle.recv_counts
            per_expert = handle.num_recv_tokens_per_expert_list
            is_in = handle.is_token_in_rank
        num_recv = sum(recv_counts)
        if num_worst_tokens and num_recv > num_worst_tokens:
            raise ValueError(f"num_worst_tokens: expected >= the {num_recv} tokens rank {self.rank} receives, "
                             f"got {num_worst_tokens}")
        fmt = dispatch_format(inp)
        rows = pack_dispatch(fmt, inp, send_idx)
        got = self.t.exchange_rows(rows, send_counts, recv_counts, "dispatch/data")
        return self._unpack(fmt, got, inp, send_idx, send_counts, recv_counts, per_expert, is_in, num_worst_tokens,
                            experts_per_rank)

    def _unpack(self, fmt, got, inp, send_idx, send_counts, recv_counts, per_expert, is_in, num_worst_tokens,
                experts_per_rank):
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
        handle = FlatHandle(
            num_tokens=inp.num_tokens, hidden=inp.x.shape[1], is_token_in_rank=is_in, send_token_idx=send_idx,
            send_counts=list(send_counts), recv_counts=list(recv_counts),
            num_recv_tokens_per_expert_list=list(per_expert), recv_src_idx=fmt.unpack(got, "src").view(-1),
            num_worst_tokens=num_worst_tokens, experts_per_rank=experts_per_rank)
        return DispatchOutput(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, handle)

    def combine(self, x: torch.Tensor, handle: FlatHandle, topk_weights: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = handle.num_recv_tokens
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
