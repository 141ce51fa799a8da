"""Buffers for Get results the caller did not provide (``out=None``), recycled once dropped.

Fresh memory is paid for by page faults and by the kernel zeroing each page:
here one 2 MiB ``np.empty`` per block ran at 1.2 GB/s where copying into
memory already faulted in ran at 10 GB/s. So:

- ``alloc_blocks(lengths) -> [memoryview]``: views carved from one anonymous
  mapping per batch (transparent huge pages where the kernel allows them),
  taken from the pool when one of a fitting size is there.
- A batch's mapping comes back to the pool when the caller has dropped every
  view of it (a finalizer on a numpy array private to the batch), so the next
  batch lands in memory that is already faulted in. The pool keeps at most
  ``POOL_BYTES`` per process, the most recently returned first: a mapping
  coming back pushes out the oldest ones (a caller whose batch size grew
  would otherwise find the pool full of sizes it no longer asks for and fault
  in every batch again: measured, 2 MiB TCP gets at 3.6-4.5 GB/s instead of
  6). One larger than the whole pool is unmapped as usual.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from kvstore.hugepages import HUGE_PAGE, advise_mapping

POOL_BYTES = 256 << 20


class BufferPool:
    def __init__(self, limit: int = POOL_BYTES):
        self.limit = limit
        self._free: list[mmap.mmap] = []
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def alloc_blocks(self, lengths: Sequence[int]) -> list[memoryview]:
        total = sum(lengths)
        if total == 0:
            return [memoryview(b"") for _ in lengths]
        mapping = self._take(total) or _new_mapping(-(-total // HUGE_PAGE) * HUGE_PAGE)
        array = np.frombuffer(mapping, dtype=np.uint8)
        weakref.finalize(array, self._give, mapping)
        views, offset = [], 0
        for n in lengths:
            views.append(array[offset : offset + n].data)
            offset += n
        return views

    def _take(self, nbytes: int) -> mmap.mmap | None:
        with self._lock:
            fits = [m for m in self._free if nbytes <= len(m) <= 2 * nbytes + HUGE_PAGE]
            if not fits:
                return None
            mapping = min(fits, key=len)
            self._free.remove(mapping)
            self._bytes -= len(mapping)
            return mapping

    def _give(self, mapping: mmap.mmap) -> None:
        """Runs as the batch's array dies (its buffer export is released just after): pool or drop."""
        if len(mapping) > self.limit:
            return
        with self._lock:
            self._free.append(mapping)
            self._bytes += len(mapping)
            while self._bytes > self.limit:
                self._bytes -= len(self._free.pop(0))  # the oldest goes (unmapped when collected)


def _new_mapping(size: int) -> mmap.mmap:
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_mapping(mapping)
    return mapping


POOL = BufferPool()


def alloc_blocks(lengths: Sequence[int]) -> list[memoryview]:
    """Buffers for a batch of blocks from the process-wide pool (see the module docstring)."""
    return POOL.alloc_blocks(lengths)
