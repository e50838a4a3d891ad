"""Near-duplicate removal with MinHash signatures and locality-sensitive hashing.

Each sample becomes the set of its token n-grams ("shingles"). A MinHash signature of
`num_perm` minima under random affine hashes estimates Jaccard similarity; LSH splits the
signature into `bands` bands of `rows` values, and samples sharing any band become candidate
pairs, which are confirmed when their estimated Jaccard reaches `threshold`. Each connected
group of duplicates keeps its lowest sample id.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
from tilehal import ArgumentError, check_int
from tqdm.auto import tqdm

_MASK32 = np.uint64(0xFFFFFFFF)


class MinHashLSH:
    def __init__(self, num_perm: int = 128, bands: int = 16, ngram: int = 5, threshold: float = 0.8,
                 seed: int = 0) -> None:
        num_perm = check_int(num_perm, "num_perm", lo=1, hi=1 << 16)
        bands = check_int(bands, "bands", lo=1, hi=num_perm)
        ngram = check_int(ngram, "ngram", lo=1)
        seed = check_int(seed, "seed", lo=0)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.floating)) or \
                not 0.0 <= threshold <= 1.0:
            raise ArgumentError(f"threshold: expected a number in [0, 1], got {threshold!r}")
        if num_perm % bands:
            raise ArgumentError(f"bands: expected a divisor of num_perm ({num_perm}), got {bands}")
        self.num_perm, self.bands, self.rows = num_perm, bands, num_perm // bands
        self.ngram, self.threshold = ngram, threshold
        rng = np.random.default_rng(seed)
        # One affine hash (a*x + b) mod 2^32 per permutation, followed by a xorshift-multiply mix.
        self._a = rng.integers(1, 1 << 32, num_perm, dtype=np.uint64)
        self._b = rng.integers(0, 1 << 32, num_perm, dtype=np.uint64)

    def shingles(self, tokens: np.ndarray) -> np.ndarray:
        """32-bit hashes of the token n-grams (the whole sample when shorter than n)."""
        t = np.asarray(tokens, dtype=np.uint64)
        n = min(self.ngram, len(t))
        if n == 0:
            return np.zeros(1, dtype=np.uint64)
        count = len(t) - n + 1
        h = np.full(count, np.uint64(1469598103934665603))
        for k in range(n):  # FNV-1a style mixing of each n-gram's tokens
            h = (h ^ t[k:k + count]) * np.uint64(1099511628211)
        return np.unique((h ^ (h >> np.uint64(29))) & _MASK32)

    def signature(self, tokens: np.ndarray) -> np.ndarray:
        """uint32 [num_perm] MinHash signature."""
        x = self.shingles(tokens)
        # (a*x + b) mod 2^32 with 32-bit a, x: exact in uint64 arithmetic (wraps mod 2^64, then masked).
        hv = (self._a[:, None] * x[None, :] + self._b[:, None]) & _MASK32
        # A second mix so low bits of x do not map linearly.
        hv = (hv ^ (hv >> np.uint64(15))) * np.uint64(0x2C1B3C6D) & _MASK32
        return hv.min(axis=1).astype(np.uint32)

    def signatures(self, samples, ids: Sequence[int] | None = None, progress: bool = True) -> np.ndarray:
        """Signatures [len(ids), num_perm] for a TokenDataset (or a list of token arrays)."""
        ids = range(len(samples)) if ids is None else ids
        out = np.empty((len(ids), self.num_perm), dtype=np.uint32)
        for k, i in enumerate(tqdm(ids, desc="minhash", disable=not progress, unit="sample")):
            out[k] = self.signature(samples[int(i)])
        return out

    def duplicate_groups(self, sigs: np.ndarray) -> list[list[int]]:
        """Groups (row indices into sigs) of near-duplicates, each sorted; singletons omitted."""
        n = len(sigs)
        parent = list(range(n))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for b in range(self.bands):
            buckets: dict[bytes, list[int]] = defaultdict(list)
            band = np.ascontiguousarray(sigs[:, b * self.rows:(b + 1) * self.rows])
            for i in range(n):
                buckets[band[i].tobytes()].append(i)
            for members in buckets.values():
                if len(members) < 2:
                    continue
                head = members[0]
                for j in members[1:]:
                    ri, rj = find(head), find(j)
                    if ri != rj and float(np.mean(sigs[head] == sigs[j])) >= self.threshold:
                        parent[max(ri, rj)] = min(ri, rj)
        groups: dict[int, list[int]] = defaultdict(list)
        for i in range(n):
            groups[find(i)].append(i)
        return [sorted(g) for g in groups.values() if len(g) > 1]

    def keep_mask(self, samples, progress: bool = True) -> np.ndarray:
        """Boolean mask over samples: False for every duplicate except the lowest id of its group."""
        sigs = self.signatures(samples, progress=progress)
        keep = np.ones(len(sigs), dtype=bool)
        for g in self.duplicate_groups(sigs):
            keep[g[1:]] = False
        return keep


def jaccard(a: np.ndarray, b: np.ndarray, ngram: int = 5) -> float:
    """Exact Jaccard similarity of two samples' n-gram sets (reference for tests)."""
    ngram = check_int(ngram, "ngram", lo=1)
    for name, x in (("a", a), ("b", b)):
        if not hasattr(x, "__len__") or isinstance(x, (str, bytes)) or np.ndim(x) != 1:
            raise ArgumentError(f"{name}: expected a sequence of token ids, got {type(x).__name__}")
    def grams(t):
        t = list(np.asarray(t).tolist())
        n = min(ngram, len(t))
        return {tuple(t[i:i + n]) for i in range(len(t) - n + 1)} if n else {()}
    sa, sb = grams(a), grams(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0
