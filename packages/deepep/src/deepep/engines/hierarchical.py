"""Two-level dispatch/combine for groups spanning several nodes (DeepEP's internode design).

Stage 1 crosses nodes on "rails": rank (node a, local l) sends a token once to rank (node b, l)
if any rank of node b wants it, together with the node-local destination mask. Stage 2 fans out
inside node b. Combine runs backwards and sums inside the node before crossing nodes again, so
each token crosses the slow link at most once per destination node in each direction.
Nodes are contiguous blocks of `num_ranks_per_node` ranks of the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tilehal import ShapeError

from ..dispatcher import (
    DispatchInput,
    DispatchOutput,
    EngineOptions,
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
from ..layout import Layout, compute_layout
from ..packing import RowFormat
from ..transport.torch_dist import TorchDistTransport, destroy_own_group

if TYPE_CHECKING:
    from ..config import Config


@dataclass
class HierarchicalHandle:
    num_tokens: int
    hidden: int
    is_token_in_rank: torch.Tensor
    experts_per_rank: int
    # stage 1 (rails): my tokens per destination node
    s1_send_idx: torch.Tensor
    s1_send_counts: list[int]
    s1_recv_counts: list[int]
    # stage 2 (in node): which stage-1 row each forwarded row is, per local destination
    s2_send_rows: torch.Tensor
    s2_send_counts: list[int]
    s2_recv_counts: list[int]
    # final order (by source rank, then token) of the stage-2 rows
    final_order: torch.Tensor
    num_recv_tokens_per_expert_list: list[int]
    recv_src_idx: torch.Tensor
    inter_node_rows_sent: int  # rows that left this node (the test of "once per node")
    num_worst_tokens: int = 0
    meta: tuple[int, ...] = ()  # dispatcher.layout_meta of the dispatch that made it

    @property
    def num_recv_tokens(self) -> int:
        return int(self.final_order.numel())


def _subgroups(group: dist.ProcessGroup, per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(my node's group, my rail's group). Every rank creates every subgroup, in the same order."""
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    glob = [dist.get_global_rank(group, r) if group is not dist.group.WORLD else r for r in range(size)]
    nodes = size // per_node
    node_group = rail_group = None
    for n in range(nodes):
        g = dist.new_group([glob[n * per_node + l] for l in range(per_node)])
        if me // per_node == n:
            node_group = g
    for l in range(per_node):
        g = dist.new_group([glob[n * per_node + l] for n in range(nodes)])
        if me % per_node == l:
            rail_group = g
    return node_group, rail_group


