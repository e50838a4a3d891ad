"""KVPool: the sequence-centric surface over storage, block manager and host tier."""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tilehal import ArgumentError, ShapeError, check_int

from .block_manager import BlockManager
from .errors import (
    InvariantError,
    OutOfRangeError,
    PoolExhaustedError,
    SlotOwnershipError,
    UnknownSequenceError,
)
from .hashing import ROOT_HASH, BlockHash, as_token_array, extra_key_bytes, hash_block
from .host_tier import HostTier
from .storage import KVStorage

log = logging.getLogger("kvpool")

_EMPTY_IDS = np.zeros(0, dtype=np.int64)


@dataclass
class _Sequence:
    blocks: list[int]
    num_tokens: int
    extra: bytes
    pending: np.ndarray  # prompt ids registered by add_sequence but not appended yet
    chain: list[BlockHash] = field(default_factory=list)  # hashes of the full blocks, while hashable
    partial: np.ndarray = field(default_factory=lambda: _EMPTY_IDS)  # ids in the last, partial block
    hashable: bool = True  # False once a token with unknown id was appended


@dataclass
class PoolStats:
    queries: int = 0  # add_sequence calls
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found cached (device or host)
    host_hit_tokens: int = 0  # of those, found on the host tier
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    blocks_cached: int = 0  # device blocks registered in the prefix cache (referenced or not)
    blocks_cached_free: int = 0  # unreferenced but still matchable
    host_blocks_total: int = 0
    host_blocks_used: int = 0
    evictions: int = 0  # cached device blocks whose hash was dropped
    offloads: int = 0  # device -> host block copies
    onloads: int = 0  # host -> device block copies
    prefetches: int = 0  # of those, issued by prefetch() ahead of use
    host_evictions: int = 0
    cow_copies: int = 0
    sequences: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d


def _hashable(x: object, name: str) -> None:
    try:
        hash(x)
    except TypeError:
        raise ArgumentError(f"{name}: expected a hashable id, got {type(x).__name__}") from None


def _id_list(ids: object, name: str) -> list:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or isinstance(ids, dict):
        raise ArgumentError(f"{name}: expected a sequence of sequence ids, got {type(ids).__name__}")
    out = list(ids)
    for x in out:
        _hashable(x, name)
    return out


