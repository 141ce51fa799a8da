"""Load or recompute: per request, how much of the cached prefix to fetch, and what to compute meanwhile.

A request of ``n`` prompt tokens whose first ``N`` blocks are cached (Lookup
gives each one's tier) runs a **plan** ``(m, k)``, ``0 <= m <= k <= N``:

    compute blocks [0, m) locally      while      loading blocks [m, k) from the store
    then compute tokens [k * block_size, n)       (the tail; it reads all earlier KV)

    predicted TTFT = elapsed + max(compute(0, m*B), load(m, k)) + compute(k*B, n)

``m = k = 0`` recomputes everything; ``m = 0, k = N`` loads the whole cached
prefix; ``m = 0 < k < N`` loads a part of it; ``m > 0`` overlaps: the store
sends later blocks while the CPU computes the earliest ones, which are the
cheapest to compute (attention grows with position, ``costs.ComputeCosts``).
With a uniform load cost per block and no overlap the best ``k`` is 0 or
``N`` (TTFT is concave in ``k``); a partial ``k`` wins when later blocks cost
more to load (an NVMe tail behind a DRAM head), overlap wins when the link
and the CPU are of comparable speed. ``overlap=False`` keeps ``m = 0`` (an
engine that can only load a leading prefix, such as vLLM's connector).

Verbs and promises (thread-safe):

- ``plan(tiers, prompt_tokens, *, block_size, block_bytes, lane, policy="decide", overlap=None, elapsed_s=0,
  computed_tokens=0) -> Plan``: ``tiers`` are the tiers of the cached blocks
  the caller may use (Lookup's), starting at block ``computed_tokens //
  block_size`` (``computed_tokens``: KV the engine already holds, for
  example from its own prefix cache; block indices in the plan count from
  there); it is clipped so at least one prompt token is left to compute.
  ``policy`` "decide" minimises the predicted TTFT; "load" and "recompute"
  are the fixed modes (still predicted, for comparison). Every plan carries
  its predicted TTFT and those of both fixed modes. Side-effect free except
  for the choice counters and the probe schedule: when a lane has had no
  load observed for ``probe_every`` plans, a plan that would load nothing
  loads its last ``probe_blocks`` cached blocks while it computes the rest
  (choice "probe"), so a link that became fast again is noticed.
- ``observe(plan, outcome)``: what actually happened; updates the cost
  models (a load that failed teaches nothing about speed), the
  predicted-vs-actual record and the partial-load counters.
- ``seed(server_counters, codec_snapshot, lane)``: priors from Stats and the codec controller.
- ``observe_compute(start, end, seconds, calls)``: a computation outside any plan.
- ``snapshot() -> {name: float}``: counters and estimates (``loadplan.*``).
- ``history()``: the last ``history_len`` (choice, predicted_s, actual_s).
"""

from __future__ import annotations

import math
import threading
from collections import Counter, defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.loadplan.costs import TIERS, ComputeCosts, LoadCosts

POLICIES = ("decide", "load", "recompute")
CHOICES = ("load", "recompute", "partial", "overlap", "probe")


@dataclass
class PlannerConfig:
    overlap: bool = True  # may compute early blocks while later ones load
    probe_every: int = 16  # plans on a lane without a load observed before a probe
    probe_blocks: int = 2
    piece_seconds: float = 0.05  # a load is split into Gets of about this many (predicted) seconds ...
    min_piece_blocks: int = 8  # ... of at least this many blocks ...
    max_pieces: int = 16  # ... and at most this many pieces
    piece_blocks: int = 0  # > 0: fixed piece size (tests)
    history_len: int = 256
    margin: float = 0.03  # a partial or overlapped plan must be predicted this much (relative) ...
    margin_s: float = 0.005  # ... and this many seconds faster than the better fixed mode


