"""KVPoolCache: transformers' `Cache` interface on a kvpool `KVPool`.

One batch row is one pool sequence. A forward's first layer update allocates the step's slots for
every row at once (`KVPool.append_batch`: all or nothing), every layer's update writes its new K/V
into those slots, and the paged attention function (tilestack/hf/attention.py) reads the pool
through the step's block table. `update` hands back its inputs unchanged: nothing is gathered into
contiguous K/V, which is the point of a paged cache.

A request starts with `new_request(input_ids, attention_mask)` (the `generate` hook calls it):
the previous batch's sequences are freed (their full blocks stay in the pool's prefix cache),
each row's prompt is registered with `KVPool.add_sequence`, which shares every cached full block,
and the number of leading columns the forward can skip is returned. Identical rows (parallel
sampling: `num_return_sequences`) are registered once and forked after the prefill wrote them,
so they share the prompt's blocks copy-on-write.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count

import numpy as np
import torch
from kvpool import KVPool, PoolExhaustedError
from kvpool.errors import UnknownSequenceError
from tilehal import ArgumentError, ShapeError
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import CacheMismatchError, SequenceTooLongError

log = logging.getLogger("tilestack.hf")

_IDS = count()


@dataclass(frozen=True)
class SparseConfig:
    """Sparse decode: attend to `top_k` blocks per (sequence, kv head), chosen by Quest bounds.

    The first `sink_blocks` and the last `local_blocks` blocks of each sequence are always among
    them (dataengine.select_blocks). Prefill stays dense. `summary_dtype=torch.float8_e4m3fn`
    keeps the pool's key summaries as outward-rounded e4m3 codes (KVPool(summary_dtype=...)):
    the selection reads half the bytes; the bounds stay bounds, a little looser (one e4m3 step
    per channel); `summary_dtype="int4"` keeps 4-bit rows on a per-32-channel grid (5/16 of bf16's
    bytes, looser still). Used by `enable_kvpool` when it builds the pool.
    """

    top_k: int
    sink_blocks: int = 1
    local_blocks: int = 1
    summary_dtype: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        for name, v, lo in (("top_k", self.top_k, 1), ("sink_blocks", self.sink_blocks, 0),
                            ("local_blocks", self.local_blocks, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ArgumentError(f"{name}: expected an int >= {lo}, got {v!r}")
        if self.summary_dtype not in (None, torch.float8_e4m3fn, "int4"):
            raise ArgumentError(f"summary_dtype: expected None, torch.float8_e4m3fn or 'int4', got "
                                f"{self.summary_dtype!r}")


@dataclass
class _Step:
    """What one forward (all layers) writes and attends to; built at the first layer's update."""

    batch: int
    length: int  # columns of this forward
    decode: bool  # one new token per row: paged_decode (dense or sparse)
    slots: torch.Tensor  # int [N] pool slots, row-major over write_mask
    write_mask: torch.Tensor | None  # bool [B, T] columns whose K/V go into the pool (None: decode, all)
    query_mask: torch.Tensor | None  # bool [B, T] columns that are tokens, not left padding (None: decode)
    block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    cu_seqlens_q: torch.Tensor | None  # int32 [B + 1] over query_mask (None: decode)
    all_written: bool  # write_mask is all True (skip the boolean gather)
    keys: dict = field(default_factory=dict)  # layer -> key tensor handed to update (identity check)


