"""A read-only view of one node's BlockStore for the index publisher.

Verbs:

- ``top_ranks(items) -> [rank]``: for (namespace, hash) pairs, the top tier rank
  of the block's copies on this node now, 0 when the node no longer holds it.
- ``snapshot(chunk) -> iterator of [(namespace, hash, rank)]``: every block the
  node holds, in chunks (for a full resync of its index).

It reads the store's public index columns (``BlockStore.table``) without taking
the store lock, so the data path never waits for Redis bookkeeping. That is safe
because the publisher only needs eventual agreement: BlockStore changes a
block's copies first and reports the change (``subscribe``) after, so for every
change there is a report that is read *after* it; whatever a racing read saw is
overwritten when that report is processed. Reads of numpy cells and dict
lookups are atomic under the GIL.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvstore.store import BlockStore
from kvstore.store.index import NO_LOC


class StoreView:
    def __init__(self, store: BlockStore):
        self.store = store
        self.ranks = [t.rank for t in store.tiers]  # top tier first

    def top_ranks(self, items: Sequence[tuple[str, bytes]]) -> list[int]:
        table = self.store.table
        entries: list[int] = []
        for ns, key in items:
            e = table.find(table.namespace_id(ns), key)
            entries.append(-1 if e is None else e)
        if not entries:
            return []
        ids = np.asarray(entries, dtype=np.int64)
        present = ids >= 0
        loc = table.loc  # one reference: a concurrent grow swaps in a larger copy
        ranks = self._top(loc[np.where(present, ids, 0)])
        return [int(r) if p else 0 for r, p in zip(ranks, present)]

    def snapshot(self, chunk: int = 16384) -> Iterator[list[tuple[str, bytes, int]]]:
        table = self.store.table
        live = np.nonzero(table.live)[0]
        for start in range(0, len(live), chunk):
            ids = live[start : start + chunk]
            ns_ids, keys, loc = table.ns[ids], table.hashes[ids], table.loc[ids]
            ranks = self._top(loc)
            out: list[tuple[str, bytes, int]] = []
            for e, ns_id, row, rank in zip(ids.tolist(), ns_ids.tolist(), keys, ranks.tolist()):
                key = row.tobytes()
                if rank and table.find(ns_id, key) == e:  # skip unmapped (deleted, still leased) entries
                    out.append((table.namespace_name(ns_id), key, rank))
            if out:
                yield out

    def _top(self, loc: np.ndarray) -> np.ndarray:
        """Per row of the loc columns: the first rank (top tier first) holding a copy, else 0."""
        cols = loc[:, self.ranks] != NO_LOC
        first = np.argmax(cols, axis=1)
        return np.where(cols.any(axis=1), np.asarray(self.ranks)[first], 0)
