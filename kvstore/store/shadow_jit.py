"""The adaptive policy's shadow caches compiled (numba): every rung of the ladder replayed in one call per batch.

``JitShadows(ladder, reuse_threshold, max_keys)`` holds what a ``PyShadows`` of ``Shadow`` objects holds
(kvstore/store/shadows.py, the reference it must equal access for access), in flat arrays, per rung: a node
per resident key (fingerprint, clock of its last access, class, parent node, resident children), an
open-addressing table fingerprint -> node (linear probing, backward-shift deletion), and one binary heap per
class of (clock, node) rows of leaves, stale rows skipped and compacted at the same bound as ``Shadow``.
Valid rows have distinct clocks (one per access), so the victim (the oldest valid leaf of the class chosen
with the rung's offset) is the one ``Shadow`` picks whatever the heaps' order of ties.

Verbs (the same as ``PyShadows``): ``run(...) -> done`` (``run_typed``: the same without the conversions) and ``rungs`` (views with the attributes of a
``Shadow``: ``P``, ``score`` (settable), ``key``, ``cls``, ``parent``, ``nchild``, ``clock``, ``last_hit``,
``len``, ``heap_rows``) and ``disagree`` (a rungs x rungs float64 array). The node arrays hold
``max_keys + 1`` keys and grow (copying) if a capacity above that is asked for.

``ancestors(...)``: the fingerprint of each entry's nearest sampled ancestor, walked in the index's columns
(``AdaptiveLeafPolicy._sampled_ancestor`` for a batch). ``AVAILABLE`` says whether numba is importable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.jit import AVAILABLE as AVAILABLE  # re-exported: callers ask the kernel module
from kvstore.jit import numba

# node fields (rows of ``node``) and per-rung scalars (columns of ``scal``)
CLOCK, CLS, PARENT, NCHILD = 0, 1, 2, 3
S_CLOCK, S_SIZE, S_NFREE, S_HEAP0, S_HEAP1, S_HASLAST, S_TBITS = 0, 1, 2, 3, 4, 5, 6
LIVE = 1

run_kernel: Any = None
rehash_kernel: Any = None
ancestors: Any = None

if AVAILABLE:
    _MIX = numba.uint64(0x9E3779B97F4A7C15)

    @numba.njit(cache=True, inline="always")
    def _pos(fp, tbits):  # type: ignore[no-untyped-def]
        return numba.int64((numba.uint64(fp) * _MIX) >> numba.uint64(64 - tbits))

    @numba.njit(cache=True)
    def _find(fpa, table, scal, r, fp):  # type: ignore[no-untyped-def]
        tbits = scal[r, S_TBITS]
        mask = (1 << tbits) - 1
        i = _pos(fp, tbits)
        while True:
            s = table[r, i]
            if s == 0:
                return -1
            if fpa[r, s - 1] == fp:
                return s - 1
            i = (i + 1) & mask

    @numba.njit(cache=True)
    def _table_add(fpa, table, scal, r, fp, node):  # type: ignore[no-untyped-def]
        tbits = scal[r, S_TBITS]
        mask = (1 << tbits) - 1
        i = _pos(fp, tbits)
        while table[r, i] != 0:
            i = (i + 1) & mask
        table[r, i] = node + 1

    @numba.njit(cache=True)
    def _table_remove(fpa, table, scal, r, fp):  # type: ignore[no-untyped-def]
        tbits = scal[r, S_TBITS]
        mask = (1 << tbits) - 1
        i = _pos(fp, tbits)
        while fpa[r, table[r, i] - 1] != fp:
            i = (i + 1) & mask
        j = i
        while True:  # backward shift: pull later rows of the run into the hole unless they sit at home
            j = (j + 1) & mask
            s = table[r, j]
            if s == 0:
                break
            k = _pos(fpa[r, s - 1], tbits)
            if (i <= j and i < k <= j) or (i > j and (k > i or k <= j)):
                continue
            table[r, i] = s
            i = j
        table[r, i] = 0

    @numba.njit(cache=True)
    def _push(heap, scal, r, c, clock, node):  # type: ignore[no-untyped-def]
        n = scal[r, S_HEAP0 + c]
        h = heap[r, c]
        i = n
        while i > 0:
            up = (i - 1) >> 1
            if h[up, 0] < clock or (h[up, 0] == clock and h[up, 1] <= node):
                break
            h[i, 0], h[i, 1] = h[up, 0], h[up, 1]
            i = up
        h[i, 0], h[i, 1] = clock, node
        scal[r, S_HEAP0 + c] = n + 1

    @numba.njit(cache=True)
    def _pop(heap, scal, r, c):  # type: ignore[no-untyped-def]
        n = scal[r, S_HEAP0 + c] - 1
        scal[r, S_HEAP0 + c] = n
        h = heap[r, c]
        if n == 0:
            return
        clock, node = h[n, 0], h[n, 1]
        i = 0
        while True:
            kid = 2 * i + 1
            if kid >= n:
                break
            if kid + 1 < n and (
                h[kid + 1, 0] < h[kid, 0] or (h[kid + 1, 0] == h[kid, 0] and h[kid + 1, 1] < h[kid, 1])
            ):
                kid += 1
            if clock < h[kid, 0] or (clock == h[kid, 0] and node <= h[kid, 1]):
                break
            h[i, 0], h[i, 1] = h[kid, 0], h[kid, 1]
            i = kid
        h[i, 0], h[i, 1] = clock, node

    @numba.njit(cache=True)
    def _head(node, heap, scal, r, c):  # type: ignore[no-untyped-def]
        """The node of the class's oldest valid leaf, -1 when none; stale rows are popped on the way."""
        h = heap[r, c]
        while scal[r, S_HEAP0 + c] > 0:
            clock, x = h[0, 0], h[0, 1]
            if node[r, CLOCK, x] == clock and node[r, CLS, x] == c + 1 and node[r, NCHILD, x] == 0:
                return x
            _pop(heap, scal, r, c)
        return -1

    @numba.njit(cache=True)
    def _compact(node, heap, scal, r, c):  # type: ignore[no-untyped-def]
        scal[r, S_HEAP0 + c] = 0
        for x in range(node.shape[2]):
            if node[r, CLOCK, x] > 0 and node[r, CLS, x] == c + 1 and node[r, NCHILD, x] == 0:
                _push(heap, scal, r, c, node[r, CLOCK, x], x)

    @numba.njit(cache=True)
    def _evict(fpa, node, free, table, heap, scal, P, r):  # type: ignore[no-untyped-def]
        once, reused = _head(node, heap, scal, r, 0), _head(node, heap, scal, r, 1)
        if once < 0 and reused < 0:
            return False
        offset = P[r] * max(scal[r, S_SIZE], 64)
        c = 0
        if once < 0 or (reused >= 0 and not node[r, CLOCK, once] <= node[r, CLOCK, reused] + offset):
            c = 1
        x = heap[r, c, 0, 1]
        _pop(heap, scal, r, c)
        _table_remove(fpa, table, scal, r, fpa[r, x])
        p = node[r, PARENT, x]
        node[r, CLOCK, x] = 0
        node[r, NCHILD, x] = 0
        node[r, PARENT, x] = -1
        free[r, scal[r, S_NFREE]] = x
        scal[r, S_NFREE] += 1
        scal[r, S_SIZE] -= 1
        if p >= 0 and node[r, CLOCK, p] > 0:
            node[r, NCHILD, p] -= 1
            if node[r, NCHILD, p] == 0:
                _push(heap, scal, r, node[r, CLS, p] - 1, node[r, CLOCK, p], p)
        return True

    @numba.njit(cache=True)
    def _access(fpa, node, free, table, heap, scal, last, score, P, r, fp, has_parent, parent, c, capacity):  # type: ignore[no-untyped-def]
        scal[r, S_CLOCK] += 1
        clock = scal[r, S_CLOCK]
        hit = False
        x = _find(fpa, table, scal, r, fp)
        if x >= 0 and scal[r, S_SIZE] > capacity:  # (found again only after evictions: one may have been x)
            while scal[r, S_SIZE] > capacity and _evict(fpa, node, free, table, heap, scal, P, r):
                pass
            x = _find(fpa, table, scal, r, fp)
        if x >= 0:
            if not has_parent or (scal[r, S_HASLAST] == 1 and parent == last[r]):
                score[r] += 1.0
                last[r] = fp
                scal[r, S_HASLAST] = 1
                hit = True
            else:
                scal[r, S_HASLAST] = 0
        else:
            scal[r, S_HASLAST] = 0
            while scal[r, S_SIZE] >= capacity and _evict(fpa, node, free, table, heap, scal, P, r):
                pass
            p = _find(fpa, table, scal, r, parent) if has_parent else -1  # before fp is in: never itself
            scal[r, S_NFREE] -= 1
            x = free[r, scal[r, S_NFREE]]
            fpa[r, x] = fp
            _table_add(fpa, table, scal, r, fp, x)
            scal[r, S_SIZE] += 1
            node[r, NCHILD, x] = 0
            node[r, PARENT, x] = p
            if p >= 0:
                node[r, NCHILD, p] += 1
        node[r, CLOCK, x] = clock
        node[r, CLS, x] = c
        if node[r, NCHILD, x] == 0:
            if scal[r, S_HEAP0 + c - 1] >= heap.shape[2]:
                _compact(node, heap, scal, r, c - 1)
            _push(heap, scal, r, c - 1, clock, x)
        limit = 4 * scal[r, S_SIZE] + 64
        for k in range(2):
            if scal[r, S_HEAP0 + k] > limit:
                _compact(node, heap, scal, r, k)
        return hit

    @numba.njit(cache=True, nogil=True)
    def _run(fpa, node, free, table, heap, scal, last, score, P, disagree, hits,  # type: ignore[no-untyped-def]
             fps, parents, has_parent, counts, caps, threshold, accesses):  # fmt: skip
        rungs = len(P)
        for i in range(len(fps)):
            c = 2 if counts[i] >= threshold else 1
            nhit = 0
            for r in range(rungs):
                h = _access(fpa, node, free, table, heap, scal, last, score, P, r, fps[i], has_parent[i],
                            parents[i], c, caps[i])  # fmt: skip
                hits[r] = h
                nhit += h
            if 0 < nhit < rungs:
                for a in range(rungs):
                    for b in range(rungs):
                        if hits[a] != hits[b]:
                            disagree[a, b] += 1.0
            accesses += 1
            if accesses % 64 == 0:
                return i + 1
        return len(fps)

    @numba.njit(cache=True)
    def _rehash(fpa, node, table, scal):  # type: ignore[no-untyped-def]
        table[:] = 0
        for r in range(node.shape[0]):
            for x in range(node.shape[2]):
                if node[r, CLOCK, x] > 0:
                    _table_add(fpa, table, scal, r, fpa[r, x], x)

    @numba.njit(cache=True, nogil=True)
    def _ancestors(parent, parent_gen, gen, flags, keys, nss, ids, sample, steps, out, has):  # type: ignore[no-untyped-def]
        for i in range(len(ids)):
            e = ids[i]
            has[i] = False
            for _ in range(steps):
                p = numba.int64(parent[e]) - 1
                if p < 0 or not (flags[p] & LIVE) or gen[p] != parent_gen[e]:
                    break
                fp = (keys[p, 0] ^ keys[p, 1]) + numba.uint64(nss[p]) * _MIX
                if fp % numba.uint64(sample) == 0:
                    out[i] = fp
                    has[i] = True
                    break
                e = p

    run_kernel, rehash_kernel, ancestors = _run, _rehash, _ancestors


