"""The codec controller: a contextual bandit over codecs with a cost model (DESIGN 5).

For a batch of ``n`` raw bytes the predicted cost of codec (arm) ``a`` is::

    enc  = n * encode_a                    sender CPU s/B (a lossy sender's CRC decode included), learned
    dec  = n * decode_a                    receiver CPU s/B, learned (reported back by the receiver)
    wb   = n / ratio_a                     wire bytes; 1/ratio_a learned
    wire = wb / bandwidth                  bandwidth estimated
    sequential:  cost = enc + wire + dec
    pipelined:   cost = max(send, recv, wire, host) + fill
      send = enc + wb * transport          the sending process: encoder and transport
      recv = dec + wb * transport          the receiving process: transport and decoder
      host = (send + recv) / cores         both on shared cores
      fill = (send + wire + recv - max(send, wire, recv)) * n / stream_bytes

``encode_a``, ``decode_a`` and ``1/ratio_a`` are learned per (arm, dtype, size
class) from what the transfers report, with exponential discounting; a key
with no observations yet borrows from the same arm's other size classes, then
from its other dtypes, then from a prior. Bandwidth is one link-wide estimate
that follows a changing link. The structure is the point: what a codec costs
in CPU and what it saves in bytes barely change with the link, so when the
bandwidth moves the controller re-ranks every arm at once instead of
re-exploring them.

Pipelined (the sender encodes batch i+1 while batch i is on the wire and the
receiver decodes batch i-1), a stream moves at the pace of its slowest
stage, so a batch costs the largest stage time, not the sum of them. The
stages are the sending process, the link and the receiving process:

- ``send`` and ``recv``: coding does not overlap the transport's own CPU
  work in the same process. Python gRPC spends about ``transport`` = 1.25 ns
  of CPU per wire byte on each end, under the GIL, as does the encoder's
  interpreter work. On an unshaped veth (bench/results/bandit.json) the
  model then gives raw bytes 0.46 ms per 360 KiB block, zstd 0.65 and
  byteplane 0.82 (measured: 0.37, 0.66, 0.76); the bare ``max(enc, dec,
  wire)`` gave zstd 0.25 and picked it, though it was twice as slow as raw.
  ``transport`` is a property of the transport
  (``ControllerConfig.transport_s_per_byte``), not learned: the host's busy
  time, the only measure of it a sender has, mixes in whatever else runs
  (on this shared host it read 5-20 ns per byte at 1 Gbit/s).
- ``host``: when both ends share fewer cores than stages (one core), the
  CPU is the bottleneck; with two or more it never binds.
- ``fill``: a pipeline of ``k`` batches takes ``k`` times its slowest
  stage plus, once, the other stages (the first batch's encode and the last
  one's decode overlap nothing), shared over its batches
  (``Context.stream_bytes``; 0: a long stream, no fill term).

At 1 Gbit/s this ranks fp8+zstd (the link: 1.31 ms a block) above fp8
(1.52), where the old ``max(enc + dec, wire)`` had fp8+zstd's 1.35 ms of CPU
(sender and receiver added up) lose to fp8's 1.52; raw bytes stay first on
fast links unless the bandwidth estimate falls below about 4.5 Gbit/s.

Verbs and their promises (all thread-safe):

- ``choose(context) -> arm``: the arm with the lowest predicted cost among
  those the context allows; lossy arms only when ``context.lossy_ok`` (a
  constraint, never traded against cost), and only arms in
  ``context.accepted`` when the receiver named them. An allowed arm with
  no observation for this dtype yet (calibration counts, ``warmup.py``) is
  tried first (once per arm and dtype);
  after that, with probability ``epsilon`` (seeded, so runs replay) it tries
  the least-observed other arm whose predicted cost is within
  ``explore_within`` times the best.
- ``count(arm, batches)``: batches sent under ``arm`` without a choice each
  (a sender's run of raw batches), for the choice counters.
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
import os
import random
import threading
from collections import Counter
from collections.abc import Sequence
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
    stream_bytes: int = 0  # raw bytes of the whole transfer (the pipeline's fill/drain); 0: long, no fill term


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


# CPU seconds per wire byte of the transport on each end: Python gRPC moved raw KV across the benchmark's
# veth at about 1 GB/s on two busy cores, and zstd's and byteplane's per-block times there fit 1.25 ns
# (bench/results/bandit.json, unshaped).
TRANSPORT_S_PER_BYTE = 1.25e-9


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
    cores: int = 0  # cores the pipeline's stages share (the host's); 0: os.cpu_count()
    transport_s_per_byte: float = TRANSPORT_S_PER_BYTE  # the transport's CPU per wire byte, on each end


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
        self._names = {a: a for a in self.arms}  # any spelling observe() may get -> canonical name
        self._stats: dict[_Key, _ArmStats] = {}
        self._chains: dict[tuple[str, str, int], tuple[_ArmStats, _ArmStats, _ArmStats]] = {}
        self._allowed: dict[tuple[bool, frozenset[str] | None], tuple[str, ...]] = {}
        self._bandwidth = BandwidthEstimator(self.config.initial_bandwidth_bps, self.config.bandwidth_alpha)
        self.cores = max(int(self.config.cores or os.cpu_count() or 1), 1)
        self._rng = random.Random(self.config.seed)
        self._choices: Counter[str] = Counter()
        self._tried: set[tuple[str, str]] = set()  # (arm, dtype) chosen or observed at least once
        self._explorations = 0
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- choosing

    def allowed(self, context: Context) -> list[str]:
        """The arms ``context`` permits, in registry order."""
        return list(self._allowed_arms(context))

    def _allowed_arms(self, context: Context) -> tuple[str, ...]:
        key = (context.lossy_ok, context.accepted)
        arms = self._allowed.get(key)
        if arms is None:
            arms = self._allowed[key] = tuple(
                a
                for a in self.arms
                if (context.lossy_ok or not self._lossy[a]) and (context.accepted is None or a in context.accepted)
            )
        return arms

    def choose(self, context: Context) -> str:
        with self._lock:
            arms = self._allowed_arms(context)
            if not arms:
                raise ValueError(f"no codec allowed for {context} among {self.arms}")
            dtype = context.dtype
            untried = [a for a in arms if (a, dtype) not in self._tried]
            if untried:
                arm = untried[0]
                self._tried.add((arm, dtype))
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

    def count(self, arm: str, batches: int) -> None:
        """``batches`` more batches went under ``arm`` without a ``choose`` each (a run of raw batches)."""
        if batches > 0:
            with self._lock:
                self._choices[arm] += batches

    def predict(self, context: Context) -> dict[str, float]:
        with self._lock:
            return self._predict(context, self._allowed_arms(context))

    def _predict(self, context: Context, arms: Sequence[str]) -> dict[str, float]:
        n = float(max(context.nbytes, 1))
        bandwidth = self._bandwidth.bps
        pipelined = context.pipelined
        transport = self.config.transport_s_per_byte
        cores = float(self.cores)
        fill = min(n / context.stream_bytes, 1.0) if pipelined and context.stream_bytes > 0 else 0.0
        costs = {}
        for arm in arms:
            inv_ratio, encode, decode = self._estimates(arm, context.dtype, context.nbytes)
            enc, dec, wire_bytes = n * encode, n * decode, n * inv_ratio
            wire = wire_bytes / bandwidth
            if pipelined:
                send = enc + wire_bytes * transport
                recv = dec + wire_bytes * transport
                slowest = max(send, recv, wire)
                costs[arm] = max(slowest, (send + recv) / cores) + (send + wire + recv - slowest) * fill
            else:
                costs[arm] = enc + dec + wire
        return costs

    def _chain(self, arm: str, dtype: str, cls: int) -> tuple[_ArmStats, _ArmStats, _ArmStats]:
        """The stats of (arm, dtype, size class), (arm, dtype, any) and (arm, any, any), most specific first."""
        chain = self._chains.get((arm, dtype, cls))
        if chain is None:
            stats = self._stats
            chain = self._chains[(arm, dtype, cls)] = (
                stats.setdefault((arm, dtype, cls), _ArmStats()),
                stats.setdefault((arm, dtype, None), _ArmStats()),
                stats.setdefault((arm, None, None), _ArmStats()),
            )
        return chain

    def _estimates(self, arm: str, dtype: str, nbytes: int) -> tuple[float, float, float]:
        """(1/ratio, encode s/B, decode s/B), each from the most specific key that has data, else the prior."""
        chain = self._chain(arm, dtype, size_class(nbytes))
        inv_ratio = encode = decode = None
        for stats in chain:
            if inv_ratio is None and stats.inv_ratio.den > 0.0:
                inv_ratio = stats.inv_ratio.num / stats.inv_ratio.den
            if encode is None and stats.encode.den > 0.0:
                encode = stats.encode.num / stats.encode.den
            if decode is None and stats.decode.den > 0.0:
                decode = stats.decode.num / stats.decode.den
        if inv_ratio is None or encode is None or decode is None:
            prior = self.config.priors.get(arm, _PRIOR)
            inv_ratio = 1.0 / prior.ratio if inv_ratio is None else inv_ratio
            encode = 1e-9 / prior.encode_gbps if encode is None else encode
            decode = 1e-9 / prior.decode_gbps if decode is None else decode
        return inv_ratio, encode, decode

    def _evidence(self, arm: str, context: Context) -> float:
        stats = self._stats.get((arm, context.dtype, size_class(context.nbytes)))
        return stats.inv_ratio.den if stats is not None else 0.0

    # ---------------------------------------------------------------- learning

    def _keys(self, arm: str, context: Context, nbytes: int) -> tuple[_ArmStats, _ArmStats, _ArmStats]:
        name = self._names.get(arm)
        if name is None:
            name = get_codec(arm).name
        return self._chain(name, context.dtype, size_class(nbytes))

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
        encode_s = max(encode_s, 0.0)
        with self._lock:
            for stats in self._keys(arm, context, nbytes):
                stats.inv_ratio.update(float(encoded_bytes), float(nbytes), gamma)
                stats.encode.update(encode_s, float(nbytes), gamma)
                if decode_s is not None:
                    stats.decode.update(max(decode_s, 0.0), float(nbytes), gamma)
            self._tried.add((self._names.get(arm, arm), context.dtype))

    def observe_decode(self, arm: str, context: Context, nbytes: int, decode_s: float) -> None:
        if nbytes <= 0:
            return
        decode_s = max(decode_s, 0.0)
        with self._lock:
            for stats in self._keys(arm, context, nbytes):
                stats.decode.update(decode_s, float(nbytes), self.config.discount)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._bandwidth.observe(nbytes, seconds)

    @property
    def bandwidth_bps(self) -> float:
        with self._lock:
            return self._bandwidth.bps

    def measured_bandwidth_bps(self) -> float:
        """The bandwidth estimate once a transfer has measured it; 0 while it is the initial guess (a CPU-bound
        sample, which only raises the estimate, must not be dropped for falling below a guess)."""
        with self._lock:
            return self._bandwidth.bps if self._bandwidth.samples else 0.0

    # ---------------------------------------------------------------- reporting

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {
                "codec.bandwidth_bps": self._bandwidth.bps,
                "codec.bandwidth_samples": float(self._bandwidth.samples),
                "codec.explorations": float(self._explorations),
                "codec.cores": float(self.cores),
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
