"""What both NVLink modes (normal and low-latency) share: one `NvlinkContext` per Buffer.

The context holds the group's rank numbers, the compiled kernel module, the peers' shared regions,
the host-mapped error word every kernel reports to, the timeout, and the SM count; the normal-mode
dispatcher and the low-latency engine each take it and never reach into each other.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Protocol

import tilehal
import torch
import torch.distributed as dist
from tilehal import CommTimeoutError, ShapeError

from ...dispatcher import check_meta
from ...transport.torch_dist import TorchDistTransport, destroy_own_group
from .memory import HostMapped, SharedRegion, cuda_driver

log = logging.getLogger("deepep.nvlink")

MAX_RANKS = 16
STAGES = {1: "dispatch/counts", 2: "dispatch/data", 3: "combine/start", 4: "combine/data",
          5: "low_latency_dispatch/data", 6: "low_latency_combine/data", 7: "low_latency_dispatch/counts",
          8: "low_latency_combine/weights", 9: "layout/tiles"}
ERR_WORDS = 8  # [stage, peer, bad id?, the id, overflow?, rows, (2 spare)]

KERNEL_DIR = Path(__file__).with_name("kernels")
KERNEL_FILES = ("intranode.cu", "low_latency.cu")
KERNEL_NAMES = ("deepep_layout", "deepep_dispatch", "deepep_combine_bf16", "deepep_combine_f32", "deepep_ll_dispatch",
                "deepep_ll_combine")


def kernel_source() -> str:
    """The translation unit of every NVLink kernel (compiled with KERNEL_DIR on the include path)."""
    return "".join(f'#include "{f}"\n' for f in KERNEL_FILES)


@functools.lru_cache(maxsize=4)
def compile_kernels(arch: str = "sm_90a") -> tilehal.CudaModule:
    """Compile (or fetch from tilehal's cache) the NVLink kernels; needs no GPU."""
    return tilehal.compile_cuda(kernel_source(), arch=arch, name="deepep_nvlink", include_dirs=[KERNEL_DIR])


def nvlink_unavailable_reason(group: dist.ProcessGroup, group_size: int, num_ranks_per_node: int) -> str | None:
    """None when the NVLink engine can run on `group`, else why not (Buffer logs it at DEBUG)."""
    if os.environ.get("DEEPEP_DISABLE_NVLINK") == "1":
        return "DEEPEP_DISABLE_NVLINK=1"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return f"the group's backend is {backend!r}, not NCCL (one GPU per rank)"
    if num_ranks_per_node != group_size:
        return "the group spans several hosts"
    if group_size > MAX_RANKS:
        return f"more than {MAX_RANKS} ranks"
    try:
        cuda_driver()
    except ImportError:
        return "cuda-bindings is not installed"
    vers = tilehal.compiler_versions()
    if not (vers.get("nvrtc") or vers.get("nvcc")):
        return "no CUDA compiler (NVRTC or nvcc) for the kernels"
    devices: list[Any] = [None] * group_size
    dist.all_gather_object(devices, torch.cuda.current_device(), group=group)
    if len(set(devices)) != len(devices):
        return f"ranks share GPUs {devices}"
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"GPU {a} cannot access GPU {b} (no peer access)"
    return None


class Regions(Protocol):
    """Where a context gets its shared regions: CUDA IPC across processes (IpcRegions), or one
    GPU's memory for emulated ranks (emulation.EmulatedRegions)."""

    def region(self, kind: str, sig_words: int, data_bytes: int) -> Any:
        """A region of `kind` with at least this many signal words and data bytes per parity."""
        ...

    def close(self) -> None:
        ...


class IpcRegions:
    """One IPC-shared region per kind, made at the first request (a collective: every rank asks for
    the same kind in the same call) and remade larger when a call needs more."""

    def __init__(self, group: dist.ProcessGroup, rank: int) -> None:
        self.group, self.rank = group, rank
        self.regions: dict[str, SharedRegion] = {}

    def region(self, kind: str, sig_words: int, data_bytes: int) -> SharedRegion:
        reg = self.regions.get(kind)
        if reg is None or not reg.fits(sig_words, data_bytes):
            if reg is not None:
                torch.cuda.synchronize()
                reg.close()
            log.debug("rank %d: allocating %s region: %d signal words, %.1f MiB data", self.rank, kind, sig_words,
                      data_bytes / 2**20)
            reg = SharedRegion(self.group, self.rank, sig_words, data_bytes)
            self.regions[kind] = reg
        return reg

    def close(self) -> None:
        for reg in self.regions.values():
            reg.close()
        self.regions.clear()


# What each kind of NVLink call lays its shared buffers out by: every rank must pass the same values.
AGREE_FIELDS = {
    "dispatch": ("magic", "row_bytes", "hidden", "x_dtype", "scales_cols", "topk", "topk_weights", "experts_per_rank",
                 "num_max_tokens_per_rank", "chunk_tokens"),
    "combine": ("magic", "row_bytes", "hidden", "x_dtype", "topk_weights", "num_max_tokens_per_rank", "chunk_tokens"),
    "low_latency_dispatch": ("magic", "hidden", "use_fp8", "topk", "num_experts", "num_max_dispatch_tokens_per_rank"),
    "low_latency_combine": ("magic", "hidden", "topk", "num_experts", "num_max_dispatch_tokens_per_rank"),
}


class Agreement:
    """Cross-rank agreement on the layout of each kind of call, checked on the host whenever this rank's
    layout of that kind changes (the first call, a new hidden size, dtype, top-k, expert count...).

    The NVLink kernels write rows at offsets and into regions sized by the sender's own layout, and a
    region is (re)made by a collective: a rank that disagreed would write past a peer's region or wait
    in a collective alone. So before such a call, every rank's values go through one small all-gather
    on a CPU (Gloo) side group, with a deadline; a mismatch raises ShapeError naming each differing field
    on every rank that made the call, before any kernel runs. Calls whose layout did not change cost
    nothing (no exchange). A rank that changes its layout alone waits in that exchange and gets
    CommTimeoutError, while its peers' kernels time out waiting for it: bounded, and no memory is touched."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        ranks = [dist.get_global_rank(group, r) if group is not dist.group.WORLD else r
                 for r in range(dist.get_world_size(group))]
        self.cpu_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self.t = TorchDistTransport(self.cpu_group, timeout_s)
        self.agreed: dict[str, tuple[int, ...]] = {}

    def ensure(self, kind: str, values: list[int]) -> None:
        key = tuple(int(v) for v in values)
        if self.agreed.get(kind) == key:
            return
        fields = AGREE_FIELDS[kind]
        mine = [0x4E564C00 + list(AGREE_FIELDS).index(kind), *key]  # "NVL" + the kind
        got = self.t.gather_counts(torch.tensor([mine], dtype=torch.int64), f"{kind}/layout")[:, 0]
        check_meta(mine, got, self.t.rank, kind, fields, f"call {kind} with the same layout",
                   "Every rank must pass the same hidden size, dtypes, top-k and expert count, and build its "
                   "Buffer with the same num_max_tokens_per_rank and Config")
        self.agreed[kind] = key

    def destroy(self) -> None:
        self.agreed.clear()
        group = self.t.group
        self.t.close()
        destroy_own_group(group)  # the side group is this context's own: its Gloo threads end here


class NvlinkContext:
    """Group, rank, module, regions, timeout and SMs of one NVLink engine, shared by both its modes.

    `group` is None for emulated ranks (one process, engines/nvlink/emulation.py); then `rank`,
    `num_ranks` and `global_rank` are given."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, num_ranks: int, global_rank: int,
                 timeout_s: float, regions: Regions, num_sms: int | None = None,
                 agreement: Agreement | None = None) -> None:
        self.group, self.rank, self.num_ranks, self.global_rank = group, rank, num_ranks, global_rank
        self.agreement = agreement  # None for emulated ranks (one process: nothing to disagree across)
        self.timeout_s = float(timeout_s)
        self.regions = regions
        self.module = compile_kernels()
        # Loaded now, not lazily at first launch: a lazy load can wait for the context to go idle,
        # which a kernel spinning on a peer (or on another stream's kernel) would never let happen.
        for name in KERNEL_NAMES:
            self.module.get_kernel(name).preload()
        self.err = HostMapped(ERR_WORDS)
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.num_sms = num_sms  # the low-latency kernels' grid (all SMs of the device unless emulated)

    @classmethod
    def for_group(cls, group: dist.ProcessGroup, timeout_s: float) -> NvlinkContext:
        """The context of this process's rank of `group` (one GPU per rank, CUDA IPC regions)."""
        rank = dist.get_rank(group)
        return cls(group, rank, dist.get_world_size(group), dist.get_rank(), timeout_s, IpcRegions(group, rank),
                   agreement=Agreement(group, timeout_s))

    def agree(self, kind: str, values: list[int]) -> None:
        """Every rank lays out this kind of call alike, or ShapeError on every rank (see Agreement)."""
        if self.agreement is not None:
            self.agreement.ensure(kind, values)

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def region(self, kind: str, sig_words: int, data_bytes: int) -> Any:
        return self.regions.region(kind, sig_words, data_bytes)

    def check(self) -> None:
        """Raise the error a kernel recorded: more rows than num_worst_tokens (ValueError, once), a bad
        expert id (ShapeError, once), or a peer's flag that never came (CommTimeoutError)."""
        err = self.err.view
        if err[4]:
            n = int(err[5])
            err[4] = 0
            raise ValueError(f"num_worst_tokens: expected >= the {n} tokens rank {self.rank} received in the previous "
                             "dispatch (found by the NVLink kernel; rows past num_worst_tokens were dropped)")
        if err[2]:
            bad = int(err[3])
            err[2] = 0
            raise ShapeError(f"topk_idx: expected expert ids in [-1, num_experts), got {bad} (found by the NVLink "
                             "layout/low-latency kernel; those entries were skipped)")
        stage = int(err[0])
        if stage:
            peer = int(err[1])
            name = STAGES.get(stage, f"stage {stage}")
            raise CommTimeoutError(
                f"deepep rank {self.global_rank}: stage '{name}' timed out after {self.timeout_s:.1f} s waiting "
                f"for rank {peer} of the group (NVLink kernel); call Buffer.reset()", rank=self.global_rank,
                stage=name, peer=self.global_rank_of(peer))

    def global_rank_of(self, rank: int) -> int:
        """The global rank of `rank` of this context's group (itself for emulated ranks)."""
        if self.group is None or self.group is dist.group.WORLD:
            return rank
        return dist.get_global_rank(self.group, rank)

    def destroy(self) -> None:
        try:
            torch.cuda.synchronize()
        except Exception:  # a failed context must not stop us releasing the rest
            pass
        self.regions.close()
        self.err.free()
        if self.agreement is not None:
            self.agreement.destroy()
