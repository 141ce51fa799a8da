"""A compiled step of giving entries a copy in a tier (numba, optional): the child counts of their parents.

``add_copies(parent, parent_gen, gen, flags, counts, ids, is_leaf, was_leaf) -> k`` does for a batch of
distinct entries just given a copy in one tier what ``EntryTable.parents_of``, ``add_children`` and the
``nchild`` read after them do in about twenty numpy calls (0.1 ms of a 32-block promotion or Put here): each
entry's parent, when it is still the block it was (live, the same generation), counts one more child with a
copy (``counts``: that tier's uint16 child counts, changed in place); ``was_leaf[:k]`` are the parents whose
count went up from 0 that are not in the batch (they stopped being leaves of the tier); ``is_leaf[i]`` says
whether ``ids[i]`` has no child with a copy afterwards. It returns -1 and changes nothing when a parent's
count could reach ``WIDE`` (those live in a dict: the numpy path handles them). ``AVAILABLE`` says whether
numba is importable; kvstore/store/index.py runs the numpy calls otherwise.
"""

from __future__ import annotations

from typing import Any

from kvstore.jit import AVAILABLE as AVAILABLE  # re-exported: callers ask the kernel module
from kvstore.jit import numba

LIVE = 1  # the index's flag (kvstore/store/index.py)
WIDE = 0xFFFF  # a count this high lives in CountColumn.big

add_copies: Any = None

if AVAILABLE:

    @numba.njit(cache=True, inline="always")
    def _parent(parent, parent_gen, gen, flags, e):  # type: ignore[no-untyped-def]
        p = numba.int64(parent[e]) - 1
        if p >= 0 and flags[p] & LIVE and gen[p] == parent_gen[e]:
            return p
        return numba.int64(-1)

    @numba.njit(cache=True, nogil=True)
    def add_copies(parent, parent_gen, gen, flags, counts, ids, is_leaf, was_leaf):  # type: ignore[no-untyped-def]
        n = len(ids)
        for i in range(n):
            p = _parent(parent, parent_gen, gen, flags, ids[i])
            if p >= 0 and numba.int64(counts[p]) + n >= WIDE:
                return -1
        k = 0
        for i in range(n):
            p = _parent(parent, parent_gen, gen, flags, ids[i])
            if p < 0:
                continue
            if counts[p] == 0:
                outside = True
                for j in range(n):
                    if ids[j] == p:
                        outside = False
                        break
                if outside:
                    was_leaf[k] = p
                    k += 1
            counts[p] += 1
        for i in range(n):
            is_leaf[i] = counts[ids[i]] == 0
        return k
