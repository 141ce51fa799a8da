"""Eviction order inside one tier: the lowest-priority evictable *leaf* goes first.

A block is a leaf in a tier when no child block holds a copy in that tier; a
parent is worth at least as much as any child (losing it makes the children
unreachable by prefix match), so only leaves are ever chosen (DESIGN 3).

Verbs (all O(log n), called with the store lock held):
- ``insert(e, is_leaf, cold)`` a copy of entry e arrived in this tier; ``cold``
  marks a block no prefix match can reach (its parent was never stored or is
  gone), which goes before every reachable one;
- ``insert_many(ids, is_leaf, cold)`` ``insert`` of each entry in order (numpy
  arrays; entries new to this tier), in a few vectorized passes: what recovery
  of millions of blocks and ``commit_puts`` call (a subclass that overrides
  ``insert`` or ``priority`` gets the per-entry loop unless it overrides this too);
- ``touch(e)`` e was read or written: its priority rises; ``touch_many(ids)``
  the same for a batch, in order (one call for a Get's blocks);
- ``set_leaf(e, is_leaf)`` e's leaf status in this tier changed;
- ``remove(e)`` the copy left the tier;
- ``pop_victim(evictable) -> e | None`` the lowest-priority leaf with
  ``evictable(e)`` true (leased copies are skipped but kept);
- ``hint(e, hint)`` an engine's reuse hint for e (ignored here; see
  kvstore.store.adaptive);

``priority(e)`` is the hook policies override: plain LRU uses a logical clock.
``bind(table, rank)`` is called once by the owning BlockStore, so a policy may
read per-entry context (depth, key, copies in other tiers) from the index
(kvstore.store.policies uses it for access frequency).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import numpy as np

COLD_PENALTY = 1e15
BULK_MIN = 8  # fewer entries than this: the per-entry loop costs less than the numpy calls


class LeafLRU:
    name = "lru"
    counts_uses = False  # whether ``uses`` answers (an admission filter needs it)

    def __init__(self) -> None:
        self._clock = 0
        self._prio: dict[int, float] = {}  # every resident copy -> current priority
        self._leaf: set[int] = set()
        self._heap: list[tuple[float, int]] = []  # (priority, e) of leaves; stale rows skipped
        self.table: Any = None  # the owner's EntryTable once bound
        self.rank = 0  # the rank of the tier this policy orders

    def bind(self, table: Any, rank: int) -> None:
        """Context from the owning BlockStore: its index and this tier's rank."""
        self.table, self.rank = table, rank

    def priority(self, e: int) -> float:
        self._clock += 1
        return float(self._clock)

    def insert(self, e: int, is_leaf: bool = True, cold: bool = False) -> None:
        self._prio[e] = self.priority(e) - (COLD_PENALTY if cold else 0.0)
        if is_leaf:
            self._leaf.add(e)
            self._push(e)

    def insert_many(self, ids: np.ndarray, is_leaf: np.ndarray, cold: np.ndarray) -> None:
        ids_l = ids.tolist()
        if (
            len(ids_l) < BULK_MIN
            or type(self).insert is not LeafLRU.insert
            or type(self).priority is not LeafLRU.priority
            or any(map(self._prio.__contains__, ids_l))
        ):
            self._insert_each(ids_l, is_leaf, cold)
            return
        n = len(ids_l)
        prio = np.arange(self._clock + 1, self._clock + n + 1, dtype=np.float64)
        self._clock += n
        self._add_new(ids, ids_l, prio - np.where(cold, COLD_PENALTY, 0.0), is_leaf)

    def _insert_each(self, ids_l: list[int], is_leaf: np.ndarray, cold: np.ndarray) -> None:
        insert = self.insert
        for e, leaf, c in zip(ids_l, np.asarray(is_leaf).tolist(), np.asarray(cold).tolist()):
            insert(e, is_leaf=leaf, cold=c)

    def _add_new(self, ids: np.ndarray, ids_l: list[int], prio: np.ndarray, is_leaf: np.ndarray) -> None:
        """Entries new to this tier with their priorities, as ``insert`` leaves them (the same heap order)."""
        self._prio.update(zip(ids_l, prio.tolist()))
        leaves = ids[is_leaf].tolist()
        self._leaf.update(leaves)
        rows = list(zip(prio[is_leaf].tolist(), leaves))
        if len(rows) > len(self._heap) // 8:
            self._heap.extend(rows)
            heapq.heapify(self._heap)
        else:
            for row in rows:
                heapq.heappush(self._heap, row)
        if len(self._heap) > 4 * len(self._prio) + 64:
            self._heap = [(p, x) for x, p in self._prio.items() if x in self._leaf]
            heapq.heapify(self._heap)

    def hint(self, e: int, hint: Any) -> None:
        """An engine's hint about e's future (kvstore.store.hints.ReuseHint); plain LRU ignores it."""

    def uses(self, e: int) -> int | None:
        """How many times block ``e`` was used (stored or read), when ``counts_uses``; else None."""
        return None

    def touch(self, e: int) -> None:
        if e in self._prio:
            self._prio[e] = self.priority(e)
            if e in self._leaf:
                self._push(e)

    def touch_many(self, ids: Any) -> None:
        """``touch`` of each entry of ``ids`` (ints, in order); a policy with its own ``touch`` keeps it."""
        if type(self).touch is not LeafLRU.touch or type(self).priority is not LeafLRU.priority:
            for e in ids:
                self.touch(e)
            return
        prio, leaf, heap = self._prio, self._leaf, self._heap
        clock = self._clock
        for e in ids:
            if e in prio:
                clock += 1
                prio[e] = p = float(clock)
                if e in leaf:
                    heapq.heappush(heap, (p, e))
        self._clock = clock
        self._trim_heap()

    def set_leaf(self, e: int, is_leaf: bool) -> None:
        if e not in self._prio:
            return
        if is_leaf and e not in self._leaf:
            self._leaf.add(e)
            self._push(e)
        elif not is_leaf:
            self._leaf.discard(e)

    def remove(self, e: int) -> None:
        self._prio.pop(e, None)
        self._leaf.discard(e)

    def nbytes(self) -> int:
        import sys

        return (
            sys.getsizeof(self._prio)
            + sys.getsizeof(self._leaf)
            + sys.getsizeof(self._heap)
            + len(self._heap) * 64
            + len(self._prio) * 24
        )  # heap rows (tuple + float) and float values

    def __contains__(self, e: int) -> bool:
        return e in self._prio

    def __len__(self) -> int:
        return len(self._prio)

    def _push(self, e: int) -> None:
        heapq.heappush(self._heap, (self._prio[e], e))
        self._trim_heap()

    def _trim_heap(self) -> None:
        """Drop the heap's stale rows once they outnumber the live ones."""
        if len(self._heap) > 4 * len(self._prio) + 64:
            self._heap = [(p, x) for x, p in self._prio.items() if x in self._leaf]
            heapq.heapify(self._heap)

    def pop_victim(self, evictable: Callable[[int], bool]) -> int | None:
        skipped: list[tuple[float, int]] = []
        victim = None
        while self._heap:
            prio, e = heapq.heappop(self._heap)
            if self._prio.get(e) != prio or e not in self._leaf:
                continue  # stale row
            if evictable(e):
                victim = e
                break
            skipped.append((prio, e))
        for row in skipped:
            heapq.heappush(self._heap, row)
        return victim