class ShadowView:
    """One rung of a ``JitShadows``, with the attributes of a ``Shadow`` (read from the arrays)."""

    __slots__ = ("bank", "r", "P")

    def __init__(self, bank: JitShadows, r: int):
        self.bank, self.r = bank, r
        self.P = float(bank.P[r])

    @property
    def score(self) -> float:
        return float(self.bank.score[self.r])

    @score.setter
    def score(self, value: float) -> None:
        self.bank.score[self.r] = value

    @property
    def clock(self) -> int:
        return int(self.bank.scal[self.r, S_CLOCK])

    @property
    def last_hit(self) -> int:
        b = self.bank
        return int(b.last[self.r]) if b.scal[self.r, S_HASLAST] else -1

    def _live(self) -> np.ndarray:
        return np.nonzero(self.bank.node[self.r, CLOCK] > 0)[0]

    def _fp(self, x: np.ndarray) -> list[int]:
        return [int(f) for f in self.bank.fpa[self.r, x]]

    @property
    def key(self) -> dict[int, int]:
        x = self._live()
        return dict(zip(self._fp(x), self.bank.node[self.r, CLOCK, x].tolist()))

    @property
    def cls(self) -> dict[int, int]:
        x = self._live()
        return dict(zip(self._fp(x), self.bank.node[self.r, CLS, x].tolist()))

    @property
    def parent(self) -> dict[int, int]:
        x = self._live()
        x = x[self.bank.node[self.r, PARENT, x] >= 0]
        return dict(zip(self._fp(x), self._fp(self.bank.node[self.r, PARENT, x])))

    @property
    def nchild(self) -> dict[int, int]:
        x = self._live()
        x = x[self.bank.node[self.r, NCHILD, x] > 0]
        return dict(zip(self._fp(x), self.bank.node[self.r, NCHILD, x].tolist()))

    def __len__(self) -> int:
        return int(self.bank.scal[self.r, S_SIZE])

    def heap_rows(self) -> int:
        return int(self.bank.scal[self.r, S_HEAP0] + self.bank.scal[self.r, S_HEAP1])


