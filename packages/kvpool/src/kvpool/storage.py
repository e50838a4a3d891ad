"""The K/V tensors themselves, their fp8 scales and the per-block key summaries.

Layout, per layer: `[num_blocks, block_size, kv_heads, head_dim]` for K and for V; all layers
live in one tensor `[num_layers, num_blocks, ...]` so moving a block (copy-on-write, host
offload) is one copy for all layers. A slot is `block * block_size + offset`.

fp8 (e4m3) storage keeps one fp32 scale per (layer, block, head) for K and one for V:
value = stored * scale. Scales are powers of two. A write that brings a larger magnitude into a
block raises the scale and requantizes the block's earlier tokens (exactly, bar values pushed
into the subnormal range), so a block never saturates. Non-finite inputs do not take part in
the scale: an Inf is stored as the largest fp8 magnitude (448 * scale) with its sign, a NaN as
NaN, each only at its own position.

Key summaries (kmin/kmax per block, head and channel) are reduced into by every write; a freshly
allocated block is reset lazily (`mark_fresh`, applied before the next device op) so allocation
stays a pure-Python operation. They are kept in the compute dtype, or with
`summary_dtype=torch.float8_e4m3fn` as e4m3 codes rounded outward (kmin down, kmax up: the
bounds stay bounds of every key, at half the bytes a selection reads). e4m3 has no infinities,
so its two NaN codes are the open ends, ordered below / above every value: 0xFF (-inf: a kmax
with nothing written, or a kmin below -448) and 0x7F (+inf: a kmin with nothing written, or a
kmax above 448; a NaN key widens both bounds to these ends). dataengine's selection decodes them
so (dataengine/select.py). Folding is monotone in that order, so round(min) == min(round): each
write folds its own rounded keys, no unrounded copy is kept.
With `summary_dtype="int4"` the exact summaries stay (the writes fold into them) and each write
also re-encodes its blocks' rows as int4 rows (uint8 [layers, blocks, heads, D/2 + D/8], what
`KVPool.key_summary` returns): per 32-channel group a bf16 origin lo (the group's minimum,
rounded down) and a bf16 step (the range / 15, rounded up), and per channel a 4-bit code, kmin's
rounded down and kmax's up, each checked in the decoder's float32 arithmetic (lo + code * step),
so the decoded kmin <= every key <= the decoded kmax. A group with a non-finite value is stored
as its own extreme with step 0 (its minimum for kmin, maximum for kmax). 5/16 of bf16's bytes.
"""

from __future__ import annotations

import logging

import torch
from tilehal import ArgumentError

log = logging.getLogger("kvpool.storage")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 views: index ops are not implemented for fp8 on every device."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


# ------------------------------------------------------------------ fp8 summary codes
FP8_TOP, FP8_BOTTOM = 0x7F, 0xFF  # the NaN codes as +inf / -inf ends of the code order


