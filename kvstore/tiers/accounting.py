"""Tiers that only account bytes: no payload is ever held, copied or allocated.

They let the real ``BlockStore`` (index, placement, leaf-first eviction,
demotion, promotion) replay a trace at the sizes of a real model, e.g. 64 MiB
blocks of Llama-3-8B KV over terabytes of "capacity", on a laptop
(``python -m bench.replay``). Capacity is enforced exactly like a real tier:
``allocate`` answers None and ``write`` raises ``TierFull`` once the bytes in
use would pass ``capacity_bytes``, so the store must evict.

- ``AccountingMemoryTier``: a memory tier (HBM or DRAM rank). ``view`` hands
  back one shared empty buffer, so a writer's copy into it moves nothing.
- ``AccountingDiskTier``: a lower tier (NVMe rank by default). Reads fill
  nothing, as a disk tier whose bytes were never written.

Locations are small ints handed out from a free list; the byte count of each
live location is kept (in a numpy column: no Python object per block, so a
replay of 100M blocks fits) so ``free`` returns exactly what was taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.tiers.base import DRAM, NVME, TIER_NAMES, BlockMeta, MemoryTier, Tier, TierFull, TierStats

_EMPTY = memoryview(bytearray(0))


class _Ledger:
    """Byte accounting of one tier: location -> bytes in a numpy column (4 bytes a location, no Python
    object per block), with a free list of locations as a numpy stack."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be positive, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self.used = 0
        self.count = 0
        self._sizes = np.zeros(1024, dtype=np.int64)  # bytes + 1 of each taken location; 0: free
        self._free_locs = np.zeros(1024, dtype=np.int64)
        self._nfree = 0
        self._next = 0
        self.peak = 0

    def take(self, nbytes: int) -> int | None:
        if self.used + nbytes > self.capacity:
            return None
        if self._nfree:
            self._nfree -= 1
            loc = int(self._free_locs[self._nfree])
        else:
            loc = self._next
            self._next += 1
            if loc == len(self._sizes):
                self._sizes = np.concatenate([self._sizes, np.zeros(len(self._sizes), dtype=np.int64)])
        self._sizes[loc] = nbytes + 1
        self.used += nbytes
        self.count += 1
        self.peak = max(self.peak, self.used)
        return loc

    def holds(self, loc: int) -> bool:
        return 0 <= loc < self._next and self._sizes[loc] != 0

    def give_back(self, loc: int) -> None:
        if not self.holds(loc):
            raise KeyError(loc)  # a double free, as a real allocator would fail
        self.used -= int(self._sizes[loc]) - 1
        self._sizes[loc] = 0
        self.count -= 1
        if self._nfree == len(self._free_locs):
            self._free_locs = np.concatenate([self._free_locs, np.zeros(len(self._free_locs), dtype=np.int64)])
        self._free_locs[self._nfree] = loc
        self._nfree += 1


class _AccountingMixin:
    """The verbs both kinds share; ``self._ledger`` does the arithmetic."""

    loc_bits = 32  # locations are small ints: the index stores them in 4 bytes

    _ledger: _Ledger
    name: str

    @property
    def capacity_bytes(self) -> int:
        return self._ledger.capacity

    @property
    def used_bytes(self) -> int:
        return self._ledger.used

    @property
    def blocks(self) -> int:
        return self._ledger.count

    def write(self, metas: Sequence[BlockMeta], sources: Sequence[Any]) -> list[int]:
        locs: list[int] = []
        for meta in metas:
            loc = self._ledger.take(meta.stored_length)
            if loc is None:
                self.free(locs)
                raise TierFull(
                    f"{self.name} accounting tier full: {self._ledger.used} of {self._ledger.capacity} bytes in use"
                )
            locs.append(loc)
        return locs

    def read(self, locs: Sequence[int], lengths: Sequence[int], dests: Sequence[Any]) -> None:
        for loc in locs:
            if not self._ledger.holds(loc):
                raise KeyError(f"{self.name}: location {loc} is not allocated")

    def free(self, locs: Sequence[int]) -> None:
        for loc in locs:
            self._ledger.give_back(loc)

    def stats(self) -> TierStats:
        return TierStats(
            self.name,
            self.capacity_bytes,
            self.used_bytes,
            backend="accounting",
            extra={"peak_bytes": float(self._ledger.peak)},
        )


class AccountingMemoryTier(_AccountingMixin, MemoryTier):
    """A memory tier of ``capacity_bytes`` that stores nothing (rank DRAM unless told HBM)."""

    def __init__(self, capacity_bytes: int, *, rank: int = DRAM, max_block_bytes: int | None = None):
        self._ledger = _Ledger(capacity_bytes)
        self.rank = rank
        self.name = TIER_NAMES[rank]
        self._max_block = int(max_block_bytes or capacity_bytes)

    @property
    def max_block_bytes(self) -> int:
        return self._max_block

    def fits(self, nbytes: int) -> bool:
        return nbytes <= min(self._max_block, self.capacity_bytes)

    def allocate(self, nbytes: int) -> int | None:
        return self._ledger.take(nbytes)

    def view(self, loc: int, nbytes: int) -> Any:
        return _EMPTY


class AccountingDiskTier(_AccountingMixin, Tier):
    """A lower (non-memory) tier of ``capacity_bytes`` that stores nothing (rank NVMe by default)."""

    def __init__(self, capacity_bytes: int, *, rank: int = NVME):
        self._ledger = _Ledger(capacity_bytes)
        self.rank = rank
        self.name = TIER_NAMES[rank]
