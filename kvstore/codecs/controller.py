"""The codec controller: a contextual bandit over codecs with a cost model (DESIGN 5).

For a transfer of ``n`` raw bytes the predicted cost of codec (arm) ``a`` is::

    cpu  = n * (encode_a + decode_a)          seconds per byte, learned
    wire = n * (1 / ratio_a) / bandwidth      1/ratio_a learned, bandwidth estimated
    cost = cpu + wire                         sequential transfer
    cost = max(cpu, wire)                     pipelined (encode i+1 while i is sent)

``encode_a``, ``decode_a`` and ``1/ratio_a`` are learned per (arm, dtype, size
class) from what the transfers report, with exponential discounting; a key
with no observations yet borrows from the same arm's other size classes, then
from its other dtypes, then from a prior. Bandwidth is one link-wide estimate
that follows a changing link. The structure is the point: what a codec costs
in CPU and what it saves in bytes barely change with the link, so when the
bandwidth moves the controller re-ranks every arm at once instead of
re-exploring them.

Verbs and their promises (all thread-safe):

- ``choose(context) -> arm``: the arm with the lowest predicted cost among
  those the context allows; lossy arms only when ``context.lossy_ok`` (a
  constraint, never traded against cost), and only arms in
  ``context.accepted`` when the receiver named them. An allowed arm never
  chosen for this dtype is tried first (once per arm and dtype);
  after that, with probability ``epsilon`` (seeded, so runs replay) it tries
  the least-observed other arm whose predicted cost is within
  ``explore_within`` times the best.
- ``observe(arm, context, nbytes, encoded_bytes, encode_s, decode_s=None)``:
  what one coded transfer (or batch) cost the sender; ``decode_s`` when known.
- ``observe_decode(arm, context, nbytes, decode_s)``: the receiver's decode
  time, when it arrives later.
- ``observe_transfer(nbytes, seconds)``: ``nbytes`` on the wire took
  ``seconds`` of wire time (measure the send alone, not the coding around it).
- ``predict(context) -> {arm: seconds}``: the model's costs for the allowed arms.
- ``snapshot() -> {name: float}``: estimates and counters for Stats and
  Prometheus (``codec.bandwidth_bps``, ``codec.choices.<arm>``,
  ``codec.<arm>.<dtype>.<size class>.ratio`` / ``.encode_gbps`` / ``.decode_gbps``).
"""
from __future__ import annotations

import math
import random
import threading
from collections import Counter
from dataclasses import dataclass, field

from .estimators import BandwidthEstimator, DiscountedRate
from .registry import codec_names, get_codec

# Size classes: blocks (or batches) below 64 KiB, to 256 KiB, to 1 MiB, to 4 MiB, above.
SIZE_BOUNDS = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
SIZE_LABELS = ("lt64KiB", "64-256KiB", "256KiB-1MiB", "1-4MiB", "ge4MiB")


def size_class(nbytes: int) -> int:
    return sum(nbytes >= bound for bound in SIZE_BOUNDS)


@dataclass(frozen=True, slots=True)
class Context:
    """What a choice depends on: the block dtype, the transfer size, and the constraints."""

    dtype: str
    nbytes: int
    pipelined: bool = False
    lossy_ok: bool = False
    accepted: frozenset[str] | None = None  # receiver's codecs (codecs.accepted_from_wire); None: any


@dataclass(frozen=True, slots=True)
class ArmPrior:
    """Starting beliefs about a codec before any observation."""

    ratio: float
    encode_gbps: float
    decode_gbps: float


# Single-core figures (per CPU-second) measured on real SmolLM2 bf16 KV, dense 360 KiB blocks,
# by bench/codecs.py (bench/results/codecs.json). Priors only: observations replace them.
DEFAULT_PRIORS: dict[str, ArmPrior] = {
    "none": ArmPrior(1.0, 20.0, 20.0),
    "zstd": ArmPrior(1.255, 1.27, 1.57),
    "byteplane": ArmPrior(1.436, 0.66, 2.13),
    "fp8": ArmPrior(1.94, 0.82, 1.29),
    "fp8+zstd": ArmPrior(2.257, 0.58, 0.92),
    "lz4": ArmPrior(0.998, 11.8, 11.8),
}
_PRIOR = ArmPrior(1.0, 1.0, 1.0)


@dataclass
class ControllerConfig:
    arms: tuple[str, ...] = ()  # empty: every registered codec
    epsilon: float = 0.03
    explore_within: float = 3.0
    discount: float = 0.9  # per observation of an (arm, dtype, size class)
    bandwidth_alpha: float = 0.35
    initial_bandwidth_bps: float = 1.25e9  # 10 Gbit/s until the first transfer says otherwise
    seed: int = 0
    priors: dict[str, ArmPrior] = field(default_factory=lambda: dict(DEFAULT_PRIORS))


@dataclass(slots=True)
class _ArmStats:
    inv_ratio: DiscountedRate = field(default_factory=DiscountedRate)  # encoded / raw bytes
    encode: DiscountedRate = field(default_factory=DiscountedRate)  # seconds / raw byte
    decode: DiscountedRate = field(default_factory=DiscountedRate)  # seconds / raw byte


_Key = tuple[str, str | None, int | None]  # (arm, dtype, size class); None pools over it


