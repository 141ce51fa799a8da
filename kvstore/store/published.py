"""Keeps a shared DRAM arena's index (``kvstore/arena_index.py``) in step with the BlockStore's copies in that
tier (``rank``).

Verbs (the BlockStore calls them with its lock held):

- ``added(ids)``: these entries' copies in the tier are in place and checked: name the raw ones.
- ``removed(ids)``: their copies in the tier are about to go (freed, demoted away, or unmapped): stop naming
  them, before the slot can be written again.

Only raw blocks (codec none) are named: a client copies the bytes as they lie.
"""

from __future__ import annotations

import numpy as np

from kvstore.arena_index import ArenaIndex, keys_of
from kvstore.store.index import EntryTable

CODEC_NONE = 0  # kvstore.v1.CODEC_NONE


class ArenaPublisher:
    def __init__(self, table: EntryTable, index: ArenaIndex, rank: int):
        self.table, self.index, self.rank = table, index, rank

    def added(self, ids: np.ndarray) -> None:
        t = self.table
        ids = ids[np.asarray(t.codec[ids]) == CODEC_NONE]
        if not len(ids):
            return
        locs = t.locs(ids, self.rank)
        for ns, pick in self._by_namespace(ids):
            keys = keys_of(t.namespace_name(ns), t.hashes[ids[pick]])
            assert keys is not None
            self.index.publish_many(keys, locs[pick], t.stored_len[ids[pick]], t.crc[ids[pick]])

    def removed(self, ids: np.ndarray) -> None:
        t = self.table
        for ns, pick in self._by_namespace(ids):
            keys = keys_of(t.namespace_name(ns), t.hashes[ids[pick]])
            assert keys is not None
            self.index.withdraw_many(keys)

    def _by_namespace(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        ns = np.asarray(self.table.ns[ids])
        if len(ns) and (ns == ns[0]).all():
            return [(int(ns[0]), np.arange(len(ids)))]
        return [(int(n), np.flatnonzero(ns == n)) for n in np.unique(ns)]
