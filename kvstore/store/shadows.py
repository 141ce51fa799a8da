"""The adaptive policy's shadow caches in Python: ``Shadow`` (one rung) and ``PyShadows`` (the ladder).

A shadow is a key-only cache that runs the adaptive class order with a fixed P (kvstore/store/adaptive.py
explains why): the leaf rule, LRU clocks, no bytes. ``PyShadows`` replays accesses into every rung of a
ladder at once; the compiled bank (kvstore/store/shadow_jit.py) does the same steps in one numba call per
batch and is what the policy uses when numba is there. Both have the verbs the policy calls:

- ``run(fps, parents, has_parent, counts, capacities, accesses) -> done``: replay the accesses in order into
  every rung (a hit counts only while the request's previous block hit: the prefix rule), add 1 to
  ``disagree[i][j]`` for each access that rung i hit and rung j missed or the reverse, and stop after the
  access that brings ``accesses`` to a multiple of 64 (where the policy re-chooses P); returns how many
  accesses it did;
- ``rungs`` (one Shadow-like object per P, with ``P``, ``score``, ``key``, ``cls``, ``parent``, ``nchild``,
  ``clock``, ``last_hit``, ``len`` and ``heap_rows``) and ``disagree`` (rungs x rungs).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

ONCE, REUSED = 1, 2


class Shadow:
    """A key-only cache running the class order with a fixed P: the leaf rule, LRU clocks, no bytes."""

    __slots__ = ("P", "reuse_threshold", "clock", "key", "cls", "parent", "nchild", "heaps", "score", "last_hit")

    def __init__(self, P: float, reuse_threshold: int):
        self.P = P
        self.reuse_threshold = reuse_threshold
        self.clock = 0
        self.key: dict[int, int] = {}  # resident fp -> clock of its last access
        self.cls: dict[int, int] = {}  # resident fp -> ONCE or REUSED
        self.parent: dict[int, int] = {}  # resident fp -> resident parent fp
        self.nchild: dict[int, int] = {}  # resident fp -> resident children (absent: 0)
        self.heaps: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])  # (clock, fp) of leaves
        self.score = 0.0
        self.last_hit = -1  # the fp of the previous access when it was a (prefix) hit

    def __len__(self) -> int:
        return len(self.key)

    def access(self, fp: int, parent: int | None, count: int, capacity: int) -> bool:
        """One access of ``fp`` (child of ``parent``), at ``capacity`` keys; whether it was a (prefix) hit."""
        self.clock += 1
        hit = False
        cls = REUSED if count >= self.reuse_threshold else ONCE
        if fp in self.key:
            while len(self.key) > capacity and self._evict():  # the tier shrank: so does its shadow
                pass
        if fp in self.key:
            if parent is None or parent == self.last_hit:
                self.score += 1.0
                self.last_hit = fp
                hit = True
            else:
                self.last_hit = -1
        else:
            self.last_hit = -1
            while len(self.key) >= capacity and self._evict():
                pass
            if parent is not None and parent in self.key:
                self.parent[fp] = parent
                self.nchild[parent] = self.nchild.get(parent, 0) + 1
        self.key[fp] = self.clock
        self.cls[fp] = cls
        if not self.nchild.get(fp):
            heapq.heappush(self.heaps[cls - ONCE], (self.clock, fp))
        self._compact()
        return hit

    def _head(self, cls: int) -> tuple[int, int] | None:
        heap = self.heaps[cls - ONCE]
        while heap:
            clock, fp = heap[0]
            if self.key.get(fp) == clock and self.cls[fp] == cls and not self.nchild.get(fp):
                return heap[0]
            heapq.heappop(heap)
        return None

    def _evict(self) -> bool:
        once, reused = self._head(ONCE), self._head(REUSED)
        if once is None and reused is None:
            return False
        offset = self.P * max(len(self.key), 64)
        cls = ONCE if reused is None or (once is not None and once[0] <= reused[0] + offset) else REUSED
        _, fp = heapq.heappop(self.heaps[cls - ONCE])
        del self.key[fp], self.cls[fp]
        self.nchild.pop(fp, None)
        p = self.parent.pop(fp, None)
        if p is not None and p in self.key:
            left = self.nchild[p] - 1
            if left:
                self.nchild[p] = left
            else:
                del self.nchild[p]
                heapq.heappush(self.heaps[self.cls[p] - ONCE], (self.key[p], p))
        return True

    def _compact(self) -> None:
        for i, heap in enumerate(self.heaps):
            if len(heap) > 4 * len(self.key) + 64:
                cls = ONCE + i
                rows = [(c, fp) for fp, c in self.key.items() if self.cls[fp] == cls and not self.nchild.get(fp)]
                heapq.heapify(rows)
                self.heaps[i][:] = rows

    def heap_rows(self) -> int:
        return sum(len(h) for h in self.heaps)


class PyShadows:
    """One ``Shadow`` per rung of the ladder, replayed one access at a time (the reference for the bank)."""

    def __init__(self, ladder: Sequence[float], reuse_threshold: int):
        self.rungs = [Shadow(p, reuse_threshold) for p in ladder]
        self.disagree: Any = [[0.0] * len(self.rungs) for _ in self.rungs]

    def run(self, fps: Any, parents: Any, has_parent: Any, counts: Any, capacities: Any, accesses: int) -> int:
        rungs, disagree = self.rungs, self.disagree
        rows = zip(fps.tolist(), parents.tolist(), has_parent.tolist(), counts.tolist(), capacities.tolist())
        done = 0
        for fp, parent, has, count, capacity in rows:
            done += 1
            hits = [s.access(fp, parent if has else None, count, capacity) for s in rungs]
            if any(hits) and not all(hits):
                for i, a in enumerate(hits):
                    row = disagree[i]
                    for j, b in enumerate(hits):
                        if a != b:
                            row[j] += 1.0
            accesses += 1
            if accesses % 64 == 0:
                break
        return done
