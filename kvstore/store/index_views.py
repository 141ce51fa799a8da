"""Array-like views of the index's columns, under the names callers have always read.

``EntryTable`` keeps its fields in packed columns (kvstore/store/columns.py);
these views let code written against plain numpy columns keep working:

- ``ScalarView``: ``v[e]`` (an int), ``v[e] = x``, ``v[ids]`` (an array),
  ``v[ids] = xs``, ``v[:n]`` (a read-only copy), ``np.asarray(v)``, ``len(v)``,
  ``v.sum()``; an ``offset`` is subtracted on read and added on write (a
  column that stores value + 1 so that 0 means "none");
- ``FlagView``: one bit of a flags column, read and written as bools;
- ``RankedView``: per-rank columns as one ``(n, N_RANKS)`` int array:
  ``v[e, rank]``, ``v[ids]``, ``v[:, rank]``, ``v.shape``; ranks without a column read -1
  after the offset (no location) or 0;
- ``HashView``: ``v[e]`` / ``v[ids]`` as 16 uint8 per row;
- ``FingerprintView``: ``v[e]`` / ``v[ids]``: ``block_fingerprint`` of each entry, computed.
- ``FieldView``: a bit field of a column (codec and dtype share one byte), as a ``ScalarView``.
- ``CountView``: a ``RankedView`` of count columns (children per tier) whose rare wide counts live aside.

Every read past the highest id handed out raises IndexError, as numpy would.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.store.columns import Column, CountColumn, Field

N_RANKS = 4
_FP_MIX = np.uint64(0x9E3779B97F4A7C15)
_M64 = (1 << 64) - 1


def _ids(k: Any) -> np.ndarray:
    ids = np.asarray(k, dtype=np.int64)
    return ids


class _View(ABC):
    def __init__(self, size: Callable[[], int]):
        self._size = size

    def __len__(self) -> int:
        return self._size()

    @property
    def shape(self) -> tuple[int, ...]:
        return (self._size(),)

    def _check(self, e: int) -> int:
        if e < 0:
            e += self._size()
        if not 0 <= e < self._size():
            raise IndexError(f"entry {e} out of range")
        return e

    @abstractmethod
    def _all(self) -> np.ndarray:
        """The whole column as one array (what ``np.asarray(view)`` gives)."""

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self._all()
        return a if dtype is None else a.astype(dtype)

    def sum(self) -> Any:
        return self._all().sum()

    def _slice(self, k: slice) -> np.ndarray:
        a = self._all()[k]
        a.flags.writeable = False  # a copy: writing into it would change nothing in the index
        return a


class ScalarView(_View):
    def __init__(self, col: Column, size: Callable[[], int], offset: int = 0):
        super().__init__(size)
        self.col, self.offset = col, offset
        self.dtype = np.dtype(np.int64) if offset else col.dtype

    def _all(self) -> np.ndarray:
        a = self.col.head(self._size())
        return a.astype(np.int64) - self.offset if self.offset else a

    def __getitem__(self, k: Any) -> Any:
        if k.__class__ is int and 0 <= k < self._size():  # the common case first: one entry by a Python int
            return self.col.base.item(k) - self.offset
        if isinstance(k, (int, np.integer)):
            e = self._check(int(k))
            return self.col.base.item(e) - self.offset
        if isinstance(k, slice):
            return self._slice(k)
        a = self.col.take(_ids(k))
        return a.astype(np.int64) - self.offset if self.offset else a

    def __setitem__(self, k: Any, v: Any) -> None:
        if isinstance(k, (int, np.integer)):
            e = self._check(int(k))
            self.col.base[e] = int(v) + self.offset
            return
        self.col.put(_ids(k), np.asarray(v) + self.offset if self.offset else v)


class FlagView(_View):
    dtype = np.dtype(np.bool_)

    def __init__(self, col: Column, bit: int, size: Callable[[], int]):
        super().__init__(size)
        self.col, self.bit = col, bit

    def _all(self) -> np.ndarray:
        return (self.col.head(self._size()) & self.bit) != 0

    def __getitem__(self, k: Any) -> Any:
        if k.__class__ is int and 0 <= k < self._size():
            return bool(self.col.base.item(k) & self.bit)
        if isinstance(k, (int, np.integer)):
            e = self._check(int(k))
            return bool(self.col.base.item(e) & self.bit)
        if isinstance(k, slice):
            return self._slice(k)
        return (self.col.take(_ids(k)) & self.bit) != 0

    def __setitem__(self, k: Any, v: Any) -> None:
        e = self._check(int(k))
        base = self.col.base
        old = base.item(e)
        base[e] = (old | self.bit) if v else (old & ~self.bit)

    def __and__(self, other: Any) -> np.ndarray:
        return self._all() & np.asarray(other)


class RankedView(_View):
    dtype = np.dtype(np.int64)

    def __init__(self, cols: dict[int, Column], size: Callable[[], int], offset: int = 0):
        super().__init__(size)
        self.cols, self.offset = cols, offset

    @property
    def shape(self) -> tuple[int, ...]:
        return (self._size(), N_RANKS)

    def _rank_all(self, rank: int, n: int) -> np.ndarray:
        col = self.cols.get(rank)
        if col is None:
            return np.full(n, -self.offset, dtype=np.int64)
        return col.head(n).astype(np.int64) - self.offset

    def _all(self) -> np.ndarray:
        n = self._size()
        out = np.full((n, N_RANKS), -self.offset, dtype=np.int64)
        for rank in self.cols:
            out[:, rank] = self._rank_all(rank, n)
        return out

    def _one(self, rank: int, e: int) -> int:
        col = self.cols.get(rank)
        return -self.offset if col is None else col.base.item(e) - self.offset

    def _take(self, rank: int, ids: np.ndarray) -> np.ndarray:
        return self.cols[rank].take(ids).astype(np.int64) - self.offset

    def __getitem__(self, k: Any) -> Any:
        if k.__class__ is tuple:
            e, rank = k
            if e.__class__ is int and 0 <= e < self._size():
                return self._one(rank, e)
            if isinstance(e, (int, np.integer)):
                return self._one(rank, self._check(int(e)))
            if isinstance(e, slice):
                a = self._rank_all(rank, self._size())[e]
                a.flags.writeable = False
                return a
            return self[_ids(e)][:, rank]
        if isinstance(k, (int, np.integer)):
            return self[np.asarray([int(k)])][0]
        if isinstance(k, slice):
            return self._slice(k)
        ids = _ids(k)
        out = np.full((len(ids), N_RANKS), -self.offset, dtype=np.int64)
        for rank in self.cols:
            out[:, rank] = self._take(rank, ids)
        return out

    def __setitem__(self, k: Any, v: Any) -> None:
        e, rank = k
        e = self._check(int(e))
        self.cols[rank].base[e] = int(v) + self.offset


class HashView(_View):
    dtype = np.dtype(np.uint8)

    def __init__(self, col: Column, size: Callable[[], int]):
        super().__init__(size)
        self.col = col

    @property
    def shape(self) -> tuple[int, ...]:
        return (self._size(), 16)

    def _all(self) -> np.ndarray:
        return self.col.head(self._size()).view(np.uint8).reshape(-1, 16)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, (int, np.integer)):
            return self.col.row(self._check(int(k))).view(np.uint8).copy()
        if isinstance(k, slice):
            return self._slice(k)
        return self.col.take(_ids(k)).view(np.uint8).reshape(-1, 16)


class FingerprintView(_View):
    dtype = np.dtype(np.uint64)

    def __init__(self, keys: Column, ns: Column, size: Callable[[], int]):
        super().__init__(size)
        self.keys, self.ns = keys, ns

    def _all(self) -> np.ndarray:
        n = self._size()
        return self._fp(self.keys.head(n), self.ns.head(n))

    @staticmethod
    def _fp(k: np.ndarray, ns: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return (k[:, 0] ^ k[:, 1]) + ns.astype(np.uint64) * _FP_MIX

    def __getitem__(self, k: Any) -> Any:
        if k.__class__ is int or isinstance(k, np.integer):
            e = self._check(int(k))
            keys = self.keys.base
            return ((keys.item(e, 0) ^ keys.item(e, 1)) + self.ns.base.item(e) * 0x9E3779B97F4A7C15) & _M64
        if isinstance(k, slice):
            return self._slice(k)
        ids = _ids(k)
        return self._fp(self.keys.take(ids), self.ns.take(ids))


class FieldView(_View):
    """A bit field of a column (kvstore/store/columns.py ``Field``), read and written as a ScalarView is."""

    def __init__(self, field: Field, size: Callable[[], int]):
        super().__init__(size)
        self.field = field
        self.dtype = field.dtype

    def _all(self) -> np.ndarray:
        return self.field.head(self._size())

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, (int, np.integer)):
            return self.field.get(self._check(int(k)))
        if isinstance(k, slice):
            return self._slice(k)
        return self.field.take(_ids(k))

    def __setitem__(self, k: Any, v: Any) -> None:
        if isinstance(k, (int, np.integer)):
            self.field.set(self._check(int(k)), int(v))
            return
        self.field.put(_ids(k), v)


class CountView(RankedView):
    """A RankedView of per-rank CountColumns (kvstore/store/columns.py): exact counts, the wide ones included."""

    def __init__(self, cols: dict[int, CountColumn], size: Callable[[], int]):
        super().__init__(dict(cols), size)
        self.counts = cols

    def _rank_all(self, rank: int, n: int) -> np.ndarray:
        col = self.counts.get(rank)
        return np.zeros(n, dtype=np.int64) if col is None else col.head(n)

    def _one(self, rank: int, e: int) -> int:
        col = self.counts.get(rank)
        return 0 if col is None else col.get(e)

    def _take(self, rank: int, ids: np.ndarray) -> np.ndarray:
        return self.counts[rank].take(ids)

    def __setitem__(self, k: Any, v: Any) -> None:
        e, rank = k
        self.counts[rank].set(self._check(int(e)), int(v))
