"""fp8 helpers of the public TileLang's language module."""

from __future__ import annotations

from .ops import DTypeConst


def determine_fp8_type(fp8_type: str = "e4m3") -> DTypeConst:
    """The fp8 dtype for "e4m3" (e4m3fn) or "e5m2"."""
    table = {"e4m3": "float8_e4m3", "e4m3fn": "float8_e4m3", "e5m2": "float8_e5m2"}
    if fp8_type not in table:
        import tilehal

        raise tilehal.ArgumentError(f"determine_fp8_type: expected one of {sorted(table)}, got {fp8_type!r}")
    return DTypeConst(table[fp8_type])