class Controller:
    """Picks a codec per transfer; see the module docstring for the model and verbs."""

    def __init__(self, config: ControllerConfig | None = None):
        self.config = config or ControllerConfig()
        arms = self.config.arms or tuple(codec_names())
        self.arms: tuple[str, ...] = tuple(get_codec(a).name for a in arms)
        self._lossy = {a: get_codec(a).lossy for a in self.arms}
        self._stats: dict[_Key, _ArmStats] = {}
        self._bandwidth = BandwidthEstimator(self.config.initial_bandwidth_bps, self.config.bandwidth_alpha)
        self._rng = random.Random(self.config.seed)
        self._choices: Counter[str] = Counter()
        self._tried: set[tuple[str, str]] = set()  # (arm, dtype) chosen at least once
        self._explorations = 0
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- choosing

    def allowed(self, context: Context) -> list[str]:
        """The arms ``context`` permits, in registry order."""
        return [
            a
            for a in self.arms
            if (context.lossy_ok or not self._lossy[a]) and (context.accepted is None or a in context.accepted)
        ]

    def choose(self, context: Context) -> str:
        with self._lock:
            arms = self.allowed(context)
            if not arms:
                raise ValueError(f"no codec allowed for {context} among {self.arms}")
            untried = [a for a in arms if (a, context.dtype) not in self._tried]
            if untried:
                arm = untried[0]
                self._tried.add((arm, context.dtype))
                self._explorations += 1
            else:
                costs = self._predict(context, arms)
                arm = min(arms, key=costs.__getitem__)
                if len(arms) > 1 and self._rng.random() < self.config.epsilon:
                    limit = costs[arm] * self.config.explore_within
                    others = [a for a in arms if a != arm and costs[a] <= limit]
                    if others:
                        arm = min(others, key=lambda a: (self._evidence(a, context), self._rng.random()))
                        self._explorations += 1
            self._choices[arm] += 1
            return arm

    def predict(self, context: Context) -> dict[str, float]:
        with self._lock:
            return self._predict(context, self.allowed(context))

    def _predict(self, context: Context, arms: list[str]) -> dict[str, float]:
        n = float(max(context.nbytes, 1))
        bandwidth = self._bandwidth.bps
        costs = {}
        for arm in arms:
            inv_ratio, encode, decode = self._estimates(arm, context.dtype, context.nbytes)
            cpu = n * (encode + decode)
            wire = n * inv_ratio / bandwidth
            costs[arm] = max(cpu, wire) if context.pipelined else cpu + wire
        return costs

    def _estimates(self, arm: str, dtype: str, nbytes: int) -> tuple[float, float, float]:
        """(1/ratio, encode s/B, decode s/B), each from the most specific key that has data."""
        keys: list[_Key] = [(arm, dtype, size_class(nbytes)), (arm, dtype, None), (arm, None, None)]
        prior = self.config.priors.get(arm, _PRIOR)
        found = [self._stats.get(k) for k in keys]

        def pick(attr: str, fallback: float) -> float:
            for stats in found:
                if stats is not None and getattr(stats, attr).known:
                    return getattr(stats, attr).value
            return fallback

        return (
            pick("inv_ratio", 1.0 / prior.ratio),
            pick("encode", 1e-9 / prior.encode_gbps),
            pick("decode", 1e-9 / prior.decode_gbps),
        )

    def _evidence(self, arm: str, context: Context) -> float:
        stats = self._stats.get((arm, context.dtype, size_class(context.nbytes)))
        return stats.inv_ratio.den if stats is not None else 0.0

    # ---------------------------------------------------------------- learning

    def _keys(self, arm: str, context: Context, nbytes: int) -> list[_ArmStats]:
        name = get_codec(arm).name
        keys: list[_Key] = [(name, context.dtype, size_class(nbytes)), (name, context.dtype, None), (name, None, None)]
        return [self._stats.setdefault(k, _ArmStats()) for k in keys]

    def observe(
        self,
        arm: str,
        context: Context,
        nbytes: int,
        encoded_bytes: int,
        encode_s: float,
        decode_s: float | None = None,
    ) -> None:
        if nbytes <= 0:
            return
        gamma = self.config.discount
        with self._lock:
            for stats in self._keys(arm, context, nbytes):
                stats.inv_ratio.update(float(encoded_bytes), float(nbytes), gamma)
                stats.encode.update(max(encode_s, 0.0), float(nbytes), gamma)
                if decode_s is not None:
                    stats.decode.update(max(decode_s, 0.0), float(nbytes), gamma)

    def observe_decode(self, arm: str, context: Context, nbytes: int, decode_s: float) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            for stats in self._keys(arm, context, nbytes):
                stats.decode.update(max(decode_s, 0.0), float(nbytes), self.config.discount)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._bandwidth.observe(nbytes, seconds)

    @property
    def bandwidth_bps(self) -> float:
        with self._lock:
            return self._bandwidth.bps

    # ---------------------------------------------------------------- reporting

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {
                "codec.bandwidth_bps": self._bandwidth.bps,
                "codec.bandwidth_samples": float(self._bandwidth.samples),
                "codec.explorations": float(self._explorations),
            }
            for arm in self.arms:
                out[f"codec.choices.{arm}"] = float(self._choices[arm])
            for (arm, dtype, cls), stats in sorted(self._stats.items(), key=lambda kv: str(kv[0])):
                if dtype is None or cls is None or not stats.inv_ratio.known:
                    continue
                prefix = f"codec.{arm}.{dtype}.{SIZE_LABELS[cls]}"
                out[f"{prefix}.ratio"] = 1.0 / stats.inv_ratio.value if stats.inv_ratio.value > 0 else math.inf
                out[f"{prefix}.observations"] = float(stats.inv_ratio.count)
                for attr in ("encode", "decode"):
                    rate: DiscountedRate = getattr(stats, attr)
                    if rate.known and rate.value > 0:
                        out[f"{prefix}.{attr}_gbps"] = 1e-9 / rate.value
            return out
