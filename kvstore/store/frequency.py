"""The ``freq`` eviction policy: leaf-first LRU with reused blocks protected, counted by a shared frequency sketch.

``FrequencySketch`` (an aging count-min sketch keyed by the block hash, shared by all tiers of one store via
``shared_sketch(table)``) and ``FrequencyLeafLRU`` (the policy); the rationale and figures are in
kvstore/store/policies.py, which registers the policies by name. ``adaptive`` builds on both.
"""

from __future__ import annotations

import heapq
import weakref
from typing import Any

import numpy as np

from kvstore.store import policy_jit, sketch_jit
from kvstore.store.policy import BULK_MIN, COLD_PENALTY, LeafLRU

_M64 = (1 << 64) - 1
_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_NO_LOC = -1
_WALK = ("parent", "parent_gen", "gen", "flags")  # the index columns a walk to an ancestor reads


class FrequencySketch:
    """Approximate access counts in fixed memory, with aging.

    A count-min sketch: ``len(_MULTIPLIERS)`` rows of 8-bit counters indexed by
    multiply-shift hashes of a 64-bit fingerprint; an estimate is the minimum
    over the rows (never below the true count since the last halving). Updates
    are conservative (only the minimal counters grow), which keeps the
    overestimate small. Every ``halve_after x population`` additions all
    counters are halved, so popularity that stops being renewed fades. The
    width grows (and the counts restart) while it is under 8x the population.
    """

    def __init__(self, width_bits: int = 14, max_width_bits: int = 24, halve_after: float = 16.0):
        self.width_bits = width_bits
        self.max_width_bits = max_width_bits
        self.halve_after = halve_after
        self._rows = [bytearray(1 << width_bits) for _ in _MULTIPLIERS]
        self._added = 0
        self.halvings = 0
        self._views: tuple[list[bytearray], list[np.ndarray]] = (self._rows, self._row_arrays())
        self._owners: weakref.WeakSet[LeafLRU] = weakref.WeakSet()
        self._first: weakref.ref[LeafLRU] | None = None

    def attach(self, policy: LeafLRU) -> None:
        """Count ``policy``'s resident blocks in the population that sizes the sketch."""
        self._owners.add(policy)
        if self._first is None or self._first() is None:
            self._first = weakref.ref(policy)

    def reported_by(self, policy: LeafLRU) -> bool:
        """Whether ``policy`` reports the sketch's bytes (one policy per sketch does)."""
        return self._first is not None and self._first() is policy

    def _row_arrays(self) -> list[np.ndarray]:
        return [np.frombuffer(row, dtype=np.uint8) for row in self._rows]

    def views(self) -> list[np.ndarray]:
        """The rows as uint8 arrays sharing their memory (made again only after the rows were replaced)."""
        if self._views[0] is not self._rows:
            self._views = (self._rows, self._row_arrays())
        return self._views[1]

    def _slots(self, fp: int) -> list[int]:
        shift = 64 - self.width_bits
        return [((fp * m) & _M64) >> shift for m in _MULTIPLIERS]

    def estimate(self, fp: int) -> int:
        return min(row[i] for row, i in zip(self._rows, self._slots(fp)))

    def add(self, fp: int) -> int:
        """Count one access of ``fp``; returns the new estimate (after any aging this addition set off)."""
        slots = self._slots(fp)
        counts = [row[i] for row, i in zip(self._rows, slots)]
        low = min(counts)
        if low < 255:
            for row, i, c in zip(self._rows, slots, counts):
                if c == low:
                    row[i] = low + 1
        self._added += 1
        if self._added & 1023 == 0 and self._maintain():
            return self.estimate(fp)
        return min(low + 1, 255)

    def _slots_many(self, fps: np.ndarray) -> list[np.ndarray]:
        shift = np.uint64(64 - self.width_bits)
        with np.errstate(over="ignore"):
            return [(fps * np.uint64(m)) >> shift for m in _MULTIPLIERS]

    def estimate_many(self, fps: np.ndarray) -> np.ndarray:
        """``estimate`` of each fingerprint (uint64 array), as an int64 array."""
        out = np.full(len(fps), 255, dtype=np.int64)
        for row, s in zip(self._rows, self._slots_many(fps)):
            np.minimum(out, np.frombuffer(row, dtype=np.uint8)[s], out=out)
        return out

    def add_many(self, fps: np.ndarray) -> None:
        """``add`` of each fingerprint (uint64 array), in one vectorized pass: the counters of a fingerprint
        added ``k`` times are raised to at least its minimum (read before the batch) + ``k``, which is what
        adding them one by one does unless fingerprints of the batch share a counter. Aging (widening or
        halving) is checked once, before the batch, when the batch crosses a check point of ``add``."""
        n = len(fps)
        if n == 0:
            return
        if (self._added + n) >> 10 != self._added >> 10:
            self._maintain()
        self._added += n
        fps, times = np.unique(fps, return_counts=True)
        rows = [np.frombuffer(row, dtype=np.uint8) for row in self._rows]
        slots = self._slots_many(fps)
        low = np.minimum.reduce([row[s] for row, s in zip(rows, slots)]).astype(np.int64)
        new = np.minimum(low + times, 255).astype(np.uint8)
        for row, s in zip(rows, slots):
            np.maximum.at(row, s, new)

    def count_many(self, fps: np.ndarray, counted: np.ndarray) -> list[int]:
        """For each fingerprint of ``fps`` (uint64) in order: ``add`` where ``counted`` is true, else
        ``estimate``; the counts, exactly as those calls one by one give them (one compiled call when numba is
        there: kvstore/store/sketch_jit.py)."""
        if not sketch_jit.AVAILABLE:
            return [self.add(fp) if c else self.estimate(fp) for fp, c in zip(fps.tolist(), counted.tolist())]
        fps = np.ascontiguousarray(fps, dtype=np.uint64)
        counted = np.ascontiguousarray(counted, dtype=np.bool_)
        out = np.zeros(len(fps), dtype=np.int64)
        start = 0
        while start < len(fps):
            rows = self.views()
            done = sketch_jit.count(*rows, 64 - self.width_bits, fps[start:], counted[start:], self._added, out[start:])
            adds = int(np.count_nonzero(counted[start : start + done]))
            self._added += adds
            start += done
            if adds and self._added & 1023 == 0 and self._maintain():
                out[start - 1] = self.estimate(int(fps[start - 1]))
        return out.tolist()

    def population(self) -> int:
        return max(sum(len(p) for p in self._owners), 1024)

    def _maintain(self) -> bool:
        """Widen (restarting the counts) or halve every counter when due; True when it did either."""
        population = self.population()
        if (1 << self.width_bits) < 8 * population and self.width_bits < self.max_width_bits:
            while (1 << self.width_bits) < 8 * population and self.width_bits < self.max_width_bits:
                self.width_bits += 1
            self._rows = [bytearray(1 << self.width_bits) for _ in _MULTIPLIERS]
            self._added = 0
            return True
        if self._added >= self.halve_after * population:
            for row in self._rows:
                counters = np.frombuffer(row, dtype=np.uint8)
                counters >>= 1
            self._added = 0
            self.halvings += 1
            return True
        return False

    def nbytes(self) -> int:
        return sum(len(row) for row in self._rows)


