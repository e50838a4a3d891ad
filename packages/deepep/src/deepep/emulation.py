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

from .nvlink_memory import SharedRegion


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


class LowLatencyRank:
    """What NvlinkLowLatency needs from its NvlinkDispatcher, for one emulated rank."""

    def __init__(self, regions: EmulatedRegions, rank: int, sms: int, timeout_s: float = 10.0) -> None:
        from .nvlink import compile_kernels
        from .nvlink_memory import HostMapped

        self.regions, self.rank, self.num_ranks = regions, rank, regions.num_ranks
        self.module = compile_kernels()
        for name in ("deepep_ll_dispatch", "deepep_ll_combine"):  # no lazy loads once kernels spin
            self.module.get_kernel(name).preload()
        self.err = HostMapped(4)
        self.timeout_ns = int(timeout_s * 1e9)
        self.num_device_sms = sms

    def _region(self, kind: str, sig_words: int, data_bytes: int) -> EmulatedRegion:
        return self.regions.region(kind, sig_words, data_bytes)

    def check(self) -> None:
        if any(self.err.view):
            raise RuntimeError(f"emulated rank {self.rank}: kernel error word {list(self.err.view)}")
