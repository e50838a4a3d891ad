"""NVLink fast path: our kernels write rows straight into the peers' IPC-shared buffers.

Taken when every rank of an NCCL group is a GPU of one host with peer access. Buffers are
plain torch allocations exported with CUDA IPC (`cuIpcGetMemHandle`), opened by every peer;
the kernels (kernels/intranode.cu, compiled by tilehal.compile_cuda) are described there.
Waits are bounded on both sides: in-kernel spins end at a deadline and record (stage, peer)
in host-mapped memory; the host polls with a deadline too. Then CommTimeoutError.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tilehal
import torch
import torch.distributed as dist
from tilehal import Arg, CommTimeoutError, ShapeError

from .flat import DispatchInput, DispatchOutput, align_counts
from .nvlink_ll import NvlinkLowLatency, NvlinkLowLatencyHandle
from .nvlink_memory import ROW_ALIGN, HostMapped, SharedRegion, addr, align_up, cuda_driver
from .waits import comm_error, spin_until

log = logging.getLogger("deepep.nvlink")

MAX_RANKS = 16
THREADS = 512
STAGES = {1: "dispatch/counts", 2: "dispatch/data", 3: "combine/start", 4: "combine/data",
          5: "low_latency_dispatch/data", 6: "low_latency_combine/data", 7: "low_latency_dispatch/counts",
          8: "low_latency_combine/weights", 9: "layout/tiles"}

P = ctypes.c_uint64  # device pointers travel as 64-bit integers


class DispatchArgs(ctypes.Structure):
    _fields_ = [(n, P) for n in ("x", "scales", "topk_idx", "topk_w", "send_pos", "counts_msg", "peer_data",
                                  "peer_sig", "recv_x", "recv_scales", "recv_topk", "recv_w", "recv_src",
                                  "recv_counts", "host_info", "err")] + [
        ("region_bytes", ctypes.c_int64), ("timeout_ns", ctypes.c_uint64)] + [
        (n, ctypes.c_int32) for n in ("T", "R", "me", "epr", "k", "x16", "S", "row_bytes", "off_scales", "off_topk",
                                      "off_w", "off_src", "chunk", "num_senders", "max_chunks", "num_worst",
                                      "sig_counts", "sig_chunks")] + [("epoch", ctypes.c_uint32)]


class CombineArgs(ctypes.Structure):
    _fields_ = [(n, P) for n in ("x", "w", "recv_counts", "send_pos", "peer_data", "peer_sig", "out", "out_w",
                                  "err")] + [
        ("region_bytes", ctypes.c_int64), ("timeout_ns", ctypes.c_uint64)] + [
        (n, ctypes.c_int32) for n in ("T", "R", "me", "k", "x16", "row_bytes", "off_w", "chunk", "num_senders",
                                      "max_chunks", "sig_hello", "sig_chunks")] + [("epoch", ctypes.c_uint32)]


class LayoutArgs(ctypes.Structure):
    _fields_ = [(n, P) for n in ("topk_idx", "in_rank", "per_expert_in", "per_rank", "per_expert", "send_pos",
                                  "counts_msg", "tile_flags", "tile_totals", "tile_experts", "ticket", "err")] + [
        ("timeout_ns", ctypes.c_uint64)] + [
        (n, ctypes.c_int32) for n in ("T", "k", "R", "E", "epr", "smem_counts", "has_topk")] + [
        ("epoch", ctypes.c_uint32)]


LAYOUT_THREADS = 512  # tokens per tile block of the layout kernel
MAX_SMEM_COUNTS = 200 * 1024  # experts counted in shared memory up to this many bytes, else in global


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


def nvlink_unavailable_reason(buf: Any) -> str | None:
    """None when the NVLink path can run for this Buffer, else why not (logged at DEBUG)."""
    if os.environ.get("DEEPEP_DISABLE_NVLINK") == "1":
        return "DEEPEP_DISABLE_NVLINK=1"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    backend = str(dist.get_backend(buf.group)).lower()
    if "nccl" not in backend:
        return f"the group's backend is {backend!r}, not NCCL (one GPU per rank)"
    if buf.num_ranks_per_node != buf.group_size:
        return "the group spans several hosts"
    if buf.group_size > MAX_RANKS:
        return f"more than {MAX_RANKS} ranks"
    try:
        cuda_driver()
    except ImportError:
        return "cuda-bindings is not installed"
    vers = tilehal.compiler_versions()
    if not (vers.get("nvrtc") or vers.get("nvcc")):
        return "no CUDA compiler (NVRTC or nvcc) for the kernels"
    devices: list[Any] = [None] * buf.group_size
    dist.all_gather_object(devices, torch.cuda.current_device(), group=buf.group)
    if len(set(devices)) != len(devices):
        return f"ranks share GPUs {devices}"
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"GPU {a} cannot access GPU {b} (no peer access)"
    return None


class LayoutScratch:
    """The layout kernel's per-tile scratch (flags, totals, expert counts, a ticket), grown on
    demand, and the epoch its flags carry. One per dispatcher: layouts run in stream order."""

    def __init__(self) -> None:
        self.epoch = 0
        self.tiles = self.ranks = self.experts = 0
        self.flags = self.totals = self.experts_t = self.ticket = None

    def reserve(self, tiles: int, ranks: int, experts: int) -> None:
        if tiles <= self.tiles and ranks <= self.ranks and experts <= self.experts:
            return
        self.tiles, self.ranks = max(tiles, self.tiles), max(ranks, self.ranks)
        self.experts = max(experts, self.experts)
        # Zeroed: flags start below every epoch, the ticket at 0.
        self.flags = torch.zeros(self.tiles, dtype=torch.int64, device="cuda")
        self.totals = torch.zeros(self.tiles, self.ranks, dtype=torch.int32, device="cuda")
        self.experts_t = torch.zeros(self.tiles, self.experts, dtype=torch.int32, device="cuda")
        self.ticket = torch.zeros(1, dtype=torch.int32, device="cuda")


def launch_layout(module: tilehal.CudaModule, err_ptr: int, scratch: LayoutScratch, R: int, T: int, epr: int, *,
                  topk_idx: torch.Tensor | None, in_rank: torch.Tensor, per_expert_in: torch.Tensor | None,
                  per_rank: torch.Tensor | None, per_expert: torch.Tensor | None,
                  timeout_s: float = 10.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout kernel (kernels/intranode.cu): -> (send_pos [T, R], counts_msg [R, 1 + epr]).

    With topk_idx it fills in_rank, per_rank and per_expert; without, it reads in_rank and
    per_expert_in. `err_ptr` is the host-mapped error word the kernel reports bad ids to."""
    E = epr * R
    dev = in_rank.device
    send_pos = torch.empty(T, R, dtype=torch.int32, device=dev)
    counts_msg = torch.empty(R, 1 + epr, dtype=torch.int32, device=dev)
    tiles = max(1, -(-T // LAYOUT_THREADS))
    scratch.reserve(tiles, R, E)
    scratch.epoch += 1
    smem = 4 * E if topk_idx is not None and 4 * E <= MAX_SMEM_COUNTS else 0
    a = LayoutArgs(topk_idx=addr(topk_idx), in_rank=addr(in_rank), per_expert_in=addr(per_expert_in),
                   per_rank=addr(per_rank), per_expert=addr(per_expert), send_pos=addr(send_pos),
                   counts_msg=addr(counts_msg), tile_flags=addr(scratch.flags), tile_totals=addr(scratch.totals),
                   tile_experts=addr(scratch.experts_t), ticket=addr(scratch.ticket), err=err_ptr,
                   timeout_ns=int(timeout_s * 1e9), T=T, k=topk_idx.shape[1] if topk_idx is not None else 0, R=R,
                   E=E, epr=epr, smem_counts=int(smem > 0), has_topk=int(topk_idx is not None), epoch=scratch.epoch)
    module.get_kernel("deepep_layout").launch(tiles, LAYOUT_THREADS, [Arg(a)], smem_bytes=smem)
    return send_pos, counts_msg


@dataclass
class NvlinkHandle:
    num_tokens: int
    hidden: int
    is_token_in_rank: torch.Tensor
    experts_per_rank: int
    send_pos: torch.Tensor  # [T, R] int32
    counts_msg: torch.Tensor  # [R, 1 + epr] int32
    recv_counts: torch.Tensor  # [R] int32 on the GPU
    num_recv_tokens: int
    num_recv_tokens_per_expert_list: list[int]
    recv_src_idx: torch.Tensor
    num_worst_tokens: int = 0
    rank: int = 0

    def as_tuple(self) -> tuple:
        """DeepEP's intranode handle members. The kernels exchange only what each receiver needs, so
        rank_prefix_matrix [R, R] has this rank's column (prefix sums of the rows it receives) and zeros
        elsewhere; channel_prefix_matrix / recv_channel_prefix_matrix [R, 1] are rows sent to / received
        from each rank; send_head is the [T, R] send positions (-1: not sent)."""
        r = self.is_token_in_rank.shape[1]
        prefix = torch.zeros(r, r, dtype=torch.int32, device=self.recv_counts.device)
        prefix[:, self.rank] = torch.cumsum(self.recv_counts.to(torch.int32), 0).to(torch.int32)
        sent = self.is_token_in_rank.sum(0).to(torch.int32).view(r, 1)
        return (prefix, sent, self.recv_counts.to(torch.int32).view(r, 1), self.recv_src_idx, self.is_token_in_rank,
                self.send_pos)

    def __getitem__(self, i: int) -> object:
        return self.as_tuple()[i]

    def __iter__(self):
        return iter(self.as_tuple())

    def __len__(self) -> int:
        return 6


class NvlinkDispatcher:
    handle_type = NvlinkHandle
    ll_handle_type = NvlinkLowLatencyHandle

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.group = buf.group
        self.rank, self.num_ranks = buf.rank, buf.group_size
        self.global_rank = dist.get_rank()
        self.cap = buf.num_max_tokens_per_rank
        self.module = compile_kernels()
        # Loaded now, not lazily at first launch: a lazy load can wait for the context to go idle,
        # which a kernel spinning on a peer (or on another stream's kernel) would never let happen.
        for name in KERNEL_NAMES:
            self.module.get_kernel(name).preload()
        self.info = HostMapped(2 + 4096)
        self.err = HostMapped(8)  # [stage, peer, bad id?, the id, overflow?, rows]
        self.regions: dict[str, SharedRegion] = {}
        self.epochs = {"dispatch": 0, "combine": 0}
        self._ll: NvlinkLowLatency | None = None
        self.layout_scratch = LayoutScratch()
        self.num_device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        # The last get_dispatch_layout's send positions, reused when dispatch gets its is_token_in_rank.
        self._layout_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ plumbing

    @property
    def timeout_ns(self) -> int:
        return int(self.buf.timeout_s * 1e9)

    def _config(self, combine: bool) -> tuple[int, int, int]:
        # The config passed to this dispatch/combine call (Buffer sets it for the call), else the default.
        cfg = getattr(self.buf, "_call_config", None)
        if cfg is None:
            cfg = (self.buf.get_combine_config if combine else self.buf.get_dispatch_config)(self.num_ranks)
        num_sms = max(cfg.num_sms, 2 * self.num_ranks)
        senders = num_sms // 2
        return num_sms, senders, cfg.chunk_tokens

    def _region(self, kind: str, sig_words: int, data_bytes: int) -> SharedRegion:
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

    def check(self) -> None:
        """Raise the error a kernel recorded: a bad expert id (ShapeError, once), or a peer's flag
        that never came (CommTimeoutError)."""
        if self.err.view[4]:
            n = int(self.err.view[5])
            self.err.view[4] = 0
            raise ValueError(f"num_worst_tokens: expected >= the {n} tokens rank {self.rank} received in the previous "
                             "dispatch (found by the NVLink kernel; rows past num_worst_tokens were dropped)")
        if self.err.view[2]:
            bad = int(self.err.view[3])
            self.err.view[2] = 0
            raise ShapeError(f"topk_idx: expected expert ids in [-1, num_experts), got {bad} (found by the NVLink "
                             "layout/low-latency kernel; those entries were skipped)")
        stage = int(self.err.view[0])
        if stage:
            peer = int(self.err.view[1])
            name = STAGES.get(stage, f"stage {stage}")
            raise CommTimeoutError(
                f"deepep rank {self.global_rank}: stage '{name}' timed out after {self.buf.timeout_s:.1f} s waiting "
                f"for rank {peer} of the group (NVLink kernel); call Buffer.reset()", rank=self.global_rank,
                stage=name)

    def destroy(self) -> None:
        try:
            torch.cuda.synchronize()
        except Exception:  # a failed context must not stop us releasing the rest
            pass
        for reg in self.regions.values():
            reg.close()
        self.regions.clear()
        self.info.free()
        self.err.free()

    # ------------------------------------------------------------------ layout

    def _layout_kernel(self, T: int, epr: int, **tensors: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return launch_layout(self.module, self.err.device, self.layout_scratch, self.num_ranks, T, epr,
                             timeout_s=self.buf.timeout_s, **tensors)

    def layout(self, topk_idx: torch.Tensor, num_experts: int):
        """get_dispatch_layout in one kernel launch, no host sync (ids are checked on the device and a
        bad one raises ShapeError at the next dispatch). Also computes the send positions."""
        from .layout import Layout, check_topk_idx

        self.check()
        R = self.num_ranks
        if num_experts % R:
            raise ValueError(f"num_experts: expected a multiple of num_ranks={R}, got {num_experts}")
        check_topk_idx(topk_idx, num_experts, values=False)
        topk_idx = topk_idx.contiguous()
        T, epr, dev = topk_idx.shape[0], num_experts // R, topk_idx.device
        in_rank = torch.empty(T, R, dtype=torch.bool, device=dev)
        per_rank = torch.empty(R, dtype=torch.int32, device=dev)
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
        send_pos, counts_msg = self._layout_kernel(T, epr, topk_idx=topk_idx, in_rank=in_rank, per_expert_in=None,
                                                   per_rank=per_rank, per_expert=per_expert)
        self._layout_cache = (in_rank, per_expert, send_pos, counts_msg)
        return Layout(per_rank, None, per_expert, in_rank)

    # ------------------------------------------------------------------ normal mode

    def dispatch(self, inp: DispatchInput, handle: NvlinkHandle | None, is_token_in_rank, num_tokens_per_expert,
                 experts_per_rank: int, expert_alignment: int, num_worst_tokens: int) -> DispatchOutput:
        self.check()
        R, T, epr = self.num_ranks, inp.num_tokens, experts_per_rank
        if T > self.cap:
            raise ShapeError(f"x: expected at most num_max_tokens_per_rank={self.cap} tokens (Buffer argument), got {T}")
        if epr > 4096:
            raise ShapeError(f"num_tokens_per_expert: expected at most {4096 * R} experts, got {epr * R}")
        x = inp.x
        x_bytes = x.shape[1] * x.element_size()
        if x_bytes % 16:
            raise ShapeError(f"x.shape[1]: expected hidden * itemsize to be a multiple of 16 bytes, got {x_bytes}")
        cache = self._layout_cache
        if handle is None and cache is not None and cache[0] is is_token_in_rank and cache[1] is num_tokens_per_expert:
            in_rank, _, send_pos, counts_msg = cache  # computed with the layout, no second pass
        elif handle is None:
            log.debug("dispatch: is_token_in_rank is not the last get_dispatch_layout's; scanning it again")
            in_rank = is_token_in_rank.to(device=x.device).contiguous()
            per_expert_in = num_tokens_per_expert.to(device=x.device, dtype=torch.int32).contiguous()
            send_pos, counts_msg = self._layout_kernel(T, epr, topk_idx=None, in_rank=in_rank,
                                                       per_expert_in=per_expert_in, per_rank=None, per_expert=None)
        else:
            in_rank, send_pos, counts_msg = handle.is_token_in_rank, handle.send_pos, handle.counts_msg
        S = inp.scales.shape[1] if inp.scales is not None else 0
        k = inp.topk_idx.shape[1] if inp.topk_idx is not None else 0
        off_scales = x_bytes
        off_topk = align_up(off_scales + 4 * S, 8)
        off_w = off_topk + 8 * k
        off_src = off_w + 4 * k
        row_bytes = align_up(off_src + 4, ROW_ALIGN)
        num_sms, senders, chunk = self._config(False)
        if chunk >= 4096 or self.cap >= 2**20:
            raise ValueError(f"config: the NVLink dispatch needs chunk_tokens < 4096 and num_max_tokens_per_rank < 2**20 "
                             f"(chunk flags pack both), got {chunk} and {self.cap}")
        max_chunks = (self.cap + chunk - 1) // chunk
        counts_words = (R * (1 + epr) + 1) // 2
        sig_words = R + counts_words + R * max_chunks
        reg = self._region("dispatch", sig_words, R * self.cap * row_bytes)
        self.epochs["dispatch"] += 1
        epoch = self.epochs["dispatch"]
        par = epoch & 1

        rows_cap = max(R * self.cap, num_worst_tokens)
        dev = x.device
        recv_x = torch.empty(rows_cap, x.shape[1], dtype=x.dtype, device=dev)
        recv_scales = torch.empty(rows_cap, S, dtype=torch.float32, device=dev) if S else None
        recv_topk = torch.empty(rows_cap, k, dtype=torch.int64, device=dev) if k else None
        recv_w = torch.empty(rows_cap, k, dtype=torch.float32, device=dev) if inp.topk_weights is not None else None
        recv_src = torch.empty(rows_cap, dtype=torch.int32, device=dev)
        recv_counts = torch.empty(R, dtype=torch.int32, device=dev)
        a = DispatchArgs(
            x=addr(x), scales=addr(inp.scales), topk_idx=addr(inp.topk_idx), topk_w=addr(inp.topk_weights),
            send_pos=addr(send_pos), counts_msg=addr(counts_msg), peer_data=addr(reg.peer_data[par]),
            peer_sig=addr(reg.peer_sig[par]), recv_x=addr(recv_x), recv_scales=addr(recv_scales),
            recv_topk=addr(recv_topk), recv_w=addr(recv_w), recv_src=addr(recv_src), recv_counts=addr(recv_counts),
            host_info=self.info.device, err=self.err.device, region_bytes=self.cap * row_bytes,
            timeout_ns=self.timeout_ns, T=T, R=R, me=self.rank, epr=epr, k=k, x16=x_bytes // 16, S=S,
            row_bytes=row_bytes, off_scales=off_scales, off_topk=off_topk, off_w=off_w, off_src=off_src, chunk=chunk,
            num_senders=senders, max_chunks=max_chunks, num_worst=num_worst_tokens, sig_counts=R,
            sig_chunks=R + counts_words, epoch=epoch)
        self.module.get_kernel("deepep_dispatch").launch(num_sms, THREADS, [Arg(a)])
        if num_worst_tokens:
            # No host read (CUDA-graph capturable, as in DeepEP): the kernel pads the top-k rows past
            # the received count and reports a count above num_worst_tokens at the next call.
            rows = num_worst_tokens
            new = NvlinkHandle(T, x.shape[1], in_rank, epr, send_pos, counts_msg, recv_counts, rows, [],
                               recv_src[:rows], num_worst_tokens, self.rank)
        else:
            # The receivers publish the counts early; the host sizes the outputs while rows still flow.
            spin_until(lambda: self.info.view[0] == epoch or self.err.view[0] != 0, rank=self.global_rank,
                       stage="dispatch/counts", timeout_s=self.buf.timeout_s + 1.0,
                       detail="waiting for the NVLink kernel's counts")
            self.check()
            rows = int(self.info.view[1])
            per_expert = align_counts([int(v) for v in self.info.view[2:2 + epr]], expert_alignment)
            new = NvlinkHandle(T, x.shape[1], in_rank, epr, send_pos, counts_msg, recv_counts, rows, per_expert,
                               recv_src[:rows], 0, self.rank)
        return DispatchOutput(recv_x[:rows], recv_scales[:rows] if S else None,
                              recv_topk[:rows] if k else None, recv_w[:rows] if recv_w is not None else None, new)

    def combine(self, x: torch.Tensor, handle: NvlinkHandle, topk_weights: torch.Tensor | None):
        self.check()
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ShapeError(f"x.dtype: expected bfloat16 or float32 on the NVLink transport, got {x.dtype}")
        R, T = self.num_ranks, handle.num_tokens
        x_bytes = x.shape[1] * x.element_size()
        k = topk_weights.shape[1] if topk_weights is not None else 0
        row_bytes = align_up(x_bytes + 4 * k, ROW_ALIGN)
        num_sms, senders, chunk = self._config(True)
        max_chunks = (self.cap + chunk - 1) // chunk
        reg = self._region("combine", R + R * max_chunks, R * self.cap * row_bytes)
        self.epochs["combine"] += 1
        epoch = self.epochs["combine"]
        par = epoch & 1
        out = torch.empty(T, x.shape[1], dtype=x.dtype, device=x.device)
        out_w = torch.empty(T, k, dtype=torch.float32, device=x.device) if k else None
        w = topk_weights.contiguous() if k else None
        a = CombineArgs(
            x=addr(x), w=addr(w), recv_counts=addr(handle.recv_counts), send_pos=addr(handle.send_pos),
            peer_data=addr(reg.peer_data[par]), peer_sig=addr(reg.peer_sig[par]), out=addr(out), out_w=addr(out_w),
            err=self.err.device, region_bytes=self.cap * row_bytes, timeout_ns=self.timeout_ns, T=T, R=R,
            me=self.rank, k=k, x16=x_bytes // 16, row_bytes=row_bytes, off_w=x_bytes, chunk=chunk,
            num_senders=senders, max_chunks=max_chunks, sig_hello=0, sig_chunks=R, epoch=epoch)
        name = "deepep_combine_bf16" if x.dtype == torch.bfloat16 else "deepep_combine_f32"
        self.module.get_kernel(name).launch(num_sms, THREADS, [Arg(a)])
        return out, out_w

    # ------------------------------------------------------------------ low latency

    def _low_latency(self) -> NvlinkLowLatency:
        if self._ll is None:
            self._ll = NvlinkLowLatency(self)
        return self._ll

    def low_latency_dispatch(self, x, topk_idx, max_tokens, num_experts, use_fp8, async_finish, return_recv_hook):
        return self._low_latency().dispatch(x, topk_idx, max_tokens, num_experts, use_fp8, return_recv_hook)

    def low_latency_combine(self, y, topk_idx, topk_weights, handle, async_finish, return_recv_hook, out):
        return self._low_latency().combine(y, topk_idx, topk_weights, handle, return_recv_hook, out)


__all__ = ["NvlinkDispatcher", "compile_kernels", "kernel_source", "nvlink_unavailable_reason", "comm_error"]
