"""Device discovery: the CPU always, CUDA GPUs when torch or the driver sees them."""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tilehal.devices")

_SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
               "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve", "sve2")


@dataclass(frozen=True)
class CPUDevice:
    name: str
    arch: str
    cores: int
    simd: tuple[str, ...]
    cache_bytes: dict[str, int] = field(default_factory=dict)
    kind: str = "cpu"

    def describe(self) -> str:
        caches = ", ".join(f"{k} {v // 1024} KiB" for k, v in self.cache_bytes.items())
        return f"CPU {self.name} ({self.arch}), {self.cores} cores, SIMD: {' '.join(self.simd) or 'none'}; caches: {caches or 'unknown'}"


@dataclass(frozen=True)
class CUDADevice:
    index: int
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    smem_per_block_optin: int
    l2_bytes: int
    memory_bytes: int
    nvlink_peers: tuple[int, ...] = ()
    kind: str = "cuda"

    @property
    def arch(self) -> str:
        """The NVRTC target, with the 'a' suffix on Hopper so wgmma/setmaxnreg are usable."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")

    def describe(self) -> str:
        peers = f", NVLink peers {list(self.nvlink_peers)}" if self.nvlink_peers else ""
        return (f"cuda:{self.index} {self.name}, sm_{self.compute_capability[0]}{self.compute_capability[1]}, "
                f"{self.sm_count} SMs, {self.smem_per_block_optin // 1024} KiB smem/block, "
                f"L2 {self.l2_bytes // 2**20} MiB, {self.memory_bytes / 2**30:.1f} GiB{peers}")


def _cpu_cache_sizes() -> dict[str, int]:
    out: dict[str, int] = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    if not base.exists():
        return out
    for idx in sorted(base.glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            typ = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1024, "M": 2**20, "G": 2**30}.get(size[-1], 1)
        num = int(size[:-1]) if size[-1] in "KMG" else int(size)
        label = f"L{level}" + ({"Data": "d", "Instruction": "i"}.get(typ, ""))
        out[label] = num * mult
    return out


@functools.lru_cache(maxsize=1)
def cpu() -> CPUDevice:
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                name = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CPUDevice(name=name, arch=platform.machine(), cores=cores,
                     simd=tuple(f for f in _SIMD_FLAGS if f in flags), cache_bytes=_cpu_cache_sizes())


def _nvlink_peers(index: int) -> tuple[int, ...]:
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        peers = set()
        for other in range(pynvml.nvmlDeviceGetCount()):
            if other == index:
                continue
            oh = pynvml.nvmlDeviceGetHandleByIndex(other)
            status = pynvml.nvmlDeviceGetP2PStatus(handle, oh, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            if status == pynvml.NVML_P2P_STATUS_OK:
                peers.add(other)
        return tuple(sorted(peers))
    except Exception as e:  # NVML missing or restricted in a VM: report no peers, say why
        log.debug("NVML NVLink query failed: %s", e)
        return ()


@functools.lru_cache(maxsize=1)
def cuda_devices() -> tuple[CUDADevice, ...]:
    """Every CUDA GPU visible through torch; empty (not an error) without CUDA."""
    try:
        import torch
    except ImportError:
        log.debug("no torch: CUDA discovery skipped")
        return ()
    if not torch.cuda.is_available():
        return ()
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        smem = getattr(p, "shared_memory_per_block_optin", 0) or 0
        l2 = getattr(p, "L2_cache_size", 0) or 0
        out.append(CUDADevice(index=i, name=p.name, compute_capability=(p.major, p.minor),
                              sm_count=p.multi_processor_count, smem_per_block_optin=int(smem),
                              l2_bytes=int(l2), memory_bytes=int(p.total_memory), nvlink_peers=_nvlink_peers(i)))
    return tuple(out)


def devices() -> list[CPUDevice | CUDADevice]:
    """The CPU first, then each CUDA GPU."""
    return [cpu(), *cuda_devices()]


def cuda_unavailable_reason() -> str | None:
    """None when CUDA launches can work here, else why not (for `tilestack doctor`)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU"
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "cuda-bindings is not installed (pip install 'tilestack-hal[cuda]')"
    return None
