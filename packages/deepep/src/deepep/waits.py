"""Bounded waits: every wait on a peer has a deadline and ends in CommTimeoutError, never a hang."""

from __future__ import annotations

import time
from typing import Any

from tilehal import CommTimeoutError


def comm_error(rank: int, stage: str, detail: str) -> CommTimeoutError:
    return CommTimeoutError(f"deepep rank {rank}: stage '{stage}' {detail}", rank=rank, stage=stage)


def wait_work(work: Any, *, rank: int, stage: str, timeout_s: float, peers: object = None) -> None:
    """Wait for a torch.distributed Work by polling `is_completed()` until the deadline.

    Polling (not `work.wait(timeout)`) because NCCL's wait only orders streams and Gloo's may
    block for the process group's own, much longer, timeout. A transport error from a peer that
    died is reported the same way, as CommTimeoutError naming our rank and the stage.
    """
    deadline = time.monotonic() + timeout_s
    spins = 0
    while not work.is_completed():
        if time.monotonic() > deadline:
            who = f" waiting on ranks {peers}" if peers is not None else ""
            raise comm_error(rank, stage, f"timed out after {timeout_s:.1f} s{who} (dead or stuck peer?)")
        spins += 1
        # Spin briefly for latency, then back off so a stalled wait does not burn a core.
        if spins > 200:
            time.sleep(min(1e-3, 1e-5 * (spins - 200)))
    try:
        work.wait()
    except Exception as e:  # a peer's closed connection surfaces here (Gloo) as RuntimeError
        raise comm_error(rank, stage, f"failed: {type(e).__name__}: {e}") from e


def spin_until(predicate: Any, *, rank: int, stage: str, timeout_s: float, detail: str = "") -> None:
    """Poll a host-side condition (e.g. a flag a kernel writes to pinned memory) with a deadline."""
    deadline = time.monotonic() + timeout_s
    spins = 0
    while not predicate():
        if time.monotonic() > deadline:
            raise comm_error(rank, stage, f"timed out after {timeout_s:.1f} s {detail}".rstrip())
        spins += 1
        if spins > 1000:
            time.sleep(min(1e-3, 1e-6 * (spins - 1000)))
