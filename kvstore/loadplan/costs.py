"""Online, decaying estimates of what a request's parts cost: loading cached blocks and computing tokens.

**Compute** (``ComputeCosts``): seconds to compute tokens ``[start, end)`` of a
prompt whose first ``start`` tokens are already in the KV pool, in ``calls``
forward calls::

    compute(start, end) = c * calls + a * (end - start) + b * sum(p for p in range(start, end))

``a`` is the per-token work (projections, MLP), ``b`` the attention work a
token at position ``p`` does over its ``p`` predecessors: a token late in a
long prompt costs more than an early one, so skipping the first blocks of a
prompt saves less than skipping the same number of later ones.

**Load** (``LoadCosts``): seconds of a Get, per lane (shm, tcp, grpc, cuda_ipc)::

    load = call * calls + sum over tiers of bytes_in_tier * s_per_byte[tier]

so an NVMe block (server read + transfer) and a DRAM block (transfer only) have
their own costs, and a Get split into several calls pays the per-call cost
each time. Priors come from the lane's nominal speed, the server's measured
NVMe read speed (``use_server_stats``: its Stats counters
``tier_nvme_read_bytes`` / ``tier_nvme_read_seconds``), the link bandwidth a
codec controller measured (``use_link_bandwidth``) and the codec's decode
speed (``use_decode_speed``); observations replace them.

Both learn with ``fit.DecayedFit`` (non-negative, discounted per observation).
Verbs: ``observe(...)`` and ``predict(...)`` on each; ``snapshot()`` for metrics.
Not thread-safe on their own: ``planner.Planner`` serialises access.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.loadplan.fit import DecayedFit

TIERS = ("hbm", "dram", "nvme")
MIB = float(1 << 20)
TOKENS_UNIT = 1e3  # feature units keep the fit well conditioned: thousands of tokens,
POSITIONS_UNIT = 1e6  # millions of token-positions


def position_sum(start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray | int:
    """``sum(range(start, end))``: the attention work of tokens ``start..end-1`` (elementwise for arrays)."""
    return (start + end - 1) * (end - start) // 2


@dataclass
class ComputePrior:
    call_s: float = 0.005
    s_per_1k_tokens: float = 1.0
    s_per_1m_positions: float = 0.2


class ComputeCosts:
    def __init__(self, prior: ComputePrior | None = None, decay: float = 0.9, prior_weight: float = 0.02):
        p = prior or ComputePrior()
        self._fit = DecayedFit(
            [p.call_s, p.s_per_1k_tokens, p.s_per_1m_positions], [1.0, 1.0, 0.5], decay, prior_weight
        )

    @staticmethod
    def features(start: int, end: int, calls: int = 1) -> list[float]:
        return [float(calls), (end - start) / TOKENS_UNIT, float(position_sum(start, end)) / POSITIONS_UNIT]

    def observe(self, start: int, end: int, seconds: float, calls: int = 1) -> None:
        if end > start and seconds > 0.0:
            self._fit.observe(self.features(start, end, calls), seconds)

    def predict(self, start: np.ndarray | int, end: np.ndarray | int, calls: int = 1) -> np.ndarray:
        """Seconds to compute ``[start, end)``, elementwise; 0 where ``end <= start``."""
        s, e = np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64)
        c, a, b = self._fit.coefficients()
        t = c * calls + a * (e - s) / TOKENS_UNIT + b * position_sum(s, e) / POSITIONS_UNIT
        return np.where(e > s, t, 0.0)

    @property
    def samples(self) -> float:
        return self._fit.samples

    def snapshot(self) -> dict[str, float]:
        c, a, b = self._fit.coefficients()
        return {
            "compute.call_s": c,
            "compute.s_per_1k_tokens": a,
            "compute.s_per_1m_positions": b,
            "compute.samples": self._fit.samples,
        }


# Nominal lane speeds (GB/s) and per-call costs before any observation: figures of the same order as
# bench/results/transfer.json on this kind of host; the first Gets replace them.
LANE_GBPS = {"shm": 4.0, "cuda_ipc": 8.0, "tcp": 1.2, "grpc": 0.4}
LANE_CALL_S = {"shm": 0.001, "cuda_ipc": 0.001, "tcp": 0.002, "grpc": 0.003}
NVME_GBPS = 1.0


@dataclass
class _Speeds:
    link_gbps: dict[str, float] = field(default_factory=lambda: dict(LANE_GBPS))
    nvme_gbps: float = NVME_GBPS
    decode_gbps: float = 0.0  # 0: raw bytes, nothing to decode


class LoadCosts:
    def __init__(self, decay: float = 0.8, prior_weight: float = 0.05):
        self.decay, self.prior_weight = decay, prior_weight
        self._speeds = _Speeds()
        self._fits: dict[str, DecayedFit] = {}

    # -- priors -------------------------------------------------------------------------
    def _prior(self, lane: str) -> list[float]:
        sp = self._speeds
        link = 1.0 / (sp.link_gbps.get(lane, LANE_GBPS["grpc"]) * 1e9)
        decode = 1.0 / (sp.decode_gbps * 1e9) if sp.decode_gbps > 0 else 0.0
        per_mib = (link + decode) * MIB
        nvme = per_mib + MIB / (sp.nvme_gbps * 1e9)
        return [LANE_CALL_S.get(lane, 0.003), per_mib, per_mib, nvme]

    def _refresh_priors(self) -> None:
        for lane, fit in self._fits.items():
            fit.reset_prior(self._prior(lane))

    def use_server_stats(self, counters: Mapping[str, float]) -> None:
        """Take the server's measured NVMe read speed (Stats counters) as the prior of NVMe blocks."""
        nbytes = counters.get("tier_nvme_read_bytes", 0.0)
        seconds = counters.get("tier_nvme_read_seconds", 0.0)
        if nbytes >= MIB and seconds > 0.0:
            self._speeds.nvme_gbps = nbytes / seconds / 1e9
            self._refresh_priors()

    def use_link_bandwidth(self, lane: str, bytes_per_s: float) -> None:
        if bytes_per_s > 0.0:
            self._speeds.link_gbps[lane] = bytes_per_s / 1e9
            self._refresh_priors()

    def use_decode_speed(self, gbps: float) -> None:
        self._speeds.decode_gbps = max(gbps, 0.0)
        self._refresh_priors()

    # -- learning and predicting --------------------------------------------------------------
    def _fit(self, lane: str) -> DecayedFit:
        fit = self._fits.get(lane)
        if fit is None:
            fit = self._fits[lane] = DecayedFit(self._prior(lane), [1.0, 8.0, 8.0, 8.0], self.decay, self.prior_weight)
        return fit

    @staticmethod
    def features(tier_bytes: Sequence[float], calls: int) -> list[float]:
        """``tier_bytes`` in TIERS order (hbm, dram, nvme)."""
        return [float(calls), *(b / MIB for b in tier_bytes)]

    def observe(self, lane: str, tier_bytes: Sequence[float], calls: int, seconds: float) -> None:
        if calls > 0 and seconds > 0.0:
            self._fit(lane).observe(self.features(tier_bytes, calls), seconds)

    def per_byte(self, lane: str) -> dict[str, float]:
        """Seconds per byte of a block in each tier (no per-call cost)."""
        _, *per_mib = self._fit(lane).coefficients()
        return {t: v / MIB for t, v in zip(TIERS, per_mib)}

    def call_s(self, lane: str) -> float:
        return self._fit(lane).coefficients()[0]

    def predict(self, lane: str, tier_bytes: Sequence[float], calls: int = 1) -> float:
        return self._fit(lane).predict(self.features(tier_bytes, calls))

    def samples(self, lane: str) -> float:
        return self._fit(lane).samples

    def snapshot(self) -> dict[str, float]:
        out: dict[str, float] = {"load.nvme_prior_gbps": self._speeds.nvme_gbps}
        for lane, fit in sorted(self._fits.items()):
            call, *per_mib = fit.coefficients()
            out[f"load.{lane}.call_s"] = call
            out[f"load.{lane}.samples"] = fit.samples
            for tier, v in zip(TIERS, per_mib):
                out[f"load.{lane}.{tier}_gbps"] = MIB / v / 1e9 if v > 0 else float("inf")
        return out
