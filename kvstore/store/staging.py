"""Staging memory for blocks read from NVMe that no DRAM slot can take: reused, never allocated per Get.

``Staging(capacity_bytes)`` is a private arena (``ArenaTier``, pageable, page-aligned slots) made on first
use. ``take(nbytes) -> (loc, view) | None`` hands out a slot whose bytes NVMe can be read into in place (no
zero-fill: the pages were faulted in by an earlier Get, or by the kernel once); ``give(loc)`` returns it.
``None`` means the arena is full (many Gets at once, or a block larger than its slots): the caller then
allocates, and ``overflows`` counts how often. Not thread-safe: the BlockStore calls it under its lock.
"""

from __future__ import annotations

from typing import Any

from kvstore.tiers.arena import ArenaTier


class Staging:
    def __init__(self, capacity_bytes: int, page_bytes: int = 8 << 20):
        self.capacity_bytes = capacity_bytes
        self.page_bytes = page_bytes
        self._arena: ArenaTier | None = None
        self.overflows = 0
        self.taken = 0

    def take(self, nbytes: int) -> tuple[int, Any] | None:
        if self.capacity_bytes <= 0:
            return None
        if self._arena is None:
            self._arena = ArenaTier(self.capacity_bytes, page_size=self.page_bytes, pinned=False)
        loc = self._arena.allocate(nbytes) if self._arena.fits(nbytes) else None
        if loc is None:
            self.overflows += 1
            return None
        self.taken += 1
        return loc, self._arena.view(loc, nbytes)

    def give(self, loc: int) -> None:
        assert self._arena is not None
        self._arena.free([loc])

    @property
    def used_bytes(self) -> int:
        return 0 if self._arena is None else self._arena.used_bytes