@dataclass(frozen=True)
class Plan:
    policy: str
    choice: str  # one of CHOICES
    lane: str
    prompt_tokens: int
    block_size: int
    block_bytes: int
    tiers: tuple[str, ...]  # of the cached blocks the plan could use, from block computed_tokens // block_size
    computed_tokens: int  # leading tokens whose KV the engine already holds (its own prefix cache): not planned
    compute_first: int  # m: blocks computed locally while [m, load_until) loads
    load_until: int  # k
    piece_blocks: int  # blocks per Get of the load
    predicted_s: float
    predicted_load_s: float
    predicted_head_s: float
    predicted_tail_s: float
    predicted_fixed: dict[str, float] = field(default_factory=dict)  # "load" / "recompute" -> seconds

    @property
    def cached(self) -> int:
        return len(self.tiers)

    @property
    def load_blocks(self) -> int:
        return self.load_until - self.compute_first

    @property
    def tokens_to_load(self) -> int:
        """Tokens after ``computed_tokens`` whose KV comes from the store, when ``compute_first`` is 0 (the cap an
        engine that can only load a leading prefix, such as vLLM's connector, applies)."""
        return self.load_until * self.block_size if self.compute_first == 0 else 0


@dataclass
class Outcome:
    """What a plan's execution measured; times in seconds."""

    loaded: int  # leading blocks of [m, k) that arrived intact (bytes and CRC) and were used
    load_s: float = 0.0
    load_calls: int = 0
    load_failed: str = ""  # why blocks after ``loaded`` were not used ("" when all arrived)
    head_s: float = 0.0
    tail_start: int = 0  # first token computed after the load
    tail_s: float = 0.0
    tail_calls: int = 1
    ttft_s: float = 0.0  # arrival to first token
    lane: str = ""  # the lane the load used, when known after it ("" : the plan's); a client opens its lane lazily


