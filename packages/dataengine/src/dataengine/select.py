"""Sparse-attention block selection for decode over a paged KV cache.

Protocol (see docs/dataengine.md), shared with kvpool without either importing the other:

  inputs   q            [B, q_heads, head_dim]            decode queries
           kmin, kmax   [num_blocks, kv_heads, head_dim]  per-block, per-channel key min/max
                                                         (kvpool's `KVPool.key_summary(layer)`)
           block_table  int32 [B, max_blocks], -1 padded  physical block of each logical block
           seq_lens     int32 [B]                         tokens per sequence
  output   int32 [B, kv_heads, n], ascending logical block positions (indices into the
           block_table row), -1 padded; what kvpool's `paged_decode(..., block_indices=...)` takes.

Quest (Tang et al. 2024) bounds the score of any key in a block by
sum_i max(q_i * kmax_i, q_i * kmin_i) >= q . k for every k in the block, so the block holding the
top-scoring key always ranks at least as high as that key's score. GQA: the q heads that share a
kv head are reduced (max by default) into one score per kv head, because the kv head's blocks
are fetched once for the whole group.

Tie rule (GPU kernel and reference alike): forced blocks (sink/local) first, by position among
themselves, then higher score, then lower position; -0 equals +0. Only forced blocks and blocks scoring above -inf are returned.

Summaries may be fp8 (torch.float8_e4m3fn; kvpool's `summary_dtype`): half the bytes of bf16,
so half the selection's memory traffic. Their writer rounds outward (kmin down, kmax up), so the
bound stays an upper bound of every key; the two NaN codes are the open ends: in kmax 0x7F means
"a key above 448" (read as 2^100, so the block stays a candidate) and 0xFF "nothing written"
(-inf); in kmin 0xFF means "a key below -448" (-2^100) and 0x7F "nothing written" (+inf). The
reference and the kernels decode them the same way (`decode_fp8_summary`).
Or int4 rows (uint8 [num_blocks, kv_heads, head_dim / 2 + head_dim / 8]; kvpool's
summary_dtype="int4"): 4-bit codes on a per-(block, head, 32 channels) grid lo + code * step, the
codes rounded outward by the writer (`decode_int4_summary`): 5/16 of bf16's bytes. The kernels
(tensor cores only) factor the grid out of the dot product, so their bounds agree with the
reference's to float32 rounding (exactly on dyadic inputs), like bf16 summaries on Gaussian data.

On CUDA tensors of bf16/fp16/fp32 (summaries also fp8) with head_dim 64/128/256, `select_blocks`, `quest_scores` and
`topk_blocks` run the kernels of cuda_select.py (kernels/select.cuh): one launch (select_blocks,
where it applies) or two, no host synchronization, CUDA-graph capturable. Checks that would need the tensors' values on the host
(block ids < num_blocks, NaN scores) are skipped there unless `validate=True`: the kernels never
read out of bounds (an id >= num_blocks scores -inf) and never choose a NaN score. The torch
functions (`*_reference`) serve CPU tensors and are the oracle of the kernels' tests.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from tilehal import ArgumentError, ShapeError, check_choice, check_int

log = logging.getLogger("dataengine.select")

Reduce = Literal["max", "sum", "mean"]


def _check_int_tensor(x: torch.Tensor, name: str, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64):
        raise ShapeError(f"{name}: expected dtype int32 or int64, got {x.dtype}")
    if x.dim() != ndim:
        raise ShapeError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")


def num_valid_blocks(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
    """Logical blocks holding tokens, per sequence: ceil(seq_len / block_size), or the non -1 count."""
    if block_size is not None:
        return (seq_lens.long() + block_size - 1) // block_size
    return (block_table >= 0).sum(-1).long() * (seq_lens > 0).long()


def _cuda_reason(q, kmin) -> str | None:
    if q.device.type != "cuda":
        return "not on CUDA"
    from . import cuda_select

    return cuda_select.unsupported_reason(q, kmin)


def _check_reduce(reduce) -> None:
    check_choice(reduce, "reduce", ("max", "sum", "mean"))


def _check_block_size(block_size) -> int | None:
    return None if block_size is None else check_int(block_size, "block_size", lo=1)


def _check_values(q, kmin, kmax, block_table, seq_lens) -> None:
    """Host checks of values (CPU tensors, or validate=True): q finite, no NaN in the summaries (+-inf
    marks a block with no keys yet), block ids >= -1, seq_lens >= 0."""
    if q.numel() and not bool(torch.isfinite(q).all()):
        raise ArgumentError(f"q: expected finite values, got {int((~torch.isfinite(q)).sum())} NaN/Inf entries")
    D = q.shape[-1]
    for name, t in (("kmin", kmin), ("kmax", kmax)):
        if t.dtype == FP8_SUMMARY:
            continue  # the NaN codes are the open ends of fp8 summaries (module docstring)
        v = t[..., D // 2:].contiguous().view(torch.bfloat16) if is_int4_summary(t, D) else t  # int4: (lo, step)
        if v.numel() and bool(torch.isnan(v).any()):
            raise ArgumentError(f"{name}: expected no NaN (+-inf marks a block with no keys), got "
                                f"{int(torch.isnan(v).sum())} NaN entries")
    if block_table.numel() and int(block_table.min()) < -1:
        raise ArgumentError(f"block_table: expected ids >= -1 (-1 pads), got {int(block_table.min())}")
    if seq_lens.numel() and int(seq_lens.min()) < 0:
        raise ArgumentError(f"seq_lens: expected lengths >= 0, got {int(seq_lens.min())}")


def _valid_mask(block_table, seq_lens, block_size, nb, device) -> torch.Tensor:
    n_valid = num_valid_blocks(block_table, seq_lens, block_size).to(device)
    return torch.arange(nb, device=device)[None, :] < n_valid[:, None]


FP8_SUMMARY = torch.float8_e4m3fn
UNBOUNDED = 2.0 ** 100  # an fp8 summary's open end, as a finite stand-in


def _fp8_tables() -> tuple[torch.Tensor, torch.Tensor]:
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_SUMMARY).float()
    vmax, vmin = v.clone(), v.clone()
    vmax[0x7F], vmax[0xFF] = UNBOUNDED, float("-inf")
    vmin[0xFF], vmin[0x7F] = -UNBOUNDED, float("inf")
    return vmin, vmax


_FP8_TABLES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def decode_fp8_summary(t: torch.Tensor, role: Literal["min", "max"]) -> torch.Tensor:
    """float32 values of fp8 (e4m3) summary codes (uint8 or float8_e4m3fn), by role: the NaN
    codes are the open ends (module docstring)."""
    key = str(t.device)
    if key not in _FP8_TABLES:
        _FP8_TABLES[key] = tuple(x.to(t.device) for x in _fp8_tables())
    lut = _FP8_TABLES[key][1 if role == "max" else 0]
    codes = t.view(torch.uint8) if t.dtype == FP8_SUMMARY else t
    return lut[codes.long()]


INT4_GROUP = 32  # channels per (origin, step) pair of an int4 summary row


def int4_row_bytes(head_dim: int) -> int:
    """Bytes of one int4 summary row (one block, one kv head): codes, then (lo, step) per group."""
    return head_dim // 2 + 4 * (head_dim // INT4_GROUP)


def is_int4_summary(t: torch.Tensor, head_dim: int) -> bool:
    return t.dtype == torch.uint8 and head_dim % INT4_GROUP == 0 and t.shape[-1] == int4_row_bytes(head_dim)


def decode_int4_summary(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """float32 [..., head_dim] values of int4 summary rows uint8 [..., int4_row_bytes(head_dim)]:
    lo + code * step per channel (float32; code * step is exact), code = the channel's nibble
    (channel 2i: low nibble of byte i), (lo, step) bf16 per 32-channel group after the codes."""
    D = head_dim
    codes = rows[..., :D // 2]
    c = torch.stack(((codes & 15), (codes >> 4)), dim=-1).reshape(*rows.shape[:-1], D).float()
    params = rows[..., D // 2:].contiguous().view(torch.bfloat16).float().reshape(*rows.shape[:-1], D // INT4_GROUP, 2)
    lo = params[..., 0].repeat_interleave(INT4_GROUP, dim=-1)
    step = params[..., 1].repeat_interleave(INT4_GROUP, dim=-1)
    return lo + c * step


def _gather_summary(t: torch.Tensor, flat: torch.Tensor, role: Literal["min", "max"], head_dim: int) -> torch.Tensor:
    """Rows `flat` of a summary [num_blocks, H, D] (or int4 rows) as float32 [len(flat), H * D]."""
    if is_int4_summary(t, head_dim):
        rows = t.index_select(0, flat)
        return decode_int4_summary(rows, head_dim).reshape(len(flat), -1)
    rows = t.reshape(t.shape[0], -1)
    if t.dtype == FP8_SUMMARY:
        return decode_fp8_summary(rows.view(torch.uint8).index_select(0, flat), role)
    return rows.index_select(0, flat).float()


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, block_size: int | None = None, reduce: Reduce = "max",
                 validate: bool | None = None) -> torch.Tensor:
    """Quest upper bound per (sequence, kv head, logical block): float32 [B, kv_heads, max_blocks].

    Blocks past a sequence's end score -inf. `validate` (default: on CPU only) checks block ids
    against num_blocks on the host.
    """
    _check_reduce(reduce)
    block_size = _check_block_size(block_size)
    _check_inputs(q, kmin, kmax, block_table, seq_lens, check_ids=False)
    if q.device.type != "cuda" or validate:
        _check_values(q, kmin, kmax, block_table, seq_lens)
    reason = _cuda_reason(q, kmin)
    if reason is not None:
        if q.device.type == "cuda":
            log.debug("quest_scores: CUDA kernel not used (%s); running the torch reference", reason)
        return quest_scores_reference(q, kmin, kmax, block_table, seq_lens, block_size, reduce)
    from . import cuda_select

    _check_inputs(q, kmin, kmax, block_table, seq_lens, check_ids=bool(validate))
    raw = cuda_select.quest_raw_scores(q, kmin, kmax, block_table, reduce)
    valid = _valid_mask(block_table, seq_lens, block_size, raw.shape[-1], raw.device)
    return raw.masked_fill(~valid[:, None, :], float("-inf"))


def quest_scores_reference(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, block_size: int | None = None,
                           reduce: Reduce = "max") -> torch.Tensor:
    """Torch reference of `quest_scores` (any device; validates block ids on the host)."""
    _check_inputs(q, kmin, kmax, block_table, seq_lens)
    B, Hq, D = q.shape
    Hkv = kmin.shape[1]
    group = Hq // Hkv
    phys = block_table.long().clamp(min=0)
    # Gather only the blocks each sequence owns, laid out [B, kv_heads, D, max_blocks] for a matmul.
    flat = phys.reshape(-1)
    kmx = _gather_summary(kmax, flat, "max", D).reshape(B, -1, Hkv, D).permute(0, 2, 3, 1)
    kmn = _gather_summary(kmin, flat, "min", D).reshape(B, -1, Hkv, D).permute(0, 2, 3, 1)
    qg = q.float().reshape(B, Hkv, group, D)
    # max(q*kmax, q*kmin) per channel = q+ * kmax + q- * kmin, summed over channels: two matmuls.
    bound = torch.matmul(qg.clamp(min=0), kmx) + torch.matmul(qg.clamp(max=0), kmn)  # [B, kv_heads, group, blocks]
    # A block with no keys written yet holds kmin=+inf / kmax=-inf (kvpool's convention), which
    # yields -inf or NaN (0 * inf) here; finite summaries always give finite bounds.
    bound = torch.where(torch.isfinite(bound), bound, float("-inf"))
    if reduce == "max":
        score = bound.amax(2)
    elif reduce == "sum":
        score = bound.sum(2)
    elif reduce == "mean":
        score = bound.mean(2)
    else:
        raise ArgumentError(f"reduce: expected 'max', 'sum' or 'mean', got {reduce!r}")
    valid = _valid_mask(block_table, seq_lens, block_size, block_table.shape[1], score.device)
    return score.masked_fill(~valid[:, None, :], float("-inf"))


def _check_inputs(q, kmin, kmax, block_table, seq_lens, check_ids: bool = True) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ShapeError(f"q: expected [B, q_heads, head_dim], got {getattr(q, 'shape', type(q).__name__)}")
    B, Hq, D = q.shape
    for name, t in (("kmin", kmin), ("kmax", kmax)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or (t.shape[2] != D and not is_int4_summary(t, D)):
            raise ShapeError(f"{name}: expected [num_blocks, kv_heads, {D}] (or int4 rows "
                             f"[num_blocks, kv_heads, {int4_row_bytes(D)}] uint8), got {getattr(t, 'shape', type(t).__name__)}")
    if kmin.shape != kmax.shape:
        raise ShapeError(f"kmax: expected shape {tuple(kmin.shape)} (same as kmin), got {tuple(kmax.shape)}")
    if kmax.dtype != kmin.dtype:
        raise ShapeError(f"kmax: expected dtype {kmin.dtype} (same as kmin), got {kmax.dtype}")
    Hkv = kmin.shape[1]
    if Hq % Hkv:
        raise ShapeError(f"q: expected q_heads divisible by kv_heads ({Hkv}), got {Hq}")
    _check_int_tensor(block_table, "block_table", 2)
    _check_int_tensor(seq_lens, "seq_lens", 1)
    if block_table.shape[0] != B:
        raise ShapeError(f"block_table: expected {B} rows (batch of q), got {block_table.shape[0]}")
    if seq_lens.shape[0] != B:
        raise ShapeError(f"seq_lens: expected shape ({B},), got {tuple(seq_lens.shape)}")
    for name, t in (("kmin", kmin), ("kmax", kmax), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ShapeError(f"{name}: expected device {q.device} (q's), got {t.device}")
    if check_ids and block_table.numel() and int(block_table.max()) >= kmin.shape[0]:
        raise ShapeError(f"block_table: expected physical ids < num_blocks ({kmin.shape[0]}), got {int(block_table.max())}")


def _select(scores: torch.Tensor, n_valid: torch.Tensor, k: int, sink_blocks: int, local_blocks: int) -> torch.Tensor:
    """Top-k positions along the last dim with forced sink/local blocks; ascending, -1 padded, int32.

    Order: forced first (among themselves by position: when more are forced than fit, the
    first ones), then higher score, then lower position (two stable sorts).
    """
    nb = scores.shape[-1]
    pos = torch.arange(nb, device=scores.device)
    nv = n_valid.reshape([n_valid.shape[0]] + [1] * (scores.dim() - 1))
    valid = pos < nv
    forced = valid & ((pos < sink_blocks) | (pos >= nv - local_blocks))
    forced = forced.expand(scores.shape)
    # + 0.0 turns -0 into +0 so the two zeros tie (position decides), as in the kernel.
    key = scores.float().masked_fill(~valid, float("-inf")) + 0.0
    width = min(k, nb)
    if width == 0:
        return torch.empty((*scores.shape[:-1], 0), dtype=torch.int32, device=scores.device)
    ranked = torch.where(forced, float("inf"), key)  # forced blocks tie: position decides among them
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    first = torch.sort(forced.gather(-1, order).to(torch.uint8), dim=-1, descending=True, stable=True).indices
    top = order.gather(-1, first)[..., :width]
    chosen = forced.gather(-1, top) | (key.gather(-1, top) > float("-inf"))
    # Ascending positions first, padding last: sort with padded slots keyed past every position.
    idx = torch.where(chosen, top, nb)
    idx = torch.sort(idx, dim=-1).values
    return torch.where(idx < nb, idx, -1).to(torch.int32)


def _check_select_args(top_k: int, sink_blocks: int, local_blocks: int) -> tuple[int, int, int]:
    return (check_int(top_k, "top_k", lo=1), check_int(sink_blocks, "sink_blocks", lo=0),
            check_int(local_blocks, "local_blocks", lo=0))


def select_blocks(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, top_k: int, sink_blocks: int = 1, local_blocks: int = 1,
                  block_size: int | None = None, reduce: Reduce = "max", validate: bool | None = None) -> torch.Tensor:
    """Quest selection: int32 logical block positions [B, kv_heads, n], ascending, -1 padded.

    `top_k` is the block budget per (sequence, kv head), including the first `sink_blocks` and
    last `local_blocks`, which are always kept (the budget grows to sink + local when smaller).
    n = min(budget, max_blocks); a sequence with fewer valid blocks than the budget gets all of
    them. `block_size`, when given, counts valid blocks from seq_lens instead of the table.
    On CUDA: one launch when `block_size` is given, q is bf16, head_dim 64/128, <= 8 q heads per kv
    head and a row has at most 1024 blocks (bf16 summaries: 2048; quest_select_chunk_kernel; DATAENGINE_SELECT_FUSED=1
    also for longer rows, =0 never), else two (scores, top-k); no host sync (`validate=True` adds
    the host check of block ids).
    """
    top_k, sink_blocks, local_blocks = _check_select_args(top_k, sink_blocks, local_blocks)
    _check_reduce(reduce)
    block_size = _check_block_size(block_size)
    _check_inputs(q, kmin, kmax, block_table, seq_lens, check_ids=False)
    if q.device.type != "cuda" or validate:
        _check_values(q, kmin, kmax, block_table, seq_lens)
    budget = max(top_k, sink_blocks + local_blocks)
    reason = _cuda_reason(q, kmin)
    if reason is not None:
        if q.device.type == "cuda":
            log.debug("select_blocks: CUDA kernels not used (%s); running the torch reference", reason)
        return select_blocks_reference(q, kmin, kmax, block_table, seq_lens, top_k, sink_blocks, local_blocks,
                                       block_size, reduce)
    from . import cuda_select

    _check_inputs(q, kmin, kmax, block_table, seq_lens, check_ids=bool(validate))
    nb = block_table.shape[-1]
    width = min(budget, nb)
    sink, local = min(sink_blocks, nb + 1), min(local_blocks, nb + 1)
    if block_size is not None:
        why = cuda_select.fused_reason(q, kmin, width, nb)
        if why is None:
            return cuda_select.select_fused(q, kmin, kmax, block_table, width, sink, local, reduce,
                                            seq_lens=seq_lens, block_size=block_size)
        log.debug("select_blocks: two launches (%s)", why)
    raw = cuda_select.quest_raw_scores(q, kmin, kmax, block_table, reduce)
    if block_size is not None:
        return cuda_select.topk_rows(raw, width, raw.shape[1], sink, local, seq_lens=seq_lens, block_size=block_size)
    return cuda_select.topk_rows(raw, width, raw.shape[1], sink, local, seq_lens=seq_lens, block_table=block_table)


def select_blocks_reference(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, top_k: int, sink_blocks: int = 1, local_blocks: int = 1,
                            block_size: int | None = None, reduce: Reduce = "max") -> torch.Tensor:
    """Torch reference of `select_blocks` (any device): the oracle of the GPU kernels."""
    top_k, sink_blocks, local_blocks = _check_select_args(top_k, sink_blocks, local_blocks)
    scores = quest_scores_reference(q, kmin, kmax, block_table, seq_lens, block_size, reduce)
    n_valid = num_valid_blocks(block_table, seq_lens, block_size).to(scores.device)
    budget = max(top_k, sink_blocks + local_blocks)
    return _select(scores, n_valid, budget, sink_blocks, local_blocks)


def _check_topk_args(scores, k, num_valid, sink_blocks, local_blocks) -> torch.Tensor:
    if not isinstance(scores, torch.Tensor) or scores.dim() < 1:
        raise ShapeError(f"scores: expected a tensor [B, ..., num_blocks], got {getattr(scores, 'shape', scores)}")
    check_int(k, "k", lo=1)
    check_int(sink_blocks, "sink_blocks", lo=0)
    check_int(local_blocks, "local_blocks", lo=0)
    rows = scores.shape[0] if scores.dim() > 1 else 1
    if num_valid is None:
        return torch.full((rows,), scores.shape[-1], device=scores.device)
    if not isinstance(num_valid, torch.Tensor):
        raise ShapeError(f"num_valid: expected an int tensor [{rows}], got {type(num_valid).__name__}")
    if num_valid.is_floating_point() or num_valid.is_complex() or num_valid.dtype == torch.bool:
        raise ShapeError(f"num_valid: expected an int tensor [{rows}], got dtype {num_valid.dtype}")
    n_valid = num_valid.to(scores.device).long()
    if n_valid.shape != (rows,):
        raise ShapeError(f"num_valid: expected shape ({rows},), got {tuple(n_valid.shape)}")
    if num_valid.device.type == "cpu" and n_valid.numel() and int(n_valid.min()) < 0:
        raise ArgumentError(f"num_valid: expected counts >= 0, got {int(n_valid.min())}")
    return n_valid


def topk_blocks(scores: torch.Tensor, k: int, num_valid: torch.Tensor | None = None,
                sink_blocks: int = 0, local_blocks: int = 0, validate: bool | None = None) -> torch.Tensor:
    """NSA-style selection from given block scores [B, ..., num_blocks] (e.g. compressed-attention
    probabilities summed per block): the k best, ascending, -1 padded, int32 [B, ..., min(k, num_blocks)].

    -inf marks blocks that may not be chosen; `num_valid` [B] (counts >= 0) limits each batch row
    to its first blocks; the first `sink_blocks` / last `local_blocks` valid blocks are always kept.
    NaN scores and negative counts are errors (checked on the host; on CUDA only with
    `validate=True`: unchecked, a NaN is never chosen and a negative count selects nothing, as 0).
    On CUDA: one kernel launch, no host sync.
    """
    n_valid = _check_topk_args(scores, k, num_valid, sink_blocks, local_blocks)
    on_gpu = scores.device.type == "cuda" and scores.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if not on_gpu or validate:
        if torch.isnan(scores).any():
            raise ArgumentError("scores: expected no NaN, got NaN entries")
        if num_valid is not None and n_valid.numel() and int(n_valid.min()) < 0:
            raise ArgumentError(f"num_valid: expected counts >= 0, got {int(n_valid.min())}")
    if not on_gpu:
        if scores.device.type == "cuda":
            log.debug("topk_blocks: CUDA kernel not used (dtype %s); running the torch reference", scores.dtype)
        return topk_blocks_reference(scores, k, num_valid, sink_blocks, local_blocks)
    from . import cuda_select

    s2 = scores.unsqueeze(0) if scores.dim() == 1 else scores
    N = s2.shape[-1]
    rows_per_b = s2[0].numel() // N if N else 1
    out = cuda_select.topk_rows(s2, min(k, N), max(rows_per_b, 1), min(sink_blocks, N + 1),
                                min(local_blocks, N + 1), num_valid=n_valid)
    return out[0] if scores.dim() == 1 else out


def topk_blocks_reference(scores: torch.Tensor, k: int, num_valid: torch.Tensor | None = None,
                          sink_blocks: int = 0, local_blocks: int = 0) -> torch.Tensor:
    """Torch reference of `topk_blocks` (any device)."""
    n_valid = _check_topk_args(scores, k, num_valid, sink_blocks, local_blocks)
    if torch.isnan(scores).any():
        raise ArgumentError("scores: expected no NaN, got NaN entries")
    if scores.dim() == 1:
        return _select(scores.unsqueeze(0), n_valid, k, sink_blocks, local_blocks)[0]
    return _select(scores, n_valid, k, sink_blocks, local_blocks)
