"""Importance scorers for filtering: length, n-gram repetition, and a user model's loss.

A scorer maps one sample's tokens to a float. `Filter` keeps samples whose score lies within
[min_score, max_score]. Scorers marked `index_only` need only the sample's length, which the
dataset index already holds, so filtering by them reads no tokens at all.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tilehal import ArgumentError, check_int
from tqdm.auto import tqdm


class Scorer(abc.ABC):
    """An importance score per sample; subclasses implement __call__ on the sample's tokens."""

    name = "scorer"
    index_only = False

    @abc.abstractmethod
    def __call__(self, tokens: np.ndarray) -> float: ...

    def score_length(self, length: int) -> float:
        raise TypeError(f"{type(self).__name__} needs the tokens, not only the length")


class LengthScorer(Scorer):
    """The number of tokens."""

    name = "length"
    index_only = True

    def __call__(self, tokens: np.ndarray) -> float:
        return float(len(tokens))

    def score_length(self, length: int) -> float:
        return float(length)


class NGramRepetitionScorer(Scorer):
    """Fraction of n-grams that repeat an earlier n-gram of the same sample (0 = no repetition).

    Gopher-style quality signal: boilerplate and degenerate loops score high.
    """

    def __init__(self, n: int = 3) -> None:
        self.n = n = check_int(n, "n", lo=1)
        self.name = f"repetition_{n}gram"

    def __call__(self, tokens: np.ndarray) -> float:
        t = np.asarray(tokens, dtype=np.int64)
        count = len(t) - self.n + 1
        if count <= 1:
            return 0.0
        # Hash each n-gram into one int64 (polynomial rolling, wrap-around is fine for equality tests
        # at these sizes; collisions could only lower the estimate).
        h = np.zeros(count, dtype=np.uint64)
        for k in range(self.n):
            h = h * np.uint64(1_000_003) + t[k:k + count].astype(np.uint64)
        return 1.0 - len(np.unique(h)) / count


class ModelLossScorer(Scorer):
    """Mean next-token cross-entropy (or perplexity) of a user model on the sample.

    `model(input_ids [1, T]) -> logits [1, T, vocab]` (a HF-style output with `.logits` also works).
    Samples longer than `max_len` are scored on their first `max_len` tokens.
    """

    def __init__(self, model: Callable[[torch.Tensor], Any], perplexity: bool = False, max_len: int = 2048,
                 device: str | torch.device = "cpu") -> None:
        self.model = model
        self.perplexity = perplexity
        self.max_len = max_len
        self.device = torch.device(device)
        self.name = "perplexity" if perplexity else "loss"

    @torch.no_grad()
    def __call__(self, tokens: np.ndarray) -> float:
        t = torch.as_tensor(np.asarray(tokens[: self.max_len], dtype=np.int64), device=self.device)
        if t.numel() < 2:
            return 0.0
        out = self.model(t.unsqueeze(0))
        logits = getattr(out, "logits", out)
        if logits.dim() != 3 or logits.shape[:2] != (1, t.numel()):
            raise ArgumentError(f"model output: expected logits [1, {t.numel()}, vocab], got {tuple(logits.shape)}")
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), t[1:]).item()
        return math.exp(loss) if self.perplexity else loss


@dataclass
class Filter:
    """Keep a sample when min_score <= scorer(sample) <= max_score (None = unbounded)."""

    scorer: Scorer
    min_score: float | None = None
    max_score: float | None = None

    def accepts(self, score: float) -> bool:
        return (self.min_score is None or score >= self.min_score) and (self.max_score is None or score <= self.max_score)

    @property
    def index_only(self) -> bool:
        return self.scorer.index_only


def score_dataset(dataset, scorer: Scorer, ids: Sequence[int] | None = None, progress: bool = True) -> np.ndarray:
    """Score every sample (or `ids`) with a progress bar; float64 [len(ids)]."""
    ids = np.arange(len(dataset)) if ids is None else np.asarray(ids)
    if scorer.index_only:
        return np.array([scorer.score_length(int(dataset.lengths[i])) for i in ids], dtype=np.float64)
    out = np.empty(len(ids), dtype=np.float64)
    for k, i in enumerate(tqdm(ids, desc=f"scoring {scorer.name}", disable=not progress, unit="sample")):
        out[k] = scorer(dataset.tokens(int(i)))
    return out
