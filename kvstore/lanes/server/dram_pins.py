"""Get blocks named where they lie in the store's shared DRAM arena, and the leases that keep them there.

On a store started with ``--share-dram`` the DRAM arena is a file that shm lane clients map read-only
(``kvstore/tiers/arena.py``). A Get that asks for it (``read_dram``) then names a DRAM hit by its arena
offset instead of copying it into the lane's region: the client copies it once, straight into its own
buffer. The block must not move or be evicted while the client reads it, so its lease outlives the reply
and ends only when the client releases the message's grant (with its next request), or when the lane closes.

Verbs of ``DramPins`` (one per lane, thread-safe):

- ``offset_of(lease, n) -> offset | None``: where a leased block's ``n`` bytes are in the arena, or None
  (another tier, staging, or past this lane's budget of pinned bytes: the block is copied as before).
- ``hold(grant_id, leases)``: these leases now belong to a sent message's grant.
- ``release(grant_ids) -> leases`` / ``close() -> leases``: the leases to end (the caller releases them).

The budget (the lane's region size by default) bounds what one client can keep from eviction.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.lanes.cma import address_of
from kvstore.store import Lease
from kvstore.tiers.arena import SharedArena


class DramPins:
    def __init__(self, arena: SharedArena, budget: int):
        self.arena, self.budget = arena, budget
        self._held: dict[int, list[Lease]] = {}
        self._bytes = 0  # pinned by sent messages plus those being built
        self._lock = threading.Lock()

    @property
    def pinned_bytes(self) -> int:
        return self._bytes

    def offset_of(self, lease: Lease, n: int) -> int | None:
        buf = lease.buffer
        if buf is None or not isinstance(buf, memoryview):  # an HBM tensor, decoded bytes, nothing yet
            return None
        address, length = address_of(buf)
        offset = self.arena.offset_of(address, n) if length >= n else None
        if offset is None:
            return None
        with self._lock:
            if self._bytes + n > self.budget:
                return None
            self._bytes += n
        return offset

    def hold(self, grant_id: int, leases: Sequence[Lease]) -> None:
        if leases:
            with self._lock:
                self._held.setdefault(grant_id, []).extend(leases)

    def unpin(self, leases: Sequence[Lease]) -> None:
        """Leases ``offset_of`` counted that never reached a held grant (their message was not sent)."""
        with self._lock:
            self._bytes -= sum(x.stored_length for x in leases)

    def release(self, grant_ids: Sequence[int]) -> list[Lease]:
        out: list[Lease] = []
        with self._lock:
            for gid in grant_ids:
                out.extend(self._held.pop(gid, ()))
            self._bytes -= sum(x.stored_length for x in out)
        return out

    def close(self) -> list[Lease]:
        with self._lock:
            out = [x for held in self._held.values() for x in held]
            self._held.clear()
            self._bytes = 0
        return out
