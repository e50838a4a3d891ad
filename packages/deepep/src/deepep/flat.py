"""Dispatch/combine over one torch.distributed group: counts all-to-all, then one row all-to-all.

Works on any backend and any number of ranks; the reference against which the hierarchical and
NVLink paths are tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tilehal import ShapeError

from .packing import RowFormat
from .transport.torch_dist import TorchDistTransport

# What every rank must agree on before any row moves, exchanged in a fixed-size header so that a
# disagreement can never reach the transport as mismatched byte counts (Gloo aborts the process).
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 4, torch.float8_e5m2: 5,
                torch.int64: 6, torch.int32: 7}
_DTYPE_NAMES = {v: str(k).removeprefix("torch.") for k, v in _DTYPE_CODES.items()}
META_FIELDS = ("magic", "row_bytes", "hidden", "x_dtype", "scales_cols", "topk", "topk_weights", "experts_per_rank")
_MAGIC = 0x44455045  # "DEPE"


def layout_meta(fmt: RowFormat, inp: DispatchInput, experts_per_rank: int) -> list[int]:
    """This rank's values of META_FIELDS for one dispatch (-1: absent)."""
    return [_MAGIC, fmt.row_bytes, inp.x.shape[1], _DTYPE_CODES.get(inp.x.dtype, 0),
            -1 if inp.scales is None else inp.scales.shape[1], -1 if inp.topk_idx is None else inp.topk_idx.shape[1],
            -1 if inp.topk_weights is None else inp.topk_weights.shape[1], experts_per_rank]


def check_meta(mine: list[int], recv: torch.Tensor, rank: int, stage: str) -> None:
    """Raise ShapeError, on this rank, if any peer's header (row r of `recv`) differs from `mine`."""
    want = torch.tensor(mine, dtype=torch.int64)
    bad = (recv[:, : len(mine)] != want).any(dim=1).nonzero().flatten().tolist()
    if not bad:
        return
    peer = bad[0]
    diffs = describe_meta_diff(mine, recv[peer, : len(mine)].tolist(), "here", f"on rank {peer}")
    raise ShapeError(f"{stage}: expected every rank to dispatch the same layout, got {diffs} (rank {rank}; "
                     f"ranks {bad} differ). Every rank must pass x of one hidden size and dtype, the same "
                     "scales/topk_idx/topk_weights presence and widths, and the same number of experts")


def describe_meta_diff(a: list[int], b: list[int], a_name: str, b_name: str) -> str:
    def show(name, v):
        if name == "x_dtype":
            return _DTYPE_NAMES.get(v, f"code {v}")
        return "none" if v == -1 and name in ("scales_cols", "topk", "topk_weights") else v

    return ", ".join(f"{n} {show(n, x)} {a_name} vs {show(n, y)} {b_name}"
                     for n, x, y in zip(META_FIELDS, a, b) if x != y)


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

    def __getitem__(self, i: int) -> object:
        return self.as_tuple()[i]

    def __iter__(self):
        return iter(self.as_tuple())

    def __len__(self) -> int:
        return 6


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
        handle = FlatHandle(
            num_tokens=inp.num_tokens, hidden=inp.x.shape[1], is_token_in_rank=is_in, send_token_idx=send_idx,
            send_counts=list(send_counts), recv_counts=list(recv_counts),
            num_recv_tokens_per_expert_list=list(per_expert), recv_src_idx=fmt.unpack(got, "src").view(-1),
            num_worst_tokens=num_worst_tokens, experts_per_rank=experts_per_rank, rank=self.rank,
            count_matrix=count_matrix)
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
