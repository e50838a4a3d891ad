"""Online domain reweighting by exponentiated gradient (DoReMi / online data mixing style).

After each report of per-domain training losses, domains whose loss exceeds its reference
(or whose loss is highest, without references) gain weight:
    w <- normalize(w * exp(lr * excess_loss)),  then  w <- (1 - smoothing) * w + smoothing / D
The smoothing keeps every domain sampled so its loss estimate stays fresh.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tilehal import ArgumentError, ShapeError, check_int


def _floats(v, name: str) -> np.ndarray:
    try:
        return np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        raise ArgumentError(f"{name}: expected a sequence of numbers, got {v!r}") from None


class ExponentiatedGradientWeights:
    def __init__(self, num_domains: int, lr: float = 1.0, smoothing: float = 1e-3,
                 initial: Sequence[float] | None = None, reference_losses: Sequence[float] | None = None,
                 ema: float = 0.9) -> None:
        num_domains = check_int(num_domains, "num_domains", lo=1)
        for name, v, lo, hi in (("smoothing", smoothing, 0, 1), ("ema", ema, 0, 1), ("lr", lr, 0, np.inf)):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not lo <= v <= hi \
                    or not np.isfinite(v):
                raise ArgumentError(f"{name}: expected a finite number in [{lo}, {hi}], got {v!r}")
        self.num_domains = num_domains
        self.lr = lr
        self.smoothing = smoothing
        self.ema = ema
        w = np.full(num_domains, 1.0 / num_domains) if initial is None else _floats(initial, "initial")
        if w.shape != (num_domains,) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise ArgumentError(f"initial: expected {num_domains} finite non-negative weights with a positive sum, "
                                f"got {initial}")
        self.weights = w / w.sum()
        self.reference = None if reference_losses is None else _floats(reference_losses, "reference_losses")
        if self.reference is not None and (self.reference.shape != (num_domains,) or not np.isfinite(self.reference).all()):
            raise ArgumentError(f"reference_losses: expected {num_domains} finite losses, got {reference_losses}")
        self.loss_ema = np.full(num_domains, np.nan)
        self.steps = 0

    def update(self, domain_losses: Sequence[float] | dict[int, float]) -> np.ndarray:
        """Report mean losses of the domains seen this step (NaN or missing = not seen); new weights."""
        if isinstance(domain_losses, dict):
            losses = np.full(self.num_domains, np.nan)
            for d, v in domain_losses.items():
                losses[check_int(d, "domain_losses key", lo=0, hi=self.num_domains - 1)] = v
        else:
            losses = np.asarray(domain_losses, dtype=np.float64)
        if losses.shape != (self.num_domains,):
            raise ShapeError(f"domain_losses: expected {self.num_domains} values, got shape {losses.shape}")
        if np.isinf(losses).any():
            raise ArgumentError(f"domain_losses: expected finite losses (NaN = not seen), got {losses.tolist()}")
        seen = ~np.isnan(losses)
        fresh = seen & np.isnan(self.loss_ema)
        self.loss_ema[fresh] = losses[fresh]
        upd = seen & ~fresh
        self.loss_ema[upd] = self.ema * self.loss_ema[upd] + (1 - self.ema) * losses[upd]
        known = ~np.isnan(self.loss_ema)
        if known.any():
            excess = self.loss_ema - (self.reference if self.reference is not None else np.nanmean(self.loss_ema))
            if self.reference is not None:
                excess = np.maximum(excess, 0.0)  # DoReMi clips the excess loss at zero
            logw = np.log(self.weights) + self.lr * np.where(known, excess, 0.0)
            w = np.exp(logw - logw.max())
            w /= w.sum()
            self.weights = (1 - self.smoothing) * w + self.smoothing / self.num_domains
        self.steps += 1
        return self.weights.copy()

    def state_dict(self) -> dict:
        return {"weights": self.weights.tolist(), "loss_ema": self.loss_ema.tolist(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.weights = np.asarray(state["weights"], dtype=np.float64)
        self.loss_ema = np.asarray(state["loss_ema"], dtype=np.float64)
        self.steps = int(state["steps"])
