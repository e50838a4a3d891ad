"""Routing layout: which rank and expert each token goes to, computed from `topk_idx` alone."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tilehal import ShapeError


def check_topk_idx(topk_idx: torch.Tensor, num_experts: int, name: str = "topk_idx", values: bool = True) -> None:
    """Type and shape checks; with `values`, also the id range (a device-to-host sync on a GPU:
    the NVLink path passes values=False and lets its layout kernel report bad ids instead)."""
    if not isinstance(topk_idx, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dtype != torch.int64:
        raise ShapeError(f"{name}: expected dtype int64, got {topk_idx.dtype}")
    if topk_idx.dim() != 2:
        raise ShapeError(f"{name}: expected 2 dims [num_tokens, num_topk], got shape {tuple(topk_idx.shape)}")
    if values and topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            raise ShapeError(f"{name}: expected values in [-1, {num_experts}), got range [{lo}, {hi}]")


@dataclass
class Layout:
    num_tokens_per_rank: torch.Tensor  # [R] int32
    num_tokens_per_rdma_rank: torch.Tensor | None  # [num_nodes] int32 when the group spans nodes
    num_tokens_per_expert: torch.Tensor  # [E] int32
    is_token_in_rank: torch.Tensor  # [T, R] bool


def compute_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, num_ranks_per_node: int) -> Layout:
    """Counts per rank/node/expert and the token-to-rank mask; -1 entries route nowhere."""
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: expected a multiple of num_ranks={num_ranks}, got {num_experts}")
    check_topk_idx(topk_idx, num_experts)
    t = topk_idx.shape[0]
    experts_per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    flat = topk_idx[valid]
    num_tokens_per_expert = torch.bincount(flat, minlength=num_experts).to(torch.int32)
    # Invalid entries go to a spare column that is dropped, so one scatter covers every case.
    rank_of = torch.where(valid, topk_idx // experts_per_rank, torch.full_like(topk_idx, num_ranks))
    hit = torch.zeros(t, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, rank_of, True)
    is_token_in_rank = hit[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    per_rdma = None
    if num_ranks_per_node < num_ranks:
        num_nodes = num_ranks // num_ranks_per_node
        in_node = is_token_in_rank.view(t, num_nodes, num_ranks_per_node).any(dim=2)
        per_rdma = in_node.sum(0, dtype=torch.int32)
    return Layout(num_tokens_per_rank, per_rdma, num_tokens_per_expert, is_token_in_rank)
