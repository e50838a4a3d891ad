"""What every transport shares (TorchDistTransport over a process group, LocalTransport for one rank)."""

from __future__ import annotations

import torch


class RowTransport:
    """The engines' row exchange: each transport implements `exchange_rows_start` (issue now, return
    a callable that waits, bounded, and yields the rows); `exchange_rows` is its blocking form."""

    def exchange_rows(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                      stage: str) -> torch.Tensor:
        """rows [N, B] uint8 grouped by destination -> [sum(recv_counts), B] grouped by source."""
        return self.exchange_rows_start(rows, send_counts, recv_counts, stage)()