_SHARED: weakref.WeakKeyDictionary[Any, FrequencySketch] = weakref.WeakKeyDictionary()


def shared_sketch(table: Any) -> FrequencySketch:
    """The one sketch of the store that owns ``table`` (created on first use)."""
    sketch = _SHARED.get(table)
    if sketch is None:
        sketch = _SHARED[table] = FrequencySketch()
    return sketch


class FrequencyLeafLRU(LeafLRU):
    """Leaf-first LRU where blocks seen ``reuse_threshold`` times are protected for ``protect`` turnovers."""

    name = "freq"
    counts_uses = True

    def __init__(self, *, protect: float = 4.0, reuse_threshold: int = 2, sketch: FrequencySketch | None = None):
        super().__init__()
        if protect < 0 or reuse_threshold < 1:
            raise ValueError("protect must be >= 0 and reuse_threshold >= 1")
        self.protect = protect
        self.reuse_threshold = reuse_threshold
        self.sketch = sketch if sketch is not None else FrequencySketch()
        self.sketch.attach(self)
        self._upper: tuple[int, ...] = ()  # ranks above this tier's
        self._fused: tuple[Any, tuple[Any, ...] | None] = (None, None)  # (table, _fused_columns() of it)
        self._buffers = policy_jit.TouchBuffers(64)
        self._others: tuple[int, ...] = ()  # every other rank

    def bind(self, table: Any, rank: int) -> None:
        super().bind(table, rank)
        self.sketch = shared_sketch(table)
        self.sketch.attach(self)
        ranks = range(1, table.loc.shape[1])
        self._upper = tuple(r for r in ranks if r < rank)
        self._others = tuple(r for r in ranks if r != rank)
        self._fused = (None, None)

    # -- the hook ----------------------------------------------------------------
    def priority(self, e: int, count: int | None = None) -> float:
        """The LRU clock, pushed ahead when the block's use count (``count``, or the sketch's) is high."""
        clock = super().priority(e)
        if count is None:
            count = self.sketch.estimate(self._fingerprint(e))
        if count >= self.reuse_threshold:
            clock += self.protect * max(len(self._prio), 64)
        return clock

    # -- verbs: count each access once, then order as the base does -----------------
    def insert(self, e: int, is_leaf: bool = True, cold: bool = False) -> None:
        if e in self._prio:  # a victim put back while its copy is written below: keep its rank
            if is_leaf:
                self._leaf.add(e)
                self._push(e)
            return
        fp = self._fingerprint(e)
        if self._sole_copy(e):  # a new block (or one recovered), not a copy moving between tiers
            self.sketch.add(fp)
        super().insert(e, is_leaf, cold)

    def _count_new(self, ids: np.ndarray) -> np.ndarray:
        """A batch of new copies counted in the sketch (once: a block another tier holds was counted there)
        and the use count of each after it."""
        assert self.table is not None
        fps = np.asarray(self.table.fp[ids], dtype=np.uint64)
        sole = np.ones(len(fps), dtype=np.bool_)
        for r in self._others:
            sole &= self.table.locs(ids, r) == _NO_LOC
        self.sketch.add_many(fps[sole])
        return np.asarray(self.sketch.estimate_many(fps))

    def insert_many(self, ids: np.ndarray, is_leaf: np.ndarray, cold: np.ndarray) -> None:
        """``insert`` of each new entry in order, vectorized (the sketch counts the batch with ``add_many``)."""
        ids_l = ids.tolist()
        if (
            len(ids_l) < BULK_MIN
            or type(self).insert is not FrequencyLeafLRU.insert
            or type(self).priority is not FrequencyLeafLRU.priority
            or self.table is None
            or any(map(self._prio.__contains__, ids_l))
        ):
            self._insert_each(ids_l, is_leaf, cold)
            return
        n = len(ids_l)
        counts = self._count_new(ids)
        # what priority() gives the i-th of them: its clock, plus protect x (entries already held, >= 64)
        prio = np.arange(self._clock + 1, self._clock + n + 1, dtype=np.float64)
        self._clock += n
        held = np.maximum(np.arange(len(self._prio), len(self._prio) + n), 64)
        prio = np.where(counts >= self.reuse_threshold, prio + self.protect * held, prio)
        self._add_new(ids, ids_l, prio - np.where(cold, COLD_PENALTY, 0.0), is_leaf)

    def touch(self, e: int) -> None:
        # the base's touch with the count computed once: counted here only when no tier above holds it
        if e not in self._prio:
            return
        fp = self._fingerprint(e)
        count = self.sketch.add(fp) if self._top_copy(e) else self.sketch.estimate(fp)
        self._prio[e] = self.priority(e, count)
        if e in self._leaf:
            self._push(e)

    def touch_many(self, ids: Any) -> None:
        """``touch`` of each entry of ``ids`` in order, with one vectorized pass over the sketch."""
        if type(self).touch is not FrequencyLeafLRU.touch or type(self).priority is not FrequencyLeafLRU.priority:
            super().touch_many(ids)
            return
        prio = self._prio
        present = ids if all(map(prio.__contains__, ids)) else [e for e in ids if e in prio]
        if not present:
            return
        # what priority() gives each in turn: its clock, plus the bonus where it was used often enough
        bonus, threshold, clock = self.protect * max(len(prio), 64), self.reuse_threshold, self._clock
        fused = self._touch_fused(present, bonus)
        if fused is None:
            _, counts = self._touch_counts(present)
            clocks = map(float, range(clock + 1, clock + 1 + len(present)))
            new = [c + bonus if k >= threshold else c for c, k in zip(clocks, counts)]
        else:
            new = fused.prio[: len(present)].tolist()
        prio.update(zip(present, new))
        self._clock = clock + len(present)
        heap = self._heap
        for e in self._leaf.intersection(present):  # its last row: an earlier one of a repeat would be stale
            heapq.heappush(heap, (prio[e], e))
        self._trim_heap()

    def _touch_counts(self, present: list[int]) -> tuple[np.ndarray, list[int]]:
        """Fingerprints of held entries being touched, in order, and each one's use count after its touch (a
        touch counts only where no tier above holds the block: ``touch`` one by one gives the same)."""
        if self.table is None:
            fps = np.asarray(present, dtype=np.uint64)
            counted = np.ones(len(present), dtype=bool)
        else:
            arr = np.asarray(present, dtype=np.int64)
            fps = np.asarray(self.table.fp[arr], dtype=np.uint64)
            counted = np.ones(len(present), dtype=bool)
            if self._upper:
                locs = self.table.loc[arr]
                for r in self._upper:
                    counted &= locs[:, r] == _NO_LOC
        return fps, self.sketch.count_many(fps, counted)

    def _fused_columns(self) -> tuple[Any, ...] | None:
        """How many ranks are above and the index columns ``policy_jit.touch`` reads (key, ns, the location
        columns of the ranks above, then parent, parent_gen, gen, flags); None where it does not apply (no
        numba, no index, a policy with its own fingerprints or more than two ranks above)."""
        t = self.table
        if "_fingerprint" in self.__dict__:
            return None
        if self._fused[0] is t:
            return self._fused[1]
        cols: tuple[Any, ...] | None = None
        if (
            policy_jit.AVAILABLE
            and t is not None
            and hasattr(t, "column")
            and type(self)._fingerprint is FrequencyLeafLRU._fingerprint
            and type(self.sketch) is FrequencySketch
        ):
            ups = []
            for r in self._upper:
                try:
                    ups.append(t.column_of_loc(r))
                except KeyError:  # no such tier: no copy there
                    continue
            if len(ups) <= 2:
                absent = [policy_jit.NO_UPPER] * (2 - len(ups))
                cols = (len(ups), (t.column("key"), t.column("ns"), *ups, *absent, *map(t.column, _WALK)))
        self._fused = (t, cols)
        return cols

    def _touch_fused(self, present: list[int], bonus: float, sample: int = 0, steps: int = 0, cap: int = 0,
                     queue: policy_jit.ShadowQueue = policy_jit.NO_QUEUE) -> policy_jit.TouchBuffers | None:  # fmt: skip
        """``policy_jit.touch`` of the held entries being touched (the sketch aged where due, as ``count_many``
        does it; the sampled ones queued for the shadows when ``sample``): the buffers it filled (fingerprints,
        counts, and the priority and class each gets with ``bonus``); None where ``_fused_columns`` is."""
        cols = self._fused_columns()
        if cols is None:
            return None
        n, sk, threshold, clock, buf = len(present), self.sketch, self.reuse_threshold, self._clock, self._buffers
        if n > buf.rows:
            buf = self._buffers = policy_jit.TouchBuffers(2 * n)
        if sample:
            queue.reserve(n)
        arr, nup, columns = np.array(present, dtype=np.int64), cols[0], [c.base for c in cols[1]]
        start, m = 0, -1
        while m < 0:
            before = sk._added
            start, sk._added, m = policy_jit.touch(columns, nup, sk.views(), 64 - sk.width_bits, arr, start, before,
                                                   clock, bonus, threshold, sample, steps, cap, buf, queue)  # fmt: skip
            if sk._added != before and sk._added & 1023 == 0 and sk._maintain():
                j = start - 1  # the count that set off the aging, read after it
                buf.counts[j] = count = sk.estimate(int(buf.fps[j]))
                reused = count >= threshold
                buf.prio[j] = float(clock + j + 1) + bonus if reused else float(clock + j + 1)
                buf.cls[j] = 2 if reused else 1
        queue.n = m
        return buf

    def uses(self, e: int) -> int:
        return self.sketch.estimate(self._fingerprint(e))

    def nbytes(self) -> int:
        return super().nbytes() + (self.sketch.nbytes() if self.sketch.reported_by(self) else 0)

    # -- context from the index -------------------------------------------------------
    def _fingerprint(self, e: int) -> int:
        return e if self.table is None else int(self.table.fp[e])

    def _sole_copy(self, e: int) -> bool:
        return all(self.table.loc[e, r] == _NO_LOC for r in self._others)

    def _top_copy(self, e: int) -> bool:
        return all(self.table.loc[e, r] == _NO_LOC for r in self._upper)
