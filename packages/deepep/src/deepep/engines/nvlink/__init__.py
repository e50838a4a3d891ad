"""The NVLink engine: our CUDA kernels over CUDA IPC buffers, for the GPUs of one host.

context.py: NvlinkContext (group, rank, kernel module, shared regions, error word, timeout, SMs),
the one object both modes take; normal.py: dispatch/combine and the layout kernel; low_latency.py:
the low-latency kernels' host side; memory.py: IPC regions and host-mapped words; emulation.py: R
ranks on one GPU for tests; kernels/: the CUDA sources.
"""

from .context import (
           KERNEL_DIR,
           KERNEL_NAMES,
           NvlinkContext,
           compile_kernels,
           kernel_source,
           nvlink_unavailable_reason,
)
from .low_latency import NvlinkLowLatency, NvlinkLowLatencyHandle, size_hint
from .normal import NvlinkDispatcher, NvlinkHandle

__all__ = ["KERNEL_DIR", "KERNEL_NAMES", "NvlinkContext", "NvlinkDispatcher", "NvlinkHandle", "NvlinkLowLatency",
           "NvlinkLowLatencyHandle", "compile_kernels", "kernel_source", "nvlink_unavailable_reason", "size_hint"]
