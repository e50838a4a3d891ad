"""Pack the per-token pieces (hidden, fp8 scales, top-k ids/weights, source index) into byte rows.

One all-to-all of byte rows moves everything a token carries in a single collective, and bytes
travel on every backend (Gloo has no fp8 or bf16 all-to-all on some versions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    width: int  # elements per row
    offset: int  # bytes from the row start


class RowFormat:
    """Fields laid out back to back, each 16-byte aligned, so any dtype view of a slice is legal."""

    def __init__(self, fields: list[tuple[str, torch.dtype, int]]) -> None:
        out, off = [], 0
        for name, dt, width in fields:
            out.append(Field(name, dt, width, off))
            off = _align(off + width * dt.itemsize, 16)
        self.fields = {f.name: f for f in out}
        self.row_bytes = max(off, 16)

    def pack(self, parts: dict[str, torch.Tensor], num_rows: int, device: torch.device) -> torch.Tensor:
        rows = torch.empty(num_rows, self.row_bytes, dtype=torch.uint8, device=device)
        for name, f in self.fields.items():
            src = parts[name]
            self.view(rows, name).copy_(src.reshape(num_rows, f.width))
        return rows

    def view(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        f = self.fields[name]
        nbytes = f.width * f.dtype.itemsize
        return rows[:, f.offset:f.offset + nbytes].view(f.dtype)

    def unpack(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        return self.view(rows, name).contiguous()
