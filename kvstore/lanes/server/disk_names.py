"""Get blocks named where they lie on NVMe, for a client that reads them itself, and what keeps them there.

On a store started with ``--share-nvme`` an shm lane client of the store's user may open the NVMe tier's
segment files (``OpenLaneResponse.nvme_dir``). A Get that asks for it (``read_disk``) then names each
NVMe-only raw block by file and payload offset instead of reading it and copying it out: the client reads it
straight into its own buffers (one DMA, no copy on either side) and checks its CRC32C. The block must stay
where it is while the client reads, so its lease and its segment's pin outlive the reply and end only when the
client releases the message's grant (with its next request), or when the lane closes.

Verbs of ``DiskNames`` (one per lane, thread-safe):

- ``all_raw_on_disk(leases)``: whether every block of a Get is one ``name`` could name.
- ``name(window) -> DiskBatch``: where each NVMe-only raw lease of the window lies (None for the others and
  past this lane's budget of named bytes); the segments are pinned.
- ``hold(grant_id, leases, batches) -> bytes``: named leases and the batches' pins now belong to a sent
  message's grant.
- ``drop(batch)``: a batch whose message was never sent: its pins end (its leases stay the caller's).
- ``release(grant_ids) -> leases`` / ``close() -> leases``: the pins end here, the leases are the caller's to end.

The budget (the lane's region size by default) bounds what one client can keep from eviction and compaction.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.store import BlockStore, Lease

CODEC_NONE = 0


@dataclass
class DiskBatch:
    where: list[tuple[str, int] | None]  # per lease of the window: (file name, payload offset) or None
    handles: list[Any] = field(default_factory=list)  # segment pins (BlockStore.disk_extents)
    nbytes: int = 0  # of the named blocks, counted against the budget


def all_raw_on_disk(leases: Sequence[Lease | None]) -> bool:
    """Every block present, raw and in no memory tier: a Get ``DiskNames`` could name whole."""
    return all(x is not None and x.buffer is None and x.codec == CODEC_NONE for x in leases)


class DiskNames:
    def __init__(self, store: BlockStore, budget: int):
        self.store, self.budget = store, budget
        self._held: dict[int, tuple[list[Lease], list[Any], int]] = {}
        self._bytes = 0  # named by sent messages plus those being built
        self._lock = threading.Lock()

    def name(self, window: Sequence[Lease | None]) -> DiskBatch:
        candidates: list[Lease | None] = [None] * len(window)
        n = 0
        with self._lock:
            room = self.budget - self._bytes
            for j, lease in enumerate(window):
                if lease is None or lease.buffer is not None or lease.codec != CODEC_NONE:
                    continue
                if n + lease.stored_length > room:
                    break
                candidates[j] = lease
                n += lease.stored_length
            self._bytes += n
        if n == 0:
            return DiskBatch([None] * len(window))
        where, handles = self.store.disk_extents(candidates)
        gone = sum(x.stored_length for x, w in zip(candidates, where) if x is not None and w is None)
        if gone:
            with self._lock:
                self._bytes -= gone
        return DiskBatch(where, handles, n - gone)

    def hold(self, grant_id: int, leases: Sequence[Lease], batches: Sequence[DiskBatch]) -> int:
        """The named ``leases`` and the ``batches``' pins now end with ``grant_id``; returns the bytes named."""
        nbytes = sum(b.nbytes for b in batches)
        with self._lock:
            held_leases, held_handles, held_bytes = self._held.get(grant_id, ([], [], 0))
            held_leases.extend(leases)
            for batch in batches:
                held_handles.extend(batch.handles)
                batch.handles, batch.nbytes = [], 0
            self._held[grant_id] = (held_leases, held_handles, held_bytes + nbytes)
        return nbytes

    def drop(self, batch: DiskBatch) -> None:
        handles, batch.handles = batch.handles, []
        self.store.release_extents(handles)
        with self._lock:
            self._bytes -= batch.nbytes
        batch.nbytes = 0

    def release(self, grant_ids: Sequence[int]) -> list[Lease]:
        with self._lock:
            ended = [held for gid in grant_ids if (held := self._held.pop(gid, None)) is not None]
            self._bytes -= sum(nbytes for _, _, nbytes in ended)
        return self._end(ended)

    def close(self) -> list[Lease]:
        with self._lock:
            ended = list(self._held.values())
            self._held.clear()
            self._bytes = 0
        return self._end(ended)

    def _end(self, ended: list[tuple[list[Lease], list[Any], int]]) -> list[Lease]:
        for _, handles, _ in ended:
            self.store.release_extents(handles)
        return [lease for leases, _, _ in ended for lease in leases]
