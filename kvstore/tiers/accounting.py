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
- ``AccountingLogTier``: a lower tier whose space comes back as the NVMe
  tier's does, a segment at a time (segments, compaction, ``freed_with``).

Locations are small ints handed out from a free list; the byte count of each
live location is kept (in a numpy column: no Python object per block, so a
replay of 100M blocks fits) so ``free`` returns exactly what was taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
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


@dataclass
class _Segment:
    records: dict[int, int] = field(default_factory=dict)  # record number -> bytes, while live
    live: int = 0  # bytes of its live records
    end: int = 0  # bytes appended (the segment is sealed once the next record does not fit)
    appended: int = 0  # records appended: the next one's number


class AccountingLogTier(Tier):
    """A lower tier of ``capacity_bytes`` kept as the NVMe tier keeps its bytes, as a log of
    ``segment_bytes`` segments, storing nothing: records are appended to the segment being written; a freed
    record's space comes back only when its segment holds nothing live (the segment goes) or ``compact``
    copies the segment's live records to the head of the log (counted: ``stats().extra["relocated"]``) and
    reports the moves to ``on_relocate``. ``TierFull`` when a write needs a segment past the
    ``capacity_bytes // segment_bytes`` allowed, one of which only compaction may use. So a replay of the
    real ``BlockStore`` (``python -m bench.replay_log``) measures what eviction costs a log: the records
    compaction copies, and the hit rate of what the store keeps."""

    loc_bits = 64
    SHIFT = 32  # a location is segment << SHIFT | record number

    def __init__(self, capacity_bytes: int, segment_bytes: int, *, rank: int = NVME):
        if segment_bytes <= 0 or capacity_bytes // segment_bytes < 2:
            raise ValueError("a log tier needs room for at least 2 segments")
        self.rank, self.name = rank, TIER_NAMES[rank]
        self._capacity, self.segment_bytes = int(capacity_bytes), int(segment_bytes)
        self.max_segments = self._capacity // self.segment_bytes
        self._segments: dict[int, _Segment] = {}
        self._active = -1
        self._next_id = 0
        self._live = 0
        self._pressure = False
        self.on_relocate: Callable[[list[tuple[int, int]]], None] | None = None
        self.counts = {"records_written": 0, "relocated": 0, "compactions": 0, "segments_dropped": 0}

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._live

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.segment_bytes

    def freed_with(self, loc: int) -> tuple[int, int] | None:
        segment = loc >> self.SHIFT
        if segment == self._active:
            return None
        return segment << self.SHIFT, (segment + 1) << self.SHIFT

    def write(self, metas: Sequence[BlockMeta], sources: Sequence[Any]) -> list[int]:
        locs = self._append([m.stored_length for m in metas], reserve=False)
        self.counts["records_written"] += len(locs)
        return locs

    def _append(self, sizes: list[int], reserve: bool) -> list[int]:
        active = self._segments.get(self._active)
        free, new = (self.segment_bytes - active.end if active else 0), 0
        for n in sizes:
            if n > free:
                new, free = new + 1, self.segment_bytes
            free -= n
        if new and len(self._segments) + new > self.max_segments - (0 if reserve else 1):
            self._pressure = True
            raise TierFull(f"{self.name} log full: {len(self._segments)} of {self.max_segments} segments")
        locs = []
        for n in sizes:
            active = self._segments.get(self._active)
            if active is None or active.end + n > self.segment_bytes:
                sealed = self._active
                self._active, self._next_id = self._next_id, self._next_id + 1
                active = self._segments[self._active] = _Segment()
                if sealed in self._segments and not self._segments[sealed].live:
                    self._drop(sealed)
            number = active.appended
            active.appended += 1
            active.records[number] = n
            active.live += n
            active.end += n
            self._live += n
            locs.append(self._active << self.SHIFT | number)
        return locs

    def read(self, locs: Sequence[int], lengths: Sequence[int], dests: Sequence[Any]) -> None:
        for loc in locs:
            segment = self._segments.get(loc >> self.SHIFT)
            if segment is None or (loc & ((1 << self.SHIFT) - 1)) not in segment.records:
                raise KeyError(f"{self.name}: location {loc:#x} is not live")

    def free(self, locs: Sequence[int]) -> None:
        for loc in locs:
            seg_id = loc >> self.SHIFT
            segment = self._segments[seg_id]
            n = segment.records.pop(loc & ((1 << self.SHIFT) - 1))  # KeyError on a double free
            segment.live -= n
            self._live -= n
            if not segment.live and seg_id != self._active:
                self._drop(seg_id)

    def _drop(self, seg_id: int) -> None:
        del self._segments[seg_id]
        self.counts["segments_dropped"] += 1

    def reclaimable(self) -> SimpleNamespace:
        """How many sealed segments are under half live (what ``compact`` takes without pressure)."""
        below = [s for k, s in self._segments.items() if k != self._active and s.live < self.segment_bytes / 2]
        return SimpleNamespace(compactable_segments=len(below))

    def compact(self, max_segments: int | None = None, threshold: float | None = None, *, wait: bool = True) -> Any:
        """As ``NvmeTier.compact``: sealed segments under ``threshold`` live (0.5), emptiest first; after a
        ``TierFull``, the single emptiest whatever its fraction. Their live records are appended again (the
        reserve segment may take them) and reported to ``on_relocate``."""
        limit = self.segment_bytes * (0.5 if threshold is None else threshold)
        sealed = sorted((s.live, k) for k, s in self._segments.items() if k != self._active)
        chosen = [k for live, k in sealed if live < limit]
        if not chosen and self._pressure:
            chosen = [k for live, k in sealed[:1] if live < self.segment_bytes]
        moved = 0
        for seg_id in chosen[: max_segments or len(chosen)]:
            segment = self._segments[seg_id]
            old = [(seg_id << self.SHIFT | r, n) for r, n in segment.records.items()]
            try:
                new = self._append([n for _, n in old], reserve=True)
            except TierFull:
                break
            self._live -= segment.live
            self._drop(seg_id)
            moved += len(old)
            if self.on_relocate is not None and old:
                self.on_relocate([(o, loc) for (o, _), loc in zip(old, new)])
            self._pressure = False
        self.counts["relocated"] += moved
        self.counts["compactions"] += 1
        return SimpleNamespace(records_moved=moved)

    def stats(self) -> TierStats:
        extra = {k: float(v) for k, v in self.counts.items()}
        extra["segments"] = float(len(self._segments))
        return TierStats(self.name, self.capacity_bytes, self.used_bytes, backend="accounting-log", extra=extra)
