"""Attention over the paged pool: decode (dense or restricted to given blocks) and prefill.

`paged_decode` runs the CUDA kernels (kvpool/cuda_decode.py) for CUDA pools of bf16/fp16 and of
fp8 (e4m3, with per-block scales), `paged_prefill` the tensor-core kernel of cuda_prefill.py,
and the torch references otherwise; the references are the oracles the kernels are tested against.
"""

from __future__ import annotations

import logging
import math

import torch
from tilehal import ArgumentError, ShapeError

from .pool import KVPool

log = logging.getLogger("kvpool.attention")


# ----------------------------------------------------------------------------- validation
def _check_pool_and_scale(pool, scale) -> None:
    if not isinstance(pool, KVPool):
        raise ArgumentError(f"pool: expected a kvpool.KVPool, got {type(pool).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ArgumentError(f"scale: expected a finite positive number or None (1/sqrt(head_dim)), got {scale!r}")


def _check_decode_args(q, pool: KVPool, layer: int, block_table, seq_lens, block_indices, scale=None) -> None:
    _check_pool_and_scale(pool, scale)
    if not isinstance(q, torch.Tensor) or q.ndim != 3:
        raise ShapeError(f"q: expected a tensor [batch, q_heads, head_dim], got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    B, hq, d = q.shape
    if d != pool.head_dim:
        raise ShapeError(f"q: expected head_dim {pool.head_dim} (the pool's), got {d}")
    if hq % pool.num_kv_heads != 0:
        raise ShapeError(f"q: expected q_heads a multiple of kv_heads={pool.num_kv_heads}, got {hq}")
    if not q.is_floating_point():
        raise ShapeError(f"q: expected a floating dtype, got {q.dtype}")
    pool._check_layer(layer)  # an int in range: ArgumentError / OutOfRangeError naming `layer`
    for name, t, nd in (("block_table", block_table, 2), ("seq_lens", seq_lens, 1)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.ndim != nd:
            raise ShapeError(f"{name}: expected an int32 tensor with {nd} dims, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} shape {tuple(getattr(t, 'shape', ()))}")
        if t.shape[0] != B:
            raise ShapeError(f"{name}: expected batch {B} (q's), got {t.shape[0]}")
    if block_indices is not None:
        bi = block_indices
        ok_shape = isinstance(bi, torch.Tensor) and (bi.ndim == 2 or (bi.ndim == 3 and bi.shape[1] == pool.num_kv_heads))
        if not ok_shape or bi.dtype != torch.int32 or bi.shape[0] != B:
            raise ShapeError(f"block_indices: expected int32 [{B}, n] or [{B}, {pool.num_kv_heads}, n], got "
                             f"{getattr(bi, 'dtype', type(bi).__name__)} shape {tuple(getattr(bi, 'shape', ()))}")
    for name, t in (("q", q), ("block_table", block_table), ("seq_lens", seq_lens), ("block_indices", block_indices)):
        if t is not None and t.device != pool.device:
            raise ShapeError(f"{name}: expected device {pool.device} (the pool's), got {t.device}")


# ----------------------------------------------------------------------------- reference
def _gather_tokens(cache: torch.Tensor, scale: torch.Tensor | None, table: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks * block_size, H, D] float32 from block ids (padding -> block 0, masked later)."""
    B, mb = table.shape
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    x = raw[table.clamp(min=0).long()].view(cache.dtype).float()  # [B, mb, bs, H, D]
    if scale is not None:
        x = x * scale[table.clamp(min=0).long()][:, :, None, :, None]
    return x.reshape(B, mb * cache.shape[1], cache.shape[2], cache.shape[3])


def _token_mask(pool: KVPool, block_table, seq_lens, block_indices) -> torch.Tensor:
    """bool [B, kv_heads, max_blocks * block_size]: which cached positions each query attends to."""
    B, mb = block_table.shape
    bs, H = pool.block_size, pool.num_kv_heads
    pos = torch.arange(mb * bs, device=block_table.device)
    valid = (pos[None, :] < seq_lens[:, None].long()) & (block_table >= 0).repeat_interleave(bs, dim=1)
    mask = valid[:, None, :].expand(B, H, mb * bs)
    if block_indices is not None:
        bi = block_indices.long()
        if bi.ndim == 2:
            bi = bi[:, None, :].expand(B, H, bi.shape[-1])
        sel = torch.zeros(B, H, mb + 1, dtype=torch.bool, device=bi.device)
        # -1 padding and positions past the table land in the extra column, which is dropped.
        bi = torch.where((bi >= 0) & (bi < mb), bi, torch.full_like(bi, mb))
        sel.scatter_(2, bi, True)
        mask = mask & sel[:, :, :mb].repeat_interleave(bs, dim=2)
    return mask


def paged_decode_reference(q: torch.Tensor, pool: KVPool, layer: int, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None,
                           block_indices: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of `paged_decode` (float32 math, any device)."""
    _check_decode_args(q, pool, layer, block_table, seq_lens, block_indices, scale)
    pool.check_tables(layer, block_table, seq_lens, block_indices)
    B, hq, d = q.shape
    H = pool.num_kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kc, vc = pool.layer_cache(layer)
    ks, vs = pool.layer_scales(layer) or (None, None)
    k = _gather_tokens(kc, ks, block_table)
    v = _gather_tokens(vc, vs, block_table)
    mask = _token_mask(pool, block_table, seq_lens, block_indices)  # [B, H, T]
    qf = q.float().view(B, H, hq // H, d)
    s = torch.einsum("bhgd,bthd->bhgt", qf, k) * scale
    s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a query with nothing to attend to gets zeros
    out = torch.einsum("bhgt,bthd->bhgd", p, v)
    return out.reshape(B, hq, d).to(q.dtype)


# ----------------------------------------------------------------------------- public
def paged_decode(q: torch.Tensor, pool: KVPool, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float | None = None, block_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence attending to its cached K/V: `[B, q_heads, head_dim]` out.

    q: `[B, q_heads, head_dim]` (q_heads a multiple of the pool's kv_heads: GQA); block_table
    int32 `[B, max_blocks]` (-1 padded) and seq_lens int32 `[B]` as from `pool.block_table` /
    `pool.seq_lens`. `block_indices` (int32 `[B, n]` or `[B, kv_heads, n]`, logical block
    positions, -1 padded, no duplicates) restricts attention to those blocks: the sparse path.
    `scale` defaults to 1/sqrt(head_dim). A sequence with nothing to attend to gets zeros.
    """
    _check_decode_args(q, pool, layer, block_table, seq_lens, block_indices, scale)
    pool.check_tables(layer, block_table, seq_lens, block_indices)
    if pool.device.type == "cuda":
        from . import cuda_decode

        if pool.is_fp8:
            reason = cuda_decode.fp8_unsupported_reason(q, pool)
            if reason is None:
                return cuda_decode.paged_decode_fp8_cuda(q, pool, layer, block_table, seq_lens, scale, block_indices)
        else:
            reason = cuda_decode.unsupported_reason(q, pool)
            if reason is None:
                return cuda_decode.paged_decode_cuda(q, pool, layer, block_table, seq_lens, scale, block_indices)
        log.debug("paged_decode: CUDA kernel not used (%s); running the torch reference", reason)
    return paged_decode_reference(q, pool, layer, block_table, seq_lens, scale, block_indices)


def paged_prefill(q: torch.Tensor, pool: KVPool, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """New tokens attending causally to their sequence's cached prefix and to each other.

    q: `[total_new_tokens, q_heads, head_dim]`, packed by sequence; `cu_seqlens_q` int `[B + 1]`
    offsets into q. Sequence b's new tokens are its last `cu_seqlens_q[b+1] - cu_seqlens_q[b]`
    positions (their K/V already written into the pool), so `seq_lens` counts them. CUDA pools of
    bf16/fp16 with head_dim 64/128 run the tensor-core kernel (kvpool/cuda_prefill.py); other
    pools the torch reference (`paged_prefill_reference`, float32 math).
    """
    cu, lens = _check_prefill_args(q, pool, layer, block_table, seq_lens, cu_seqlens_q, scale)
    if pool.device.type == "cuda":
        from . import cuda_prefill

        reason = cuda_prefill.unsupported_reason(q, pool)
        if reason is None:
            return cuda_prefill.paged_prefill_cuda(q, pool, layer, block_table, seq_lens, cu_seqlens_q, cu, lens,
                                                   scale)
        log.debug("paged_prefill: CUDA kernel not used (%s); running the torch reference", reason)
    return _prefill_reference(q, pool, layer, block_table, cu, lens, scale)


def paged_prefill_reference(q: torch.Tensor, pool: KVPool, layer: int, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            scale: float | None = None) -> torch.Tensor:
    """Torch reference of `paged_prefill` (float32 math, any device): the kernel's oracle."""
    cu, lens = _check_prefill_args(q, pool, layer, block_table, seq_lens, cu_seqlens_q, scale)
    return _prefill_reference(q, pool, layer, block_table, cu, lens, scale)


def _check_prefill_args(q, pool: KVPool, layer: int, block_table, seq_lens, cu_seqlens_q,
                        scale=None) -> tuple[list, list]:
    _check_pool_and_scale(pool, scale)
    if not isinstance(q, torch.Tensor) or q.ndim != 3:
        raise ShapeError(f"q: expected a tensor [total_tokens, q_heads, head_dim], got {getattr(q, 'shape', q)}")
    total, hq, d = q.shape
    H = pool.num_kv_heads
    if d != pool.head_dim or hq % H:
        raise ShapeError(f"q: expected head_dim {pool.head_dim} and q_heads a multiple of {H}, got {tuple(q.shape)}")
    for name, t, nd in (("block_table", block_table, 2), ("seq_lens", seq_lens, 1)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.ndim != nd:
            raise ShapeError(f"{name}: expected an int32 tensor with {nd} dims, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} shape {tuple(getattr(t, 'shape', ()))}")
    B = block_table.shape[0]
    if seq_lens.shape[0] != B:
        raise ShapeError(f"seq_lens: expected {B} entries (block_table's batch), got {seq_lens.shape[0]}")
    pool.check_tables(layer, block_table, seq_lens, contiguous=True)
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.ndim != 1 or cu_seqlens_q.is_floating_point() \
            or cu_seqlens_q.is_complex() or cu_seqlens_q.dtype == torch.bool:
        raise ShapeError(f"cu_seqlens_q: expected a 1-D integer tensor of {B + 1} offsets, got "
                         f"{getattr(cu_seqlens_q, 'dtype', type(cu_seqlens_q).__name__)} shape "
                         f"{tuple(getattr(cu_seqlens_q, 'shape', ()))}")
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    if len(cu) != B + 1 or cu[0] != 0 or cu[-1] != total or any(a > b for a, b in zip(cu, cu[1:])):
        raise ShapeError(f"cu_seqlens_q: expected {B + 1} non-decreasing offsets from 0 to {total}, got {cu}")
    lens = [int(x) for x in seq_lens.tolist()]
    for b in range(B):
        if cu[b + 1] - cu[b] > lens[b]:
            raise ShapeError(f"seq_lens[{b}]: expected >= its {cu[b + 1] - cu[b]} new tokens, got {lens[b]}")
    for name, t in (("q", q), ("block_table", block_table), ("seq_lens", seq_lens)):
        if pool.device.type == "cuda" and t.device != pool.device:
            raise ShapeError(f"{name}: expected device {pool.device} (the pool's), got {t.device}")
    return cu, lens


def _prefill_reference(q, pool: KVPool, layer: int, block_table, cu: list, lens: list, scale) -> torch.Tensor:
    total, hq, d = q.shape
    H = pool.num_kv_heads
    B = len(lens)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kc, vc = pool.layer_cache(layer)
    ks, vs = pool.layer_scales(layer) or (None, None)
    out = torch.empty_like(q)
    for b in range(B):
        n_new, L = cu[b + 1] - cu[b], lens[b]
        if n_new == 0:
            continue
        table = block_table[b:b + 1, : -(-L // pool.block_size)]
        k = _gather_tokens(kc, ks, table)[0, :L]  # [L, H, D]
        v = _gather_tokens(vc, vs, table)[0, :L]
        qb = q[cu[b]:cu[b + 1]].float().view(n_new, H, hq // H, d)
        s = torch.einsum("nhgd,thd->hgnt", qb, k) * scale
        qpos = torch.arange(L - n_new, L, device=q.device)
        causal = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]  # [n_new, L]
        s = s.masked_fill(~causal, float("-inf"))
        o = torch.einsum("hgnt,thd->nhgd", torch.softmax(s, dim=-1), v)
        out[cu[b]:cu[b + 1]] = o.reshape(n_new, hq, d).to(q.dtype)
    return out
