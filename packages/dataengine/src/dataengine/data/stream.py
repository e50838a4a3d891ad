"""Deterministic, resumable streaming over a TokenDataset with filtering and domain mixing.

The stream is one global sequence of *positions* 0, 1, 2, ... Position p names a candidate
sample, fixed by (seed, weight schedule, p) alone:
  * without domain weights: epoch p // N of a seeded permutation of all N samples;
  * with weights: a domain drawn from the weights in force at p (a seeded uniform per position,
    inverse CDF), then that domain's next sample in its own seeded per-epoch permutation.
A candidate is yielded unless excluded (`keep_mask`) or rejected by a filter; both decisions are
deterministic, so the yielded sequence is a fixed subsequence of the positions.

Consumers (ranks x DataLoader workers, C of them) split positions round-robin: consumer c takes
p % C == c. Every yielded sample carries its position, so the union of all consumers, ordered by
position, is the same sequence for any split. The resumable state is split-independent: a
frontier F (every position below it is done) plus the positions at or above F already yielded;
resuming under any other split re-examines the rest, and filters give the same answers again.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from tilehal import ArgumentError, ShapeError, check_int

from .scoring import Filter
from .shards import TokenDataset

log = logging.getLogger("dataengine.stream")


class StreamingDataset(torch.utils.data.IterableDataset):
    def __init__(self, dataset: TokenDataset, seed: int = 0, domain_weights: Sequence[float] | None = None,
                 num_positions: int | None = None, filters: Sequence[Filter] = (),
                 keep_mask: np.ndarray | None = None, rank: int = 0, world_size: int = 1, chunk: int = 8192) -> None:
        super().__init__()
        if not isinstance(dataset, TokenDataset):
            raise ArgumentError(f"dataset: expected a TokenDataset, got {type(dataset).__name__}")
        world_size = check_int(world_size, "world_size", lo=1)
        rank = check_int(rank, "rank", lo=0)
        if rank >= world_size:
            raise ArgumentError(f"rank/world_size: expected 0 <= rank < world_size, got {rank}/{world_size}")
        chunk = check_int(chunk, "chunk", lo=1)
        if num_positions is not None:
            num_positions = check_int(num_positions, "num_positions", lo=0)
        self.dataset = dataset
        self.seed = check_int(seed, "seed", lo=0)
        self.filters = list(filters)
        self.rank, self.world_size = rank, world_size
        self.chunk = chunk
        n = len(dataset)
        if keep_mask is not None:
            km = np.asarray(keep_mask)
            if km.shape != (n,):
                raise ShapeError(f"keep_mask: expected a boolean array of shape ({n},), got {km.shape}")
            if km.dtype != np.bool_ and not (np.issubdtype(km.dtype, np.integer) and np.isin(km, (0, 1)).all()):
                # a float mask with NaN would keep those samples: refuse anything but booleans (or 0/1)
                raise ShapeError(f"keep_mask: expected booleans (or integers 0/1), got dtype {km.dtype}")
        self.keep_mask = None if keep_mask is None else np.asarray(keep_mask, dtype=bool)
        self._domain_members = [np.flatnonzero(dataset.domains == d) for d in range(len(dataset.domain_names))]
        self.schedule: list[tuple[int, np.ndarray]] = []
        if domain_weights is not None:
            self.schedule.append((0, self._check_weights(domain_weights)))
        if num_positions is None and not self.schedule:
            num_positions = n  # one epoch
        self.num_positions = num_positions  # None: endless (mixtures cycle their domains)
        self.start = 0
        self.ahead: frozenset[int] = frozenset()
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}
        self._fingerprint: str | None = None

    # -- the global candidate sequence ---------------------------------------------------------

    def _check_weights(self, w: Sequence[float]) -> np.ndarray:
        D = len(self._domain_members)
        try:
            w = np.asarray(w, dtype=np.float64)
        except (TypeError, ValueError):
            raise ArgumentError(f"domain_weights: expected {D} non-negative numbers, got {w!r}") from None
        if w.shape != (D,) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise ArgumentError(f"domain_weights: expected {D} finite non-negative weights with a positive sum, "
                                f"got {w.tolist()}")
        empty = [d for d in range(D) if w[d] > 0 and len(self._domain_members[d]) == 0]
        if empty:
            raise ArgumentError(f"domain_weights: domains {empty} have weight but no samples")
        return w / w.sum()

    def set_domain_weights(self, weights: Sequence[float], from_position: int) -> None:
        """Use `weights` for positions >= from_position (must not precede an earlier change)."""
        w = self._check_weights(weights)
        if not self.schedule:
            raise ArgumentError("set_domain_weights: this stream was built without domain_weights (plain shuffle)")
        from_position = check_int(from_position, "from_position", lo=0)
        if from_position < self.schedule[-1][0]:
            raise ArgumentError(f"from_position: expected >= {self.schedule[-1][0]} (the last change), got {from_position}")
        self.schedule = [s for s in self.schedule if s[0] < from_position] + [(int(from_position), w)]

    def _perm(self, domain: int, epoch: int) -> np.ndarray:
        key = (domain, epoch)
        if key not in self._perm_cache:
            if len(self._perm_cache) > 64:
                self._perm_cache.clear()
            members = self._domain_members[domain] if domain >= 0 else np.arange(len(self.dataset))
            rng = np.random.default_rng([self.seed, 2, domain + 1, epoch])
            self._perm_cache[key] = members[rng.permutation(len(members))]
        return self._perm_cache[key]

    def _chunk_domains(self, c: int) -> np.ndarray:
        """Domain of every position in chunk c (mixture mode)."""
        lo = c * self.chunk
        u = np.random.default_rng([self.seed, 1, c]).random(self.chunk)
        pos = lo + np.arange(self.chunk)
        out = np.empty(self.chunk, dtype=np.int64)
        starts = [s for s, _ in self.schedule] + [np.iinfo(np.int64).max]
        for k, (_, w) in enumerate(self.schedule):
            sel = (pos >= starts[k]) & (pos < starts[k + 1])
            if sel.any():
                cdf = np.cumsum(w)
                out[sel] = np.minimum(np.searchsorted(cdf, u[sel] * cdf[-1], side="right"), len(w) - 1)
        return out

    def _ids_for_chunk(self, c: int, counts: np.ndarray) -> np.ndarray:
        """Sample ids of chunk c; `counts` (draws per domain before the chunk) is advanced in place."""
        lo = c * self.chunk
        if not self.schedule:
            n = len(self.dataset)
            pos = lo + np.arange(self.chunk)
            ids = np.empty(self.chunk, dtype=np.int64)
            for e in np.unique(pos // n):
                sel = pos // n == e
                ids[sel] = self._perm(-1, int(e))[pos[sel] % n]
            return ids
        doms = self._chunk_domains(c)
        ids = np.empty(self.chunk, dtype=np.int64)
        for d in np.unique(doms):
            sel = np.flatnonzero(doms == d)
            k = counts[d] + np.arange(len(sel))  # this domain's draw numbers
            size = len(self._domain_members[d])
            for e in np.unique(k // size):
                part = k // size == e
                ids[sel[part]] = self._perm(int(d), int(e))[k[part] % size]
            counts[d] += len(sel)
        return ids

    def candidates(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, sample ids) for positions in [start, stop), before exclusion and filters."""
        counts = np.zeros(len(self._domain_members), dtype=np.int64)
        first = start // self.chunk
        if self.schedule:
            for c in range(first):  # draws per domain before the first chunk
                counts += np.bincount(self._chunk_domains(c), minlength=len(counts))
        out_p, out_i = [], []
        for c in range(first, -(-stop // self.chunk)):
            ids = self._ids_for_chunk(c, counts)
            pos = c * self.chunk + np.arange(self.chunk)
            sel = (pos >= start) & (pos < stop)
            out_p.append(pos[sel])
            out_i.append(ids[sel])
        if not out_p:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(out_p), np.concatenate(out_i)

    # -- iteration -----------------------------------------------------------------------------

    def consumer(self) -> tuple[int, int]:
        """(this consumer's id, number of consumers) from rank/world_size and the DataLoader worker."""
        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return self.rank * workers + worker, self.world_size * workers

    def _accepts(self, i: int, length: int, tokens: np.ndarray | None) -> tuple[bool, np.ndarray | None]:
        for f in self.filters:
            if f.index_only:
                if not f.accepts(f.scorer.score_length(length)):
                    return False, tokens
        for f in self.filters:
            if not f.index_only:
                if tokens is None:
                    tokens = self.dataset.tokens(i)
                if not f.accepts(f.scorer(tokens)):
                    return False, tokens
        return True, tokens

    def iter_samples(self, consumer: int, num_consumers: int) -> Iterator[dict[str, Any]]:
        """The samples of one consumer, as dicts with tokens, sample_id, domain, position."""
        counts = np.zeros(len(self._domain_members), dtype=np.int64)
        c0 = self.start // self.chunk
        if self.schedule:
            for c in range(c0):
                counts += np.bincount(self._chunk_domains(c), minlength=len(counts))
        c = c0
        while self.num_positions is None or c * self.chunk < self.num_positions:
            ids = self._ids_for_chunk(c, counts)
            pos = c * self.chunk + np.arange(self.chunk)
            sel = (pos % num_consumers == consumer) & (pos >= self.start)
            if self.num_positions is not None:
                sel &= pos < self.num_positions
            if self.keep_mask is not None:
                sel &= self.keep_mask[ids]
            for p, i in zip(pos[sel].tolist(), ids[sel].tolist()):
                if p in self.ahead:
                    continue
                ok, tokens = self._accepts(i, int(self.dataset.lengths[i]), None)
                if not ok:
                    continue
                if tokens is None:
                    tokens = self.dataset.tokens(i)
                yield {"tokens": torch.from_numpy(tokens), "sample_id": i,
                       "domain": int(self.dataset.domains[i]), "position": p}
            c += 1

    def __iter__(self) -> Iterator[dict[str, Any]]:
        consumer, total = self.consumer()
        return self.iter_samples(consumer, total)

    # -- resumption ----------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """Identifies the dataset and the stream's configuration a resume state belongs to: sample and
        token counts, a CRC of every sample's length and domain, the domain names and the chunk size."""
        if self._fingerprint is None:
            ds = self.dataset
            crc = zlib.crc32(np.ascontiguousarray(ds.lengths, dtype=np.int64).tobytes())
            crc = zlib.crc32(np.ascontiguousarray(ds.domains, dtype=np.int64).tobytes(), crc)
            crc = zlib.crc32("\x1f".join(ds.domain_names).encode(), crc)
            self._fingerprint = f"n={len(ds)};tokens={ds.num_tokens};crc={crc:08x};chunk={self.chunk}"
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        """The stream's configuration-dependent part of a resume state (start, ahead, schedule)."""
        return {"seed": self.seed, "frontier": self.start, "ahead": sorted(self.ahead),
                "schedule": [(p, w.tolist()) for p, w in self.schedule], "complete": True,
                "dataset": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ArgumentError(f"state: expected a dict from state_dict(), got {type(state).__name__}")
        if not state.get("complete", True):
            raise ArgumentError("state: expected a complete (merged) state, got one rank's partial state; "
                                "combine every rank's state with dataengine.data.merge_states first")
        for key in ("seed", "frontier", "ahead"):
            if key not in state:
                raise ArgumentError(f"state: expected key {key!r} (a state from state_dict()), got keys {sorted(state)}")
        if "dataset" in state and state["dataset"] != self.fingerprint():
            raise ArgumentError(f"state['dataset']: expected {self.fingerprint()!r} (this stream's dataset), got "
                                f"{state['dataset']!r}: the state belongs to another dataset or chunk size")
        if "dataset" not in state:
            log.warning("load_state_dict: the state carries no dataset fingerprint (written by an older version); "
                        "it cannot be checked against this dataset")
        if check_int(state["seed"], "state['seed']") != self.seed:
            raise ArgumentError(f"state['seed']: expected {self.seed} (this stream's seed), got {state['seed']}")
        frontier = check_int(state["frontier"], "state['frontier']", lo=0)
        ahead = frozenset(check_int(p, "state['ahead']", lo=frontier) for p in state["ahead"])
        schedule = [(check_int(p, "state['schedule']", lo=0), self._check_weights(w))
                    for p, w in state.get("schedule") or []]
        if bool(schedule) != bool(self.schedule) and schedule:
            raise ArgumentError("state['schedule']: expected none (this stream is a plain shuffle), got domain weights")
        self.start, self.ahead = frontier, ahead
        if schedule:
            self.schedule = schedule
