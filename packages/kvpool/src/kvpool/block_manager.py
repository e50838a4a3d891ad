"""Device block bookkeeping: ref counts, free lists, the prefix-cache map, eviction.

Free blocks live in one of two places:

- `plain`: blocks holding nothing reusable, a LIFO stack (hot blocks are reused first);
- the LRU list: unreferenced blocks that still hold a full, hashed block. They stay matchable
  by `lookup` until an allocation needs them; allocation takes plain blocks first and only
  then the least recently released cached block (evicting its hash). This is vLLM's design.

The LRU list is doubly linked through two int arrays (`prev`/`next`, sentinel = num_blocks),
so unlinking a block on a prefix hit, appending on release and popping the oldest are O(1).
Everything is plain Python ints and lists: allocation cost is what the benchmark measures.
"""

from __future__ import annotations

from collections.abc import Callable

from tilehal import ArgumentError

from .errors import InvariantError
from .hashing import BlockHash

EvictCallback = Callable[[int, BlockHash], None]


class BlockManager:
    def __init__(self, num_blocks: int, on_evict: EvictCallback | None = None) -> None:
        if num_blocks < 1:
            raise ArgumentError(f"num_blocks: expected >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self.ref = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        # Reversed so block 0 is handed out first (deterministic, easy to read in tests).
        self.plain: list[int] = list(range(num_blocks - 1, -1, -1))
        s = num_blocks  # sentinel
        self.prev = [s] * (num_blocks + 1)
        self.next = [s] * (num_blocks + 1)
        self.num_lru = 0
        self.evictions = 0

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (plain + cached-but-unreferenced)."""
        return len(self.plain) + self.num_lru

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (referenced or not)."""
        return len(self.cached)

    # ------------------------------------------------------------------ LRU list
    def _lru_append(self, b: int) -> None:
        s = self.num_blocks
        last = self.prev[s]
        self.next[last] = b
        self.prev[b] = last
        self.next[b] = s
        self.prev[s] = b
        self.num_lru += 1

    def _lru_unlink(self, b: int) -> None:
        p, n = self.prev[b], self.next[b]
        self.next[p] = n
        self.prev[n] = p
        self.prev[b] = self.next[b] = self.num_blocks
        self.num_lru -= 1

    def _lru_pop_oldest(self) -> int:
        b = self.next[self.num_blocks]
        self._lru_unlink(b)
        return b

    def lru_order(self) -> list[int]:
        """Cached free blocks, least recently released first (tests, debugging)."""
        out, s = [], self.num_blocks
        b = self.next[s]
        while b != s:
            out.append(b)
            b = self.next[b]
        return out

    # ------------------------------------------------------------------ ops
    def _drop_hash(self, b: int) -> None:
        h = self.block_hash[b]
        self.block_hash[b] = None
        del self.cached[h]
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(b, h)

    def allocate(self, n: int) -> list[int]:
        """n blocks with ref count 1. The caller checks `num_free` first (no partial allocation)."""
        if n > self.num_free:
            raise InvariantError(f"allocate({n}) with only {self.num_free} free blocks; callers must check first")
        plain, ref = self.plain, self.ref
        out = []
        for _ in range(n):
            if plain:
                b = plain.pop()
            else:
                b = self._lru_pop_oldest()
                self._drop_hash(b)
            ref[b] = 1
            out.append(b)
        return out

    def incref(self, b: int) -> None:
        if self.ref[b] == 0:  # a prefix hit on a cached free block takes it off the LRU list
            self._lru_unlink(b)
        self.ref[b] += 1

    def decref(self, b: int) -> None:
        r = self.ref[b] - 1
        if r < 0:
            raise InvariantError(f"block {b} released more often than referenced")
        self.ref[b] = r
        if r == 0:
            if self.block_hash[b] is None:
                self.plain.append(b)
            else:
                self._lru_append(b)

    def lookup(self, h: BlockHash) -> int | None:
        return self.cached.get(h)

    def register(self, b: int, h: BlockHash) -> bool:
        """Make full block `b` matchable under `h`; a block with equal content already wins."""
        if h in self.cached or self.block_hash[b] is not None:
            return False
        self.cached[h] = b
        self.block_hash[b] = h
        return True

    def evict(self, n: int) -> int:
        """Drop up to n least recently released cached blocks; returns how many went."""
        done = 0
        while done < n and self.num_lru:
            b = self._lru_pop_oldest()
            self._drop_hash(b)
            self.plain.append(b)
            done += 1
        return done

    # ------------------------------------------------------------------ debug
    def check(self, expected_refs: list[int] | None = None) -> None:
        """Raise InvariantError unless every structure agrees with every other."""
        N = self.num_blocks

        def fail(msg: str) -> None:
            raise InvariantError(f"block manager: {msg}")

        lru = self.lru_order()
        if len(lru) != self.num_lru:
            fail(f"LRU list has {len(lru)} entries but num_lru={self.num_lru}")
        plain_set, lru_set = set(self.plain), set(lru)
        if len(plain_set) != len(self.plain):
            fail("a block is on the plain free list twice (double free)")
        if len(lru_set) != len(lru) or plain_set & lru_set:
            fail("a block is on two free lists")
        for b in range(N):
            free = b in plain_set or b in lru_set
            if self.ref[b] < 0:
                fail(f"block {b} has ref count {self.ref[b]}")
            if (self.ref[b] == 0) != free:
                fail(f"block {b}: ref={self.ref[b]} but {'on' if free else 'not on'} a free list (leak)")
            if b in lru_set and self.block_hash[b] is None:
                fail(f"block {b} is on the LRU list without a hash")
            if b in plain_set and self.block_hash[b] is not None:
                fail(f"block {b} is on the plain list but still cached")
            h = self.block_hash[b]
            if h is not None and self.cached.get(h) != b:
                fail(f"block {b} hash not mapped back to it")
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                fail(f"cache entry points to block {b} with another hash")
        if expected_refs is not None and expected_refs != self.ref:
            bad = [b for b in range(N) if expected_refs[b] != self.ref[b]][:5]
            fail(f"ref counts differ from live references at blocks {bad}: "
                 f"{[(self.ref[b], expected_refs[b]) for b in bad]} (stored, live)")

    def snapshot(self) -> tuple:
        """A comparable copy of the whole state (tests: a failed op must leave it unchanged)."""
        return (tuple(self.ref), tuple(self.block_hash), tuple(self.plain), tuple(self.lru_order()),
                tuple(sorted(self.cached.items())))
