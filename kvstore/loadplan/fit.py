"""A discounted, non-negative least-squares fit with a prior: the estimator every cost in loadplan learns with.

``y ~ x . beta`` over a few features (at most 4), fitted to observations
``(x, y)`` whose weights decay by ``decay`` per new observation, so the fit
follows a cost that drifts (a link that slows down, a CPU that other work
shares). Verbs and promises:

- ``observe(x, y)``: one observation; older ones count ``decay`` times less.
- ``coefficients() -> tuple[float, ...]``: every coefficient >= 0 (a cost
  never falls as work grows). Before enough observations pin a coefficient
  down, it stays near ``prior``: the prior is a ridge penalty worth
  ``prior_weight`` observations at the features' typical sizes (``scale``).
- ``predict(x) -> float``.
- ``samples``: the discounted number of observations (how much evidence).

The non-negative solution is exact: with at most 4 features every subset of
coefficients held at zero is tried, and the best feasible one kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class DecayedFit:
    prior: Sequence[float]
    scale: Sequence[float]  # a typical magnitude of each feature (the prior's pseudo-observation)
    decay: float = 0.9
    prior_weight: float = 0.2
    samples: float = 0.0
    _a: np.ndarray = field(init=False, repr=False)
    _b: np.ndarray = field(init=False, repr=False)
    _beta: tuple[float, ...] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        d = len(self.prior)
        if len(self.scale) != d or not 1 <= d <= 4:
            raise ValueError("prior and scale need the same length, 1 to 4 features")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self._a = np.zeros((d, d))
        self._b = np.zeros(d)

    @property
    def dim(self) -> int:
        return len(self.prior)

    def observe(self, x: Sequence[float], y: float) -> None:
        v = np.asarray(x, dtype=float)
        if v.shape != (self.dim,) or not np.all(np.isfinite(v)) or not np.isfinite(y):
            raise ValueError(f"need {self.dim} finite features and a finite value")
        self._a = self._a * self.decay + np.outer(v, v)
        self._b = self._b * self.decay + v * float(y)
        self.samples = self.samples * self.decay + 1.0
        self._beta = None

    def reset_prior(self, prior: Sequence[float]) -> None:
        """New prior beliefs (for example a bandwidth read from the server's Stats); observations stay."""
        if len(prior) != self.dim:
            raise ValueError("prior has the wrong length")
        self.prior = list(prior)
        self._beta = None

    def coefficients(self) -> tuple[float, ...]:
        if self._beta is None:
            self._beta = self._solve()
        return self._beta

    def predict(self, x: Sequence[float]) -> float:
        return float(np.dot(self.coefficients(), np.asarray(x, dtype=float)))

    def _solve(self) -> tuple[float, ...]:
        d = self.dim
        lam = self.prior_weight * np.asarray(self.scale, dtype=float) ** 2
        prior = np.maximum(np.asarray(self.prior, dtype=float), 0.0)
        a = self._a + np.diag(lam)
        b = self._b + lam * prior

        def objective(beta: np.ndarray) -> float:  # the fit's loss up to a constant
            return float(beta @ a @ beta - 2.0 * b @ beta)

        best: np.ndarray | None = None
        best_obj = np.inf
        for size in range(d, 0, -1):
            for free in itertools.combinations(range(d), size):
                idx = list(free)
                try:
                    sol = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
                except np.linalg.LinAlgError:
                    continue
                if np.any(sol < 0.0):
                    continue
                beta = np.zeros(d)
                beta[idx] = sol
                obj = objective(beta)
                if obj < best_obj:
                    best, best_obj = beta, obj
        if best is None:
            best = np.zeros(d)
        return tuple(float(v) for v in best)
