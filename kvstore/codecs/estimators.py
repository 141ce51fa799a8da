"""Discounted estimators the codec controller learns with.

- ``DiscountedRate``: a ratio of exponentially discounted sums,
  ``sum(g^k num_k) / sum(g^k den_k)`` with ``g`` applied per update: seconds per
  byte, encoded bytes per raw byte. Large samples weigh more than small ones;
  old samples fade, so the estimate follows drift.
- ``BandwidthEstimator``: the link's bytes per second as an exponentially
  weighted mean of log throughput, so it tracks a drop and a recovery equally
  fast (a mean of seconds would let slow transfers dominate after a recovery);
  small transfers, dominated by latency, weigh less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class DiscountedRate:
    """``num / den`` over discounted sums; ``count`` is the number of updates seen."""

    num: float = 0.0
    den: float = 0.0
    count: int = 0

    def update(self, num: float, den: float, discount: float) -> None:
        self.num = self.num * discount + num
        self.den = self.den * discount + den
        self.count += 1

    @property
    def known(self) -> bool:
        return self.den > 0.0

    @property
    def value(self) -> float:
        return self.num / self.den if self.den > 0.0 else math.nan


@dataclass(slots=True)
class BandwidthEstimator:
    """Bytes per second of the link, from ``(nbytes, seconds)`` of completed transfers.

    A sample moves the log estimate by ``alpha * min(1, 2n / (n + ref_bytes))``
    of the way to its own log throughput: full weight from ``ref_bytes`` up,
    less for small, latency-bound transfers. The first sample moves it all
    the way (``alpha`` = 1): ``initial_bps`` is a guess, not a measurement.
    """

    initial_bps: float
    alpha: float = 0.35
    ref_bytes: int = 64 * 1024
    samples: int = 0
    _log_bps: float = 0.0

    def __post_init__(self) -> None:
        self._log_bps = math.log(self.initial_bps)

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0.0:
            return
        alpha = self.alpha if self.samples else 1.0  # the first sample replaces the initial guess
        weight = alpha * min(1.0, 2.0 * nbytes / (nbytes + self.ref_bytes))
        self._log_bps += weight * (math.log(nbytes / seconds) - self._log_bps)
        self.samples += 1

    @property
    def bps(self) -> float:
        return math.exp(self._log_bps)
