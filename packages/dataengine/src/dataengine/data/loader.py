"""torch DataLoader integration: collation and a resumable loader that tracks stream positions."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from tilehal import ArgumentError, ShapeError, check_int

from ..packing import pack
from .stream import StreamingDataset


def pad_collate(samples: Sequence[dict[str, Any]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: input_ids [b, max_len], lengths, sample_id, domain, position."""
    pad_id = check_int(pad_id, "pad_id")
    if isinstance(samples, (str, bytes)) or not hasattr(samples, "__len__"):
        raise ArgumentError(f"samples: expected a list of samples (dicts with 'tokens'), got {type(samples).__name__}")
    for i, s in enumerate(samples):
        if not isinstance(s, dict) or "tokens" not in s:
            raise ArgumentError(f"samples[{i}]: expected a dict with a 'tokens' entry (a StreamingDataset sample), "
                                f"got {type(s).__name__}")
    lengths = torch.tensor([len(s["tokens"]) for s in samples], dtype=torch.long)
    shape = (len(samples), int(lengths.max()) if len(samples) else 0)
    # zeros() gets pre-zeroed pages from the allocator, noticeably faster than full() for big batches.
    ids = torch.zeros(shape, dtype=torch.long) if pad_id == 0 else torch.full(shape, pad_id, dtype=torch.long)
    for k, s in enumerate(samples):
        ids[k, : len(s["tokens"])] = s["tokens"]
    return {"input_ids": ids, "lengths": lengths, **_meta(samples)}


def _meta(samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor([s[key] for s in samples], dtype=torch.long) for key in ("sample_id", "domain", "position")}


class PackCollate:
    """Collate by packing into rows of `row_len` (best-fit-decreasing; overlong samples split)."""

    def __init__(self, row_len: int, pad_id: int = 0) -> None:
        self.row_len, self.pad_id = check_int(row_len, "row_len", lo=1), check_int(pad_id, "pad_id")

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        pb = pack([s["tokens"] for s in samples], self.row_len, self.pad_id, overlong="split")
        return {"input_ids": pb.tokens, "position_ids": pb.position_ids, "doc_ids": pb.doc_ids,
                "cu_seqlens": pb.cu_seqlens, "cu_seqlens_flat": pb.cu_seqlens_flat, **_meta(samples)}


class PositionTracker:
    """Turns the positions a group of consumers has yielded into a split-independent resume state.

    Consumer c examines its positions (p % C == c) in increasing order, so once it yields p, every
    position of its class below p + C is done: yielded, or excluded by a deterministic filter that
    will exclude it again. Positions below the starting frontier or in the starting `ahead` set
    were done before this run.
    """

    def __init__(self, classes: Sequence[int], num_consumers: int, start: int, ahead: frozenset[int]) -> None:
        self.classes, self.num_consumers = list(classes), num_consumers
        self.start, self.ahead = start, frozenset(ahead)
        self.last: dict[int, int] = {}

    def observe(self, positions: Sequence[int]) -> None:
        for p in positions:
            c = p % self.num_consumers
            if p > self.last.get(c, -1):
                self.last[c] = p

    def cursors(self) -> dict[int, int]:
        return {c: max(self.start, self.last[c] + self.num_consumers) if c in self.last else self.start
                for c in self.classes}

    def max_position(self) -> int:
        seen = list(self.last.values()) + list(self.ahead)
        return max(seen) if seen else self.start - 1

    def partial_state(self) -> dict[str, Any]:
        """This group's part of the state; `merge_states` of every rank's part gives the full state."""
        return {"cursors": {str(c): v for c, v in self.cursors().items()}, "num_consumers": self.num_consumers,
                "base_frontier": self.start, "base_ahead": sorted(self.ahead)}


def _resolve(cursors: dict[str, int], num_consumers: int, base_frontier: int, base_ahead: Sequence[int]
             ) -> tuple[int, list[int]]:
    """(frontier, done positions at or above it) from per-consumer cursors and the base state."""
    cur = np.full(num_consumers, base_frontier, dtype=np.int64)
    for c, v in cursors.items():
        cur[int(c)] = v
    base = np.asarray(sorted(base_ahead), dtype=np.int64)
    hi = max(int(cur.max()), int(base.max()) + 1 if base.size else 0, base_frontier)
    pos = np.arange(base_frontier, hi, dtype=np.int64)
    done = (pos < cur[pos % num_consumers]) | np.isin(pos, base)
    not_done = np.flatnonzero(~done)
    frontier = int(pos[not_done[0]]) if not_done.size else hi
    return frontier, pos[done & (pos >= frontier)].tolist()


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Combine every rank's `ResumableLoader.state_dict()` into one state loadable under any split."""
    if not states:
        raise ArgumentError("states: expected one state per rank, got none")
    cursors: dict[str, int] = {}
    base_ahead: set[int] = set()
    for s in states:
        cursors.update(s["cursors"])
        base_ahead.update(s["base_ahead"])
    first = states[0]
    if len(cursors) != first["num_consumers"]:
        raise ArgumentError(f"states: expected cursors for all {first['num_consumers']} consumers, "
                         f"got {len(cursors)} (is a rank missing?)")
    frontier, ahead = _resolve(cursors, first["num_consumers"], first["base_frontier"], sorted(base_ahead))
    merged = dict(first)
    merged.update(frontier=frontier, ahead=ahead, complete=True)
    return merged


