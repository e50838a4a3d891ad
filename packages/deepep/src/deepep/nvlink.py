"""NVLink fast path (filled in below)."""
from __future__ import annotations


def nvlink_unavailable_reason(buf) -> str | None:
    return "not implemented yet"
