"""Bounded waits: every wait on a peer has a deadline and ends in CommTimeoutError, never a hang."""

from __future__ import annotations

import time
from typing import Any

from tilehal import CommTimeoutError

BUSY_SPIN_S = 0.05


def _pause(waited_s: float) -> None:
    """Busy-spin for the first 50 ms (a sleep costs far more than a fast transfer), then nap
    100 us per check so a stalled peer does not burn a core until the deadline."""
    if waited_s > BUSY_SPIN_S:
        time.sleep(1e-4)


def comm_error(rank: int, stage: str, detail: str, peer: int | None = None) -> CommTimeoutError:
    """CommTimeoutError from `rank` (global) at `stage`; `peer`: the global rank that stopped answering."""
    who = f" (waiting for rank {peer})" if peer is not None else ""
    return CommTimeoutError(f"deepep rank {rank}: stage '{stage}' {detail}{who}", rank=rank, stage=stage, peer=peer)


def wait_work(work: Any, *, rank: int, stage: str, timeout_s: float, peers: object = None,
              peer: int | None = None) -> None:
    """Wait for a torch.distributed Work by polling `is_completed()` until the deadline.

    Polling (not `work.wait(timeout)`) because NCCL's wait only orders streams and Gloo's may
    block for the process group's own, much longer, timeout. A transport error from a peer that
    died is reported the same way, as CommTimeoutError naming our rank and the stage.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            who = f" waiting on ranks {peers}" if peers is not None else ""
            raise comm_error(rank, stage, f"timed out after {timeout_s:.1f} s{who} (dead or stuck peer?)", peer)
        _pause(now - start)
    try:
        work.wait()
    except Exception as e:  # a peer's closed connection surfaces here (Gloo) as RuntimeError
        raise comm_error(rank, stage, f"failed: {type(e).__name__}: {e}", peer) from e


def spin_until(predicate: Any, *, rank: int, stage: str, timeout_s: float, detail: str = "",
               peer: int | None = None) -> None:
    """Poll a host-side condition (e.g. a flag a kernel writes to pinned memory) with a deadline."""
    start = time.monotonic()
    deadline = start + timeout_s
    while not predicate():
        now = time.monotonic()
        if now > deadline:
            raise comm_error(rank, stage, f"timed out after {timeout_s:.1f} s {detail}".rstrip(), peer)
        _pause(now - start)
