"""Per-entry columns that grow without copying: each is one zeroed numpy reservation, committed as it is touched.

A ``Column`` keeps its rows in one array, ``base``, allocated with room for
``RESERVE_SMALL`` rows (1M), then, once an index outgrows that, for
``RESERVE_LARGE`` rows (2**28, the most entries the slot index can address).
``np.zeros`` of that size is a lazily mapped, zero-filled reservation: pages
nobody wrote take no memory, so growing within it copies nothing and a column
never doubles (the one switch from small to large copies the first 1M rows).
``rows`` is the high-water mark rounded up to ``CHUNK``: what ``nbytes``
counts. Where the kernel refuses the reservation (no overcommit), a column
falls back to twice what it needs, copying on growth.

One array per column is also what compiled kernels (kvstore/store/slots_jit.py)
and numpy gathers index directly: no per-chunk dispatch.

Verbs: ``ensure(n)`` (room for entries 0..n-1), ``get(e)`` / ``set(e, v)``,
``take(ids)`` / ``put(ids, values)`` / ``add(ids, delta)`` (ids may repeat in
``add``), ``head(n)`` (a copy of rows 0..n-1, for whole-index scans).
"""

from __future__ import annotations

from typing import Any

import numpy as np

CHUNK = 1 << 16
RESERVE_SMALL = 1 << 20
RESERVE_LARGE = 1 << 28


