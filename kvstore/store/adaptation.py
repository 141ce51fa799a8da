"""The adaptation of ``adaptive`` (kvstore/store/adaptive.py, part 4 of its doc): shadow caches choose P.

``ShadowDueling`` is the part of ``AdaptiveLeafPolicy`` that replays accesses into the shadows (one per rung
of ``ladder``: ``Shadow`` objects, kvstore/store/shadows.py, or the compiled bank, kvstore/store/shadow_jit.py)
and picks the P whose shadow scores best on a lead that noise does not explain. Verbs (for the policy):
``_shadow`` (one access), ``_shadow_batch`` / ``_shadow_many`` (a batch, in order), ``_coarsen`` (sample
the shadows more coarsely as the tier grows), ``_replay`` (accesses into every shadow, P re-chosen after
each 64th: ``_choose``); ``touch_many`` queues its sampled accesses (``_queue``) and replays them once P
could change, and ``_flush`` replays them before anything reads the shadows (``_shadows``, ``_disagree``,
``_accesses``) or adds to them, so every decision is the one replaying them at once gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.store import policy_jit, shadow_jit
from kvstore.store.frequency import FrequencyLeafLRU, FrequencySketch
from kvstore.store.shadows import PyShadows

FREQ_PROTECT = 4.0  # FrequencyLeafLRU's default protection, in turnovers
ANCESTOR_STEPS = 8  # how far (x the sample) a sampled block's shadow parent is looked for


class ShadowDueling(FrequencyLeafLRU):
    """A frequency policy whose reused offset P is chosen by shadow caches (the base of ``adaptive``)."""

    def __init__(self, *, ladder: Sequence[float], reuse_threshold: int, window: float, margin: float,
                 confidence: float, max_shadow: int, sketch: FrequencySketch | None, jit: bool):  # fmt: skip
        super().__init__(protect=0.0, reuse_threshold=reuse_threshold, sketch=sketch)
        self.ladder = tuple(float(p) for p in ladder)
        self.window = window
        self.margin = margin
        self.confidence = confidence
        self.max_shadow = max_shadow
        # start where freq is (what worked before), until the shadows have seen a window of accesses
        self.P = min(self.ladder, key=lambda p: abs(p - FREQ_PROTECT))
        self.switches = 0
        self._sample = 1  # shadows see fingerprints with fp % _sample == 0
        self._jit = jit and shadow_jit.AVAILABLE  # the shadows in one compiled call per batch, not per rung
        self._bank: Any = self._new_bank()
        self._replayed = 0  # shadow accesses replayed
        self._queue = policy_jit.ShadowQueue()  # and those waiting (touch_many's, until P could change)
        self.parent_of: Callable[[int], int | None] = lambda e: None  # the parent entry (from the index once bound)
        self._walks: tuple[Any, Any, bool] = (None, None, False)  # (table, parent_of, _walks_index() of them)

    def bind(self, table: Any, rank: int) -> None:
        super().bind(table, rank)
        self.parent_of = table.parent_of

    @property
    def _shadows(self) -> list[Any]:
        """One shadow per rung of the ladder (``Shadow``, or a view of the compiled bank's arrays)."""
        self._flush()
        return self._bank.rungs

    @property
    def _disagree(self) -> Any:
        """[i][j]: accesses (decayed like the scores) that shadow i hit and j missed or the reverse."""
        self._flush()
        return self._bank.disagree

    @_disagree.setter
    def _disagree(self, value: Any) -> None:
        self._flush()
        if isinstance(self._bank.disagree, np.ndarray):
            self._bank.disagree[:] = np.asarray(value, dtype=np.float64)
        else:
            self._bank.disagree = [list(row) for row in value]

    @property
    def _accesses(self) -> int:
        """Accesses the shadows saw."""
        self._flush()
        return self._replayed

    def _new_bank(self) -> Any:
        if self._jit:
            return shadow_jit.JitShadows(self.ladder, self.reuse_threshold, self.max_shadow)
        return PyShadows(self.ladder, self.reuse_threshold)

    # -- the adaptation ------------------------------------------------------------------------
    def _shadow(self, e: int, fp: int, count: int, resident: int | None = None) -> None:
        """One access into the shadows, with ``resident`` blocks in the tier (default: those held now)."""
        resident = len(self._prio) if resident is None else resident
        self._coarsen(resident)
        if fp % self._sample:
            return
        parent = self._sampled_ancestor(e)
        self._replay(
            np.array([fp], dtype=np.uint64),
            np.array([0 if parent is None else parent], dtype=np.uint64),
            np.array([parent is not None]),
            np.array([count], dtype=np.int64),
            np.array([max(resident // self._sample, 1)], dtype=np.int64),
        )

    def _coarsen(self, resident: int) -> None:
        """Sample the shadows more coarsely while ``resident`` is over ``max_shadow`` x the sample."""
        if resident > self.max_shadow * self._sample:
            while resident > self.max_shadow * self._sample:
                self._sample *= 2
            # restart, sampled; the scores carry on (halved: fewer accesses count from now on)
            old, disagree = [s.score for s in self._shadows], [[d / 2 for d in row] for row in self._disagree]
            self._bank = self._new_bank()
            for s, score in zip(self._shadows, old):
                s.score = score / 2
            self._disagree = disagree

    def _shadow_batch(self, ids: np.ndarray, fps: np.ndarray, counts: np.ndarray, residents: np.ndarray) -> None:
        """``_shadow`` of sampled entries in order, the i-th with ``residents[i]`` blocks in the tier (none
        of them above the sample's limit)."""
        if len(ids):
            parents, has = self._sampled_ancestors(ids)
            self._replay(fps, parents, has, counts, np.maximum(residents // self._sample, 1))

    def _replay(self, fps: np.ndarray, parents: np.ndarray, has: np.ndarray, counts: np.ndarray,
                caps: np.ndarray) -> None:  # fmt: skip
        """Sampled accesses into every shadow (after the queued ones), P re-chosen after each 64th (at that
        access's capacity)."""
        self._flush()
        i, n = 0, len(fps)
        while i < n:
            done = self._bank.run(fps[i:], parents[i:], has[i:], counts[i:], caps[i:], self._replayed)
            i += done
            self._replayed += done
            if self._replayed % 64 == 0:
                self._choose(int(caps[i - 1]))

    def _flush(self) -> None:
        """The queued shadow accesses replayed (``_replay`` of them; they are in the compiled bank's types)."""
        queue = self._queue
        if not queue.n:
            return
        cap_max, bank = queue.cap_max, self._bank
        fps, parents, has, counts, caps = queue.take()
        i, n = 0, len(fps)
        while i < n:
            done = bank.run_typed(fps[i:], parents[i:], has[i:], counts[i:], caps[i:], cap_max, self._replayed)
            i += done
            self._replayed += done
            if self._replayed % 64 == 0:
                self._choose(int(caps[i - 1]))

    def _sampled_ancestors(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_sampled_ancestor`` of each entry: fingerprints (uint64) and whether each has one; one compiled
        walk over the index's columns when the policy reads its parents and fingerprints from the index."""
        out, has = np.zeros(len(ids), dtype=np.uint64), np.zeros(len(ids), dtype=np.bool_)
        t = self.table
        if self._walks_index():
            c = t.column
            shadow_jit.ancestors(
                c("parent").base, c("parent_gen").base, c("gen").base, c("flags").base, c("key").base,
                c("ns").base, np.ascontiguousarray(ids, dtype=np.int64), self._sample,
                ANCESTOR_STEPS * self._sample, out, has,
            )  # fmt: skip
            return out, has
        for i, e in enumerate(ids.tolist()):
            fp = self._sampled_ancestor(e)
            if fp is not None:
                out[i], has[i] = fp, True
        return out, has

    def _walks_index(self) -> bool:
        """Whether the ancestors are walked in the index's columns, compiled (else ``_sampled_ancestor``)."""
        t, parent_of, seen = self.table, self.parent_of, self._walks
        if seen[0] is t and seen[1] is parent_of and "_fingerprint" not in self.__dict__:
            return seen[2]
        walks = bool(
            self._jit
            and t is not None
            and hasattr(t, "column")
            and parent_of == t.parent_of
            and "_fingerprint" not in self.__dict__
            and type(self)._fingerprint is FrequencyLeafLRU._fingerprint
        )
        self._walks = (t, parent_of, walks)
        return walks

    def _sampled_ancestor(self, e: int) -> int | None:
        """The fingerprint of e's nearest sampled ancestor: a shadow's parent link, so that a sampled shadow
        keeps the prefix tree (contracted to the sampled blocks) with its leaf and prefix rules. None: a root,
        or none within ``ANCESTOR_STEPS`` x the sample (the walk costs about one step per access)."""
        p = self.parent_of(e)
        for _ in range(ANCESTOR_STEPS * self._sample):
            if p is None:
                return None
            fp = self._fingerprint(p)
            if fp % self._sample == 0:
                return fp
            p = self.parent_of(p)
        return None

    def _shadow_many(self, ids: list[int], fps: np.ndarray, counts: np.ndarray, base: int) -> None:
        """``_shadow`` of the i-th entry of a batch with ``base + i + 1`` residents, for every i in order:
        only the sampled entries (and the one at which the sample coarsens) go through Python."""
        fps_l, counts_l, n, i = fps.tolist(), counts.tolist(), len(ids), 0
        ids_a, counts_a = np.asarray(ids, dtype=np.int64), np.asarray(counts, dtype=np.int64)
        while i < n:
            coarsen = max(i, self.max_shadow * self._sample - base)  # first i with base + i + 1 above the limit
            end = min(n, coarsen)
            if self._sample == 1:
                picked = np.arange(i, end)
            else:
                picked = np.nonzero(fps[i:end] % np.uint64(self._sample) == 0)[0] + i
            self._shadow_batch(ids_a[picked], fps[picked], counts_a[picked], base + picked + 1)
            if end < n:  # this access coarsens the sample (and restarts the shadows), then counts as sampled
                self._shadow(ids[end], fps_l[end], counts_l[end], base + end + 1)
                end += 1
            i = end

    def _choose(self, capacity: int) -> None:
        decay = (1.0 - 1.0 / (self.window * max(capacity, 64))) ** 64
        bank = self._bank
        if isinstance(bank.disagree, np.ndarray):  # the compiled bank's arrays: the same products, at once
            bank.score *= decay
            bank.disagree *= decay
            scores = bank.score.tolist()
        else:
            for s in bank.rungs:
                s.score *= decay
            for row in bank.disagree:
                row[:] = [d * decay for d in row]
            scores = [s.score for s in bank.rungs]
        best, ladder = scores.index(max(scores)), self.ladder  # the rungs' P, in order; the first best
        if self.P not in ladder:
            self.P = ladder[best]
            return
        cur = ladder.index(self.P)
        # switch on a lead that noise does not explain: the shadows see the same accesses, so the lead of
        # one over the other is a sum over the accesses where they disagree, +-1 each: its noise is about
        # the square root of their number
        lead = scores[best] - scores[cur] * (1.0 + self.margin)
        if best != cur and lead > self.confidence * math.sqrt(bank.disagree[best][cur] + 1.0):
            self.switches += 1
            self.P = ladder[best]
