"""Host-memory tier: blocks evicted from the device pool are kept in (pinned) host memory.

Host blocks are not referenced by sequences; they form one LRU map hash -> host block. On a
GPU pool every copy runs on a side CUDA stream so offloads and prefetches overlap compute:
the side stream first waits for the compute stream (the data it copies is complete), and the
compute stream waits for the side stream's last event before it next touches pool memory
(`sync`, called before every device op of the storage). On a CPU pool copies are plain.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from tilehal import ArgumentError

from .hashing import BlockHash
from .storage import KVStorage


class HostTier:
    def __init__(self, storage: KVStorage, host_blocks: int) -> None:
        if host_blocks < 1:
            raise ArgumentError(f"host_blocks: expected >= 1, got {host_blocks}")
        self.storage = storage
        self.num_blocks = host_blocks
        self.on_gpu = storage.device.type == "cuda"
        # Host layout puts the block first so each host block is one contiguous chunk.
        self.tensors = [
            torch.empty((host_blocks, t.shape[0], *t.shape[2:]), dtype=t.dtype, pin_memory=self.on_gpu)
            for t in storage.tensors()
        ]
        self.lru: OrderedDict[BlockHash, int] = OrderedDict()
        self.free: list[int] = list(range(host_blocks - 1, -1, -1))
        self.held: dict[int, BlockHash] = {}  # host blocks out of the LRU while an onload is pending
        self.stream = torch.cuda.Stream(device=storage.device) if self.on_gpu else None
        self._event: torch.cuda.Event | None = None
        self.evictions = 0

    # ------------------------------------------------------------------ map
    def lookup(self, h: BlockHash) -> int | None:
        return self.lru.get(h)

    def hold(self, h: BlockHash) -> int:
        """Take `h`'s host block out of the LRU (it must survive until its onload is issued)."""
        hid = self.lru.pop(h)
        self.held[hid] = h
        return hid

    # ------------------------------------------------------------------ copies
    def store(self, block: int, h: BlockHash) -> bool:
        """Offload device `block` under hash `h`; False when already on the host or no room."""
        if h in self.lru:
            self.lru.move_to_end(h)
            return False
        if self.free:
            hid = self.free.pop()
        elif self.lru:
            _, hid = self.lru.popitem(last=False)
            self.evictions += 1
        else:
            return False  # every host block is held by a pending onload
        self._copy(lambda ht, dt: ht[hid].copy_(dt[:, block], non_blocking=self.on_gpu))
        self.lru[h] = hid
        return True

    def load(self, hid: int, block: int) -> None:
        """Copy held host block `hid` into device `block`; the host copy stays matchable."""
        h = self.held.pop(hid)
        self._copy(lambda ht, dt: dt[:, block].copy_(ht[hid], non_blocking=self.on_gpu))
        self.lru[h] = hid

    def _copy(self, fn) -> None:
        pairs = list(zip(self.tensors, self.storage.tensors()))
        if self.stream is None:
            for ht, dt in pairs:
                fn(ht, dt)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.storage.device))
        with torch.cuda.stream(self.stream):
            for ht, dt in pairs:
                fn(ht, dt)
            self._event = torch.cuda.Event()
            self._event.record(self.stream)

    def sync(self) -> None:
        """Make the compute stream wait for every copy issued so far (no host blocking)."""
        if self._event is not None:
            torch.cuda.current_stream(self.storage.device).wait_event(self._event)
            self._event = None

    def check(self) -> list[str]:
        problems = []
        ids = list(self.lru.values()) + self.free + list(self.held)
        if sorted(ids) != list(range(self.num_blocks)):
            problems.append(f"host blocks leaked or duplicated: lru={len(self.lru)} free={len(self.free)} "
                            f"held={len(self.held)} of {self.num_blocks}")
        return problems