class ResumableLoader:
    """A torch DataLoader over a StreamingDataset whose `state_dict()` resumes under any split.

    `set_domain_weights(w)` changes the mixture from the next unseen position; the DataLoader is
    rebuilt from the current state so worker processes pick the new weights up (prefetched
    samples are discarded and drawn again under the new weights).
    """

    def __init__(self, stream: StreamingDataset, batch_size: int = 8, num_workers: int = 0,
                 collate_fn: Callable | None = None, **loader_kwargs: Any) -> None:
        if not isinstance(stream, StreamingDataset):
            raise ArgumentError(f"stream: expected a StreamingDataset, got {type(stream).__name__}")
        self.stream = stream
        self.batch_size = check_int(batch_size, "batch_size", lo=1)
        self.num_workers = check_int(num_workers, "num_workers", lo=0, hi=1024)
        self.collate_fn = collate_fn or pad_collate
        self.loader_kwargs = loader_kwargs
        self._restart = False
        self._new_tracker()

    def _new_tracker(self) -> None:
        w = max(self.num_workers, 1)
        classes = range(self.stream.rank * w, (self.stream.rank + 1) * w)
        self.tracker = PositionTracker(classes, self.stream.world_size * w, self.stream.start, self.stream.ahead)

    def _sync_stream(self) -> None:
        if self.stream.world_size == 1:
            st = self.state_dict()
            self.stream.start, self.stream.ahead = st["frontier"], frozenset(st["ahead"])
        else:
            # Other ranks' progress is unknown here: keep the frontier and record this rank's done
            # positions explicitly (merge_states unions every rank's base_ahead).
            p = self.tracker.partial_state()
            _, ahead = _resolve(p["cursors"], p["num_consumers"], p["base_frontier"], p["base_ahead"])
            self.stream.ahead = frozenset(ahead) | self.stream.ahead
        self._new_tracker()

    def __iter__(self) -> Iterator[Any]:
        while True:
            self._sync_stream()
            self._restart = False
            loader = torch.utils.data.DataLoader(self.stream, batch_size=self.batch_size, num_workers=self.num_workers,
                                                 collate_fn=self.collate_fn, **self.loader_kwargs)
            for batch in loader:
                self.tracker.observe(batch["position"].tolist())
                yield batch
                if self._restart:
                    break
            else:
                return

    def set_domain_weights(self, weights: Sequence[float], from_position: int | None = None) -> None:
        """New mixture weights from `from_position` (default: just past every position seen here).

        With several ranks, pass the same from_position on all of them (e.g. the all-reduced max of
        `max_position() + 1`), so every rank agrees on the schedule.
        """
        if from_position is None:
            if self.stream.world_size > 1:
                raise ArgumentError("from_position: expected an explicit position agreed by all ranks when world_size > 1")
            from_position = self.tracker.max_position() + 1
        self.stream.set_domain_weights(weights, from_position)
        self._restart = True

    def max_position(self) -> int:
        return self.tracker.max_position()

    def state_dict(self) -> dict[str, Any]:
        """Complete with one rank; with several, a partial state for `merge_states`."""
        state = self.stream.state_dict()
        state.update(self.tracker.partial_state(), complete=False)
        return merge_states([state]) if self.stream.world_size == 1 else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
        self._new_tracker()


def domain_losses(per_sample_loss: torch.Tensor, domains: torch.Tensor, num_domains: int) -> np.ndarray:
    """Mean loss per domain in a batch (NaN where the batch has none), for ExponentiatedGradientWeights."""
    num_domains = check_int(num_domains, "num_domains", lo=1)
    for name, t in (("per_sample_loss", per_sample_loss), ("domains", domains)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise ShapeError(f"{name}: expected a 1-D tensor [batch], got {getattr(t, 'shape', type(t).__name__)}")
    if per_sample_loss.shape != domains.shape:
        raise ShapeError(f"domains: expected shape {tuple(per_sample_loss.shape)} (per_sample_loss's), got "
                         f"{tuple(domains.shape)}")
    if domains.is_floating_point():
        raise ShapeError(f"domains: expected integer domain ids, got {domains.dtype}")
    num_domains = check_int(num_domains, "num_domains", lo=1, hi=1 << 24)
    loss = per_sample_loss.detach().double().cpu()
    d = domains.cpu().long()
    if d.numel() and (int(d.min()) < 0 or int(d.max()) >= num_domains):
        raise ArgumentError(f"domains: expected ids in [0, {num_domains}), got [{int(d.min())}, {int(d.max())}]")
    total = torch.zeros(num_domains, dtype=torch.float64).index_add_(0, d, loss)
    count = torch.zeros(num_domains, dtype=torch.float64).index_add_(0, d, torch.ones_like(loss))
    out = (total / count).numpy()
    out[count.numpy() == 0] = np.nan
    return out
