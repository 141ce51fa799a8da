"""``adaptive``: leaf-first eviction whose protection of reused blocks is chosen online by shadow caches.

Parts (each small, each measured by ``python -m bench.replay``):

1. **Leaf-first order with leases** (as every policy here, DESIGN 3): only a
   leaf of the tier is a victim; a leased leaf is skipped, never evicted.
2. **Classes, one heap of leaves each, ordered by last access**: ``dead``
   (unreachable by prefix match, or hinted "no reuse", or a TTL hint that ran
   out) always goes first; ``once`` (seen fewer than ``reuse_threshold``
   times) ranks by its clock; ``reused`` by its clock plus ``P x N`` (N: blocks
   resident in the tier), so a reused block outlives about P turnovers of
   blocks seen once; ``kept`` (a "reuse" or TTL hint on a reused block) by its
   clock plus ``(P + hint_turnovers) x N`` and ``kept_once`` (the same hints on
   a block seen once) by its clock plus ``hint_turnovers x N``. Because the offset is applied when heads are
   compared, a new P takes effect at once, with no re-ranking.
3. **The frequency sketch** (TinyLFU's count-min sketch with aging, shared
   with ``freq`` and by every tier of a store): it decides ``once`` against
   ``reused`` and, since it remembers blocks after they are evicted, it plays
   the part of ARC's ghost lists and LIRS's non-resident entries: a block that
   comes back after its eviction is known as reused.
4. **The adaptation: shadow caches choose P.** P = 0 is leaf-first LRU and
   P = 4 is ``freq``; which is better depends on the workload (``freq`` loses to
   LRU where blocks are reused once, soon, then die: one-shot documents,
   conversations that end). Instead of a hill climber on the hit rate (Caffeine
   resizes its window that way, and pays in noise and lag), every access is
   replayed into small directories (keys only, no bytes) that run this policy
   with each P of ``ladder`` on the same accesses and at the same size,
   leaf rule included, counting a hit only while the request's previous block
   hit (the prefix rule). Their hits decay over about ``window`` turnovers.
   The tier switches to the P whose shadow scores best only on a lead that
   noise does not explain: more than ``margin`` of the current score plus
   ``confidence`` x the square root of the (decayed) accesses where the two
   shadows disagree, since their lead is a sum of +-1 over exactly those. A
   test on the raw scores instead (their square root) switched too late on
   one-shot documents, and too eagerly early in a trace without it; each
   switch costs hits, since the tier's contents were chosen under the old P.
   With LRU on the ladder the policy tracks the better of LRU and every other
   rung. This is set dueling (as in CPU caches' adaptive insertion) with
   whole shadow caches instead of sets.
5. **Engine hints** (``hint(e, ReuseHint)``, kvstore.store.hints): "no reuse"
   sends a block to ``dead``; "reuse" (the conversation continues) or a TTL
   moves it to ``kept`` (``kept_once`` if its uses made it ``once``) until its
   next access or the deadline: ``hint_turnovers`` (2) ahead of its own class,
   so where every block is hinted the uses still rank them. One ``kept`` class
   for all, 8 turnovers ahead, made that LRU among the hinted: on a trace of
   shifting popularity the hints cost 0.018 / 0.035 of hit rate at 5% / 10%
   (``bench.replay --generated all``); split and at 2 they gain 0.034 / 0.047;
   ``priority`` adds that many turnovers to its rank while resident.

Memory is bounded: per resident block a clock and a class (two dict slots)
and heap rows compacted at 4x the residents; each shadow holds at most as
many keys as the tier held blocks at its last access, and at most
``max_shadow``: beyond that, the shadows see a hash-sampled 1/R of the blocks
(R a power of two) at 1/R of the size, and a sampled block's shadow parent is
its nearest sampled ancestor, so a sampled shadow keeps the prefix tree
(contracted) with its leaf and prefix rules; the scores carry over when R
grows. ``insert_many`` (what ``commit_puts`` and recovery call) does the
sketch, clocks, classes and heaps in vectorized passes; ``touch_many`` (a
Get's release) counts the sketch, computes clocks and classes and picks the
shadows' sample with its ancestors in one compiled call
(kvstore/store/policy_jit.py), then updates the dicts in bulk and pushes a
heap row per leaf. Both replay the shadows' sampled share of the batch in one
compiled call (kvstore/store/shadow_jit.py, with numba; the same accesses as
``Shadow`` objects one by one, which ``jit=False`` or no numba uses:
tests/test_adaptive_jit.py checks they decide alike); ``touch_many``'s wait
in a queue until P could change (every 64th access: kvstore/store/adaptation.py,
which holds the shadows' part of the policy).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.store.adaptation import ANCESTOR_STEPS, ShadowDueling
from kvstore.store.frequency import FrequencySketch
from kvstore.store.hints import ReuseHint
from kvstore.store.policy import BULK_MIN
from kvstore.store.shadows import Shadow as Shadow  # re-exported: the reference rung the tests drive

DEAD, ONCE, REUSED, KEPT, KEPT_ONCE = 0, 1, 2, 3, 4  # KEPT: hinted and reused; KEPT_ONCE: hinted, seen once
CLASS_NAMES = ("dead", "once", "reused", "kept", "kept_once")
DEFAULT_LADDER = (0.0, 1.0, 4.0, 16.0)


class AdaptiveLeafPolicy(ShadowDueling):
    """Leaf-first classes (dead, once, reused, kept) with the reused offset P chosen by shadow caches."""

    name = "adaptive"
    counts_uses = True

    def __init__(
        self,
        *,
        ladder: Sequence[float] = DEFAULT_LADDER,
        reuse_threshold: int = 2,
        window: float = 32.0,
        margin: float = 0.01,
        confidence: float = 3.0,
        hint_turnovers: float = 2.0,
        max_shadow: int = 6144,
        now: Callable[[], float] = time.monotonic,
        sketch: FrequencySketch | None = None,
        jit: bool = True,
    ):
        if not ladder or any(p < 0 for p in ladder) or window <= 0 or margin < 0 or max_shadow < 64:
            raise ValueError("ladder must be non-empty and >= 0; window > 0; margin >= 0; max_shadow >= 64")
        super().__init__(ladder=ladder, reuse_threshold=reuse_threshold, window=window, margin=margin,
                         confidence=confidence, max_shadow=max_shadow, sketch=sketch, jit=jit)  # fmt: skip
        self.hint_turnovers = hint_turnovers
        self.now = now
        self._cls: dict[int, int] = {}  # resident e -> its class
        self._heaps: tuple[list[tuple[float, int]], ...] = ([], [], [], [], [])  # per class: (clock, e) of leaves
        self._boost: dict[int, float] = {}  # e -> priority hint, in turnovers
        self._deadline: dict[int, float] = {}  # e in KEPT or KEPT_ONCE by a TTL hint -> when it runs out
        self._expiry: list[tuple[float, int]] = []  # (deadline, e); stale rows skipped

    # -- verbs -----------------------------------------------------------------------------
    def insert(self, e: int, is_leaf: bool = True, cold: bool = False) -> None:
        if e in self._prio:  # a victim put back while its copy is written below: keep its rank
            if is_leaf:
                self._leaf.add(e)
                self._push(e)
            return
        fp = self._fingerprint(e)
        count = self.sketch.add(fp) if self._sole_copy(e) else self.sketch.estimate(fp)
        self._access(e, fp, count, DEAD if cold else None)
        if is_leaf:
            self._leaf.add(e)
            self._push(e)

    def insert_many(self, ids: np.ndarray, is_leaf: np.ndarray, cold: np.ndarray) -> None:
        """``insert`` of each new entry in order: the sketch, clocks, classes and heaps in vectorized passes
        (the sketch counts the batch with ``add_many``, as ``freq`` does); the shadows' sampled share of the
        batch in order, one compiled call per run between changes of the sample."""
        ids_l = ids.tolist()
        if (
            len(ids_l) < BULK_MIN
            or type(self).insert is not AdaptiveLeafPolicy.insert
            or self.table is None
            or any(map(self._prio.__contains__, ids_l))
        ):
            self._insert_each(ids_l, is_leaf, cold)
            return
        n, base = len(ids_l), len(self._prio)
        is_leaf, cold = np.asarray(is_leaf, dtype=np.bool_), np.asarray(cold, dtype=np.bool_)
        fps = np.asarray(self.table.fp[ids], dtype=np.uint64)
        counts = self._count_new(ids)
        cls = np.where(cold, DEAD, np.where(counts >= self.reuse_threshold, REUSED, ONCE))
        prio = np.arange(self._clock + 1, self._clock + n + 1, dtype=np.float64)
        self._clock += n
        prio_l, cls_l = prio.tolist(), cls.tolist()
        self._prio.update(zip(ids_l, prio_l))
        self._cls.update(zip(ids_l, cls_l))
        self._leaf.update(ids[is_leaf].tolist())
        for c in (DEAD, ONCE, REUSED):
            pick = is_leaf & (cls == c)
            if pick.any():  # as LeafLRU._add_new: re-heapify only for a batch that is large beside the heap
                heap, rows = self._heaps[c], list(zip(prio[pick].tolist(), ids[pick].tolist()))
                if len(rows) > len(heap) // 8:
                    heap.extend(rows)
                    heapq.heapify(heap)
                else:
                    for row in rows:
                        heapq.heappush(heap, row)
        self._compact_heaps()
        self._shadow_many(ids_l, fps, counts, base)

    def touch(self, e: int) -> None:
        if e not in self._prio:
            return
        fp = self._fingerprint(e)
        count = self.sketch.add(fp) if self._top_copy(e) else self.sketch.estimate(fp)
        self._deadline.pop(e, None)  # a hint lasts until the block's next access
        self._access(e, fp, count, None)
        if e in self._leaf:
            self._push(e)

    def touch_many(self, ids: Any) -> None:
        """``touch`` of each entry of ``ids`` in order: the sketch's counts, clocks, classes and the shadows'
        sample in one compiled call where numba is there (kvstore/store/policy_jit.py), the dicts in bulk, a
        heap row per leaf; the shadows replay the queued sample once P could change (every 64th access)."""
        prio = self._prio
        present = ids if all(map(prio.__contains__, ids)) else [e for e in ids if e in prio]
        if not present:
            return
        # what _access and _push do for each, in order; the shadows after, in one batch (they read nothing
        # of this, and this nothing of them but P, read at eviction)
        resident, k, clock = len(prio), len(present), self._clock
        if resident > self.max_shadow * self._sample:
            self._coarsen(resident)  # (what the shadows' sample is: nothing here changes it)
        q, queue = self._sample, self._queue if self._walks_index() else None
        cap = max(resident // q, 1)
        if queue is None:
            buf = self._touch_fused(present, 0.0)
        else:
            queued = queue.n
            buf = self._touch_fused(present, 0.0, q, ANCESTOR_STEPS * q, cap, queue)
            if queue.n > queued:
                queue.cap_max = max(queue.cap_max, cap)
        if buf is None:
            fps, counts = self._touch_counts(present)
            new = list(map(float, range(clock + 1, clock + 1 + k)))
            classes = [REUSED if c >= self.reuse_threshold else ONCE for c in counts]
        else:
            new, classes = buf.prio[:k].tolist(), buf.cls[:k].tolist()
        boost, deadline, cls_of, heaps = self._boost, self._deadline, self._cls, self._heaps
        if boost:
            n = max(resident, 64)
            new = [c + boost.get(e, 0.0) * n for c, e in zip(new, present)]
        if deadline:
            for e in present:
                deadline.pop(e, None)  # a hint lasts until the block's next access
        cls_of.update(zip(present, classes))
        prio.update(zip(present, new))
        self._clock = clock + k
        for e in self._leaf.intersection(present):  # its last row: an earlier one of a repeat would be stale
            heapq.heappush(heaps[cls_of[e]], (prio[e], e))
        if max(map(len, heaps)) > 4 * resident + 64:  # (compacted once, after: the same rows stay valid)
            self._compact_heaps()
        if buf is None:
            arr, counts_a = np.asarray(present, dtype=np.int64), np.asarray(counts, dtype=np.int64)
        elif queue is not None:  # queued (with their ancestors) by the compiled call
            if self._replayed % 64 + queue.n >= 64:
                self._flush()
            return
        else:
            arr, fps, counts_a = np.asarray(present, dtype=np.int64), buf.fps[:k], buf.counts[:k]
        if q > 1:
            pick = np.nonzero(fps % np.uint64(q) == 0)[0]
            arr, fps, counts_a = arr[pick], fps[pick], counts_a[pick]
        self._shadow_batch(arr, fps, counts_a, np.full(len(arr), resident, dtype=np.int64))

    def hint(self, e: int, hint: ReuseHint) -> None:
        if e not in self._prio:
            return
        if hint.priority:
            self._boost[e] = float(hint.priority)
            self._prio[e] = float(self._clock_of(e)) + hint.priority * max(len(self._prio), 64)
        cls = self._cls[e]
        if hint.reuse is False:
            cls = DEAD
            self._deadline.pop(e, None)
        elif hint.reuse is True or hint.ttl_s is not None:
            cls = KEPT if cls in (REUSED, KEPT) else KEPT_ONCE  # kept, and still ranked by its own uses
            if hint.ttl_s is None:
                self._deadline.pop(e, None)
            else:
                self._deadline[e] = deadline = self.now() + hint.ttl_s
                heapq.heappush(self._expiry, (deadline, e))
                if len(self._expiry) > 4 * len(self._deadline) + 64:
                    self._expiry = [(d, x) for x, d in self._deadline.items()]
                    heapq.heapify(self._expiry)
        self._cls[e] = cls
        if e in self._leaf:
            self._push(e)

    def remove(self, e: int) -> None:
        super().remove(e)
        self._cls.pop(e, None)
        self._boost.pop(e, None)
        self._deadline.pop(e, None)

    def pop_victim(self, evictable: Callable[[int], bool]) -> int | None:
        skipped: list[tuple[int, tuple[float, int]]] = []
        victim = None
        while True:
            cls = self._victim_class()
            if cls is None:
                break
            row = heapq.heappop(self._heaps[cls])
            e = row[1]
            if evictable(e):
                victim = e
                break
            skipped.append((cls, row))
        for cls, row in skipped:
            heapq.heappush(self._heaps[cls], row)
        return victim

    def nbytes(self) -> int:
        import sys

        rows = sum(len(h) for h in self._heaps) + len(self._expiry) + sum(s.heap_rows() for s in self._shadows)
        keys = len(self._cls) + len(self._boost) + len(self._deadline) + sum(4 * len(s) for s in self._shadows)
        return super().nbytes() + sys.getsizeof(self._cls) + rows * 64 + keys * 32

    def footprint(self) -> dict[str, int]:
        """What the policy holds, in rows: bounded by the residents (tests check it)."""
        return {
            "resident": len(self._prio),
            "heap_rows": sum(len(h) for h in self._heaps) + len(self._expiry),
            "hinted": len(self._boost) + len(self._deadline),
            "shadow_keys": max((len(s) for s in self._shadows), default=0),
            "shadow_heap_rows": max((s.heap_rows() for s in self._shadows), default=0),
        }

    def stats(self) -> dict[str, Any]:
        """What it adapted: the P in use, the shadows' scores, how many switches; blocks per class."""
        return {
            "P": self.P,
            "switches": self.switches,
            "shadow_scores": {s.P: round(s.score, 1) for s in self._shadows},
            "shadow_sample": self._sample,
            "classes": {name: sum(1 for c in self._cls.values() if c == i) for i, name in enumerate(CLASS_NAMES)},
        }

    # -- the order ---------------------------------------------------------------------------
    def _clock_of(self, e: int) -> float:
        return self._prio[e] - self._boost.get(e, 0.0) * max(len(self._prio), 64)

    def _access(self, e: int, fp: int, count: int, cls: int | None) -> None:
        self._clock += 1
        if cls is None:
            cls = REUSED if count >= self.reuse_threshold else ONCE
        self._cls[e] = cls
        self._prio[e] = float(self._clock) + self._boost.get(e, 0.0) * max(len(self._prio), 64)
        self._shadow(e, fp, count)

    def _push(self, e: int) -> None:
        heapq.heappush(self._heaps[self._cls[e]], (self._prio[e], e))
        self._compact_heaps()

    def _compact_heaps(self) -> None:
        """Rebuild the heaps from the residents once any holds more than 4x their number in rows."""
        if max(len(h) for h in self._heaps) > 4 * len(self._prio) + 64:
            for i, h in enumerate(self._heaps):
                rows = [(p, x) for x, p in self._prio.items() if x in self._leaf and self._cls[x] == i]
                heapq.heapify(rows)
                h[:] = rows

    def _head(self, cls: int) -> tuple[float, int] | None:
        heap = self._heaps[cls]
        while heap:
            prio, e = heap[0]
            if self._prio.get(e) == prio and e in self._leaf and self._cls[e] == cls:
                return heap[0]
            heapq.heappop(heap)
        return None

    def _expire(self) -> None:
        """Blocks whose TTL hint ran out: nothing keeps them any more."""
        now = self.now()
        while self._expiry and self._expiry[0][0] <= now:
            deadline, e = heapq.heappop(self._expiry)
            if self._deadline.get(e) == deadline:
                del self._deadline[e]
                self._cls[e] = DEAD
                if e in self._leaf:
                    self._push(e)

    def _victim_class(self) -> int | None:
        if self._expiry:
            self._expire()
        if self._head(DEAD) is not None:
            return DEAD
        n = max(len(self._prio), 64)
        offsets = (0.0, 0.0, self.P * n, (self.P + self.hint_turnovers) * n, self.hint_turnovers * n)
        best, best_key = None, 0.0
        for cls in (ONCE, REUSED, KEPT, KEPT_ONCE):
            head = self._head(cls)
            if head is not None and (best is None or head[0] + offsets[cls] < best_key):
                best, best_key = cls, head[0] + offsets[cls]
        return best