class JitShadows:
    """Every rung of the ladder in flat arrays, replayed by one compiled call per batch (see the module doc)."""

    def __init__(self, ladder: Sequence[float], reuse_threshold: int, max_keys: int):
        rungs = len(ladder)
        self.threshold = reuse_threshold
        self.P = np.asarray(ladder, dtype=np.float64)
        self.score = np.zeros(rungs, dtype=np.float64)
        self.disagree = np.zeros((rungs, rungs), dtype=np.float64)
        self.last = np.zeros(rungs, dtype=np.uint64)
        self.scal = np.zeros((rungs, 8), dtype=np.int64)
        self._hits = np.zeros(rungs, dtype=np.int64)
        self._alloc(max_keys + 1)
        self.rungs = [ShadowView(self, r) for r in range(rungs)]

    def _alloc(self, nodes: int) -> None:
        rungs = len(self.P)
        tbits = max(int(nodes).bit_length() + 1, 4)  # a table at least twice the nodes
        self.nodes = nodes
        self.fpa = np.zeros((rungs, nodes), dtype=np.uint64)
        self.node = np.zeros((rungs, 4, nodes), dtype=np.int64)
        self.node[:, PARENT] = -1
        self.free = np.tile(np.arange(nodes - 1, -1, -1, dtype=np.int64), (rungs, 1))
        self.table = np.zeros((rungs, 1 << tbits), dtype=np.int64)
        self.heap = np.zeros((rungs, 2, 5 * nodes + 128, 2), dtype=np.int64)
        self.scal[:, S_NFREE] = nodes
        self.scal[:, S_TBITS] = tbits

    def _grow(self, nodes: int) -> None:
        """Room for ``nodes`` keys per rung: the nodes keep their numbers, the table is rebuilt."""
        old = (self.fpa, self.node, self.heap, self.scal.copy(), self.free)
        n0 = self.nodes
        self._alloc(nodes)
        fpa, node, heap, scal, free = old
        self.fpa[:, :n0], self.node[:, :, :n0] = fpa, node
        self.heap[:, :, : heap.shape[2]] = heap
        for r in range(len(self.P)):
            nfree = int(scal[r, S_NFREE])
            fresh = np.arange(nodes - 1, n0 - 1, -1, dtype=np.int64)
            self.free[r, : len(fresh)] = fresh
            self.free[r, len(fresh) : len(fresh) + nfree] = free[r, :nfree]
            self.scal[r, :S_TBITS] = scal[r, :S_TBITS]
            self.scal[r, S_NFREE] = len(fresh) + nfree
        rehash_kernel(self.fpa, self.node, self.table, self.scal)

    def run(self, fps: Any, parents: Any, has_parent: Any, counts: Any, capacities: Any, accesses: int) -> int:
        caps = np.ascontiguousarray(capacities, dtype=np.int64)
        return self.run_typed(np.ascontiguousarray(fps, dtype=np.uint64),
                              np.ascontiguousarray(parents, dtype=np.uint64),
                              np.ascontiguousarray(has_parent, dtype=np.bool_),
                              np.ascontiguousarray(counts, dtype=np.int64), caps,
                              int(caps.max()) if len(caps) else 0, accesses)  # fmt: skip

    def run_typed(self, fps: np.ndarray, parents: np.ndarray, has_parent: np.ndarray, counts: np.ndarray,
                  caps: np.ndarray, cap_max: int, accesses: int) -> int:  # fmt: skip
        """``run`` of contiguous arrays already of its types (uint64, uint64, bool, int64, int64), the largest
        capacity among ``caps`` given: what a caller that keeps them so (the adaptive policy's queue) calls."""
        if cap_max >= self.nodes:
            self._grow(2 * cap_max + 1)
        return int(
            run_kernel(self.fpa, self.node, self.free, self.table, self.heap, self.scal, self.last, self.score,
                       self.P, self.disagree, self._hits, fps, parents, has_parent, counts, caps, self.threshold,
                       accesses)
        )  # fmt: skip
