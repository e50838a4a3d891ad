"""Memory the NVLink kernels share: IPC-exported regions every peer writes into, and host-mapped
words the kernels report to (counts, errors) and the host polls."""

from __future__ import annotations

import ctypes
from typing import Any

import tilehal
import torch
import torch.distributed as dist

# Staged rows start on 128-byte lines: a row that straddles lines costs partial NVLink writes.
ROW_ALIGN = 128


def addr(t: torch.Tensor | None) -> int:
    """Device address of a tensor (0 for None), as the kernels' argument structs take it."""
    return 0 if t is None else int(t.data_ptr())


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def cuda_driver():
    from cuda.bindings import driver

    return driver


def checked(res: Any, what: str) -> Any:
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise tilehal.DeviceError(f"{what} failed: {err}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


class HostMapped:
    """Pinned host memory the GPU writes to (flags, counts, error word) and the CPU polls."""

    def __init__(self, num_ints: int) -> None:
        from tilehal import ensure_context

        drv = ensure_context(torch.cuda.current_device())
        flags = drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE
        self.host = int(checked(drv.cuMemHostAlloc(num_ints * 4, flags), "cuMemHostAlloc"))
        self.device = int(checked(drv.cuMemHostGetDevicePointer(self.host, 0), "cuMemHostGetDevicePointer"))
        self.view = (ctypes.c_int32 * num_ints).from_address(self.host)
        ctypes.memset(self.host, 0, num_ints * 4)

    def free(self) -> None:
        if self.host:
            cuda_driver().cuMemFreeHost(self.host)
            self.host = 0


class SharedRegion:
    """One IPC-shared allocation per kind, two parities of [signal words | data bytes]."""

    @staticmethod
    def parity_size(sig_words: int, data_bytes: int) -> int:
        """Bytes of one parity: the signal area, then the data, each on 4 KiB pages."""
        return align_up(align_up(sig_words * 8, 4096) + data_bytes, 4096)

    def __init__(self, group: dist.ProcessGroup, rank: int, sig_words: int, data_bytes: int) -> None:
        self.sig_words, self.data_bytes = sig_words, data_bytes
        self.sig_bytes = align_up(sig_words * 8, 4096)
        self.parity_bytes = self.parity_size(sig_words, data_bytes)
        # Our own cuMemAlloc, not torch's allocator: an IPC handle names a whole allocation, and
        # torch packs several tensors into one segment, which a peer could then not open twice.
        from tilehal import ensure_context

        drv = ensure_context(torch.cuda.current_device())
        size = 2 * self.parity_bytes
        self.ptr = int(checked(drv.cuMemAlloc(size), "cuMemAlloc"))
        # Flags start at epoch 0; synchronous, so no peer can write before we are zero.
        checked(drv.cuMemsetD8(self.ptr, 0, size), "cuMemsetD8")
        checked(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        ptr = self.ptr
        handle = checked(drv.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
        blob = ctypes.string_at(handle.getPtr(), 64)
        world = dist.get_world_size(group)
        shared: list[Any] = [None] * world
        dist.all_gather_object(shared, (blob, 0), group=group)
        self._opened: list[Any] = []
        bases = []
        for r, (b, off) in enumerate(shared):
            if r == rank:
                bases.append(ptr)
                continue
            h = drv.CUipcMemHandle()
            ctypes.memmove(h.getPtr(), b, 64)
            dptr = checked(drv.cuIpcOpenMemHandle(h, drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                       "cuIpcOpenMemHandle")
            self._opened.append(dptr)
            bases.append(int(dptr) + off)
        # [parity][rank] pointers to each rank's signal area and data region.
        sig = [[b + p * self.parity_bytes for b in bases] for p in range(2)]
        data = [[b + p * self.parity_bytes + self.sig_bytes for b in bases] for p in range(2)]
        self.peer_sig = torch.tensor(sig, dtype=torch.int64, device="cuda")
        self.peer_data = torch.tensor(data, dtype=torch.int64, device="cuda")
        # Everyone has opened everyone's memory before anyone writes into it.
        dist.barrier(group=group)

    def fits(self, sig_words: int, data_bytes: int) -> bool:
        return sig_words <= self.sig_words and data_bytes <= self.data_bytes

    def close(self) -> None:
        drv = cuda_driver()
        for p in self._opened:
            drv.cuIpcCloseMemHandle(p)
        self._opened = []
        if self.ptr:
            drv.cuMemFree(self.ptr)
            self.ptr = 0