class HierarchicalDispatcher:
    """The hierarchical engine (nodes of `options.num_ranks_per_node` ranks); see deepep.dispatcher."""

    handle_type = HierarchicalHandle
    device_layout = False

    def __init__(self, options: EngineOptions) -> None:
        group, num_ranks_per_node, timeout_s = options.group, options.num_ranks_per_node, options.timeout_s
        self.per_node = num_ranks_per_node
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_nodes = self.num_ranks // num_ranks_per_node
        node_group, rail_group = _subgroups(group, num_ranks_per_node)
        self.node = TorchDistTransport(node_group, timeout_s)  # rank index inside = local rank
        self.rail = TorchDistTransport(rail_group, timeout_s)  # rank index inside = node index
        self.flat = TorchDistTransport(group, timeout_s)  # the whole group: layout headers

    def dispatch(self, inp: DispatchInput, handle: HierarchicalHandle | None, is_token_in_rank, num_tokens_per_expert,
                 experts_per_rank: int, expert_alignment: int, num_worst_tokens: int,
                 config: Config | None = None) -> DispatchOutput:
        if handle is not None:
            is_token_in_rank = handle.is_token_in_rank
        t, L = inp.num_tokens, self.per_node
        node_mask = is_token_in_rank.view(t, self.num_nodes, L)
        in_node = node_mask.any(dim=2)  # [T, nodes]
        bits = (node_mask.to(torch.int64) << torch.arange(L, device=node_mask.device)).sum(dim=2)  # [T, nodes]

        # Stage 1: once per destination node, along my rail.
        s1_idx, s1_counts = send_order(in_node)
        s1_node = torch.repeat_interleave(torch.arange(self.num_nodes, device=s1_idx.device),
                                          torch.tensor(s1_counts, device=s1_idx.device))
        fmt1 = dispatch_format(inp)
        fmt1 = RowFormat([(f.name, f.dtype, f.width) for f in fmt1.fields.values()] + [("route", torch.int64, 2)])
        rows = pack_dispatch_with_route(fmt1, inp, s1_idx, bits[s1_idx, s1_node], self.rank)
        meta = layout_meta(dispatch_format(inp), inp, experts_per_rank)
        if handle is None:
            # The layout header (dispatcher.layout_meta) goes to every rank of the group first, so that every
            # rank sees any disagreement and raises, before a row of either stage moves.
            head = torch.tensor([meta] * self.num_ranks, dtype=torch.int64)
            check_meta(meta, self.flat.exchange_counts(head, "dispatch/counts"), self.rank, "dispatch")
            s1_recv = self.rail.exchange_counts(torch.tensor(s1_counts).view(-1, 1), "dispatch/inter-node counts")
            s1_recv_counts = s1_recv[:, 0].tolist()
        else:
            # A cached dispatch may change x's layout when every rank does: the same header, checked everywhere.
            head = torch.tensor([meta] * self.num_ranks, dtype=torch.int64)
            check_meta(meta, self.flat.exchange_counts(head, "dispatch/cached_layout"), self.rank, "dispatch (cached)")
            s1_recv_counts = handle.s1_recv_counts
        got1 = self.rail.exchange_rows(rows, s1_counts, s1_recv_counts, "dispatch/inter-node data")

        # Stage 2: fan out inside the node by the mask that travelled with the row.
        route = fmt1.unpack(got1, "route")
        mask = ((route[:, 0:1] >> torch.arange(L, device=route.device)) & 1).bool()  # [N1, L]
        s2_rows, s2_counts = send_order(mask)
        if handle is None:
            s2_recv = self.node.exchange_counts(torch.tensor(s2_counts).view(-1, 1), "dispatch/intra-node counts")
            s2_recv_counts = s2_recv[:, 0].tolist()
        else:
            s2_recv_counts = handle.s2_recv_counts
        got2 = self.node.exchange_rows(got1.index_select(0, s2_rows), s2_counts, s2_recv_counts,
                                       "dispatch/intra-node data")
        route2 = fmt1.unpack(got2, "route")
        # Rows from one source rank all come through one forwarder, in token order: a stable sort
        # by source rank gives DeepEP's order.
        final_order = torch.sort(route2[:, 1], stable=True)[1] if handle is None else handle.final_order
        got = got2.index_select(0, final_order)

        rows_out = num_worst_tokens or got.shape[0]
        if num_worst_tokens and got.shape[0] > num_worst_tokens:
            raise ShapeError(f"num_worst_tokens: expected >= the {got.shape[0]} tokens rank {self.rank} receives, "
                             f"got {num_worst_tokens}")
        recv_x = pad_rows(fmt1.unpack(got, "x"), rows_out)
        recv_scales = pad_rows(fmt1.unpack(got, "scales"), rows_out) if inp.scales is not None else None
        recv_topk_idx = recv_topk_weights = None
        if inp.topk_idx is not None:
            recv_topk_idx = to_local_experts(fmt1.unpack(got, "topk_idx"), self.rank, experts_per_rank)
        if handle is None:
            if recv_topk_idx is None:
                raise ShapeError("topk_idx: the hierarchical transport needs topk_idx on a dispatch without handle")
            valid = recv_topk_idx[recv_topk_idx >= 0]
            per_expert = align_counts(torch.bincount(valid, minlength=experts_per_rank).tolist(), expert_alignment)
        else:
            per_expert = handle.num_recv_tokens_per_expert_list
        if inp.topk_weights is not None:
            w = fmt1.unpack(got, "topk_weights")
            if recv_topk_idx is not None:
                w = torch.where(recv_topk_idx >= 0, w, torch.zeros_like(w))
            recv_topk_weights = pad_rows(w, rows_out)
        if recv_topk_idx is not None:
            recv_topk_idx = pad_rows(recv_topk_idx, rows_out, -1)
        my_node = self.rank // L
        new = HierarchicalHandle(
            num_tokens=t, hidden=inp.x.shape[1], is_token_in_rank=is_token_in_rank, experts_per_rank=experts_per_rank,
            s1_send_idx=s1_idx, s1_send_counts=s1_counts, s1_recv_counts=s1_recv_counts, s2_send_rows=s2_rows,
            s2_send_counts=s2_counts, s2_recv_counts=s2_recv_counts, final_order=final_order,
            num_recv_tokens_per_expert_list=per_expert, recv_src_idx=fmt1.unpack(got, "src").view(-1),
            inter_node_rows_sent=sum(c for n, c in enumerate(s1_counts) if n != my_node),
            num_worst_tokens=num_worst_tokens)
        new.meta = tuple(meta)
        return DispatchOutput(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, new)

    def layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        return compute_layout(topk_idx, num_experts, self.num_ranks, self.per_node)

    def low_latency(self) -> None:
        return None  # the low-latency mode stays single level (Buffer's torch engine over the group)

    def destroy(self) -> None:
        node, rail = self.node.group, self.rail.group
        for t in (self.node, self.rail, self.flat):
            t.close()
        for g in (node, rail):  # made by this engine (_subgroups): freed with it
            destroy_own_group(g)

    def combine(self, x: torch.Tensor, handle: HierarchicalHandle, topk_weights: torch.Tensor | None,
                config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = handle.num_recv_tokens
        meta = combine_meta(x, topk_weights)
        head = torch.tensor([meta] * self.num_ranks, dtype=torch.int64)
        check_combine_meta(meta, self.flat.exchange_counts(head, "combine/layout"), self.rank)
        width = x.shape[1]
        acc_dtype = torch.float32
        fields = [("x", acc_dtype, width)]
        if topk_weights is not None:
            fields.append(("w", torch.float32, topk_weights.shape[1]))
        fmt = RowFormat(fields)
        # Undo the final sort, so rows line up with what each forwarder sent us.
        parts = {"x": torch.empty(n, width, dtype=acc_dtype, device=x.device)}
        parts["x"][handle.final_order] = x[:n].to(acc_dtype)
        if topk_weights is not None:
            parts["w"] = torch.empty(n, topk_weights.shape[1], dtype=torch.float32, device=x.device)
            parts["w"][handle.final_order] = topk_weights[:n]
        rows = fmt.pack(parts, n, x.device)
        back2 = self.node.exchange_rows(rows, handle.s2_recv_counts, handle.s2_send_counts,
                                        "combine/intra-node data")
        # Sum inside the node: every forwarded copy of a stage-1 row adds into that row.
        n1 = sum(handle.s1_recv_counts)
        part = torch.zeros(n1, width, dtype=acc_dtype, device=x.device)
        part.index_add_(0, handle.s2_send_rows, fmt.view(back2, "x"))
        parts1 = {"x": part}
        if topk_weights is not None:
            pw = torch.zeros(n1, topk_weights.shape[1], dtype=torch.float32, device=x.device)
            pw.index_add_(0, handle.s2_send_rows, fmt.view(back2, "w"))
            parts1["w"] = pw
        back1 = self.rail.exchange_rows(fmt.pack(parts1, n1, x.device), handle.s1_recv_counts,
                                        handle.s1_send_counts, "combine/inter-node data")
        acc = torch.zeros(handle.num_tokens, width, dtype=acc_dtype, device=x.device)
        acc.index_add_(0, handle.s1_send_idx, fmt.view(back1, "x"))
        combined_w = None
        if topk_weights is not None:
            combined_w = torch.zeros(handle.num_tokens, topk_weights.shape[1], dtype=torch.float32, device=x.device)
            combined_w.index_add_(0, handle.s1_send_idx, fmt.view(back1, "w"))
        return acc.to(x.dtype), combined_w


def pack_dispatch_with_route(fmt: RowFormat, inp: DispatchInput, token_idx: torch.Tensor, local_bits: torch.Tensor,
                             src_rank: int) -> torch.Tensor:
    rows = pack_dispatch(RowFormat([(f.name, f.dtype, f.width) for f in fmt.fields.values() if f.name != "route"]),
                         inp, token_idx)
    out = torch.empty(rows.shape[0], fmt.row_bytes, dtype=torch.uint8, device=rows.device)
    out[:, : rows.shape[1]] = rows
    route = torch.stack([local_bits, torch.full_like(local_bits, src_rank)], dim=1)
    fmt.view(out, "route").copy_(route)
    return out
