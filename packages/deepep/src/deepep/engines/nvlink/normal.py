"""The NVLink engine's normal mode: our kernels write rows straight into the peers' IPC-shared buffers.

Taken when every rank of an NCCL group is a GPU of one host with peer access. Buffers are
our own cuMemAlloc allocations exported with CUDA IPC (`cuIpcGetMemHandle`), opened by every peer
(context.py); the kernels (kernels/intranode.cu, compiled by tilehal.compile_cuda) are described there.
Waits are bounded on both sides: in-kernel spins end at a deadline and record (stage, peer)
in host-mapped memory; the host polls with a deadline too. Then CommTimeoutError.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import tilehal
import torch
from tilehal import Arg, ShapeError

from ...config import Config, default_combine_config, default_dispatch_config
from ...dispatcher import DTYPE_CODES, DispatchInput, DispatchOutput, EngineOptions, HandleTuple, align_counts
from ...layout import Layout, check_topk_idx, compute_layout
from ...waits import spin_until
from .context import NvlinkContext
from .low_latency import NvlinkLowLatency
from .memory import ROW_ALIGN, HostMapped, SharedRegion, addr, align_up

if TYPE_CHECKING:
    from ...dispatcher import LowLatencyEngine

log = logging.getLogger("deepep.nvlink")

THREADS = 512

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
class NvlinkHandle(HandleTuple):
    _TUPLE_LEN = 6  # as_tuple()'s length

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


class NvlinkDispatcher:
    """The NVLink engine (one host, one GPU per rank); see deepep.dispatcher.Dispatcher. Its
    NvlinkContext (built from the group unless given, e.g. emulated ranks) is shared with the
    low-latency mode (low_latency.NvlinkLowLatency)."""

    handle_type = NvlinkHandle
    device_layout = True

    def __init__(self, options: EngineOptions, context: NvlinkContext | None = None) -> None:
        self.options = options
        self.ctx = context if context is not None else NvlinkContext.for_group(options.group, options.timeout_s)
        self.rank, self.num_ranks = self.ctx.rank, self.ctx.num_ranks
        self.cap = options.num_max_tokens_per_rank
        self.info = HostMapped(2 + 4096)  # the dispatch receivers' counts, read by the host
        self.epochs = {"dispatch": 0, "combine": 0}
        self._ll: NvlinkLowLatency | None = None
        self.layout_scratch = LayoutScratch()
        # The last get_dispatch_layout's send positions, reused when dispatch gets its is_token_in_rank.
        self._layout_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ plumbing

    def _config(self, config: Config | None, combine: bool) -> tuple[int, int, int]:
        # The config Buffer passes for this call (its default when the caller gave none).
        cfg = config
        if cfg is None:
            cfg = (default_combine_config if combine else default_dispatch_config)(self.num_ranks, Config.num_sms)
        num_sms = max(cfg.num_sms, 2 * self.num_ranks)
        senders = num_sms // 2
        return num_sms, senders, cfg.chunk_tokens

    def _capacity(self, kind: str, sig_words: int, row_bytes: int, T: int) -> tuple[int, int]:
        """(rows a source may send this rank in one call, data bytes of the region) for a call of `kind`.

        num_nvl_bytes = 0: the region holds num_max_tokens_per_rank rows from every rank (made at the first
        call, remade larger when rows grow). num_nvl_bytes > 0 (DeepEP's sizing): each of the two kinds
        (dispatch, combine) gets a quarter of it per parity, and a call holds what fits of its rows, up to
        num_max_tokens_per_rank; a call with more tokens than that raises ShapeError naming num_nvl_bytes."""
        R, nvl = self.num_ranks, self.options.num_nvl_bytes
        if not nvl:
            if T > self.cap:
                raise ShapeError(f"x: expected at most num_max_tokens_per_rank={self.cap} tokens (Buffer argument), "
                                 f"got {T}")
            return self.cap, R * self.cap * row_bytes
        data = nvl // 4 - SharedRegion.parity_size(sig_words, 0)
        fit = max(data, 0) // (R * row_bytes)
        cap = min(self.cap, fit)
        if T > cap:
            raise ShapeError(f"x: expected at most {cap} tokens per rank for this {kind} (num_nvl_bytes={nvl}: a quarter "
                             f"per kind and parity holds {fit} rows of {row_bytes} bytes from each of {R} ranks; "
                             f"num_max_tokens_per_rank={self.cap}), got {T}")
        return cap, data

    def check(self) -> None:
        """Raise what a kernel of this context recorded (see NvlinkContext.check)."""
        self.ctx.check()

    def low_latency(self) -> LowLatencyEngine:
        if self._ll is None:
            self._ll = NvlinkLowLatency(self.ctx, enable_shrink=self.options.enable_shrink)
        return self._ll

    def destroy(self) -> None:
        self.ctx.destroy()
        self.info.free()

    # ------------------------------------------------------------------ layout

    def _layout_kernel(self, T: int, epr: int, **tensors: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return launch_layout(self.ctx.module, self.ctx.err.device, self.layout_scratch, self.num_ranks, T, epr,
                             timeout_s=self.ctx.timeout_s, **tensors)

    def layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        """get_dispatch_layout in one kernel launch, no host sync (ids are checked on the device and a
        bad one raises ShapeError at the next dispatch). Also computes the send positions. A CPU
        topk_idx gets the host computation."""
        if not topk_idx.is_cuda:
            return compute_layout(topk_idx, num_experts, self.num_ranks, self.num_ranks)
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
                 experts_per_rank: int, expert_alignment: int, num_worst_tokens: int,
                 config: Config | None = None) -> DispatchOutput:
        self.check()
        R, T, epr = self.num_ranks, inp.num_tokens, experts_per_rank
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
        num_sms, senders, chunk = self._config(config, False)
        if chunk >= 4096 or self.cap >= 2**20:
            raise ValueError(f"config: the NVLink dispatch needs chunk_tokens < 4096 and num_max_tokens_per_rank < 2**20 "
                             f"(chunk flags pack both), got {chunk} and {self.cap}")
        max_chunks = (self.cap + chunk - 1) // chunk
        counts_words = (R * (1 + epr) + 1) // 2
        sig_words = R + counts_words + R * max_chunks
        cap, data_bytes = self._capacity("dispatch", sig_words, row_bytes, T)
        self.ctx.agree("dispatch", [row_bytes, x.shape[1], DTYPE_CODES.get(x.dtype, 0), S, k,
                                    -1 if inp.topk_weights is None else k, epr, cap, chunk])
        reg = self.ctx.region("dispatch", sig_words, data_bytes)
        self.epochs["dispatch"] += 1
        epoch = self.epochs["dispatch"]
        par = epoch & 1

        rows_cap = max(R * cap, num_worst_tokens)
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
            host_info=self.info.device, err=self.ctx.err.device, region_bytes=cap * row_bytes,
            timeout_ns=self.ctx.timeout_ns, T=T, R=R, me=self.rank, epr=epr, k=k, x16=x_bytes // 16, S=S,
            row_bytes=row_bytes, off_scales=off_scales, off_topk=off_topk, off_w=off_w, off_src=off_src, chunk=chunk,
            num_senders=senders, max_chunks=max_chunks, num_worst=num_worst_tokens, sig_counts=R,
            sig_chunks=R + counts_words, epoch=epoch)
        self.ctx.module.get_kernel("deepep_dispatch").launch(num_sms, THREADS, [Arg(a)])
        if num_worst_tokens:
            # No host read (CUDA-graph capturable, as in DeepEP): the kernel pads the top-k rows past
            # the received count and reports a count above num_worst_tokens at the next call.
            rows = num_worst_tokens
            new = NvlinkHandle(T, x.shape[1], in_rank, epr, send_pos, counts_msg, recv_counts, rows, [],
                               recv_src[:rows], num_worst_tokens, self.rank)
        else:
            # The receivers publish the counts early; the host sizes the outputs while rows still flow.
            spin_until(lambda: self.info.view[0] == epoch or self.ctx.err.view[0] != 0, rank=self.ctx.global_rank,
                       stage="dispatch/counts", timeout_s=self.ctx.timeout_s + 1.0,
                       detail="waiting for the NVLink kernel's counts")
            self.check()
            rows = int(self.info.view[1])
            per_expert = align_counts([int(v) for v in self.info.view[2:2 + epr]], expert_alignment)
            new = NvlinkHandle(T, x.shape[1], in_rank, epr, send_pos, counts_msg, recv_counts, rows, per_expert,
                               recv_src[:rows], 0, self.rank)
        return DispatchOutput(recv_x[:rows], recv_scales[:rows] if S else None,
                              recv_topk[:rows] if k else None, recv_w[:rows] if recv_w is not None else None, new)

    def combine(self, x: torch.Tensor, handle: NvlinkHandle, topk_weights: torch.Tensor | None,
                config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.check()
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ShapeError(f"x.dtype: expected bfloat16 or float32 on the NVLink transport, got {x.dtype}")
        R, T = self.num_ranks, handle.num_tokens
        x_bytes = x.shape[1] * x.element_size()
        k = topk_weights.shape[1] if topk_weights is not None else 0
        row_bytes = align_up(x_bytes + 4 * k, ROW_ALIGN)
        num_sms, senders, chunk = self._config(config, True)
        max_chunks = (self.cap + chunk - 1) // chunk
        cap, data_bytes = self._capacity("combine", R + R * max_chunks, row_bytes, T)
        self.ctx.agree("combine", [row_bytes, x.shape[1], DTYPE_CODES.get(x.dtype, 0), k, cap, chunk])
        reg = self.ctx.region("combine", R + R * max_chunks, data_bytes)
        self.epochs["combine"] += 1
        epoch = self.epochs["combine"]
        par = epoch & 1
        out = torch.empty(T, x.shape[1], dtype=x.dtype, device=x.device)
        out_w = torch.empty(T, k, dtype=torch.float32, device=x.device) if k else None
        w = topk_weights.contiguous() if k else None
        a = CombineArgs(
            x=addr(x), w=addr(w), recv_counts=addr(handle.recv_counts), send_pos=addr(handle.send_pos),
            peer_data=addr(reg.peer_data[par]), peer_sig=addr(reg.peer_sig[par]), out=addr(out), out_w=addr(out_w),
            err=self.ctx.err.device, region_bytes=cap * row_bytes, timeout_ns=self.ctx.timeout_ns, T=T, R=R,
            me=self.rank, k=k, x16=x_bytes // 16, row_bytes=row_bytes, off_w=x_bytes, chunk=chunk,
            num_senders=senders, max_chunks=max_chunks, sig_hello=0, sig_chunks=R, epoch=epoch)
        name = "deepep_combine_bf16" if x.dtype == torch.bfloat16 else "deepep_combine_f32"
        self.ctx.module.get_kernel(name).launch(num_sms, THREADS, [Arg(a)])
        return out, out_w


__all__ = ["NvlinkDispatcher", "NvlinkHandle", "LayoutScratch", "launch_layout"]
