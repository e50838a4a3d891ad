"""The transport of a group of one rank without torch.distributed: nothing leaves the process.

Same methods as TorchDistTransport, so the engines written against it (the torch engine's
low-latency mode) run unchanged on one process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tilehal import ShapeError

from .base import RowTransport


class LocalTransport(RowTransport):
    rank = 0
    num_ranks = 1
    global_rank = 0
    backend = "local"

    def __init__(self, timeout_s: float = 0.0) -> None:
        self.timeout_s = timeout_s  # nothing is ever waited for; kept for the transports' common shape
        self.device = torch.device("cpu")

    def exchange_counts(self, counts: torch.Tensor, stage: str, masked: frozenset[int] = frozenset(),
                        lost: set[int] | None = None) -> torch.Tensor:
        """counts [1, C] -> the same counts (what this rank sends itself), on the CPU. (`masked`/`lost`:
        the transports' signature; a one-rank group has no peer to mask or lose.)"""
        return counts.to("cpu", torch.int64).clone()

    def gather_counts(self, counts: torch.Tensor, stage: str) -> torch.Tensor:
        return counts.to("cpu", torch.int64).unsqueeze(0).clone()

    def exchange_rows_start(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                            stage: str, masked: frozenset[int] = frozenset(),
                            wait_ns: torch.Tensor | None = None, lost: set[int] | None = None
                            ) -> Callable[[], torch.Tensor]:
        if list(send_counts) != list(recv_counts) or rows.shape[0] != sum(send_counts):
            raise ShapeError(f"{stage}: expected the rows a one-rank group sends itself to be the rows it receives, "
                             f"got {rows.shape[0]} rows, send counts {list(send_counts)}, receive counts "
                             f"{list(recv_counts)}")
        return lambda: rows

    def barrier(self, stage: str) -> None:
        pass
