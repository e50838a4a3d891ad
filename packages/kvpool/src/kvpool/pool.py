"""KVPool: the sequence-centric surface over storage, block manager and host tier."""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .block_manager import BlockManager
from .errors import InvariantError, PoolExhaustedError
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
    ) -> None:
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if host_blocks < 0:
            raise ValueError(f"host_blocks: expected >= 0, got {host_blocks}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark: expected a fraction in [0, 1), got {watermark}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype
        self.prefix_caching = prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.debug = bool(int(os.environ.get("KVPOOL_DEBUG", "0"))) if debug is None else debug
        self.storage = KVStorage(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, self.device)
        self.host = HostTier(self.storage, host_blocks) if host_blocks > 0 else None
        if self.host is not None:
            self.storage.before_device_op = self.host.sync
        self.manager = BlockManager(num_blocks, on_evict=self._on_evict)
        self._seqs: dict[Hashable, _Sequence] = {}
        self._onload: dict[int, int] = {}  # device block -> held host block, copy not issued yet
        self._offsets = np.arange(block_size, dtype=np.int32)
        self._stats = PoolStats()

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
        if seq_id in self._seqs:
            raise ValueError(f"seq_id: {seq_id!r} is already registered")
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
        counts = [num_tokens] * len(seq_ids) if isinstance(num_tokens, int) else list(num_tokens)
        if len(counts) != len(seq_ids):
            raise ValueError(f"num_tokens: expected {len(seq_ids)} counts, got {len(counts)}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids: expected distinct sequences")
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
                raise ValueError(f"tokens: expected a count >= 0, got {n}")
            return n, (pend[:n] if len(pend) else _EMPTY_IDS)
        known = as_token_array(tokens)
        k = min(len(known), len(pend))
        if not np.array_equal(known[:k], pend[:k]):
            raise ValueError(f"tokens: the first {k} ids differ from the pending prompt of {seq_id!r}")
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
        self.manager.decref(old_block)
        seq.blocks[-1] = new
        self._stats.cow_copies += 1

    def fork(self, src_id: Hashable, dst_id: Hashable) -> None:
        """`dst_id` becomes a copy of `src_id` sharing all its blocks (copy-on-write on append)."""
        src = self._seq(src_id)
        if dst_id in self._seqs:
            raise ValueError(f"dst_id: {dst_id!r} is already registered")
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
        n = self.manager.evict(self.manager.num_lru if num_blocks is None else num_blocks)
        self._after_op()
        return n

    def prefetch(self, seq_id: Hashable) -> int:
        """Start copying `seq_id`'s host-tier prefix blocks back now (async on GPU); returns count."""
        n = self._issue_onloads(self._seq(seq_id).blocks, prefetch=True)
        self._after_op()
        return n

    # ------------------------------------------------------------------ data
    def write(self, layer: int, slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V `[T, kv_heads, head_dim]` at `slots` (int `[T]`) of `layer`; updates key summaries."""
        self._check_layer(layer)
        slots = torch.as_tensor(slots)
        if slots.ndim != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots: expected a 1-D int32/int64 tensor, got {slots.dtype} shape {tuple(slots.shape)}")
        want = (slots.shape[0], self.num_kv_heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != want:
                raise ValueError(f"{name}: expected shape {want} (slots, kv_heads, head_dim), got {tuple(x.shape)}")
            if not x.is_floating_point():
                raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")
        if self.debug and slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi >= self.num_blocks * self.block_size:
                raise ValueError(f"slots: expected values in [0, {self.num_blocks * self.block_size}), got [{lo}, {hi}]")
        if slots.numel():
            self.storage.write(layer, slots, k, v)

    def gather(self, layer: int, seq_id: Hashable, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence as contiguous `[num_tokens, kv_heads, head_dim]` (fp8: dequantized)."""
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
        seqs = [self._seq(s) for s in seq_ids]
        width = max((len(s.blocks) for s in seqs), default=0)
        table = np.full((len(seqs), width), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            table[i, :len(s.blocks)] = s.blocks
            self._issue_onloads(s.blocks, prefetch=False)
        self._ready()
        return torch.from_numpy(table).to(device or self.device)

    def seq_lens(self, seq_ids: Sequence[Hashable], device: str | torch.device | None = None) -> torch.Tensor:
        """int32 `[B]` token counts (positions with slots) per sequence."""
        lens = np.array([self._seq(s).num_tokens for s in seq_ids], dtype=np.int32)
        return torch.from_numpy(lens).to(device or self.device)

    def key_summary(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kmin, kmax), each `[num_blocks, kv_heads, head_dim]`: per-block per-channel key bounds.

        Maintained by `write` (a rewritten position keeps widening the bounds, which stay valid
        upper/lower bounds). Unwritten blocks hold +inf / -inf. Views into the pool's storage.
        """
        self._check_layer(layer)
        self._issue_onloads(list(self._onload), prefetch=False)
        self._ready()
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
        if self.debug:
            self.check_invariants()

    # ------------------------------------------------------------------ helpers
    def _seq(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"seq_id: {seq_id!r} is not a registered sequence") from None

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer: expected 0 <= layer < {self.num_layers}, got {layer}")

    def __repr__(self) -> str:
        return (f"KVPool(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"blocks={self.num_blocks}x{self.block_size}, dtype={self.dtype}, device={self.device}, "
                f"host_blocks={self.host.num_blocks if self.host else 0}, sequences={len(self._seqs)})")
