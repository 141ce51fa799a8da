"""Chunked numpy columns: per-entry fields that grow a chunk at a time, never by copying.

A ``Column`` is a list of numpy arrays of ``CHUNK`` rows each (rows may have an
inner shape, e.g. two uint64 words of a key). Entry ``e`` lives in chunk
``e >> CHUNK_BITS`` at row ``e & CHUNK_MASK``. Growth appends zeroed chunks
(``np.zeros``: pages untouched stay unbacked), so a column never doubles, and
a reader holding a chunk never sees it swapped.

Verbs:

- ``ensure(n)``: room for entries 0..n-1;
- ``get(e)`` / ``set(e, v)``: one row (Python ints out);
- ``take(ids, plan)`` / ``put(ids, values, plan)`` / ``add(ids, delta, plan)``:
  gathers and scatters of many rows, where ``plan(ids)`` (computed once per
  batch and shared by every column) splits ids by chunk; ``add`` handles ids
  repeated in one batch;
- ``head(n)``: a copy of rows 0..n-1 as one array (whole-index scans).
"""

from __future__ import annotations

from typing import Any

import numpy as np

CHUNK_BITS = 16
CHUNK = 1 << CHUNK_BITS
CHUNK_MASK = CHUNK - 1

# (None, [(chunk, positions in ids, rows in chunk)]) for a batch spread over chunks,
# (chunk, rows) when every id falls in one chunk (the common case: a prefix is inserted together)
Plan = tuple[Any, Any]


def plan(ids: np.ndarray) -> Plan:
    if len(ids) == 0:
        return (0, ids)
    c = ids >> CHUNK_BITS
    first, last = int(c.min()), int(c.max())
    rows = ids & CHUNK_MASK
    if first == last:
        return (first, rows)
    groups = []
    for cc in range(first, last + 1) if last - first < 8 else np.unique(c).tolist():
        where = np.nonzero(c == cc)[0]
        if len(where):
            groups.append((cc, where, rows[where]))
    return (None, groups)


class Column:
    __slots__ = ("dtype", "inner", "chunks")

    def __init__(self, dtype: Any, inner: tuple[int, ...] = ()):
        self.dtype = np.dtype(dtype)
        self.inner = inner
        self.chunks: list[np.ndarray] = []

    def ensure(self, n: int) -> None:
        while len(self.chunks) * CHUNK < n:
            self.chunks.append(np.zeros((CHUNK, *self.inner), dtype=self.dtype))

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def get(self, e: int) -> Any:
        return self.chunks[e >> CHUNK_BITS][e & CHUNK_MASK].item()

    def row(self, e: int) -> np.ndarray:
        return self.chunks[e >> CHUNK_BITS][e & CHUNK_MASK]

    def set(self, e: int, v: Any) -> None:
        self.chunks[e >> CHUNK_BITS][e & CHUNK_MASK] = v

    def take(self, ids: np.ndarray, p: Plan | None = None) -> np.ndarray:
        c, rows = plan(ids) if p is None else p
        if c is not None:
            if len(rows) == 0:
                return np.zeros((0, *self.inner), dtype=self.dtype)
            return self.chunks[c][rows]
        out = np.empty((len(ids), *self.inner), dtype=self.dtype)
        for cc, where, r in rows:
            out[where] = self.chunks[cc][r]
        return out

    def put(self, ids: np.ndarray, values: Any, p: Plan | None = None) -> None:
        c, rows = plan(ids) if p is None else p
        if c is not None:
            if len(rows):
                self.chunks[c][rows] = values
            return
        values = np.broadcast_to(np.asarray(values, dtype=self.dtype), (len(ids), *self.inner))
        for cc, where, r in rows:
            self.chunks[cc][r] = values[where]

    def add(self, ids: np.ndarray, delta: int, p: Plan | None = None) -> None:
        c, rows = plan(ids) if p is None else p
        op, step = (np.add, self.dtype.type(delta)) if delta >= 0 else (np.subtract, self.dtype.type(-delta))
        if c is not None:
            if len(rows):
                op.at(self.chunks[c], rows, step)
            return
        for cc, _, r in rows:
            op.at(self.chunks[cc], r, step)

    def head(self, n: int) -> np.ndarray:
        if n <= 0 or not self.chunks:
            return np.zeros((0, *self.inner), dtype=self.dtype)
        full, rest = divmod(n, CHUNK)
        parts = self.chunks[:full] + ([self.chunks[full][:rest]] if rest else [])
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
