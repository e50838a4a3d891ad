"""The NVLink engine's low-latency mode: host side of kernels/low_latency.cu.

One kernel launch per call, no host synchronization, fixed output buffers: dispatch and combine
can be captured in a CUDA graph and replayed. The kernels send each token once per destination
rank (not once per expert), see kernels/low_latency.cu for why and how.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
from tilehal import Arg, ShapeError

from ...dispatcher import HandleTuple
from ...event import EventOverlap
from .context import NvlinkContext
from .memory import ROW_ALIGN, SharedRegion, addr, align_up

THREADS = 512
MAX_TOPK = 32  # the kernels keep one token's top-k entries in shared arrays of this size
MAX_SMEM_BYTES = 200 * 1024
SEND, RECEIVE = 1, 2  # kernel phases (low_latency.cu)

P = ctypes.c_uint64  # device pointers travel as 64-bit integers


class LLArgs(ctypes.Structure):
    """Mirror of deepep::LLArgs (kernels/low_latency.cu); tests compare every offset."""

    _fields_ = [(n, P) for n in ("x", "topk_idx", "topk_w", "y", "tok_rows", "src_tokens", "recv_x", "recv_scales",
                                  "recv_src", "recv_count", "out", "peer_data", "peer_sig", "state", "err", "mask",
                                  "call_mask")] + [
        ("timeout_ns", ctypes.c_uint64)] + [
        (n, ctypes.c_int32) for n in ("T", "k", "H", "R", "me", "E", "epr", "M", "use_fp8", "phases", "row_bytes",
                                      "payload_bytes", "sig_tokens", "sig_msg", "scale_pad", "shrink")] + [
        ("data_rows", ctypes.c_int64)]


@dataclass
class NvlinkLowLatencyHandle(HandleTuple):
    _TUPLE_LEN = 5  # as_tuple()'s length

    num_tokens: int
    hidden: int
    num_experts: int
    num_max_dispatch_tokens_per_rank: int
    tok_rows: torch.Tensor  # [R, M, k] int32: recv_x row of each received (source, token, j), or -1
    src_tokens: torch.Tensor  # [R] int32: tokens each source had
    recv_src_info: torch.Tensor  # [E_l, R * M] int32: source token of each received row
    call_mask: torch.Tensor | None = None  # [R] int32: ranks the dispatch left out (masked or timed out)

    def as_tuple(self) -> tuple:
        """DeepEP's low-latency handle: (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
        num_experts); layout_range [E_l, R] int64 = (first row << 32) | rows, per local expert and source
        rank, derived on the device from tok_rows (valid once the dispatch's receive has run)."""
        r, m, k = self.tok_rows.shape
        e_l, cap = self.recv_src_info.shape[0], r * m
        rows = self.tok_rows.reshape(r, m * k).to(torch.int64)
        valid = rows >= 0
        src = torch.arange(r, device=rows.device).view(r, 1).expand_as(rows)
        flat = torch.where(valid, (rows // cap) * r + src, torch.full_like(rows, e_l * r)).reshape(-1)
        slot = torch.where(valid, rows % cap, torch.full_like(rows, cap)).reshape(-1)
        count = torch.bincount(flat, minlength=e_l * r + 1)[: e_l * r]
        begin = torch.full((e_l * r + 1,), cap, dtype=torch.int64, device=rows.device)
        begin = begin.scatter_reduce(0, flat, slot, reduce="amin")[: e_l * r]
        begin = torch.where(count > 0, begin, torch.zeros_like(begin))
        layout = ((begin << 32) | count).view(e_l, r)
        return (self.recv_src_info, layout, self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)


def scale_pad(rows: int) -> int:
    """Rows of one column of column-major fp32 scales: padded to 16 bytes (TMA's alignment)."""
    return (rows + 3) // 4 * 4


def payload_bytes(H: int, use_fp8: bool) -> int:
    """Bytes of one staged token before its top-k ids and slots: fp8 values and fp32 scales, or bf16."""
    return H + 4 * (H // 128) if use_fp8 else 2 * H


def region_sizes(R: int, M: int, H: int, E: int, k: int, use_fp8: bool) -> dict[str, tuple[int, int, int]]:
    """Per kind: (signal words, data bytes, row bytes) of one parity of the low-latency regions."""
    row = align_up(payload_bytes(H, use_fp8) + 8 * k, ROW_ALIGN)
    sig_msg = R + R * M  # count flags, token flags, then the int32 [R][epr] counts messages
    data_rows = align_up(R * M * k * 4, 16)  # combine: the top-k weights, then partial rows
    return {"ll_dispatch": (sig_msg + (R * (E // R) + 1) // 2, R * M * row, row),
            "ll_combine": (R + R * M, data_rows + R * M * 2 * H, 2 * H)}


def size_hint(R: int, M: int, H: int, E: int) -> int:
    """Bytes of IPC memory the low-latency mode allocates per rank (both kinds, both parities),
    for the largest top-k the kernels take and bf16 rows (the larger format)."""
    total = 0
    for sig_words, data_bytes, _ in region_sizes(R, M, H, E, MAX_TOPK, use_fp8=False).values():
        total += 2 * SharedRegion.parity_size(sig_words, data_bytes)
    return total


class NvlinkLowLatency:
    """Owns the fixed outputs, the device-side epochs and the rank mask; module, regions, error word,
    timeout and SMs come from the NvlinkContext it shares with the normal mode.

    Rank masking (DeepEP's shrink mode, kernels/low_latency.cu): `mask` (int32 [R] on the device,
    1 = masked) is read by every call's kernels: a masked rank is sent nothing and waited for by
    nobody. With `enable_shrink` a wait that passes its deadline masks that peer there and the call
    finishes for the live ranks (query the mask to see who was dropped); without it the timeout is
    recorded and the next call raises CommTimeoutError naming the peer."""

    handle_type = NvlinkLowLatencyHandle

    def __init__(self, ctx: NvlinkContext, enable_shrink: bool = False) -> None:
        self.ctx = ctx
        self.rank, self.num_ranks = ctx.rank, ctx.num_ranks
        self.enable_shrink = bool(enable_shrink)
        self.mask = torch.zeros(ctx.num_ranks, dtype=torch.int32, device="cuda")
        self.state = torch.zeros(2, 2, dtype=torch.int32, device="cuda")  # [dispatch|combine][epoch, blocks done]
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.parity = 0  # the output set the next dispatch fills: two sets, so two results are live at once

    def _out(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, col_major: bool = False) -> torch.Tensor:
        """The fixed output `key` of the current set (the same storage every call of that set: graph-safe).
        `col_major`: [..., rows, cols] stored column-major with rows padded to 4 (16 bytes), the
        TMA-aligned scale layout deepgemm's masked GEMM reads as it is."""
        key = f"{key}/{self.parity}"
        k = (key, shape, dtype, col_major)
        t = self.outputs.get(k)
        if t is None:
            for old in [o for o in self.outputs if o[0] == key]:
                del self.outputs[old]
            if col_major:
                *lead, rows, cols = shape
                t = torch.zeros((*lead, cols, scale_pad(rows)), dtype=dtype, device="cuda")[..., :rows].transpose(-1, -2)
            else:
                t = torch.zeros(shape, dtype=dtype, device="cuda")
            self.outputs[k] = t
        return t

    # ------------------------------------------------------------------ rank mask (stream-ordered, graph-safe)

    def update_mask(self, rank: int, mask: bool) -> None:
        """Mask (unmask) `rank` for the calls queued after this on the current stream."""
        self.mask[rank] = 1 if mask else 0

    def query_mask(self, out: torch.Tensor) -> None:
        """Copy the mask (1 = masked) into `out` (int32 [R]) on the current stream."""
        out.copy_(self.mask)

    def clean_mask(self) -> None:
        self.mask.zero_()

    def _args(self, **kw: Any) -> LLArgs:
        a = LLArgs(err=self.ctx.err.device, timeout_ns=self.ctx.timeout_ns, R=self.num_ranks, me=self.rank,
                   mask=addr(self.mask) if self.enable_shrink else 0, shrink=int(self.enable_shrink))
        for key, v in kw.items():
            setattr(a, key, v)
        return a

    def _launch(self, name: str, a: LLArgs, return_recv_hook: bool, keep: tuple, smem_bytes: int = 0):
        """Both phases in one launch; with `return_recv_hook` only the send phase now, and a hook
        that launches the receive phase (DeepEP's overlap: no SMs sit waiting in between). `keep`:
        the tensors `a` points into, held until the receive launch is queued."""
        kernel = self.ctx.module.get_kernel(name)

        def launch(phases: int) -> None:
            a.phases = phases
            # Every SM: tokens and items are spread one per block (a block sends before it waits).
            kernel.launch(self.ctx.num_sms, THREADS, [Arg(a)], smem_bytes=smem_bytes)

        if not return_recv_hook:
            launch(SEND | RECEIVE)
            return None
        launch(SEND)
        done = []

        def hook() -> None:
            if done:
                raise RuntimeError("the receive hook of a low-latency call was already called")
            done.append(keep)
            launch(RECEIVE)
        return hook

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int, num_experts: int, use_fp8: bool,
                 return_recv_hook: bool):
        self.ctx.check()
        R, T, H = self.num_ranks, x.shape[0], x.shape[1]
        k = topk_idx.shape[1]
        epr = num_experts // R
        if x.dtype != torch.bfloat16:
            raise ShapeError(f"x.dtype: expected torch.bfloat16 on the NVLink low-latency path, got {x.dtype}")
        if k > MAX_TOPK:
            raise ShapeError(f"topk_idx.shape[1]: expected at most {MAX_TOPK} experts per token on the NVLink "
                             f"low-latency path, got {k}")
        smem = 4 * max(num_experts, epr * (R + 1))
        if smem > MAX_SMEM_BYTES:
            raise ShapeError(f"num_experts: expected at most {MAX_SMEM_BYTES // 4 - epr} on the NVLink low-latency "
                             f"path, got {num_experts}")
        payload = payload_bytes(H, use_fp8)
        M = max_tokens
        self.ctx.agree("low_latency_dispatch", [H, int(use_fp8), k, num_experts, M])
        sig_words, data_bytes, row_bytes = region_sizes(R, M, H, num_experts, k, use_fp8)["ll_dispatch"]
        sig_tokens, sig_msg = R, R + R * M
        reg = self.ctx.region("ll_dispatch", sig_words, data_bytes)
        cap = R * M
        if use_fp8:
            recv_x: Any = (self._out("x", (epr, cap, H), torch.float8_e4m3fn),
                           self._out("scales", (epr, cap, H // 128), torch.float32, col_major=True))
            rx, rs = recv_x
        else:
            recv_x = rx = self._out("x_bf16", (epr, cap, H), torch.bfloat16)
            rs = None
        recv_count = self._out("count", (epr,), torch.int32)
        recv_src = self._out("src", (epr, cap), torch.int32)
        self.parity ^= 1
        # Per call (graph-safe: captured allocations come from the graph's pool); the kernel writes
        # every entry the combine reads.
        tok_rows = torch.empty(R, M, k, dtype=torch.int32, device=x.device)
        src_tokens = torch.empty(R, dtype=torch.int32, device=x.device)
        call_mask = torch.zeros(R, dtype=torch.int32, device=x.device)
        a = self._args(x=addr(x), topk_idx=addr(topk_idx), tok_rows=addr(tok_rows), src_tokens=addr(src_tokens),
                       call_mask=addr(call_mask),
                       recv_x=addr(rx), recv_scales=addr(rs), recv_src=addr(recv_src), recv_count=addr(recv_count),
                       peer_data=addr(reg.peer_data), peer_sig=addr(reg.peer_sig), state=addr(self.state[0]),
                       T=T, k=k, H=H, E=num_experts, epr=epr, M=M, use_fp8=int(use_fp8), row_bytes=row_bytes,
                       payload_bytes=payload, sig_tokens=sig_tokens, sig_msg=sig_msg, scale_pad=scale_pad(cap))
        hook = self._launch("deepep_ll_dispatch", a, return_recv_hook, (x, topk_idx), smem_bytes=smem)
        handle = NvlinkLowLatencyHandle(T, H, num_experts, M, tok_rows, src_tokens, recv_src, call_mask)
        return recv_x, recv_count, handle, EventOverlap.capture(x.device), hook

    def combine(self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: NvlinkLowLatencyHandle, return_recv_hook: bool, out: torch.Tensor | None):
        self.ctx.check()
        R, H, M = self.num_ranks, handle.hidden, handle.num_max_dispatch_tokens_per_rank
        E, T, k = handle.num_experts, handle.num_tokens, topk_idx.shape[1]
        if y.dtype != torch.bfloat16:
            raise ShapeError(f"x.dtype: expected torch.bfloat16 for low_latency_combine, got {y.dtype}")
        if k != handle.tok_rows.shape[2]:
            raise ShapeError(f"topk_idx.shape[1]: expected {handle.tok_rows.shape[2]} (as in the dispatch), got {k}")
        self.ctx.agree("low_latency_combine", [H, k, E, M])
        sig_words, data_bytes, row_bytes = region_sizes(R, M, H, E, k, True)["ll_combine"]
        data_rows = data_bytes - R * M * row_bytes
        reg = self.ctx.region("ll_combine", sig_words, data_bytes)
        if out is None:
            out = torch.empty(T, H, dtype=torch.bfloat16, device=y.device)
        # Converted copies stay referenced until the launch is queued.
        idx, w, y = topk_idx.to(torch.int64).contiguous(), topk_weights.float().contiguous(), y.contiguous()
        a = self._args(topk_idx=addr(idx), topk_w=addr(w), y=addr(y), tok_rows=addr(handle.tok_rows),
                       src_tokens=addr(handle.src_tokens), call_mask=addr(handle.call_mask), out=addr(out), peer_data=addr(reg.peer_data), peer_sig=addr(reg.peer_sig),
                       state=addr(self.state[1]), T=T, k=k, H=H, E=E, epr=E // R, M=M, row_bytes=row_bytes,
                       sig_tokens=R, data_rows=data_rows)
        hook = self._launch("deepep_ll_combine", a, return_recv_hook, (idx, w, y, out))
        return out, EventOverlap.capture(y.device), hook
