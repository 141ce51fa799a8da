"""Compiled passes of an eviction policy's ``touch_many`` (numba, optional): a Get's 32 touches in one call.

``touch(keys, nss, up0, up1, nup, r0, r1, r2, r3, shift, ids, start, added, clock, bonus, threshold,
parent, parent_gen, gen, flags, sample, steps, buf) -> (done, added, m)`` does for ``ids[start:]`` in order
what ``FrequencyLeafLRU._touch_counts`` does with numpy calls and ``FrequencySketch.count_many``, and what
the policies' loops then did per entry:

- each entry's fingerprint (``EntryTable.fp``: the key's halves xor-ed, plus the namespace times a
  constant) into ``fps``; whether a tier above holds it (``up0``, ``up1``: the raw location columns of the
  first ``nup`` ranks above, 0 where no copy); its count into ``counts``: ``add`` where none does, else
  ``estimate``, exactly as ``sketch_jit.count``;
- its priority into ``prio``: ``clock + i + 1`` (as a float) plus ``bonus`` where its count reaches
  ``threshold``, and its class into ``cls`` (``REUSED`` there, else ``ONCE``: kvstore/store/adaptive.py).

Like ``sketch_jit.count`` it stops after the addition that brings ``added`` to a multiple of 1024 (the
sketch's aging is due) and returns how far it got, the new ``added`` and -1; the caller ages the sketch,
fixes that one count (and its priority and class) and calls again from there. Once at the end it appends
to ``queue`` (a ``ShadowQueue``: the adaptive policy's shadow accesses not replayed yet) each entry whose
fingerprint is a multiple of ``sample`` (none when ``sample`` is 0), in order, with its count, the capacity
``cap`` and its nearest sampled ancestor within ``steps`` (what ``shadow_jit.ancestors`` finds), and
returns the queue's new length. ``buf`` is a ``TouchBuffers`` (arrays of ``rows`` rows, reused from call
to call: a policy makes new ones, twice as long, for a longer batch).

``AVAILABLE`` says whether numba is importable; kvstore/store/frequency.py keeps the numpy path otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.jit import AVAILABLE as AVAILABLE  # re-exported: callers ask the kernel module
from kvstore.jit import numba

LIVE = 1  # the index's live flag (kvstore/store/index.py)
ONCE, REUSED = 1, 2  # the adaptive policy's classes (kvstore/store/adaptive.py)


class Absent:
    """Stands for the location column of an absent rank above (``nup`` says it is not read)."""

    base = np.zeros(1, dtype=np.uint32)


NO_UPPER = Absent()


class TouchBuffers:
    """The arrays ``touch`` writes, ``rows`` long, reused by one policy from call to call."""

    __slots__ = ("rows", "fps", "counts", "prio", "cls")

    def __init__(self, rows: int):
        self.rows = rows
        self.fps, self.prio = np.zeros(rows, dtype=np.uint64), np.zeros(rows, dtype=np.float64)
        self.counts, self.cls = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)


class ShadowQueue:
    """Shadow accesses waiting to be replayed, in order: ``n`` rows of fingerprint, ancestor's fingerprint,
    whether there is one, count and capacity (the arguments of ``JitShadows.run``)."""

    __slots__ = ("n", "cap_max", "fps", "anc", "has", "counts", "caps")

    def __init__(self, rows: int = 256):
        self.n = self.cap_max = 0  # rows held, and the largest capacity among them
        self.fps, self.anc = np.zeros(rows, dtype=np.uint64), np.zeros(rows, dtype=np.uint64)
        self.has = np.zeros(rows, dtype=np.bool_)
        self.counts, self.caps = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)

    def reserve(self, more: int) -> None:
        """Room for ``more`` rows after the ``n`` held (the arrays grow, copying, when short)."""
        if self.n + more > self.fps.shape[0]:
            rows, n = 2 * (self.n + more), self.n
            for name in self.__slots__[2:]:
                old = getattr(self, name)
                new = np.zeros(rows, dtype=old.dtype)
                new[:n] = old[:n]
                setattr(self, name, new)

    def take(self) -> tuple[np.ndarray, ...]:
        """The rows held (views), the queue emptied."""
        n, self.n, self.cap_max = self.n, 0, 0
        return self.fps[:n], self.anc[:n], self.has[:n], self.counts[:n], self.caps[:n]


NO_QUEUE = ShadowQueue(1)  # for a policy without shadows (``sample`` 0: never written)
_kernel: Any = None


def touch(columns: list[Any], nup: int, rows: list[Any], shift: int, ids: Any, start: int, added: int, clock: int,
          bonus: float, threshold: int, sample: int, steps: int, cap: int, buf: TouchBuffers,
          queue: ShadowQueue) -> tuple[int, int, int]:  # fmt: skip
    """The compiled pass of the module doc (``columns``: the index's key, ns, the two location columns above,
    parent, parent_gen, gen and flags; ``rows``: the sketch's four)."""
    keys, nss, up0, up1, parent, parent_gen, gen, flags = columns
    r0, r1, r2, r3 = rows
    q = queue
    return _kernel(keys, nss, up0, up1, nup, r0, r1, r2, r3, shift, ids, start, added, clock, bonus, threshold,
                   parent, parent_gen, gen, flags, sample, steps, cap, buf.fps, buf.counts, buf.prio, buf.cls,
                   q.fps, q.anc, q.has, q.counts, q.caps, q.n)  # fmt: skip


if AVAILABLE:
    _U = numba.uint64
    _FP = _U(0x9E3779B97F4A7C15)  # the fingerprint's namespace multiplier (kvstore/store/index_views.py)
    from kvstore.store.sketch_jit import bump  # the sketch's counting step, inlined here

    @numba.njit(cache=True, nogil=True)
    def _touch(keys, nss, up0, up1, nup, r0, r1, r2, r3, shift, ids, start, added, clock, bonus, threshold,  # type: ignore[no-untyped-def]
               parent, parent_gen, gen, flags, sample, steps, cap, fps, out, prio, cls,
               qfps, qanc, qhas, qcounts, qcaps, qn):  # fmt: skip
        sh = numba.uint64(shift)
        for i in range(start, len(ids)):
            e = ids[i]
            fp = (keys[e, 0] ^ keys[e, 1]) + numba.uint64(nss[e]) * _FP
            fps[i] = fp
            counted = not ((nup > 0 and up0[e] != 0) or (nup > 1 and up1[e] != 0))  # else counted above
            count = bump(r0, r1, r2, r3, sh, fp, counted)
            if counted:
                count = min(count + 1, 255)
            out[i] = count
            reused = count >= threshold
            prio[i] = numba.float64(clock + i + 1) + bonus if reused else numba.float64(clock + i + 1)
            cls[i] = REUSED if reused else ONCE
            if counted:
                added += 1
                if added & 1023 == 0:
                    return i + 1, added, -1
        m = qn
        if sample > 0:
            q = numba.uint64(sample)
            for i in range(len(ids)):
                if fps[i] % q != 0:
                    continue
                qfps[m], qcounts[m], qcaps[m] = fps[i], out[i], cap
                qanc[m] = 0
                qhas[m] = False
                e = ids[i]
                for _ in range(steps):
                    p = numba.int64(parent[e]) - 1
                    if p < 0 or not (flags[p] & LIVE) or gen[p] != parent_gen[e]:
                        break
                    fp = (keys[p, 0] ^ keys[p, 1]) + numba.uint64(nss[p]) * _FP
                    if fp % q == 0:
                        qanc[m] = fp
                        qhas[m] = True
                        break
                    e = p
                m += 1
        return len(ids), added, m

    _kernel = _touch