class Column:
    __slots__ = ("dtype", "inner", "base", "rows")

    def __init__(self, dtype: Any, inner: tuple[int, ...] = ()):
        self.dtype = np.dtype(dtype)
        self.inner = inner
        self.base = np.zeros((0, *inner), dtype=self.dtype)
        self.rows = 0

    def ensure(self, n: int) -> None:
        if n <= self.rows:
            return
        self.rows = -(-n // CHUNK) * CHUNK
        if self.rows > len(self.base):
            self._reserve(self.rows)

    def _reserve(self, rows: int) -> None:
        want = RESERVE_SMALL if len(self.base) == 0 else RESERVE_LARGE
        for size in (max(rows, want), 2 * rows):
            try:
                base = np.zeros((size, *self.inner), dtype=self.dtype)
                break
            except MemoryError:  # no overcommit here: take what is needed, copying on growth
                continue
        else:
            raise MemoryError(f"cannot reserve {rows} rows of {self.dtype}")
        base[: len(self.base)] = self.base
        self.base = base

    def nbytes(self) -> int:
        return self.rows * self.dtype.itemsize * int(np.prod(self.inner or (1,)))

    def get(self, e: int) -> Any:
        return self.base[e].item() if self.inner else self.base.item(e)

    def row(self, e: int) -> np.ndarray:
        return self.base[e]

    def set(self, e: int, v: Any) -> None:
        self.base[e] = v

    def take(self, ids: np.ndarray) -> np.ndarray:
        return self.base[ids]

    def put(self, ids: Any, values: Any) -> None:
        self.base[ids] = values

    def add(self, ids: np.ndarray, delta: int) -> None:
        if delta >= 0:
            np.add.at(self.base, ids, self.dtype.type(delta))
        else:
            np.subtract.at(self.base, ids, self.dtype.type(-delta))

    def head(self, n: int) -> np.ndarray:
        return self.base[: max(n, 0)].copy()


class Field:
    """A bit field of a Column (``bits`` wide at ``shift``): two small fields share one byte of a row.

    The Column verbs (``get``, ``set``, ``take``, ``put``, ``head``) in the field's own values; a value that
    does not fit in ``bits`` raises ValueError instead of spilling into its neighbour.
    """

    __slots__ = ("col", "shift", "mask", "dtype")

    def __init__(self, col: Column, shift: int, bits: int):
        self.col, self.shift, self.mask = col, shift, (1 << bits) - 1
        self.dtype = col.dtype

    @property
    def limit(self) -> int:
        """The largest value the field holds."""
        return self.mask

    def check(self, values: Any) -> None:
        a = np.asarray(values)
        if a.size and (int(a.max()) > self.mask or int(a.min()) < 0):
            raise ValueError(f"a value of {a.max()} does not fit the index's {self.mask.bit_length()}-bit field")

    def get(self, e: int) -> int:
        return (self.col.base.item(e) >> self.shift) & self.mask

    def set(self, e: int, v: int) -> None:
        self.check(v)
        base = self.col.base
        base[e] = (base.item(e) & ~(self.mask << self.shift) & 0xFF) | (int(v) << self.shift)

    def _unpack(self, raw: np.ndarray) -> np.ndarray:
        return (raw >> self.dtype.type(self.shift)) & self.dtype.type(self.mask)

    def take(self, ids: np.ndarray) -> np.ndarray:
        return self._unpack(self.col.take(ids))

    def head(self, n: int) -> np.ndarray:
        return self._unpack(self.col.head(n))

    def put(self, ids: Any, values: Any) -> None:
        self.check(values)
        base = self.col.base
        keep = self.dtype.type(~(self.mask << self.shift) & 0xFF)
        base[ids] = (base[ids] & keep) | (np.asarray(values).astype(self.dtype) << self.dtype.type(self.shift))


WIDE = 0xFFFF  # a CountColumn row holding this: the count is in ``big``


class CountColumn(Column):
    """A count per row in a uint16 column; the rare counts of ``WIDE`` or more live in a dict (``big``).

    What a block's children in one tier are counted in: nearly always a few, but a shared prefix (a system
    prompt) may have any number, and leaf-first eviction needs the exact count. ``get`` / ``set`` /
    ``take`` / ``put`` / ``add`` / ``head`` read and write exact counts (int64 arrays out).
    """

    __slots__ = ("big",)

    def __init__(self) -> None:
        super().__init__(np.uint16)
        self.big: dict[int, int] = {}

    def get(self, e: int) -> int:
        v: int = self.base.item(e)
        return self.big[e] if v == WIDE else v

    def set(self, e: int, v: Any) -> None:
        v = int(v)
        if v < 0:
            raise ValueError("a count cannot go below 0")
        if v >= WIDE:
            self.big[e] = v
            self.base[e] = WIDE
            return
        if self.big:
            self.big.pop(e, None)
        self.base[e] = v

    def _exact(self, raw: np.ndarray, ids: Any) -> np.ndarray:
        out = raw.astype(np.int64)
        if self.big:
            wide = np.nonzero(out == WIDE)[0]
            if len(wide):
                rows = np.asarray(ids)[wide] if ids is not None else wide
                out[wide] = [self.big[int(e)] for e in rows.tolist()]
        return out

    def take(self, ids: np.ndarray) -> np.ndarray:
        return self._exact(self.base[ids], ids)

    def head(self, n: int) -> np.ndarray:
        return self._exact(self.base[: max(n, 0)], None)

    def put(self, ids: Any, values: Any) -> None:
        if values.__class__ is int and 0 <= values < WIDE:  # the common case: rows of new entries set to 0
            if self.big:
                for e in np.asarray(ids).reshape(-1).tolist():
                    self.big.pop(e, None)
            self.base[ids] = values
            return
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        vals = np.broadcast_to(np.asarray(values, dtype=np.int64), ids.shape)
        if len(vals) and int(vals.min()) < 0:
            raise ValueError("a count cannot go below 0")
        if self.big:
            for e in ids.tolist():
                self.big.pop(e, None)
        wide = vals >= WIDE
        if wide.any():
            self.big.update(zip(ids[wide].tolist(), vals[wide].tolist()))
        self.base[ids] = np.minimum(vals, WIDE)

    def add(self, ids: np.ndarray, delta: int) -> None:
        uniq, times = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
        self.put(uniq, self.take(uniq) + delta * times)

    def nbytes(self) -> int:
        return super().nbytes() + 64 * len(self.big)
