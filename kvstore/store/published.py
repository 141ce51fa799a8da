"""Keeps a shared DRAM arena's index (``kvstore/arena_index.py``) in step with the BlockStore's copies: those
in the arena's tier (``rank``) and, with ``disk``, those only in the NVMe tier (named in its segment files).

Verbs (the BlockStore calls them with its lock held; ``rank`` is the tier whose copy changed):

- ``added(ids, rank)``: these entries' copies in ``rank`` are in place and checked (on NVMe: written): name
  the raw ones, where they lie in DRAM, else in their segment file.
- ``removed(ids, rank)``: their copies in ``rank`` are about to go (freed, demoted away, unmapped, found
  corrupt): stop naming them there, before the slot or record can be written again or its segment deleted;
  a block leaving DRAM with an NVMe copy is named on disk instead.
- ``moved(ids)``: compaction moved their NVMe records (the table has the new places; the old ones stay
  readable until their segment is retired, which comes after this).
- ``unmapped(ids)``: deleted: not named anywhere.

An entry deleted while a Get still leases it keeps its copies until the lease ends, and the same hash may be
put again meanwhile as a new entry under the same key: the verbs ignore such an entry (``unmapped`` withdrew
it), so its copies going, a promotion or a write-back finishing never name it again nor take the key from
the new one.

Only raw blocks (codec none) are named: a client copies the bytes as they lie.

``names_memory=False`` (an index beside an arena clients cannot map: ``serve --share-nvme`` without
``--share-dram``): only blocks NVMe alone holds are named; one that gains a DRAM copy (a promotion) is withdrawn, so
its next Get asks the store, which serves it from DRAM.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvstore.arena_index import ArenaIndex, keys_of
from kvstore.arena_index_layout import ON_DISK, SEGMENT_SHIFT
from kvstore.store.index import NO_LOC, EntryTable

CODEC_NONE = 0  # kvstore.v1.CODEC_NONE


class PayloadFiles(Protocol):
    """A durable tier whose records clients may read from its files (``NvmeTier``)."""

    rank: int

    def payload_places(self, locs: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


class ArenaPublisher:
    def __init__(
        self,
        table: EntryTable,
        index: ArenaIndex,
        rank: int,
        disk: PayloadFiles | None = None,
        names_memory: bool = True,
    ):
        self.table, self.index, self.rank, self.disk = table, index, rank, disk
        self.names_memory = names_memory

    def added(self, ids: np.ndarray, rank: int) -> None:
        ids = self._mapped(ids)
        if rank == self.rank and not self.names_memory:
            if self.disk is not None:  # named on disk until now (a new block has no NVMe copy: nothing to probe)
                self._withdraw(ids[np.asarray(self.table.locs(ids, self.disk.rank)) != NO_LOC])
        elif rank == self.rank:
            self._publish(ids, rank)
        elif self.disk is not None and rank == self.disk.rank:
            self._publish(self._not_in_dram(ids), rank)  # a DRAM copy keeps being the one named

    def removed(self, ids: np.ndarray, rank: int) -> None:
        ids = self._mapped(ids)
        if rank == self.rank:
            if self.disk is not None:
                on_disk = np.asarray(self.table.locs(ids, self.disk.rank)) != NO_LOC
                self._publish(ids[on_disk], self.disk.rank)  # replaces the DRAM entry: its seq moves
                ids = ids[~on_disk]
            if self.names_memory:
                self._withdraw(ids)
        elif self.disk is not None and rank == self.disk.rank:
            self._withdraw(self._not_in_dram(ids))

    def moved(self, ids: np.ndarray) -> None:
        if self.disk is not None:
            self._publish(self._not_in_dram(self._mapped(ids)), self.disk.rank)

    def unmapped(self, ids: np.ndarray) -> None:
        self._withdraw(ids)

    def _mapped(self, ids: np.ndarray) -> np.ndarray:
        """Those not deleted (a deleted entry's key may name a new entry of the same hash by now)."""
        return ids[np.asarray(self.table.mapped[ids], dtype=bool)]

    def _not_in_dram(self, ids: np.ndarray) -> np.ndarray:
        return ids[np.asarray(self.table.locs(ids, self.rank)) == NO_LOC]

    def _publish(self, ids: np.ndarray, rank: int) -> None:
        t = self.table
        ids = ids[np.asarray(t.codec[ids]) == CODEC_NONE]
        if not len(ids):
            return
        locs = np.asarray(t.locs(ids, rank))
        if rank != self.rank:
            assert self.disk is not None
            segments, offsets = self.disk.payload_places(locs)
            locs = (
                np.uint64(ON_DISK) | segments.astype(np.uint64) << np.uint64(SEGMENT_SHIFT) | offsets.astype(np.uint64)
            )
        for ns, pick in self._by_namespace(ids):
            keys = keys_of(t.namespace_name(ns), t.hashes[ids[pick]])
            assert keys is not None
            self.index.publish_many(keys, locs[pick], t.stored_len[ids[pick]], t.crc[ids[pick]])

    def _withdraw(self, ids: np.ndarray) -> None:
        t = self.table
        for ns, pick in self._by_namespace(ids):
            keys = keys_of(t.namespace_name(ns), t.hashes[ids[pick]])
            assert keys is not None
            self.index.withdraw_many(keys)

    def _by_namespace(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        if not len(ids):
            return []
        ns = np.asarray(self.table.ns[ids])
        if (ns == ns[0]).all():
            return [(int(ns[0]), np.arange(len(ids)))]
        return [(int(n), np.flatnonzero(ns == n)) for n in np.unique(ns)]