class Planner:
    def __init__(
        self,
        config: PlannerConfig | None = None,
        *,
        compute: ComputeCosts | None = None,
        loads: LoadCosts | None = None,
    ):
        self.config = config or PlannerConfig()
        self.compute = compute or ComputeCosts()
        self.loads = loads or LoadCosts()
        self._lock = threading.Lock()
        self._choices: Counter[str] = Counter()
        self._policies: Counter[str] = Counter()
        self._since_load: Counter[str] = Counter()  # per lane: plans since a load was observed
        self._history: deque[tuple[str, float, float]] = deque(maxlen=self.config.history_len)
        self._totals: defaultdict[str, float] = defaultdict(float)

    # ------------------------------------------------------------------ planning
    def plan(
        self,
        tiers: Sequence[str],
        prompt_tokens: int,
        *,
        block_size: int,
        block_bytes: int,
        lane: str,
        policy: str = "decide",
        overlap: bool | None = None,
        elapsed_s: float = 0.0,
        computed_tokens: int = 0,
    ) -> Plan:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        if computed_tokens % block_size or computed_tokens < 0:
            raise ValueError(f"computed_tokens ({computed_tokens}) must be a multiple of the block size")
        n_cached = min(len(tiers), max(prompt_tokens - 1 - computed_tokens, 0) // block_size)
        tiers = tuple(tiers[:n_cached])
        allow_overlap = self.config.overlap if overlap is None else overlap
        with self._lock:
            costs = self._costs(tiers, prompt_tokens, block_size, block_bytes, lane, computed_tokens)
            fixed = {"load": costs.total(0, n_cached) + elapsed_s, "recompute": costs.total(0, 0) + elapsed_s}
            if policy == "load":
                m, k = 0, n_cached
            elif policy == "recompute":
                m, k = 0, 0
            else:
                m, k = costs.best(allow_overlap, self.config.margin, self.config.margin_s)
            choice = _choice(m, k, n_cached)
            if policy == "decide" and k == m and n_cached > 0 and self._since_load[lane] >= self.config.probe_every:
                probe = max(min(self.config.probe_blocks, n_cached), 1)
                m, k = (n_cached - probe, n_cached) if allow_overlap else (0, probe)
                choice = "probe"
            self._since_load[lane] += 1
            self._choices[choice] += 1
            self._policies[policy] += 1
            pred_load = costs.load(m, k)
            return Plan(
                policy=policy,
                choice=choice,
                lane=lane,
                prompt_tokens=prompt_tokens,
                block_size=block_size,
                block_bytes=block_bytes,
                tiers=tiers,
                computed_tokens=computed_tokens,
                compute_first=m,
                load_until=k,
                piece_blocks=self._piece_blocks(k - m, pred_load),
                predicted_s=costs.total(m, k) + elapsed_s,
                predicted_load_s=pred_load,
                predicted_head_s=float(costs.head[m]) if k > m else 0.0,
                predicted_tail_s=float(costs.tail[k]),
                predicted_fixed=fixed,
            )

    def _costs(self, tiers: tuple[str, ...], n: int, bs: int, block_bytes: int, lane: str, first: int) -> _Costs:
        starts = first + np.arange(len(tiers) + 1) * bs
        per_byte = self.loads.per_byte(lane)
        block_s = np.array([per_byte.get(t, per_byte["dram"]) * block_bytes for t in tiers], dtype=float)
        return _Costs(
            head=self.compute.predict(first, starts),
            tail=self.compute.predict(starts, n),
            prefix=np.concatenate([[0.0], np.cumsum(block_s)]),
            call_s=self.loads.call_s(lane),
        )

    def _piece_blocks(self, blocks: int, predicted_load_s: float) -> int:
        cfg = self.config
        if blocks <= 0:
            return 0
        if cfg.piece_blocks > 0:
            return min(cfg.piece_blocks, blocks)
        pieces = min(max(math.ceil(predicted_load_s / cfg.piece_seconds), 1), cfg.max_pieces)
        return min(max(math.ceil(blocks / pieces), cfg.min_piece_blocks), blocks)

    # ------------------------------------------------------------------ learning
    def observe(self, plan: Plan, outcome: Outcome) -> None:
        m, k, bs, n = plan.compute_first, plan.load_until, plan.block_size, plan.prompt_tokens
        with self._lock:
            t = self._totals
            t["requests"] += 1
            if k > m:
                if outcome.load_failed:
                    t["failed_loads"] += 1
                    t["blocks_discarded"] += k - m - outcome.loaded
                    if outcome.loaded > 0:
                        t["partial_loads"] += 1
                        t["partial_blocks_used"] += outcome.loaded
                elif outcome.load_s > 0:
                    tier_bytes = [0.0] * len(TIERS)
                    for tier in plan.tiers[m:k]:
                        tier_bytes[TIERS.index(tier) if tier in TIERS else 1] += plan.block_bytes
                    lane = outcome.lane or plan.lane
                    self.loads.observe(lane, tier_bytes, max(outcome.load_calls, 1), outcome.load_s)
                    self._since_load[lane] = 0
                t["blocks_loaded"] += outcome.loaded
            if m > 0 and outcome.head_s > 0:
                self.compute.observe(plan.computed_tokens, plan.computed_tokens + m * bs, outcome.head_s)
            if outcome.tail_s > 0:
                self.compute.observe(outcome.tail_start, n, outcome.tail_s, outcome.tail_calls)
            if outcome.ttft_s > 0 and not outcome.load_failed:
                self._history.append((plan.choice, plan.predicted_s, outcome.ttft_s))
                t["predicted_s_sum"] += plan.predicted_s
                t["actual_s_sum"] += outcome.ttft_s
                t["abs_error_s_sum"] += abs(plan.predicted_s - outcome.ttft_s)
                t["compared"] += 1

    def seed(self, server_counters: Mapping[str, float], codec_snapshot: Mapping[str, float], lane: str) -> None:
        """Priors from a server's Stats counters (NVMe read speed) and a client's ``codec_stats()``
        (link bandwidth, once measured); observations still outweigh them."""
        with self._lock:
            self.loads.use_server_stats(server_counters)
            if codec_snapshot.get("codec.bandwidth_samples", 0.0) > 0:
                self.loads.use_link_bandwidth(lane, codec_snapshot.get("codec.bandwidth_bps", 0.0))

    def observe_compute(self, start: int, end: int, seconds: float, calls: int = 1) -> None:
        """A computation outside any plan (no store, a failed Lookup): the compute model still learns."""
        with self._lock:
            self.compute.observe(start, end, seconds, calls)

    def count_lookup_failure(self) -> None:
        with self._lock:
            self._totals["lookup_failures"] += 1

    # ------------------------------------------------------------------ reporting
    def history(self) -> list[tuple[str, float, float]]:
        with self._lock:
            return list(self._history)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out = {f"loadplan.{k}": float(v) for k, v in self._totals.items()}
            for c in CHOICES:
                out[f"loadplan.choices.{c}"] = float(self._choices[c])
            for p in POLICIES:
                out[f"loadplan.policy.{p}"] = float(self._policies[p])
            out.update({f"loadplan.{k}": v for k, v in self.compute.snapshot().items()})
            out.update({f"loadplan.{k}": v for k, v in self.loads.snapshot().items()})
            return out


@dataclass
class _Costs:
    """Predicted parts of every plan of one request: head[m], tail[k], and load(m, k) from prefix sums."""

    head: np.ndarray  # compute of tokens [0, m * B), m = 0..N
    tail: np.ndarray  # compute of tokens [k * B, n), k = 0..N
    prefix: np.ndarray  # load seconds of blocks [0, i), without the per-call cost
    call_s: float

    def load(self, m: int, k: int) -> float:
        return float(self.prefix[k] - self.prefix[m] + self.call_s) if k > m else 0.0

    def total(self, m: int, k: int) -> float:
        if k <= m:
            return float(self.tail[0])
        return max(float(self.head[m]) if m else 0.0, self.load(m, k)) + float(self.tail[k])

    def best(self, overlap: bool, margin: float, margin_s: float) -> tuple[int, int]:
        """The (m, k) of least predicted TTFT. A plan other than the two fixed ones (load all, recompute)
        must beat both by ``margin`` (relative) and ``margin_s``: predictions are noisy, and a partial or
        overlapped plan has more parts that can slow each other down."""
        count = len(self.prefix) - 1
        plain = {(0, 0): float(self.tail[0])}
        if count:
            plain[(0, count)] = self.total(0, count)
        best_plain = min(plain, key=plain.__getitem__)
        if count < 1:
            return best_plain
        ks = np.arange(1, count + 1)
        times = [self.prefix[ks] + self.call_s + self.tail[ks]]  # serial: m = 0
        ms = [np.zeros_like(ks)]
        if overlap and count >= 2:
            # max(head[m], load(m, k)) is least where the rising head meets the falling load: head[m] + prefix[m]
            # rises with m, so the crossing for each k is one binary search.
            cross = np.searchsorted(self.head + self.prefix, self.prefix[ks] + self.call_s)
            for lo in (cross - 1, cross):
                m = np.clip(lo, 1, np.maximum(ks - 1, 1))
                t = np.maximum(self.head[m], self.prefix[ks] - self.prefix[m] + self.call_s) + self.tail[ks]
                times.append(np.where(ks >= 2, t, np.inf))
                ms.append(m)
        grid = np.stack(times)
        row, col = np.unravel_index(int(np.argmin(grid)), grid.shape)
        t, m, k = float(grid[row, col]), int(ms[row][col]), int(ks[col])
        limit = plain[best_plain] * (1.0 - margin) - margin_s
        if (m, k) not in plain and t > limit:
            return best_plain
        return (m, k) if t < plain[best_plain] else best_plain


def _choice(m: int, k: int, cached: int) -> str:
    if k == m:
        return "recompute"
    if m > 0:
        return "overlap"
    return "load" if k == cached else "partial"
