"""NVLink kernels with R ranks emulated on ONE GPU, for tests and measurements without a
multi-GPU machine.

Each emulated rank gets its own regions in the same GPU's memory (instead of CUDA IPC), its own
stream, and a slice of the SMs, so all ranks' kernels are resident at once and their spin-waits
meet. Everything but the IPC plumbing and the link runs as on R GPUs.

Rules the callers follow (each broke a first attempt): run every allocation, memset and first
use of a torch kernel before any rank's kernel spins (a device allocation between two launches,
or a lazy kernel load, serializes them and the spinning one waits out its timeout); create the
regions under one lock when ranks run on threads.
"""

from __future__ import annotations

import threading

import torch

from .context import NvlinkContext
from .memory import SharedRegion


class EmulatedRegion:
    def __init__(self, sig: torch.Tensor, data: torch.Tensor) -> None:
        self.peer_sig, self.peer_data = sig, data


class EmulatedRegions:
    """Regions of every emulated rank, made together at the first request for a kind, carved from
    one zeroed pool per rank allocated up front."""

    POOL_BYTES = 128 * 2**20

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.pools = [torch.zeros(self.POOL_BYTES, dtype=torch.uint8, device="cuda") for _ in range(num_ranks)]
        self.used = 0
        self.views: dict[str, EmulatedRegion] = {}
        self.lock = threading.Lock()  # ranks' threads ask at once: exactly one creates a kind
        torch.cuda.synchronize()

    def region(self, kind: str, sig_words: int, data_bytes: int) -> EmulatedRegion:
        with self.lock:
            if kind not in self.views:
                sig_bytes = SharedRegion.parity_size(sig_words, 0)
                parity = SharedRegion.parity_size(sig_words, data_bytes)
                if self.used + 2 * parity > self.POOL_BYTES:
                    raise MemoryError(f"emulated regions: {kind} needs {2 * parity} bytes, "
                                      f"{self.POOL_BYTES - self.used} left in the pool")
                base = [p.data_ptr() + self.used for p in self.pools]
                self.used += 2 * parity
                sig = [[b + p * parity for b in base] for p in range(2)]
                data = [[b + p * parity + sig_bytes for b in base] for p in range(2)]
                self.views[kind] = EmulatedRegion(torch.tensor(sig, dtype=torch.int64, device="cuda"),
                                                  torch.tensor(data, dtype=torch.int64, device="cuda"))
            return self.views[kind]

    def close(self) -> None:
        """Nothing to unmap: the pools are this process's own memory (freed with the object)."""


def emulated_context(regions: EmulatedRegions, rank: int, sms: int, timeout_s: float = 10.0) -> NvlinkContext:
    """The NvlinkContext of emulated rank `rank` (group None): give it to NvlinkDispatcher(options,
    context=...) and NvlinkLowLatency(...) as on a real GPU; `sms` is its share of the device."""
    return NvlinkContext(None, rank, regions.num_ranks, rank, timeout_s, regions, num_sms=sms)