class _TableMirror:
    """The rows' block tables on the device, updated by the blocks each step adds.

    `KVPool.block_table` rebuilds a `[B, max_blocks]` table from Python lists at every call
    (milliseconds at 128K tokens, every decode step); this mirror writes only the entries a step
    changed. It is rebuilt from the pool when the rows change, when a row's length is not the one
    it recorded (the pool was used directly), when an append will copy a shared last block
    (copy-on-write after a fork) and when a row outgrows its width. Columns past a row's blocks
    hold -1; the width keeps `SLACK` spare columns so it changes every SLACK blocks, not every block.
    """

    SLACK = 64

    def __init__(self) -> None:
        self.rows: list | None = None

    def invalidate(self) -> None:
        self.rows = None

    def stale(self, pool: KVPool, rows: list) -> bool:
        """Before an append: must the table be rebuilt from the pool afterwards?"""
        if self.rows != rows:
            return True
        ref, bs = pool.manager.ref, pool.block_size
        for b, sid in enumerate(rows):
            n = pool.num_tokens(sid)
            if n != self.tokens[b]:
                return True
            if n % bs and ref[int(self.host[b, self.nblocks[b] - 1])] > 1:  # the append will copy-on-write it
                return True
        return False

    def update(self, pool: KVPool, rows: list, rebuild: bool) -> torch.Tensor:
        """After an append: the device table `[B, width]` (int32, -1 padded)."""
        bs = pool.block_size
        lens = [pool.num_tokens(s) for s in rows]
        nbs = [-(-n // bs) for n in lens]
        if not rebuild and self.rows is not None and max(nbs, default=0) <= self.host.shape[1]:
            lo, hi = None, 0
            for b, sid in enumerate(rows):
                if nbs[b] != self.nblocks[b]:
                    k0 = self.nblocks[b]
                    self.host[b, k0:nbs[b]] = pool.blocks_of(sid)[k0:nbs[b]]
                    lo, hi = (k0 if lo is None else min(lo, k0)), max(hi, nbs[b])
            if lo is not None:
                self.device[:, lo:hi].copy_(torch.from_numpy(self.host[:, lo:hi]))
        else:
            blocks = [pool.blocks_of(s) for s in rows]
            width = max(nbs, default=0) + self.SLACK
            self.host = np.full((len(rows), width), -1, dtype=np.int32)
            for b, bl in enumerate(blocks):
                self.host[b, :len(bl)] = bl
            self.device = torch.from_numpy(self.host).to(pool.device)
            self.rows = list(rows)
        self.tokens, self.nblocks = lens, nbs
        return self.device


class _PoolLayer(CacheLayerMixin):
    """One model layer's view of the cache: transformers asks it for lengths and updates."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: KVPoolCache, layer: int) -> None:
        super().__init__()
        self._cache, self._layer = cache, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the pool is allocated up front
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache._update(self._layer, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self._cache.max_tokens

    def reset(self) -> None:  # the cache resets all layers at once
        return None

    def offload(self) -> None:  # the pool's host tier does this, per block
        return None

    def prefetch(self) -> None:
        return None


class KVPoolCache(Cache):
    """transformers `Cache` on a `KVPool`; made by `tilestack.hf.enable_kvpool`.

    `pool` is the KVPool; `seq_ids` the pool sequence of each batch row; `stats()` the pool's
    figures plus this cache's (prompt tokens served from the prefix cache, decode steps, blocks
    attended by sparse steps). `sparse` (a SparseConfig or None) may be changed between steps.
    `observer`, when set, is called at every decode step of every layer, before attention, as
    `observer(layer, q, block_table, seq_lens, block_indices)` (block_indices None when dense):
    `tilestack demo` measures the selection's attention-mass recall with it.
    """

    def __init__(self, pool: KVPool, *, sparse: SparseConfig | None = None, max_tokens: int | None = None,
                 window: int | None = None) -> None:
        self.pool = pool
        self.sparse = sparse
        self.observer = None
        capacity = pool.num_blocks * pool.block_size
        self.max_tokens = capacity if max_tokens is None else min(max_tokens, capacity)
        self.window = window
        super().__init__(layers=[_PoolLayer(self, i) for i in range(pool.num_layers)])
        self._rows: list[Hashable] | None = None
        self._plan: dict | None = None  # set by new_request for the request's first forward
        self._next_ids: torch.Tensor | None = None  # set_next_tokens: ids of the next forward's tokens
        self._inflight: int | None = None  # layers written by an eager step not finished yet
        self._tables = _TableMirror()
        self._step: _Step | None = None
        self._static: _Step | None = None
        self._static_ready = False
        self._static_width = 0
        self._figures = {"requests": 0, "prompt_tokens": 0, "prompt_tokens_cached": 0, "prompt_tokens_computed": 0,
                         "forks": 0, "decode_steps": 0, "sparse_decode_steps": 0, "blocks_attended": 0,
                         "blocks_valid": 0}

    # ------------------------------------------------------------------ requests
    @property
    def seq_ids(self) -> list[Hashable]:
        """The pool sequence of each batch row (a copy; empty before the first forward)."""
        return list(self._rows or [])

    def new_request(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Start a batch: free the previous one, register these prompts; returns the columns already cached.

        `input_ids` `[B, S]` are whole prompts (left padding marked by zeros in `attention_mask`).
        The forward that follows must get `input_ids[:, h:]` (h the return value): every row's
        first h columns are padding or tokens whose K/V the pool already holds. Raises
        PoolExhaustedError / SequenceTooLongError with the pool as it was after the previous
        batch was freed.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ShapeError(f"input_ids: expected a [batch, seq_len] tensor with seq_len >= 1, got "
                             f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)}")
        B, S = input_ids.shape
        ids = input_ids.detach().to("cpu", torch.long)
        if attention_mask is None:
            mask = torch.ones(B, S, dtype=torch.bool)
        else:
            if tuple(attention_mask.shape) != (B, S):
                raise ShapeError(f"attention_mask: expected shape {(B, S)} (input_ids'), got "
                                 f"{tuple(attention_mask.shape)}")
            mask = attention_mask.detach().to("cpu").bool()
        pads = (~mask).long().cumprod(1).sum(1)  # leading zeros per row
        if not bool((mask.sum(1) == S - pads).all()):
            raise ShapeError("attention_mask: expected left padding only (zeros before the tokens of a row)")
        if bool((pads == S).any()):
            raise ShapeError(f"attention_mask: row {int((pads == S).nonzero()[0])} has no tokens")
        prompts = [ids[b, int(pads[b]):] for b in range(B)]
        for b, p in enumerate(prompts):
            if len(p) > self.max_tokens:
                raise SequenceTooLongError(self._too_long(f"row {b}: a {len(p)}-token prompt"))
        self.release()
        first: dict[bytes, int] = {}
        src = []
        for b, p in enumerate(prompts):
            src.append(first.setdefault(p.numpy().tobytes(), b))
        rows: list[Hashable] = [None] * B
        hits = [0] * B
        try:
            for b in range(B):
                if src[b] == b:
                    rows[b] = ("hf", next(_IDS))
                    hits[b] = self.pool.add_sequence(rows[b], prompts[b])
        except PoolExhaustedError as e:
            for sid in rows:
                if sid is not None:
                    self.pool.free(sid)
            raise PoolExhaustedError(
                f"new_request: the pool cannot hold this batch's prompts ({e}); free requests with cache.reset() "
                f"or give enable_kvpool more num_blocks", needed=e.needed, available=e.available) from e
        for b in range(B):
            if src[b] != b:
                rows[b] = ("hf", next(_IDS))  # forked from rows[src[b]] once the prefill wrote it
                hits[b] = hits[src[b]]
        h = min(hits[b] + int(pads[b]) for b in range(B))
        T = S - h
        col = torch.arange(h, S)[None, :] - pads[:, None]  # index into each row's tokens, [B, T]
        query_mask = col >= 0
        write_mask = col >= torch.tensor(hits)[:, None]
        write_mask &= torch.tensor([src[b] == b for b in range(B)])[:, None]
        self._rows = rows
        self._plan = {"start": h, "length": T, "src": src, "query_mask": query_mask, "write_mask": write_mask,
                      "counts": [len(prompts[b]) - hits[b] for b in range(B)]}
        f = self._figures
        f["requests"] += 1
        f["prompt_tokens"] += sum(len(p) for p in prompts)
        f["prompt_tokens_cached"] += sum(hits)
        f["prompt_tokens_computed"] += int(query_mask.sum())
        return h

    def attach(self, seq_ids: Sequence[Hashable]) -> None:
        """Make existing pool sequences this cache's batch rows (e.g. filled outside a model forward).

        The previous batch is released first; the sequences stay owned by the pool (release()
        and the next new_request free them).
        """
        missing = [s for s in seq_ids if s not in self.pool]
        if missing:
            raise UnknownSequenceError(f"seq_ids: {missing!r} are not sequences of this cache's pool")
        if len(set(seq_ids)) != len(seq_ids):
            raise ArgumentError("seq_ids: expected distinct sequences")
        self.release()
        self._rows = list(seq_ids)

    # ------------------------------------------------------------------ static decode (CUDA graphs)
    def begin_static_decode(self, max_blocks: int) -> None:
        """Decode through persistent step tensors, so a whole model step can be captured in a CUDA graph.

        Then, before every forward (or graph replay) of one token per row, call
        `prepare_static_step()`: it allocates the token in the pool on the host and refreshes the
        step tensors in place; the forward itself does no host work or synchronization (sparse
        steps need a graph-capturable dataengine.select_blocks). `max_blocks` bounds each row's
        blocks for the whole run. `end_static_decode()` goes back to ordinary steps.
        """
        rows = self._rows
        if not rows or self._plan is not None:
            raise CacheMismatchError("begin_static_decode: expected a batch whose prompts were prefilled")
        B, dev = len(rows), self.pool.device
        need = max(-(-self.pool.num_tokens(s) // self.pool.block_size) for s in rows) + 1
        if max_blocks < need:
            raise ArgumentError(f"max_blocks: expected >= {need} (the longest row's blocks + 1), got {max_blocks}")
        self._static = _Step(batch=B, length=1, decode=True, slots=torch.zeros(B, dtype=torch.long, device=dev),
                             write_mask=torch.ones(B, 1, dtype=torch.bool, device=dev),
                             query_mask=torch.ones(B, 1, dtype=torch.bool, device=dev),
                             block_table=torch.full((B, max_blocks), -1, dtype=torch.int32, device=dev),
                             seq_lens=torch.zeros(B, dtype=torch.int32, device=dev),
                             cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=dev), all_written=True)
        self._static_width = max_blocks

    def prepare_static_step(self) -> None:
        """Host side of one static decode step: append a token per row and refresh the step tensors."""
        st = getattr(self, "_static", None)
        if st is None:
            raise CacheMismatchError("prepare_static_step: call begin_static_decode first")
        rows, pool = self._rows, self.pool
        for b, sid in enumerate(rows):
            if pool.num_tokens(sid) + 1 > self.max_tokens:
                raise SequenceTooLongError(self._too_long(f"row {b}: {pool.num_tokens(sid) + 1} tokens"))
            if -(-(pool.num_tokens(sid) + 1) // pool.block_size) > self._static_width:
                raise SequenceTooLongError(f"row {b}: outgrows begin_static_decode's max_blocks={self._static_width}")
        rebuild = self._tables.stale(pool, rows)
        try:
            slots = pool.append_batch(rows, 1)
        except PoolExhaustedError as e:
            raise PoolExhaustedError(f"kvpool cache: the pool is exhausted at this step ({e}); the batch's sequences "
                                     f"are kept", needed=e.needed, available=e.available) from e
        table = self._table(rows, rebuild)
        w = min(table.shape[1], st.block_table.shape[1])
        st.block_table[:, :w].copy_(table[:, :w])
        if w < st.block_table.shape[1]:
            st.block_table[:, w:].fill_(-1)
        st.seq_lens.copy_(pool.seq_lens(rows), non_blocking=True)
        st.slots.copy_(slots.to(torch.long), non_blocking=True)
        st.keys.clear()
        self._step = st
        self._figures["decode_steps"] += 1
        self._static_ready = True

    def end_static_decode(self) -> None:
        self._static = None
        self._step = None

    def release(self) -> None:
        """Free the current batch's sequences (their full blocks stay matchable in the prefix cache)."""
        for sid in self._rows or []:
            if sid in self.pool:
                self.pool.free(sid)
        self._rows, self._plan, self._step, self._static, self._next_ids = None, None, None, None, None
        self._inflight = None

    def reset(self) -> None:
        """transformers' reset: drop the current batch (the pool keeps its prefix cache)."""
        self.release()

    # ------------------------------------------------------------------ Cache interface
    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._plan is not None:  # between new_request and its prefill: the columns it skips
            return self._plan["start"]
        if not self._rows:
            return 0
        return max(self.pool.num_tokens(s) for s in self._rows)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_tokens

    @property
    def is_compileable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reorder([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reorder([int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reorder([b for b in range(len(self._rows or [])) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("KVPoolCache.crop: a paged pool does not drop tokens from its sequences")

    def _reorder(self, order: Sequence[int]) -> None:
        """Row i becomes a copy-on-write fork of old row order[i] (beam search, repeat, select)."""
        if self._plan is not None:
            raise CacheMismatchError("cache: rows cannot be reordered between new_request and its prefill")
        old = self._rows or []
        if any(not 0 <= i < len(old) for i in order):
            raise ShapeError(f"indices: expected rows in [0, {len(old)}), got {list(order)}")
        new = []
        for i in order:
            sid = ("hf", next(_IDS))
            self.pool.fork(old[i], sid)
            new.append(sid)
        for sid in old:
            self.pool.free(sid)
        self._rows, self._step = new, None
        self._figures["forks"] += len(order)

    # ------------------------------------------------------------------ the step
    def _too_long(self, what: str) -> str:
        cap = self.pool.num_blocks * self.pool.block_size
        why = (f"the model's attention window is {self.window} tokens and kvpool attends to whole sequences"
               if self.window is not None and self.max_tokens == self.window else
               f"the pool holds {cap} tokens ({self.pool.num_blocks} blocks of {self.pool.block_size})")
        return f"{what} exceeds {self.max_tokens} tokens: {why}"

    def _begin_step(self, B: int, T: int, device: torch.device) -> _Step:
        pool = self.pool
        plan = self._plan
        if self._inflight is not None:
            raise CacheMismatchError(
                f"cache: the previous forward failed after its tokens were allocated (K/V written for layers "
                f"0..{self._inflight - 1} of {pool.num_layers}); its rows are incomplete: cache.reset() or start a new "
                f"request (the pool itself is consistent)")
        if self._rows is None:  # a forward loop that never called new_request: rows without token ids
            self._rows = [("hf", next(_IDS)) for _ in range(B)]
            for sid in self._rows:
                pool.add_sequence(sid, [])
        rows = self._rows
        if len(rows) != B:
            raise CacheMismatchError(f"input batch: expected {len(rows)} rows (the cache's sequences), got {B}; "
                                     f"start a new batch with cache.new_request() or cache.reset()")
        if plan is not None:
            if T != plan["length"]:
                raise CacheMismatchError(f"input length: expected {plan['length']} columns (new_request skipped the "
                                         f"cached ones), got {T}")
            src, counts = plan["src"], plan["counts"]
            query_mask, write_mask = plan["query_mask"], plan["write_mask"]
        else:
            src, counts = list(range(B)), [T] * B
            query_mask = write_mask = torch.ones(B, T, dtype=torch.bool)
        writers = [b for b in range(B) if src[b] == b]
        for b in writers:
            n = pool.num_tokens(rows[b]) + counts[b]
            if n > self.max_tokens:
                raise SequenceTooLongError(self._too_long(f"row {b}: {n} tokens"))
        ids, self._next_ids = self._next_ids, None
        rebuild = self._tables.stale(pool, rows)
        try:
            if plan is None and ids is not None and tuple(ids.shape) == (B, T):
                slots = self._append_known(rows, ids)
            else:
                slots = pool.append_batch([rows[b] for b in writers], [counts[b] for b in writers])
        except PoolExhaustedError as e:
            raise PoolExhaustedError(
                f"kvpool cache: the pool is exhausted at this step ({e}); the batch's sequences are kept "
                f"(cache.reset() frees them) — give enable_kvpool more num_blocks", needed=e.needed,
                available=e.available) from e
        for b in range(B):
            if src[b] != b:
                pool.fork(rows[src[b]], rows[b])
                self._figures["forks"] += 1
        self._plan = None
        self._inflight = 0
        lens = query_mask.sum(1)
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        decode = T == 1 and bool(query_mask.all())
        all_written = bool(write_mask.all())
        if decode and all_written:  # the decode path reads neither mask nor cu_seqlens: no copies to the device
            write_mask = query_mask = cu = None
        else:
            write_mask, query_mask, cu = write_mask.to(device), query_mask.to(device), cu.to(device)
        # device_slots: the pool checks every layer's write on this host copy, no sync per step
        step = _Step(batch=B, length=T, decode=decode, slots=pool.device_slots(slots), write_mask=write_mask,
                     query_mask=query_mask, block_table=self._table(rows, rebuild), seq_lens=pool.seq_lens(rows),
                     cu_seqlens_q=cu, all_written=all_written)
        if decode:
            f = self._figures
            f["decode_steps"] += 1
            nb = [-(-pool.num_tokens(s) // pool.block_size) for s in rows]
            f["blocks_valid"] += sum(nb) * pool.num_kv_heads
            if self.sparse is not None:
                budget = max(self.sparse.top_k, self.sparse.sink_blocks + self.sparse.local_blocks)
                f["sparse_decode_steps"] += 1
                f["blocks_attended"] += sum(min(budget, n) for n in nb) * pool.num_kv_heads
            else:
                f["blocks_attended"] += sum(nb) * pool.num_kv_heads
        return step

    def _table(self, rows: list, rebuild: bool) -> torch.Tensor:
        table = self._tables.update(self.pool, rows, rebuild)
        self.pool.key_summary(0)  # applies the new blocks' pending summary resets (and host-tier copies) now
        return table

    def set_next_tokens(self, input_ids: torch.Tensor) -> None:
        """Ids `[B, T]` of the tokens the next forward appends (the generate hook passes them).

        Optional: with them the generated tokens' full blocks join the prefix cache too, so a
        follow-up request that contains this one's output (a chat turn) reuses it.
        """
        self._next_ids = input_ids.detach().to("cpu", torch.long)

    def _append_known(self, rows: list[Hashable], ids: torch.Tensor) -> torch.Tensor:
        """append(row, its ids) for every row, all or nothing (the free blocks are counted first)."""
        pool, bs = self.pool, self.pool.block_size
        T = ids.shape[1]
        needed = 0
        for sid in rows:
            n, blocks = pool.num_tokens(sid), pool.blocks_of(sid)
            needed += -(-(n + T) // bs) - len(blocks)
            needed += int(n % bs != 0 and pool.manager.ref[blocks[-1]] > 1)  # copy-on-write of a shared block
        free = pool.manager.num_free
        if needed > free:
            raise PoolExhaustedError(f"append({len(rows)} sequences, {T} tokens each): needs {needed} free blocks, "
                                     f"{free} are", needed=needed, available=free)
        return torch.cat([pool.append(sid, ids[b]) for b, sid in enumerate(rows)])

    def _update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        if key_states.ndim != 4 or key_states.shape[1] != self.pool.num_kv_heads or \
                key_states.shape[3] != self.pool.head_dim:
            raise ShapeError(f"key_states: expected [batch, {self.pool.num_kv_heads}, tokens, {self.pool.head_dim}] "
                             f"(the pool's kv_heads, head_dim), got {tuple(key_states.shape)}")
        B, _, T, _ = key_states.shape
        if layer == 0:
            if self._static is not None:
                if not self._static_ready:
                    raise CacheMismatchError("static decode: call cache.prepare_static_step() before each step")
                self._static_ready = False
                self._step = self._static
            else:
                self._step = self._begin_step(B, T, key_states.device)
        step = self._step
        if step is None or step.batch != B or step.length != T:
            raise CacheMismatchError(f"layer {layer}: update without a step begun at layer 0 for this input "
                                     f"({B} x {T})")
        k = key_states.transpose(1, 2)  # [B, T, kv_heads, D]
        v = value_states.transpose(1, 2)
        if step.all_written:
            k, v = k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:])
        else:
            k, v = k[step.write_mask], v[step.write_mask]
        self.pool.write(layer, step.slots, k, v)
        step.keys[layer] = key_states
        if self._inflight is not None:  # eager steps: count the layers written; done after the last
            self._inflight = None if layer == self.pool.num_layers - 1 else layer + 1
        return key_states, value_states

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict:
        """The pool's figures (`KVPool.stats().as_dict()`) and this cache's, in one dict.

        prompt_tokens / prompt_tokens_cached / prompt_tokens_computed: prompt tokens of all
        requests, those served from the prefix cache, those run through the model;
        prefix_hit_rate: cached / prompt tokens; decode_steps, sparse_decode_steps;
        blocks_attended / blocks_valid: (sequence, kv head, block) triples read by decode steps
        against those holding tokens (1.0 when dense).
        """
        d = self.pool.stats().as_dict()
        f = dict(self._figures)
        f["prefix_hit_rate"] = f["prompt_tokens_cached"] / f["prompt_tokens"] if f["prompt_tokens"] else 0.0
        f["attended_fraction"] = f["blocks_attended"] / f["blocks_valid"] if f["blocks_valid"] else 0.0
        d.update(f)
        return d

    def __repr__(self) -> str:
        return f"KVPoolCache(pool={self.pool!r}, sparse={self.sparse}, rows={len(self._rows or [])})"
