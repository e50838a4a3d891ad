"""Gradient compression for data-parallel training, as torch.distributed DDP communication hooks.

    state = Int8ErrorFeedbackState(process_group=None)
    model.register_comm_hook(state, int8_error_feedback_hook)     # ~4:1 against fp32

    state = TopKErrorFeedbackState(ratio=0.01)
    model.register_comm_hook(state, topk_error_feedback_hook)

Both keep the compression error of each bucket and add it to the next step's gradient (error
feedback), which is what lets a lossy all-reduce converge like the exact one. Each rank
all-gathers the compressed payloads and averages them locally (int8 sums would overflow).
The residuals live in the state object; `state.state_dict()` / `load_state_dict()` carry them
through a checkpoint.
"""

# No `from __future__ import annotations`: DDP inspects the hooks' annotations at runtime.
from typing import Any

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _ErrorFeedbackState:
    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.residuals: dict[int, torch.Tensor] = {}
        self.step = 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def _residual(self, index: int, like: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(index)
        if r is None or r.shape != like.shape or r.device != like.device:
            r = torch.zeros_like(like, dtype=torch.float32)
            self.residuals[index] = r
        return r

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.residuals = {int(k): v.clone() for k, v in sd["residuals"].items()}

    def _gather(self, payload: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
        out = torch.empty(self.world_size * payload.numel(), dtype=payload.dtype, device=payload.device)
        work = _all_gather_single(out, payload, group=self.process_group, async_op=True)
        return work.get_future().then(lambda _: out.view(self.world_size, -1))


class Int8ErrorFeedbackState(_ErrorFeedbackState):
    """int8 with one fp32 scale per `block_size` values: 4 bytes -> ~1.02 bytes per element."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, block_size: int = 256) -> None:
        super().__init__(process_group)
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1, got {block_size}")
        self.block_size = block_size

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "block_size": self.block_size}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        self.block_size = int(sd.get("block_size", self.block_size))


class TopKErrorFeedbackState(_ErrorFeedbackState):
    """Send the `ratio` largest-magnitude entries (index + value) of each bucket."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, ratio: float = 0.01) -> None:
        super().__init__(process_group)
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio: expected in (0, 1], got {ratio}")
        self.ratio = ratio

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ratio": self.ratio}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        self.ratio = float(sd.get("ratio", self.ratio))


def _finish(bucket_buffer: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    bucket_buffer.copy_(mean.view_as(bucket_buffer).to(bucket_buffer.dtype))
    return bucket_buffer


def int8_error_feedback_hook(state: Int8ErrorFeedbackState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    residual = state._residual(bucket.index(), buf)
    g = buf.float().view(-1) + residual.view(-1)
    n, b = g.numel(), state.block_size
    nb = (n + b - 1) // b
    padded = torch.zeros(nb * b, dtype=torch.float32, device=g.device)
    padded[:n] = g
    blocks = padded.view(nb, b)
    scale = blocks.abs().amax(dim=1).clamp(min=1e-30) / 127.0
    q = torch.round(blocks / scale[:, None]).clamp(-127, 127).to(torch.int8)
    residual.view(-1).copy_(g - (q.float() * scale[:, None]).view(-1)[:n])
    payload = torch.cat([q.view(-1).view(torch.uint8), scale.view(torch.uint8)])
    state.step += 1

    def decode(fut: "torch.futures.Future[torch.Tensor]") -> torch.Tensor:
        all_p = fut.value()  # [world, nb*b + 4*nb]
        qs = all_p[:, : nb * b].contiguous().view(torch.int8).view(-1, nb, b).float()
        ss = all_p[:, nb * b:].contiguous().view(torch.float32).view(-1, nb, 1)
        mean = (qs * ss).sum(0).view(-1)[:n] / all_p.shape[0]
        return _finish(buf, mean)

    return state._gather(payload).then(decode)


def topk_error_feedback_hook(state: TopKErrorFeedbackState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    residual = state._residual(bucket.index(), buf)
    g = buf.float().view(-1) + residual.view(-1)
    n = g.numel()
    k = max(1, int(n * state.ratio))
    idx = g.abs().topk(k, sorted=False)[1]
    vals = g[idx]
    res = g.clone()
    res[idx] = 0.0
    residual.view(-1).copy_(res)
    payload = torch.cat([idx.to(torch.int32).view(torch.uint8), vals.view(torch.uint8)])
    state.step += 1

    def decode(fut: "torch.futures.Future[torch.Tensor]") -> torch.Tensor:
        all_p = fut.value()
        world = all_p.shape[0]
        ids = all_p[:, : 4 * k].contiguous().view(torch.int32).view(-1).long()
        vs = all_p[:, 4 * k:].contiguous().view(torch.float32).view(-1)
        mean = torch.zeros(n, dtype=torch.float32, device=g.device)
        mean.index_add_(0, ids, vs)
        return _finish(buf, mean / world)

    return state._gather(payload).then(decode)
