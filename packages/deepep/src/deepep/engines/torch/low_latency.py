"""The torch engine's low-latency mode: dispatch/combine over a row transport: fixed per-expert receive buffers.

Every (token, expert) pair is its own row, so the receiver's experts get packed
`[num_local_experts, num_ranks * max_tokens, hidden]` inputs ready for a masked grouped GEMM;
combine returns each expert's output to the token's rank, which takes the top-k weighted sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...dispatcher import HandleTuple
from ...fp8 import pack_ue8m0, per_token_cast_to_fp8
from ...packing import RowFormat
from ...transport.torch_dist import TorchDistTransport


@dataclass
class LowLatencyHandle(HandleTuple):
    """What low_latency_combine needs. Indexable like DeepEP's handle tuple:
    (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts), where
    src_info [local_experts, ranks * max_tokens] int32 is each received row's token index on its
    source rank and layout_range [local_experts, ranks] int64 is (first row << 32) | row count per
    source rank (valid once the dispatch's receive has finished)."""
    _TUPLE_LEN = 5  # as_tuple()'s length

    num_tokens: int
    hidden: int
    num_experts: int
    num_max_dispatch_tokens_per_rank: int
    pair_token: torch.Tensor  # [P] token index of each sent (token, expert) pair, grouped by destination
    pair_slot: torch.Tensor  # [P] which top-k slot the pair came from
    send_counts: list[int]
    recv_counts: list[int]
    recv_expert: torch.Tensor  # [N] local expert of each received row (in arrival order)
    recv_slot: torch.Tensor  # [N] its row inside that expert's block of recv_x
    recv_src_rank: torch.Tensor  # [N]
    recv_src_token: torch.Tensor  # [N]
    masked: frozenset = frozenset()  # ranks masked when this dispatch ran (combine skips them too)
    src_info: torch.Tensor | None = None
    layout_range: torch.Tensor | None = None

    def as_tuple(self) -> tuple:
        return (self.src_info, self.layout_range, self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)


class LowLatencyBuffers:
    """The fixed output tensors; the same storage is returned by every call with the same `slot` (CUDA-graph
    friendly). Dispatch alternates between two slots, so two results are live at once (as DeepEP)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}
        self.parity = 0

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            col_major: bool = False) -> torch.Tensor:
        k = (key, shape, dtype, str(device), col_major)
        t = self._cache.get(k)
        if t is None:
            # Drop stale shapes of the same key: only one layout is live at a time.
            for old in [o for o in self._cache if o[0] == key]:
                del self._cache[old]
            if col_major:
                # [..., rows, cols] stored column-major with the row count padded to 16 bytes (TMA-aligned):
                # the scale layout deepgemm's masked GEMM reads without a copy.
                *lead, rows, cols = shape
                pad = (rows + 3) // 4 * 4
                t = torch.zeros((*lead, cols, pad), dtype=dtype, device=device)[..., :rows].transpose(-1, -2)
            else:
                t = torch.zeros(shape, dtype=dtype, device=device)
            self._cache[k] = t
        return t


def ll_dispatch(t: TorchDistTransport, bufs: LowLatencyBuffers, x: torch.Tensor, topk_idx: torch.Tensor,
                max_tokens: int, num_experts: int, use_fp8: bool, round_scale: bool = False, use_ue8m0: bool = False,
                masked: frozenset[int] = frozenset(), wait_ns: torch.Tensor | None = None,
                lost: set[int] | None = None) -> tuple[Callable[[], tuple], LowLatencyHandle]:
    """Issue the exchange; the returned `finish()` waits and fills the fixed buffers (of this call's slot).

    `lost` (shrink mode, a set the caller owns): peers that fail or pass the deadline during this call
    are added to it and left out like masked ones (nothing from them is received; the combine of this
    handle skips them too)."""
    r = t.num_ranks
    epr = num_experts // r
    num_tokens, k = topk_idx.shape
    hidden = x.shape[1]
    flat = topk_idx.reshape(-1)
    keep = flat >= 0
    if masked:  # pairs for experts of masked ranks are not sent
        owner = torch.div(flat.clamp(min=0), epr, rounding_mode="floor")
        keep &= ~torch.isin(owner, torch.tensor(sorted(masked), device=flat.device))
    pair = keep.nonzero(as_tuple=True)[0]
    dest = flat[pair] // epr
    dest_sorted, order = torch.sort(dest, stable=True)
    pair = pair[order]
    pair_token, pair_slot = pair // k, pair % k
    send_counts = torch.bincount(dest_sorted, minlength=r).tolist()
    local_expert = flat[pair] - dest_sorted * epr

    if use_fp8:
        x_fp8, scales = per_token_cast_to_fp8(x, round_scale=round_scale)
        fmt = RowFormat([("x", torch.float8_e4m3fn, hidden), ("scales", torch.float32, scales.shape[1]),
                         ("meta", torch.int64, 2)])
        parts = {"x": x_fp8.index_select(0, pair_token), "scales": scales.index_select(0, pair_token)}
    else:
        fmt = RowFormat([("x", x.dtype, hidden), ("meta", torch.int64, 2)])
        parts = {"x": x.index_select(0, pair_token)}
    parts["meta"] = torch.stack([local_expert, pair_token], dim=1)
    rows = fmt.pack(parts, pair.numel(), x.device)

    counts = torch.tensor(send_counts, dtype=torch.int64).view(r, 1)
    recv_counts = t.exchange_counts(counts, "low_latency_dispatch/counts", masked, lost)[:, 0].tolist()
    get_rows = t.exchange_rows_start(rows, send_counts, recv_counts, "low_latency_dispatch/data", masked, wait_ns,
                                     lost)
    empty = torch.empty(0, dtype=torch.int64, device=x.device)  # filled in by finish()
    handle = LowLatencyHandle(num_tokens, hidden, num_experts, max_tokens, pair_token, pair_slot, send_counts,
                              recv_counts, empty, empty, empty, empty, masked)
    slot_name = f"/{bufs.parity}"
    bufs.parity ^= 1

    def finish() -> tuple:
        got = get_rows()
        src_rank = torch.repeat_interleave(torch.arange(r, device=got.device),
                                           torch.tensor(recv_counts, device=got.device))
        if lost:  # a peer that stopped after its counts: its (zero-filled) rows are not received
            handle.masked = masked | frozenset(lost)
            live = ~torch.isin(src_rank, torch.tensor(sorted(lost), device=got.device))
            got, src_rank = got[live], src_rank[live]
            handle.recv_counts = [0 if q in lost else c for q, c in enumerate(recv_counts)]
        meta = fmt.unpack(got, "meta")
        expert, src_token = meta[:, 0], meta[:, 1]
        # Rows arrive grouped by source rank; a stable sort by expert keeps that order inside an expert.
        by_expert = torch.sort(expert, stable=True)[1]
        recv_count = torch.bincount(expert, minlength=epr)
        starts = torch.cumsum(recv_count, 0) - recv_count
        slot = torch.empty_like(expert)
        slot[by_expert] = torch.arange(expert.numel(), device=got.device) - starts[expert[by_expert]]
        cap = r * max_tokens
        if use_fp8:
            out_x = bufs.get("x" + slot_name, (epr, cap, hidden), torch.float8_e4m3fn, x.device)
            # Through uint8: index_put has no fp8 kernel on every backend.
            out_x.view(torch.uint8)[expert, slot] = fmt.view(got, "x").view(torch.uint8)
            sc = fmt.view(got, "scales")
            if use_ue8m0:
                out_s = bufs.get("scales_ue8m0" + slot_name, (epr, cap, hidden // 512), torch.int32, x.device, True)
                out_s[expert, slot] = pack_ue8m0(sc)
            else:
                out_s = bufs.get("scales" + slot_name, (epr, cap, hidden // 128), torch.float32, x.device, True)
                out_s[expert, slot] = sc
            recv_x: object = (out_x, out_s)
        else:
            out_x = bufs.get("x_bf16" + slot_name, (epr, cap, hidden), x.dtype, x.device)
            out_x[expert, slot] = fmt.view(got, "x")
            recv_x = out_x
        out_count = bufs.get("count" + slot_name, (epr,), torch.int32, x.device)
        out_count.copy_(recv_count)
        handle.recv_expert, handle.recv_slot = expert, slot
        handle.recv_src_rank, handle.recv_src_token = src_rank, src_token
        src_info = torch.zeros(epr, cap, dtype=torch.int32, device=x.device)
        src_info[expert, slot] = src_token.to(torch.int32)
        per_rank = torch.zeros(epr, r, dtype=torch.int64, device=x.device)
        per_rank.index_put_((expert, src_rank), torch.ones_like(expert), accumulate=True)
        begin = torch.cumsum(per_rank, 1) - per_rank
        handle.src_info, handle.layout_range = src_info, (begin << 32) | per_rank
        return recv_x, out_count

    return finish, handle


def ll_combine(t: TorchDistTransport, x: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
               out: torch.Tensor | None, wait_ns: torch.Tensor | None = None,
               masked: frozenset[int] = frozenset(), lost: set[int] | None = None) -> Callable[[], torch.Tensor]:
    """Issue the return trip; `finish()` waits and takes each token's weighted sum. Rows of ranks masked at
    dispatch or now (`masked`), or lost during this call (shrink mode), do not come back: they count as
    zeros."""
    rows_back = x[handle.recv_expert, handle.recv_slot]
    fmt = RowFormat([("x", x.dtype, handle.hidden)])
    rows = fmt.pack({"x": rows_back}, rows_back.shape[0], x.device)
    get_rows = t.exchange_rows_start(rows, handle.recv_counts, handle.send_counts, "low_latency_combine/data",
                                     handle.masked | masked, wait_ns, lost)

    def finish() -> torch.Tensor:
        got = fmt.unpack(get_rows(), "x").float()
        w = topk_weights[handle.pair_token, handle.pair_slot].float().unsqueeze(1)
        acc = torch.zeros(handle.num_tokens, handle.hidden, dtype=torch.float32, device=x.device)
        acc.index_add_(0, handle.pair_token, got * w)
        if out is None:
            return acc.to(x.dtype)
        out.copy_(acc)
        return out

    return finish
