"""The paged attention function transformers calls through its `AttentionInterface`.

Registered as "tilestack_kvpool". transformers hands it the layer's query and the key/value that
`KVPoolCache.update` returned (this step's new K/V, already written into the pool); it reads the
pool instead: `kvpool.paged_decode` for one new token per row (restricted to the blocks
`dataengine.select_blocks` picks when the cache is sparse), `kvpool.paged_prefill` otherwise.
Causality and padding come from the pool's sequence lengths, so no mask is built (transformers
builds none for an implementation without a registered mask function).
"""

from __future__ import annotations

import logging

import torch
from dataengine import select_blocks
from kvpool import paged_decode, paged_prefill
from tilehal import ArgumentError
from transformers import AttentionInterface

from .errors import CacheMismatchError

log = logging.getLogger("tilestack.hf")

NAME = "tilestack_kvpool"
# paged_prefill's torch reference holds [q_heads, new, cached] fp32 scores per sequence; above this
# many bytes (per device type) a sequence's queries go in chunks (each a valid prefill of its last
# positions). kvpool's CUDA kernel (bf16/fp16, head_dim 64/128) takes whole sequences.
PREFILL_SCORE_BYTES = {"cpu": 1 << 28, "cuda": 1 << 31}


def kvpool_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """query `[B, q_heads, T, D]` -> (`[B, T, q_heads, D]`, None), attending through the pool."""
    cache = getattr(module, "_tilestack_kvpool", None)
    layer = getattr(module, "layer_idx", None)
    step = cache._step if cache is not None else None
    if step is None or step.keys.get(layer) is not key:
        raise CacheMismatchError(
            "attention: this model runs kvpool's paged attention (tilestack.hf.enable_kvpool); pass the cache "
            "enable_kvpool returned as past_key_values, or call tilestack.hf.disable_kvpool(model) first")
    if dropout:
        raise ArgumentError(f"dropout: expected 0.0 (kvpool attention is for inference), got {dropout}")
    pool = cache.pool
    B, hq, T, D = query.shape
    if step.decode:
        q = query[:, :, 0, :]
        indices = None
        if cache.sparse is not None:
            kmin, kmax = pool.key_summary(layer)
            sp = cache.sparse
            indices = select_blocks(q, kmin, kmax, step.block_table, step.seq_lens, sp.top_k, sp.sink_blocks,
                                    sp.local_blocks, block_size=pool.block_size)
        if cache.observer is not None:
            cache.observer(layer, q, step.block_table, step.seq_lens, indices)
        out = paged_decode(q, pool, layer, step.block_table, step.seq_lens, scale=scaling, block_indices=indices)
        return out[:, None], None
    qt = query.transpose(1, 2)  # [B, T, hq, D]
    packed = qt.reshape(B * T, hq, D) if step.all_written and bool(step.query_mask.all()) else qt[step.query_mask]
    out_packed = _prefill(packed, pool, layer, step, scaling)
    out = query.new_zeros(B, T, hq, D)
    out[step.query_mask] = out_packed
    return out, None


def _prefill(q: torch.Tensor, pool, layer: int, step, scale) -> torch.Tensor:
    cu = [int(x) for x in step.cu_seqlens_q.tolist()]
    lens = [int(x) for x in step.seq_lens.tolist()]
    hq = q.shape[1]
    worst = max((cu[b + 1] - cu[b]) * lens[b] for b in range(len(lens))) * hq * 4
    budget = PREFILL_SCORE_BYTES.get(q.device.type, 1 << 28)
    if worst <= budget or _prefill_kernel_serves(q, pool):
        return paged_prefill(q, pool, layer, step.block_table, step.seq_lens, step.cu_seqlens_q, scale=scale)
    log.debug("paged_prefill: %d-byte score matrix; queries go in chunks", worst)
    out = torch.empty_like(q)
    for b in range(len(lens)):
        n, L = cu[b + 1] - cu[b], lens[b]
        chunk = max(1, budget // (hq * 4 * L))
        table = step.block_table[b:b + 1]
        for a in range(0, n, chunk):
            e = min(n, a + chunk)
            end = torch.tensor([L - n + e], dtype=torch.int32, device=step.seq_lens.device)
            cuq = torch.tensor([0, e - a], dtype=torch.int32, device=step.seq_lens.device)
            out[cu[b] + a:cu[b] + e] = paged_prefill(q[cu[b] + a:cu[b] + e], pool, layer, table, end, cuq, scale=scale)
    return out


def _prefill_kernel_serves(q: torch.Tensor, pool) -> bool:
    """Whether paged_prefill runs kvpool's CUDA kernel here (it needs no chunks: no score matrix)."""
    if pool.device.type != "cuda":
        return False
    try:
        from kvpool.cuda_prefill import unsupported_reason
    except ImportError:  # a kvpool without the prefill kernel
        return False
    return unsupported_reason(q, pool) is None


def register() -> None:
    """Make "tilestack_kvpool" a valid `attn_implementation` (idempotent)."""
    AttentionInterface.register(NAME, kvpool_attention)