class KVPool:
    """A paged KV cache: per layer K and V in `[num_blocks, block_size, kv_heads, head_dim]` blocks.

    Sequences are registered with `add_sequence` (sharing any cached prefix), grown with
    `append` (which returns the slots to `write` their K/V into), shared with `fork`
    (copy-on-write) and released with `free`. See docs/kvpool.md.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        host_blocks: int = 0,
        prefix_caching: bool = True,
        watermark: float = 0.01,
        debug: bool | None = None,
        summary_dtype: torch.dtype | str | None = None,
    ) -> None:
        num_layers, num_kv_heads, head_dim, num_blocks, block_size = (
            check_int(v, name, lo=1) for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                                                     ("head_dim", head_dim), ("num_blocks", num_blocks),
                                                     ("block_size", block_size)))
        host_blocks = check_int(host_blocks, "host_blocks", lo=0)
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0.0 <= watermark < 1.0:
            raise ArgumentError(f"watermark: expected a fraction in [0, 1), got {watermark!r}")
        if not isinstance(dtype, torch.dtype):
            raise ArgumentError(f"dtype: expected a torch dtype (torch.bfloat16, torch.float8_e4m3fn, ...), got {dtype!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ArgumentError(f"device: expected a torch device like 'cpu' or 'cuda:0', got {device!r} ({e})") from None
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype
        self.prefix_caching = prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.debug = bool(int(os.environ.get("KVPOOL_DEBUG", "0"))) if debug is None else debug
        try:
            self.storage = KVStorage(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, self.device,
                                     summary_dtype=summary_dtype)
            self.host = HostTier(self.storage, host_blocks) if host_blocks > 0 else None
        except (RuntimeError, MemoryError) as e:  # the allocator's refusal, as the stack's error
            total = 2 * num_layers * (num_blocks + host_blocks) * block_size * num_kv_heads * head_dim
            raise ArgumentError(f"num_blocks: expected a pool that fits in memory, got {num_layers} layers x "
                                f"{num_blocks} (+{host_blocks} host) blocks x {block_size} tokens x {num_kv_heads} "
                                f"heads x {head_dim} = {total} K/V elements ({str(e)[:80]})") from None
        if self.host is not None:
            self.storage.before_device_op = self.host.sync
        self.manager = BlockManager(num_blocks, on_evict=self._on_evict)
        self._seqs: dict[Hashable, _Sequence] = {}
        self._onload: dict[int, int] = {}  # device block -> held host block, copy not issued yet
        self._offsets = np.arange(block_size, dtype=np.int32)
        self._stats = PoolStats()
        # Per (layer, block): 1 + the highest offset written since the block was allocated (CPU mirror;
        # a full prefix-cache block is sealed once written, and decode checks seq_lens against it).
        self._filled = np.zeros((num_layers, num_blocks), dtype=np.int32)
        self._epoch = 0  # bumped by every operation that changes block ownership
        self._untracked_writes = False  # a write went unchecked (CUDA graph capture): _filled is a lower bound
        self._slot_memo: tuple | None = None
        self._device_slots_reg: tuple | None = None  # (device tensor, its _version, host int64 copy)

    # ------------------------------------------------------------------ properties
    @property
    def is_fp8(self) -> bool:
        return self.storage.is_fp8

    @property
    def k_cache(self) -> torch.Tensor:
        """All layers' K blocks `[num_layers, num_blocks, block_size, kv_heads, head_dim]`."""
        return self.storage.k

    @property
    def v_cache(self) -> torch.Tensor:
        return self.storage.v

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each `[num_blocks, block_size, kv_heads, head_dim]` (views)."""
        self._check_layer(layer)
        self._ready()
        return self.storage.k[layer], self.storage.v[layer]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp8 pools: (k_scale, v_scale) of one layer, each `[num_blocks, kv_heads]` float32."""
        if not self.is_fp8:
            return None
        return self.storage.k_scale[layer], self.storage.v_scale[layer]

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._seq(seq_id).num_tokens

    def blocks_of(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of a sequence, in logical order (a copy)."""
        return list(self._seq(seq_id).blocks)

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: Hashable, tokens, extra_key: Hashable | None = None) -> int:
        """Register `seq_id` with its prompt; returns how many leading tokens are already cached.

        Cached full blocks (device or host tier) are shared. The last prompt token is never
        reported cached (its logits must be computed), so the hit is at most len(tokens) - 1,
        rounded down to whole blocks. The caller then `append`s the remaining prompt tokens.
        Raises PoolExhaustedError (pool unchanged) if the whole prompt would not fit above the
        watermark.
        """
        _hashable(seq_id, "seq_id")
        if seq_id in self._seqs:
            raise ArgumentError(f"seq_id: {seq_id!r} is already registered")
        ids = as_token_array(tokens)
        n, bs = len(ids), self.block_size
        extra = extra_key_bytes(extra_key)
        hits: list[tuple[BlockHash, int | None]] = []  # (hash, device block or None: on the host tier)
        if self.prefix_caching and n > 1:
            parent = ROOT_HASH
            for i in range((n - 1) // bs):
                h = hash_block(parent, ids[i * bs:(i + 1) * bs].tobytes(), extra)
                b = self.manager.lookup(h)
                if b is None and (self.host is None or self.host.lookup(h) is None):
                    break
                hits.append((h, b))
                parent = h
        matched = len(hits)
        on_host = [h for h, b in hits if b is None]
        revived = sum(1 for _, b in hits if b is not None and self.manager.ref[b] == 0)
        needed = revived + len(on_host) + (-(-n // bs) - matched)
        available = self.manager.num_free - self.watermark_blocks
        if needed > available:
            raise PoolExhaustedError(
                f"add_sequence({seq_id!r}): a {n}-token prompt needs {needed} free blocks above the watermark "
                f"({self.watermark_blocks}); {available} are", needed=needed, available=available)
        for _, b in hits:
            if b is not None:
                self.manager.incref(b)
        blocks = [b for _, b in hits]
        if on_host:
            held = [self.host.hold(h) for h in on_host]  # safe from host eviction during allocate
            new = iter(self.manager.allocate(len(held)))
            fresh = []
            for i, (h, b) in enumerate(hits):
                if b is None:
                    b = next(new)
                    self.manager.register(b, h)
                    self._onload[b] = held[len(fresh)]
                    fresh.append(b)
                    blocks[i] = b
            self.storage.mark_fresh(fresh)
            self._filled[:, fresh] = self.block_size  # full blocks coming back from the host tier
        chain = [h for h, _ in hits]
        hit = matched * bs
        self._seqs[seq_id] = _Sequence(blocks=blocks, num_tokens=hit, extra=extra, pending=ids[hit:], chain=chain)
        st = self._stats
        st.queries += 1
        st.query_tokens += n
        st.hit_tokens += hit
        st.host_hit_tokens += len(on_host) * bs
        self._after_op()
        return hit

    def append(self, seq_id: Hashable, tokens: int | Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        """Grow `seq_id` by `tokens` (a count or the token ids); returns int32 slots (CPU tensor).

        A count takes its ids from the registered prompt while any is pending; tokens past it
        have unknown ids, so their blocks are not prefix-cached. Blocks are allocated as needed;
        a shared partial last block is copied first (copy-on-write). Raises PoolExhaustedError
        and allocates nothing when the free blocks do not suffice.
        """
        seq = self._seq(seq_id)
        n, known = self._new_ids(seq_id, seq, tokens)
        if n == 0:
            return torch.zeros(0, dtype=torch.int32)
        needed = self._blocks_needed(seq, n)
        if needed > self.manager.num_free:
            raise PoolExhaustedError(
                f"append({seq_id!r}, {n} tokens): needs {needed} free blocks, {self.manager.num_free} are",
                needed=needed, available=self.manager.num_free)
        old = self._grow(seq, n, known)
        self._after_op()
        return self._slots(seq.blocks, old, old + n)

    def append_batch(self, seq_ids: Sequence[Hashable], num_tokens: int | Sequence[int] = 1) -> torch.Tensor:
        """One decode step for many sequences: `append(s, n)` for each, all or nothing.

        Returns the concatenated int32 slots (sequence order). Raises PoolExhaustedError, with
        nothing allocated, unless every sequence's growth fits.
        """
        seq_ids = _id_list(seq_ids, "seq_ids")
        if not isinstance(num_tokens, (int, np.integer, list, tuple, np.ndarray, torch.Tensor)) or \
                isinstance(num_tokens, (bool, np.bool_)):
            raise ArgumentError(f"num_tokens: expected an int or a sequence of ints, got {num_tokens!r}")
        counts = ([num_tokens] * len(seq_ids) if isinstance(num_tokens, (int, np.integer)) else
                  np.asarray(num_tokens).reshape(-1).tolist())
        counts = [check_int(c, "num_tokens", lo=0) for c in counts]
        if len(counts) != len(seq_ids):
            raise ArgumentError(f"num_tokens: expected {len(seq_ids)} counts, got {len(counts)}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ArgumentError("seq_ids: expected distinct sequences")
        seqs = [self._seq(s) for s in seq_ids]
        news = [self._new_ids(sid, seq, n) for sid, seq, n in zip(seq_ids, seqs, counts)]
        needed = sum(self._blocks_needed(seq, n) for seq, (n, _) in zip(seqs, news) if n)
        if needed > self.manager.num_free:
            raise PoolExhaustedError(
                f"append_batch({len(seq_ids)} sequences): needs {needed} free blocks, {self.manager.num_free} are",
                needed=needed, available=self.manager.num_free)
        bs = self.block_size
        out: list[int] = []
        for seq, (n, known) in zip(seqs, news):
            if n == 0:
                continue
            old = self._grow(seq, n, known)
            blocks, end = seq.blocks, old + n
            for i in range(old // bs, (end - 1) // bs + 1):  # one contiguous slot range per block
                base = blocks[i] * bs - i * bs
                out.extend(range(base + max(old, i * bs), base + min(end, (i + 1) * bs)))
        self._after_op()
        return torch.from_numpy(np.array(out, dtype=np.int32))

    def _new_ids(self, seq_id: Hashable, seq: _Sequence, tokens) -> tuple[int, np.ndarray]:
        """(count, known ids) of an append; checks explicit ids against the pending prompt."""
        pend = seq.pending
        if isinstance(tokens, int) or isinstance(tokens, np.integer):
            n = int(tokens)
            if n < 0:
                raise ArgumentError(f"tokens: expected a count >= 0, got {n}")
            return n, (pend[:n] if len(pend) else _EMPTY_IDS)
        known = as_token_array(tokens)
        k = min(len(known), len(pend))
        if not np.array_equal(known[:k], pend[:k]):
            raise ArgumentError(f"tokens: the first {k} ids differ from the pending prompt of {seq_id!r}")
        return len(known), known

    def _blocks_needed(self, seq: _Sequence, n: int) -> int:
        bs = self.block_size
        grow = -(-(seq.num_tokens + n) // bs) - len(seq.blocks)
        cow = seq.num_tokens % bs != 0 and self.manager.ref[seq.blocks[-1]] > 1
        return grow + int(cow)

    def _grow(self, seq: _Sequence, n: int, known: np.ndarray) -> int:
        """Allocate (after copy-on-write) and hash; the caller checked the free blocks. Returns the old length."""
        bs, mgr = self.block_size, self.manager
        old = seq.num_tokens
        if old % bs != 0 and mgr.ref[seq.blocks[-1]] > 1:
            self._copy_on_write(seq)
        grow = -(-(old + n) // bs) - len(seq.blocks)
        if grow:
            new = mgr.allocate(grow)
            self.storage.mark_fresh(new)
            self._filled[:, new] = 0
            seq.blocks.extend(new)
        if self.prefix_caching and seq.hashable:
            self._extend_hashes(seq, old, known, n)
        seq.num_tokens = old + n
        pend = seq.pending
        if len(pend):
            seq.pending = pend[n:] if n < len(pend) else _EMPTY_IDS
        return old

    def _slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        first = start // bs
        if (end - 1) // bs == first:  # one block (every decode step): a shifted arange
            off = start - first * bs
            return torch.from_numpy(self._offsets[off:off + end - start] + np.int32(blocks[first] * bs))
        last = (end - 1) // bs
        if last - first < 8:  # a few blocks: one shifted arange per block, concatenated
            off = self._offsets
            parts = [off[max(start - i * bs, 0):min(end - i * bs, bs)] + np.int32(blocks[i] * bs)
                     for i in range(first, last + 1)]
            return torch.from_numpy(np.concatenate(parts))
        b = np.asarray(blocks[first:], dtype=np.int32)
        pos = np.arange(start - first * bs, end - first * bs, dtype=np.int32)
        return torch.from_numpy(b[pos // bs] * bs + pos % bs)

    def _extend_hashes(self, seq: _Sequence, old: int, known: np.ndarray, n: int) -> None:
        """Hash (and register) every block the appended known ids complete."""
        bs = self.block_size
        ids = np.concatenate([seq.partial, known]) if len(seq.partial) else known
        base = old - len(seq.partial)  # position of ids[0]; always block aligned
        full = len(ids) // bs
        parent = seq.chain[-1] if seq.chain else ROOT_HASH
        for i in range(full):
            h = hash_block(parent, ids[i * bs:(i + 1) * bs].tobytes(), seq.extra)
            self.manager.register(seq.blocks[base // bs + i], h)
            seq.chain.append(h)
            parent = h
        seq.partial = ids[full * bs:].copy()
        if len(known) < n:  # ids past the prompt are unknown: the chain ends here
            seq.hashable = False
            seq.partial = _EMPTY_IDS

    def _copy_on_write(self, seq: _Sequence) -> None:
        old_block = seq.blocks[-1]
        (new,) = self.manager.allocate(1)
        self.storage.mark_fresh([new])
        self.storage.copy_blocks([old_block], [new])
        self._filled[:, new] = self._filled[:, old_block]
        self.manager.decref(old_block)
        seq.blocks[-1] = new
        self._stats.cow_copies += 1

    def fork(self, src_id: Hashable, dst_id: Hashable) -> None:
        """`dst_id` becomes a copy of `src_id` sharing all its blocks (copy-on-write on append)."""
        src = self._seq(src_id)
        _hashable(dst_id, "dst_id")
        if dst_id in self._seqs:
            raise ArgumentError(f"dst_id: {dst_id!r} is already registered")
        for b in src.blocks:
            self.manager.incref(b)
        self._seqs[dst_id] = _Sequence(blocks=list(src.blocks), num_tokens=src.num_tokens, extra=src.extra,
                                       pending=src.pending, chain=list(src.chain), partial=src.partial,
                                       hashable=src.hashable)
        self._after_op()

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence; its full hashed blocks stay matchable until reused."""
        seq = self._seq(seq_id)
        self._issue_onloads(seq.blocks, prefetch=False)  # a cached block must hold its data
        del self._seqs[seq_id]
        # Last blocks first: they are the least likely to be shared, so the LRU evicts them first.
        for b in reversed(seq.blocks):
            self.manager.decref(b)
        self._after_op()

    def evict(self, num_blocks: int | None = None) -> int:
        """Evict up to `num_blocks` (default: all) unreferenced cached blocks, least recent first.

        With a host tier they are offloaded there and stay matchable. Returns how many went.
        """
        n = self.manager.evict(self.manager.num_lru if num_blocks is None else check_int(num_blocks, "num_blocks", lo=0))
        self._after_op()
        return n

    def prefetch(self, seq_id: Hashable) -> int:
        """Start copying `seq_id`'s host-tier prefix blocks back now (async on GPU); returns count."""
        n = self._issue_onloads(self._seq(seq_id).blocks, prefetch=True)
        self._after_op()
        return n

    # ------------------------------------------------------------------ data
    def write(self, layer: int, slots, k: torch.Tensor, v: torch.Tensor, *, seq_id: Hashable | None = None) -> None:
        """Store K/V `[T, kv_heads, head_dim]` at `slots` (int `[T]`) of `layer`; updates key summaries.

        Only slots the pool handed out may be written (checked on every call, not only in debug
        mode; docs/security.md): each must be in range, distinct within the call, and lie in a
        live block that no other sequence shares. A block that is free (even if its prefix-cache
        entry is still matchable), shared by a fork or a prefix hit, or a full prefix-cache block
        already written for this layer is refused with `SlotOwnershipError`. With `seq_id` the
        slots must also be that sequence's, at positions it has appended. The checks run on the
        CPU: pass the CPU slots `append` returns (CUDA slots cost one sync per new slots tensor;
        the verdict is reused for every layer of one step; `device_slots` uploads host slots so that
        their checks need no sync at all).
        """
        self._check_layer(layer)
        slots = self._as_slots(slots)
        want = (slots.shape[0], self.num_kv_heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise ShapeError(f"{name}: expected a torch tensor {want} (slots, kv_heads, head_dim), got "
                                 f"{type(x).__name__}")
            if tuple(x.shape) != want:
                raise ShapeError(f"{name}: expected shape {want} (slots, kv_heads, head_dim), got {tuple(x.shape)}")
            if not x.is_floating_point():
                raise ShapeError(f"{name}: expected a floating dtype, got {x.dtype}")
        if not slots.numel():
            return
        if slots.is_cuda and torch.cuda.is_current_stream_capturing():
            # Reading the slots would need a sync, which capture forbids (and a replay runs no Python):
            # the write is unchecked, and from now on seq_lens cannot be checked against written tokens.
            if not self._untracked_writes:
                log.debug("write: slot checks skipped during CUDA graph capture; written-token tracking off")
            self._untracked_writes = True
            self.storage.write(layer, slots, k, v)
            return
        blocks, offsets = self._check_slots(slots, seq_id)
        self._check_unsealed(layer, blocks, offsets)
        self.storage.write(layer, slots, k, v)
        np.maximum.at(self._filled[layer], blocks, offsets + 1)

    def device_slots(self, slots) -> torch.Tensor:
        """`slots` (host ints, e.g. what `append` returned) as an int64 tensor on the pool's device,
        remembered with their host copy: a `write` given this very tensor (unmodified: same
        `_version`) runs its checks on the host copy instead of reading the device tensor back, so a
        GPU step pays no synchronization for them. The checks are the same; the latest tensor is
        remembered."""
        s = self._as_slots(slots)
        host = s.detach().cpu().numpy().astype(np.int64, copy=True)
        dev = torch.from_numpy(host.copy()).to(self.device, non_blocking=True)
        self._device_slots_reg = (dev, dev._version, host)
        return dev

    def _as_slots(self, slots) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor):
            arr = np.asarray(slots)
            if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
                raise ShapeError(f"slots: expected a 1-D int32/int64 tensor, got {type(slots).__name__} of {arr.dtype}")
            slots = torch.from_numpy(arr.astype(np.int64))
        if slots.ndim != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ShapeError(f"slots: expected a 1-D int32/int64 tensor, got {slots.dtype} shape {tuple(slots.shape)}")
        return slots

    def _check_slots(self, slots: torch.Tensor, seq_id: Hashable | None) -> tuple[np.ndarray, np.ndarray]:
        """(block, offset) of every slot, after the range, duplicate and ownership checks (memoized per
        slots tensor until the pool changes, so the layers of one step pay once)."""
        memo = self._slot_memo
        if (memo is not None and memo[0] is slots and memo[1] == slots._version and memo[2] == self._epoch
                and memo[3] == seq_id):
            return memo[4], memo[5]
        reg = self._device_slots_reg
        if reg is not None and reg[0] is slots and reg[1] == slots._version:
            s = reg[2]  # the host copy device_slots uploaded: the same values, no sync
        else:
            s = slots.detach().to("cpu").numpy().astype(np.int64, copy=False)
        total = self.num_blocks * self.block_size
        bad = np.flatnonzero((s < 0) | (s >= total))
        if bad.size:
            i = int(bad[0])
            raise OutOfRangeError(f"slots: expected values in [0, {total}) (num_blocks * block_size), got "
                                  f"{int(s[i])} at index {i} (range [{int(s.min())}, {int(s.max())}])")
        order = np.sort(s)
        dup = np.flatnonzero(order[1:] == order[:-1])
        if dup.size:
            raise ArgumentError(f"slots: expected distinct slots within one write, got slot {int(order[dup[0]])} "
                                f"more than once ({dup.size} repeats)")
        bs = self.block_size
        blocks, offsets = s // bs, s % bs
        ref = self.manager.ref
        for b in np.unique(blocks).tolist():
            r = ref[b]
            if r == 0:
                cached = self.manager.block_hash[b] is not None
                raise SlotOwnershipError(
                    f"slots: expected slots of live sequences, got slot {int(s[np.argmax(blocks == b)])} in block {b}, "
                    f"which is free{' (its cached prefix stays matchable)' if cached else ''}; write only slots "
                    "that append returned")
        if seq_id is not None:
            seq = self._seq(seq_id)
            logical = {b: i for i, b in enumerate(seq.blocks)}
            for j, b in enumerate(blocks.tolist()):
                i = logical.get(b)
                if i is None or i * bs + int(offsets[j]) >= seq.num_tokens:
                    raise SlotOwnershipError(
                        f"slots: expected slots of {seq_id!r} below its {seq.num_tokens} tokens, got slot {int(s[j])} "
                        f"(index {j}), " + ("in a block it does not hold" if i is None else
                                            f"position {i * bs + int(offsets[j])}"))
        self._slot_memo = (slots, slots._version, self._epoch, seq_id, blocks, offsets)
        return blocks, offsets

    def _check_unsealed(self, layer: int, blocks: np.ndarray, offsets: np.ndarray) -> None:
        """Positions other sequences can read are immutable: in a block shared by a fork or a prefix hit,
        or registered in the prefix cache (matchable by any later prompt), a position already written
        for this layer may not be written again. Unwritten positions of such a block may (append, fork,
        then write the step's K/V is the normal order)."""
        written = offsets < self._filled[layer][blocks]
        if not written.any():
            return
        ref, hashes = self.manager.ref, self.manager.block_hash
        for j in np.flatnonzero(written).tolist():
            b = int(blocks[j])
            if ref[b] > 1 or hashes[b] is not None:
                why = (f"shared by {ref[b]} sequences (a fork or a prefix hit)" if ref[b] > 1
                       else "a prefix-cache block any later prompt may match")
                raise SlotOwnershipError(
                    f"slots: expected unwritten or private slots, got slot {b * self.block_size + int(offsets[j])} "
                    f"(index {j}), already written for layer {layer} in block {b}, {why}; rewriting it would change "
                    "K/V that other sequences read")

    def gather(self, layer: int, seq_id: Hashable, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence as contiguous `[num_tokens, kv_heads, head_dim]` (fp8: dequantized)."""
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ArgumentError(f"dtype: expected a torch dtype or None, got {dtype!r}")
        self._check_layer(layer)
        seq = self._seq(seq_id)
        self._issue_onloads(seq.blocks, prefetch=False)
        idx = torch.tensor(seq.blocks, dtype=torch.long)
        out = []
        for which in ("k", "v"):
            x = self.storage.read_blocks(layer, idx, which)
            x = x.reshape(-1, self.num_kv_heads, self.head_dim)[:seq.num_tokens]
            out.append(x.to(dtype) if dtype is not None else x)
        return out[0], out[1]

    def block_table(self, seq_ids: Sequence[Hashable], device: str | torch.device | None = None) -> torch.Tensor:
        """int32 `[B, max_blocks]` physical block ids per sequence, -1 padded (on the pool device)."""
        device = self._target_device(device)
        seqs = [self._seq(s) for s in _id_list(seq_ids, "seq_ids")]
        width = max((len(s.blocks) for s in seqs), default=0)
        table = np.full((len(seqs), width), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            table[i, :len(s.blocks)] = s.blocks
            self._issue_onloads(s.blocks, prefetch=False)
        self._ready()
        return torch.from_numpy(table).to(device)

    def seq_lens(self, seq_ids: Sequence[Hashable], device: str | torch.device | None = None) -> torch.Tensor:
        """int32 `[B]` token counts (positions with slots) per sequence."""
        device = self._target_device(device)
        lens = np.array([self._seq(s).num_tokens for s in _id_list(seq_ids, "seq_ids")], dtype=np.int32)
        return torch.from_numpy(lens).to(device)

    def check_tables(self, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     block_indices: torch.Tensor | None = None, *, contiguous: bool = False) -> None:
        """Check the values of attention arguments against the pool (paged_decode/prefill call this).

        block_table ids must lie in [-1, num_blocks); seq_lens[b] must be >= 0 and cover only
        positions written for `layer` (an unwritten slot holds stale K/V of an earlier owner);
        positions past the table or under a -1 entry are masked (with `contiguous`, for prefill,
        seq_lens[b] may not reach past the row's first -1);
        block_indices must lie in [-1, table width) without repeats in a row. Types and shapes
        are the caller's to check first. The values are read on the host, so with CUDA tensors
        the check runs in debug mode only (it would cost a sync per call) and never while a CUDA
        graph is being captured.
        """
        self._check_layer(layer)
        tensors = [t for t in (block_table, seq_lens, block_indices) if t is not None]
        on_cpu = all(t.device.type == "cpu" for t in tensors)
        if not on_cpu:
            if not self.debug or torch.cuda.is_current_stream_capturing():
                log.debug("check_tables: value checks skipped for CUDA tensors (set KVPOOL_DEBUG=1 to run them)")
                return
        table = block_table.detach().to("cpu").numpy().astype(np.int64, copy=False)
        lens = seq_lens.detach().to("cpu").numpy().astype(np.int64, copy=False)
        bad = np.argwhere((table < -1) | (table >= self.num_blocks))
        if bad.size:
            b, i = (int(x) for x in bad[0])
            raise OutOfRangeError(f"block_table: expected block ids in [-1, {self.num_blocks}) (num_blocks), got "
                                  f"{int(table[b, i])} at [{b}, {i}]")
        bs, width = self.block_size, table.shape[1]
        valid = table >= 0
        # Leading valid entries per row: seq_lens may not reach past the first -1.
        lead = np.where(valid.all(axis=1), width, np.argmin(valid, axis=1)) if width else np.zeros(len(table), int)
        for b in range(len(lens)):
            L = int(lens[b])
            if L < 0 or (contiguous and L > int(lead[b]) * bs):
                hi = f"{int(lead[b]) * bs}] (its {int(lead[b])} leading blocks x block_size {bs})" if contiguous else "inf)"
                raise OutOfRangeError(f"seq_lens[{b}]: expected a length in [0, {hi}, got {L}")
            nb = min(-(-L // bs), width)
            if nb and not self._untracked_writes:
                ids = table[b, :nb]
                have = np.where(ids >= 0, self._filled[layer][np.maximum(ids, 0)], bs)  # -1: masked, not read
                need = np.minimum(bs, L - np.arange(nb) * bs)
                short = np.flatnonzero(have < need)
                if short.size:
                    i = int(short[0])
                    raise OutOfRangeError(
                        f"seq_lens[{b}]: expected at most the tokens written for layer {layer}, got {L}: block "
                        f"{int(table[b, i])} (table[{b}, {i}]) holds {int(have[i])} written positions, position "
                        f"{i * bs + int(have[i])} would read stale K/V")
        if block_indices is not None:
            bi = block_indices.detach().to("cpu").numpy().astype(np.int64, copy=False)
            bad = np.argwhere((bi < -1) | (bi >= width))
            if bad.size:
                where = ", ".join(str(int(x)) for x in bad[0])
                raise OutOfRangeError(f"block_indices: expected logical block positions in [-1, {width}) (the block "
                                      f"table's width), got {int(bi[tuple(bad[0])])} at [{where}]")
            rows = bi.reshape(-1, bi.shape[-1]) if bi.size else bi.reshape(0, 0)
            srt = np.sort(rows, axis=-1)
            dup = np.argwhere((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0))
            if dup.size:
                r, j = (int(x) for x in dup[0])
                raise ArgumentError(f"block_indices: expected no repeated block in a row, got {int(srt[r, j])} twice "
                                    f"in row {r} (of the flattened [batch{', kv_heads' if bi.ndim == 3 else ''}] rows)")

    def key_summary(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kmin, kmax), each `[num_blocks, kv_heads, head_dim]`: per-block per-channel key bounds.

        Maintained by `write` (a rewritten position keeps widening the bounds, which stay valid
        upper/lower bounds). Unwritten blocks hold +inf / -inf. Views into the pool's storage.
        With `summary_dtype=torch.float8_e4m3fn` they are e4m3 codes rounded outward, whose NaN
        codes are the open ends (storage.py; dataengine.select_blocks reads them so). With
        `summary_dtype="int4"`: int4 rows uint8 `[num_blocks, kv_heads, head_dim / 2 + head_dim / 8]`
        (storage.py), re-encoded from the exact summaries by every write.
        """
        self._check_layer(layer)
        self._issue_onloads(list(self._onload), prefetch=False)
        self._ready()
        if self.storage.int4_summaries:
            return self.storage.kmin_q4[layer], self.storage.kmax_q4[layer]
        return self.storage.kmin[layer], self.storage.kmax[layer]

    # ------------------------------------------------------------------ host tier
    def _on_evict(self, block: int, h: BlockHash) -> None:
        if self.host is None:
            return
        self.storage.flush_fresh()
        if self.host.store(block, h):
            self._stats.offloads += 1

    def _issue_onloads(self, blocks: Sequence[int], prefetch: bool) -> int:
        if not self._onload:
            return 0
        count = 0
        for b in blocks:
            hid = self._onload.pop(b, None)
            if hid is not None:
                self.storage.flush_fresh()
                self.host.load(hid, b)
                count += 1
        self._stats.onloads += count
        if prefetch:
            self._stats.prefetches += count
        return count

    def _ready(self) -> None:
        """Before handing out views of pool memory: pending resets applied, copies ordered."""
        self.storage.flush_fresh()

    # ------------------------------------------------------------------ stats, checks
    def stats(self) -> PoolStats:
        st = self._stats
        m = self.manager
        st.blocks_total, st.blocks_free, st.blocks_used = m.num_blocks, m.num_free, m.num_used
        st.blocks_cached, st.blocks_cached_free = m.num_cached, m.num_lru
        st.evictions = m.evictions
        st.sequences = len(self._seqs)
        if self.host is not None:
            st.host_blocks_total = self.host.num_blocks
            st.host_blocks_used = self.host.num_blocks - len(self.host.free)
            st.host_evictions = self.host.evictions
        return PoolStats(**asdict(st))

    def check_invariants(self) -> None:
        """Raise InvariantError unless manager, sequences and host tier agree (debug mode: after every op)."""
        refs = [0] * self.num_blocks
        for sid, s in self._seqs.items():
            if len(s.blocks) != -(-s.num_tokens // self.block_size):
                raise InvariantError(f"sequence {sid!r}: {len(s.blocks)} blocks for {s.num_tokens} tokens")
            for b in s.blocks:
                refs[b] += 1
        self.manager.check(expected_refs=refs)
        for b in self._onload:
            if refs[b] == 0 or self.manager.block_hash[b] is None:
                raise InvariantError(f"block {b} awaits an onload but is unreferenced or unhashed")
        if self.host is not None:
            problems = self.host.check()
            if set(self._onload.values()) != set(self.host.held):
                problems.append("held host blocks differ from pending onloads")
            if problems:
                raise InvariantError("host tier: " + "; ".join(problems))

    def _after_op(self) -> None:
        self._epoch += 1
        if self.debug:
            self.check_invariants()

    # ------------------------------------------------------------------ helpers
    def _seq(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"seq_id: {seq_id!r} is not a registered sequence") from None
        except TypeError:
            raise ArgumentError(f"seq_id: expected a hashable id, got {type(seq_id).__name__}") from None

    def _target_device(self, device: object) -> torch.device:
        if device is None:
            return self.device
        if not isinstance(device, (str, torch.device)):
            raise ArgumentError(f"device: expected a torch device, a string like 'cuda:0' or None, got {device!r}")
        try:
            return torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ArgumentError(f"device: expected a torch device like 'cpu' or 'cuda:0', got {device!r} ({e})") from None

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise ArgumentError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise OutOfRangeError(f"layer: expected 0 <= layer < {self.num_layers}, got {layer}")

    def __repr__(self) -> str:
        return (f"KVPool(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"blocks={self.num_blocks}x{self.block_size}, dtype={self.dtype}, device={self.device}, "
                f"host_blocks={self.host.num_blocks if self.host else 0}, sequences={len(self._seqs)})")