def fp8_order(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes -> int32 keys in value order (0xFF lowest, -0 just below +0, 0x7F highest)."""
    c = codes.to(torch.int32)
    return torch.where(c < 128, c + 128, 255 - c)


def fp8_unorder(order: torch.Tensor) -> torch.Tensor:
    return torch.where(order >= 128, order - 128, 255 - order).to(torch.uint8)


def fp8_round_outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """uint8 e4m3 codes of x (float), rounded up (the smallest code >= x; above 448: 0x7F) or down
    (the largest code <= x; below -448: 0xFF). NaN goes to the open end (0x7F up, 0xFF down)."""
    x = x.float()
    c = x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)  # nearest; NaN stays a NaN code
    o = fp8_order(c)
    step = 1 if up else -1
    for _ in range(2):  # nearest is at most one code away, two across the signed zeros
        v = fp8_unorder(o).view(FP8_DTYPE).float()
        off = (v < x) if up else (v > x)
        o = torch.where(off & (o > 0) & (o < 255), o + step, o)
    c = fp8_unorder(o)
    return torch.where(torch.isnan(x), FP8_TOP if up else FP8_BOTTOM, c.to(torch.int32)).to(torch.uint8)


# ------------------------------------------------------------------ int4 summary rows
INT4_GROUP = 32


def int4_row_bytes(head_dim: int) -> int:
    return head_dim // 2 + 4 * (head_dim // INT4_GROUP)


def _bf16_order(bits: torch.Tensor) -> torch.Tensor:
    b = bits.to(torch.int32) & 0xFFFF
    return torch.where(b < 0x8000, b + 0x8000, 0xFFFF - b)


def _bf16_from_order(o: torch.Tensor) -> torch.Tensor:
    b = torch.where(o >= 0x8000, o - 0x8000, 0xFFFF - o)
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def bf16_round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """bfloat16 of finite float32 x rounded up (smallest >= x) or down (largest <= x)."""
    o = _bf16_order(x.to(torch.bfloat16).view(torch.int16))
    step = 1 if up else -1
    for _ in range(2):  # nearest is at most one away, two across the signed zeros
        v = _bf16_from_order(o).float()
        off = (v < x) if up else (v > x)
        o = torch.where(off, o + step, o)
    return _bf16_from_order(o)


def int4_encode(x: torch.Tensor, up: bool) -> torch.Tensor:
    """int4 summary rows uint8 [..., D/2 + D/8] of exact summaries x [..., D] (float32): codes
    rounded up (kmax) or down (kmin) on each 32-channel group's grid; see the module docstring."""
    x = x.float()
    D = x.shape[-1]
    lead = x.shape[:-1]
    g = x.reshape(*lead, D // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    fin = torch.isfinite(g).all(-1)
    lo_b = bf16_round(torch.where(fin, lo, 0.0), up=False).float()
    d = hi - lo_b
    fin = fin & torch.isfinite(d)
    d = torch.where(fin, d, 0.0)
    step = bf16_round(d / 15.0, up=True)
    for _ in range(2):  # the decoder's lo + 15 * step must reach hi
        short = fin & ((lo_b + 15.0 * step.float()) < hi)
        step = torch.where(short, _bf16_from_order(_bf16_order(step.view(torch.int16)) + 1), step)
    st = step.float()[..., None]
    lb = lo_b[..., None]
    safe = torch.where(st > 0, st, 1.0)
    q = (g - lb) / safe
    c = (torch.ceil(q) if up else torch.floor(q)).clamp(0, 15)
    coded = (st > 0) & fin[..., None]  # other groups decode to lo alone: their codes stay 0
    c = torch.where(coded, c, 0.0)
    for _ in range(2):  # the decoder's float32 lo + c * step must stay on the right side of x
        v = lb + c * st
        if up:
            c = torch.where(coded & (v < g) & (c < 15), c + 1, c)
        else:
            c = torch.where(coded & (v > g) & (c > 0), c - 1, c)
    # non-finite groups: their own extreme, step 0
    ext = hi if up else lo
    ext_b = torch.where(torch.isfinite(ext), bf16_round(torch.where(torch.isfinite(ext), ext, 0.0), up).float(), ext)
    lo_out = torch.where(fin, lo_b, ext_b).to(torch.bfloat16)
    st_out = torch.where(fin, step.float(), 0.0).to(torch.bfloat16)
    codes = c.to(torch.uint8).reshape(*lead, D // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    params = torch.stack((lo_out, st_out), dim=-1).reshape(*lead, D // INT4_GROUP * 2).view(torch.uint8)
    return torch.cat((packed, params), dim=-1)


def _int_index(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return x.to(device=device, dtype=torch.long, non_blocking=True)


class KVStorage:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, pin_memory: bool = False,
                 summary_dtype: torch.dtype | str | None = None) -> None:
        if dtype not in SUPPORTED_DTYPES:
            raise ArgumentError(f"dtype: expected one of {[str(d) for d in SUPPORTED_DTYPES]}, got {dtype}")
        if summary_dtype not in (None, FP8_DTYPE, "int4"):
            raise ArgumentError(f"summary_dtype: expected None (the compute dtype), torch.float8_e4m3fn or "
                                f"'int4', got {summary_dtype!r}")
        if summary_dtype == "int4" and head_dim % INT4_GROUP:
            raise ArgumentError(f"summary_dtype: 'int4' expects head_dim a multiple of {INT4_GROUP}, got {head_dim}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.is_fp8 = dtype == FP8_DTYPE
        # Summaries and dequantized reads use the model dtype; fp8 has none, so float32.
        self.compute_dtype = torch.float32 if self.is_fp8 else dtype
        self.summary_dtype = summary_dtype or self.compute_dtype
        self.fp8_summaries = self.summary_dtype == FP8_DTYPE
        self.int4_summaries = summary_dtype == "int4"
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        kw = dict(device=device, pin_memory=pin_memory) if device.type == "cpu" and pin_memory else dict(device=device)
        self.k = torch.zeros(shape, dtype=dtype, **kw)
        self.v = torch.zeros(shape, dtype=dtype, **kw)
        sshape = (num_layers, num_blocks, num_kv_heads, head_dim)
        if self.fp8_summaries:
            self.kmin = torch.full(sshape, FP8_TOP, dtype=torch.uint8, **kw).view(FP8_DTYPE)
            self.kmax = torch.full(sshape, FP8_BOTTOM, dtype=torch.uint8, **kw).view(FP8_DTYPE)
        else:
            self.kmin = torch.full(sshape, float("inf"), dtype=self.compute_dtype, **kw)
            self.kmax = torch.full(sshape, float("-inf"), dtype=self.compute_dtype, **kw)
        self.kmin_q4 = self.kmax_q4 = None
        if self.int4_summaries:  # rows of the fresh state (+inf / -inf, step 0), re-encoded by every write
            rb = int4_row_bytes(head_dim)
            self._fresh_q4 = (int4_encode(torch.full((head_dim,), float("inf")), up=False).to(device),
                              int4_encode(torch.full((head_dim,), float("-inf")), up=True).to(device))
            self.kmin_q4 = self._fresh_q4[0].expand(num_layers, num_blocks, num_kv_heads, rb).clone()
            self.kmax_q4 = self._fresh_q4[1].expand(num_layers, num_blocks, num_kv_heads, rb).clone()
            if kw.get("pin_memory"):
                self.kmin_q4, self.kmax_q4 = self.kmin_q4.pin_memory(), self.kmax_q4.pin_memory()
        if self.is_fp8:
            self.k_scale = torch.zeros((num_layers, num_blocks, num_kv_heads), dtype=torch.float32, **kw)
            self.v_scale = torch.zeros((num_layers, num_blocks, num_kv_heads), dtype=torch.float32, **kw)
        else:
            self.k_scale = self.v_scale = None
        self._fresh: list[int] = []
        # Set by the host tier: makes the compute stream wait for pending offload/prefetch copies.
        self.before_device_op = None

    def tensors(self) -> list[torch.Tensor]:
        """Every per-block tensor (dim 1 = block), i.e. what a block copy must move."""
        ts = [self.k, self.v, self.kmin, self.kmax]
        if self.int4_summaries:
            ts += [self.kmin_q4, self.kmax_q4]
        if self.is_fp8:
            ts += [self.k_scale, self.v_scale]
        return ts

    # ------------------------------------------------------------------ fresh blocks
    def mark_fresh(self, blocks: list[int]) -> None:
        self._fresh.extend(blocks)
        if len(self._fresh) > 4 * self.num_blocks:  # bound the list when nobody writes
            self.flush_fresh()

    def flush_fresh(self) -> None:
        """Reset the summaries (and fp8 scales) of blocks allocated since the last device op."""
        if self.before_device_op is not None:
            self.before_device_op()
        if not self._fresh:
            return
        idx = torch.tensor(sorted(set(self._fresh)), dtype=torch.long).to(self.device, non_blocking=True)
        self._fresh.clear()
        if self.int4_summaries:
            for t, row in ((self.kmin_q4, self._fresh_q4[0]), (self.kmax_q4, self._fresh_q4[1])):
                t.index_copy_(1, idx, row.expand(t.shape[0], len(idx), t.shape[2], t.shape[3]).contiguous())
        if self.fp8_summaries:
            _raw(self.kmin).index_fill_(1, idx, FP8_TOP)
            _raw(self.kmax).index_fill_(1, idx, FP8_BOTTOM)
        else:
            self.kmin.index_fill_(1, idx, float("inf"))
            self.kmax.index_fill_(1, idx, float("-inf"))
        if self.is_fp8:
            self.k_scale.index_fill_(1, idx, 0.0)
            self.v_scale.index_fill_(1, idx, 0.0)

    # ------------------------------------------------------------------ block copies
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (all layers, data + scales + summaries) within this storage."""
        self.flush_fresh()
        s = torch.tensor(src, dtype=torch.long).to(self.device, non_blocking=True)
        d = torch.tensor(dst, dtype=torch.long).to(self.device, non_blocking=True)
        for t in map(_raw, self.tensors()):
            t.index_copy_(1, d, t.index_select(1, s))

    # ------------------------------------------------------------------ write
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.flush_fresh()
        slots = _int_index(slots, self.device)
        if self.device.type == "cuda":
            from . import cuda_write  # one kernel for data + summaries (kvpool/cuda_write.py)

            reason = cuda_write.unsupported_reason(self, k)
            if reason is None:
                cuda_write.write_kv(self, layer, slots, k, v)
                if self.int4_summaries:
                    cuda_write.encode_int4(self, layer, slots)
                return
            log.debug("write: CUDA kernel not used (%s); running torch ops", reason)
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        k = k.to(self.device)
        v = v.to(self.device)
        if self.is_fp8:
            self._write_fp8(self.k[layer], self.k_scale[layer], slots, blocks, k)
            self._write_fp8(self.v[layer], self.v_scale[layer], slots, blocks, v)
        else:
            flat = (-1, self.num_kv_heads, self.head_dim)
            self.k[layer].view(flat).index_copy_(0, slots, k.to(self.dtype))
            self.v[layer].view(flat).index_copy_(0, slots, v.to(self.dtype))
        kc = k.to(self.compute_dtype)
        if self.fp8_summaries:
            self._fold_fp8_summaries(layer, blocks, kc)
            return
        bidx = blocks.view(-1, 1, 1).expand_as(kc)
        self.kmin[layer].scatter_reduce_(0, bidx, kc, "amin", include_self=True)
        self.kmax[layer].scatter_reduce_(0, bidx, kc, "amax", include_self=True)
        if self.int4_summaries:
            self._encode_int4(layer, torch.unique(blocks))

    def _encode_int4(self, layer: int, blocks: torch.Tensor) -> None:
        """Re-encode the int4 rows of `blocks` from the exact summaries."""
        self.kmin_q4[layer].index_copy_(0, blocks, int4_encode(self.kmin[layer].index_select(0, blocks), up=False))
        self.kmax_q4[layer].index_copy_(0, blocks, int4_encode(self.kmax[layer].index_select(0, blocks), up=True))

    def _fold_fp8_summaries(self, layer: int, blocks: torch.Tensor, k: torch.Tensor) -> None:
        """Widen the touched blocks' e4m3 codes by the outward-rounded keys, in code order."""
        touched, inv = torch.unique(blocks, return_inverse=True)
        idx = inv.view(-1, 1, 1).expand(k.shape)
        for cache, up, how in ((self.kmin, False, "amin"), (self.kmax, True, "amax")):
            raw = _raw(cache[layer])
            cur = fp8_order(raw.index_select(0, touched))
            cur.scatter_reduce_(0, idx, fp8_order(fp8_round_outward(k, up)), how, include_self=True)
            raw.index_copy_(0, touched, fp8_unorder(cur))

    def _write_fp8(self, cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor,
                   x: torch.Tensor) -> None:
        x = x.float()
        # [T, H]: the scale each new token asks for, rounded up to a power of two so that raising
        # a block's scale later requantizes its earlier tokens exactly (an exponent shift). Only
        # finite values set it: an Inf saturates to the largest fp8 value of its own (token, head)
        # and a NaN stays a NaN there, instead of an infinite scale turning every other token of
        # the block (and of every sequence sharing it) into NaN.
        finite = torch.isfinite(x)
        amax = torch.where(finite, x.abs(), torch.zeros_like(x)).amax(dim=-1)
        need = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / FP8_MAX))),
                           torch.zeros_like(amax))
        # A (token, head) with an Inf needs some scale to keep the Inf's sign: the smallest that matters.
        has_inf = torch.isinf(x).any(dim=-1)
        need = torch.where(has_inf, need.clamp_min(2.0 ** -20), need)
        new_scale = scale.clone()
        new_scale.scatter_reduce_(0, blocks.view(-1, 1).expand_as(need), need, "amax", include_self=True)
        touched = torch.unique(blocks)
        old_s, new_s = scale[touched], new_scale[touched]
        # Requantize the earlier tokens of every touched block to the (possibly larger) scale.
        # A block with no scale yet holds nothing but a NaN written there (or stale bytes of an earlier
        # owner): keep the NaNs, clear the rest.
        ratio = torch.where(new_s > 0, old_s / new_s.clamp_min(1e-30), torch.zeros_like(new_s))[:, None, :, None]
        old = _raw(cache).index_select(0, touched).view(FP8_DTYPE).float()
        old = torch.where(ratio > 0, old * ratio, torch.where(torch.isnan(old), old, torch.zeros_like(old)))
        _raw(cache).index_copy_(0, touched, _raw(old.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)))
        scale.copy_(new_scale)
        s = new_scale[blocks].clamp_min(1e-30)  # [T, H]
        q = (x / s[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        _raw(cache).view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, _raw(q))

    # ------------------------------------------------------------------ reads
    def read_blocks(self, layer: int, blocks: torch.Tensor, which: str) -> torch.Tensor:
        """Blocks `[n, block_size, H, D]` of K or V in compute dtype (dequantized for fp8)."""
        self.flush_fresh()
        cache = self.k if which == "k" else self.v
        idx = _int_index(blocks, self.device)
        x = _raw(cache[layer]).index_select(0, idx)
        if not self.is_fp8:
            return x
        x = x.view(FP8_DTYPE)
        scale = (self.k_scale if which == "k" else self.v_scale)[layer].index_select(0, idx)
        return x.float() * scale[:, None, :, None]
