"""The local engine: a group of one rank, without torch.distributed (`Buffer(group=None)` in a
process that never initialized it, or `Buffer(transport="local")`).

Same results as the torch engine on a one-rank group: every token with at least one expert is
received once, in token order; `recv_topk_idx` is `topk_idx` (every expert is local) and the
weights of -1 entries read 0; combine returns each received row to its token (zeros for tokens
routed nowhere). Nothing moves, so nothing is packed: when every token is routed, `recv_x` and
the combined rows are the caller's tensors themselves (no copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tilehal import ShapeError

from ..dispatcher import DispatchInput, DispatchOutput, EngineOptions, align_counts, pad_rows
from ..layout import Layout, compute_layout
from .torch.normal import TorchHandle

if TYPE_CHECKING:
    from ..config import Config


class LocalDispatcher:
    """One rank, one process; see deepep.dispatcher.Dispatcher."""

    handle_type = TorchHandle
    device_layout = False
    rank = 0
    num_ranks = 1

    def __init__(self, options: EngineOptions) -> None:
        self.options = options

    def layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        return compute_layout(topk_idx, num_experts, 1, 1)

    def dispatch(self, inp: DispatchInput, handle: TorchHandle | None, is_token_in_rank: torch.Tensor | None,
                 num_tokens_per_expert: torch.Tensor | None, experts_per_rank: int, expert_alignment: int,
                 num_worst_tokens: int, config: Config | None = None) -> DispatchOutput:
        t = inp.num_tokens
        if handle is None:
            in_rank = is_token_in_rank[:, 0]
            # One host read for both: the per-expert counts (the list dispatch returns) and the routed tokens.
            counts = torch.cat([num_tokens_per_expert.view(-1).to(torch.int64),
                                in_rank.sum().view(1).to(torch.int64)]).tolist()
            n = counts[-1]
            per_expert = align_counts(counts[:-1], expert_alignment)
            # send_token_idx None: every token, in order (no gather needed)
            send_idx = None if n == t else in_rank.nonzero().flatten()
            is_in = is_token_in_rank
        else:
            n, per_expert, is_in = handle.num_recv_tokens, handle.num_recv_tokens_per_expert_list, handle.is_token_in_rank
            send_idx = None if n == t else handle.send_token_idx
        if num_worst_tokens and n > num_worst_tokens:
            raise ShapeError(f"num_worst_tokens: expected >= the {n} tokens rank 0 receives, got {num_worst_tokens}")

        def take(v: torch.Tensor | None) -> torch.Tensor | None:
            if v is None or send_idx is None:
                return v
            return v.index_select(0, send_idx)

        rows = num_worst_tokens or n
        recv_x = pad_rows(take(inp.x), rows)
        recv_scales = pad_rows(take(inp.scales), rows) if inp.scales is not None else None
        recv_idx = recv_w = None
        if inp.topk_idx is not None:
            recv_idx = pad_rows(take(inp.topk_idx), rows, -1)
        if inp.topk_weights is not None:
            w = take(inp.topk_weights)
            if inp.topk_idx is not None:
                w = torch.where(recv_idx[: w.shape[0]] >= 0, w, torch.zeros_like(w))
            recv_w = pad_rows(w, rows)
        dev = inp.x.device
        idx = send_idx if send_idx is not None else torch.arange(t, device=dev)
        new = TorchHandle(num_tokens=t, hidden=inp.x.shape[1], is_token_in_rank=is_in, send_token_idx=idx,
                          send_counts=[n], recv_counts=[n], num_recv_tokens_per_expert_list=list(per_expert),
                          recv_src_idx=idx, num_worst_tokens=num_worst_tokens, experts_per_rank=experts_per_rank,
                          rank=0, count_matrix=torch.tensor([[n]], dtype=torch.int64))
        return DispatchOutput(recv_x, recv_scales, recv_idx, recv_w, new)

    def combine(self, x: torch.Tensor, handle: TorchHandle, topk_weights: torch.Tensor | None,
                config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, t = handle.num_recv_tokens, handle.num_tokens
        w = topk_weights[:n].float() if topk_weights is not None else None
        if n == t:
            return x[:n], w  # each token came back once: the rows themselves
        out = torch.zeros(t, x.shape[1], dtype=x.dtype, device=x.device)
        out.index_copy_(0, handle.send_token_idx, x[:n])
        out_w = None
        if w is not None:
            out_w = torch.zeros(t, w.shape[1], dtype=torch.float32, device=x.device)
            out_w.index_copy_(0, handle.send_token_idx, w)
        return out, out_w

    def low_latency(self) -> None:
        return None  # Buffer runs the torch engine's low-latency mode over a LocalTransport

    def destroy(self) -> None:
        pass
