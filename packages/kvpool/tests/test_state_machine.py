"""Hypothesis state machine over the whole sequence API, checked against a plain model.

The model gives every position a K/V value that is a deterministic function of (extra key,
token ids up to it), like a real model would, so prefix sharing must reproduce it exactly,
and forks diverging inside a shared block (copy-on-write) must not leak into each other.
"""

import hashlib

import hypothesis.strategies as st
import kvpool
import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)
from kvpool import PoolExhaustedError
from kvpool.errors import SlotOwnershipError

BS, H, D = 2, 1, 2
ALPHABET = st.integers(0, 2)
DOCS = [[0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 1, 1, 1, 2, 2, 0, 0, 1], [2, 2, 2, 1, 1, 1, 0, 0, 0]]
# Prompts are a prefix of a few shared documents plus a random tail, so prefix hits are common.
PROMPTS = st.builds(lambda doc, n, tail: (doc[:n] + tail)[:9] or [0], st.sampled_from(DOCS), st.integers(0, 9),
                    st.lists(ALPHABET, max_size=3))


def kv_value(extra, ids: list[int]) -> torch.Tensor:
    digest = hashlib.blake2b(repr((extra, tuple(ids))).encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return torch.from_numpy(rng.standard_normal((2, H, D)).astype(np.float32))


class PoolMachine(RuleBasedStateMachine):
    host_blocks = 0

    def __init__(self):
        super().__init__()
        self.pool = kvpool.KVPool(1, H, D, 12, block_size=BS, dtype=torch.float32, host_blocks=self.host_blocks,
                                  watermark=0.0, debug=True)
        self.model: dict[int, dict] = {}  # seq -> {"ids": [...], "pending": [...], "extra": ...}
        self.next_id = 0

    seqs = Bundle("seqs")

    # -------------------------------------------------------------- helpers
    def _state(self):
        p = self.pool
        return (p.manager.snapshot(), {s: p.num_tokens(s) for s in self.model}, p.stats(),
                dict(p._onload), sorted(p.host.lru.items()) if p.host else None)

    def _write_new(self, sid: int, slots: torch.Tensor, start: int) -> None:
        m = self.model[sid]
        vals = [kv_value(m["extra"], m["ids"][:p + 1]) for p in range(start, start + len(slots))]
        k = torch.stack([x[0] for x in vals])
        v = torch.stack([x[1] for x in vals])
        self.pool.write(0, slots, k, v)

    # -------------------------------------------------------------- rules
    @precondition(lambda self: len(self.model) < 5)
    @rule(target=seqs, prompt=PROMPTS, extra=st.sampled_from([None, None, 7]))
    def add(self, prompt, extra):
        sid = self.next_id
        self.next_id += 1
        before = self._state()
        try:
            hit = self.pool.add_sequence(sid, prompt, extra_key=extra)
        except PoolExhaustedError:
            assert self._state() == before
            return multiple()
        assert hit % BS == 0 and hit <= len(prompt) - 1
        self.model[sid] = {"ids": list(prompt[:hit]), "pending": list(prompt[hit:]), "extra": extra}
        return sid

    @rule(sid=seqs, n=st.integers(1, 5), by_ids=st.booleans(), generated=st.lists(ALPHABET, min_size=5, max_size=5))
    def append(self, sid, n, by_ids, generated):
        """Prompt ids first, then "generated" ids (unknown to the pool when appended by count)."""
        if sid not in self.model:
            return
        m = self.model[sid]
        new_ids = (m["pending"] + generated)[:n]
        before = self._state()
        start = len(m["ids"])
        try:
            slots = self.pool.append(sid, new_ids if by_ids else n)
        except PoolExhaustedError:
            assert self._state() == before
            return
        assert slots.shape == (n,) and slots.dtype == torch.int32
        m["ids"] += new_ids
        m["pending"] = m["pending"][n:]
        self._write_new(sid, slots, start)

    @rule(sids=st.lists(seqs, max_size=3, unique=True), n=st.integers(1, 3))
    def append_batch(self, sids, n):
        """A decode step over several sequences at once (all or nothing)."""
        sids = [s for s in sids if s in self.model]
        if not sids:
            return
        before = self._state()
        starts = [len(self.model[s]["ids"]) for s in sids]
        try:
            slots = self.pool.append_batch(sids, n)
        except PoolExhaustedError:
            assert self._state() == before
            return
        assert slots.shape == (n * len(sids),)
        for i, (sid, start) in enumerate(zip(sids, starts)):
            m = self.model[sid]
            m["ids"] += (m["pending"] + [0] * n)[:n]
            m["pending"] = m["pending"][n:]
            self._write_new(sid, slots[i * n:(i + 1) * n], start)

    @rule(sid=seqs, back=st.integers(1, 4))
    def rewrite(self, sid, back):
        """Write the same values again at existing positions (through the block table)."""
        if sid not in self.model or not self.model[sid]["ids"]:
            return
        L = len(self.model[sid]["ids"])
        start = max(0, L - back)
        blocks = self.pool.blocks_of(sid)
        slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(start, L)], dtype=torch.int32)
        mgr = self.pool.manager
        touched = {p // BS for p in range(start, L)}
        # The write contract: written positions of a shared or prefix-cached block are read-only.
        refused = any(mgr.ref[blocks[i]] > 1 or mgr.block_hash[blocks[i]] is not None for i in touched)
        before = self._state()
        try:
            self._write_new(sid, slots, start)
        except SlotOwnershipError:
            assert refused and self._state() == before
            return
        assert not refused

    @precondition(lambda self: len(self.model) < 5)
    @rule(target=seqs, src=seqs)
    def fork(self, src):
        """Parallel sampling / beam search: the two copies then generate different tokens."""
        if src not in self.model:
            return multiple()
        dst = self.next_id
        self.next_id += 1
        self.pool.fork(src, dst)
        m = self.model[src]
        self.model[dst] = {"ids": list(m["ids"]), "pending": list(m["pending"]), "extra": m["extra"]}
        return dst

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid in self.model:
            self.pool.free(sid)
            del self.model[sid]

    @rule(n=st.integers(1, 4))
    def evict(self, n):
        cached_free = self.pool.stats().blocks_cached_free
        assert self.pool.evict(n) == min(n, cached_free)

    @precondition(lambda self: self.pool.host is not None)
    @rule(sid=seqs)
    def prefetch(self, sid):
        if sid in self.model:
            self.pool.prefetch(sid)
            assert not set(self.pool.blocks_of(sid)) & set(self.pool._onload)

    # -------------------------------------------------------------- invariants
    @invariant()
    def structures_agree(self):
        self.pool.check_invariants()  # no leak or double free; ref counts == live references
        st_ = self.pool.stats()
        assert st_.blocks_used + st_.blocks_free == st_.blocks_total

    @invariant()
    def gather_returns_what_was_written(self):
        for sid, m in self.model.items():
            k, v = self.pool.gather(0, sid)
            assert k.shape[0] == len(m["ids"])
            for p in range(len(m["ids"])):
                want = kv_value(m["extra"], m["ids"][:p + 1])
                assert torch.equal(k[p], want[0]) and torch.equal(v[p], want[1]), (sid, p)


class HostTierMachine(PoolMachine):
    host_blocks = 4


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("machine", [PoolMachine, HostTierMachine], ids=["device_only", "host_tier"])
def test_state_machine(machine):
    case = machine.TestCase
    case.settings = SETTINGS
    case().runTest()
