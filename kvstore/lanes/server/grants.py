"""Grants: which byte ranges of a lane's region a client may use, for what, and until when.

Verbs of ``GrantTable`` (thread-safe; one per shared-memory lane):

- ``open_put() -> grant``, ``add_put(grant, hash, length, item, written=True) -> bool``
  (a region range for each block whose bytes are wanted, False once the region
  is full), ``arm(grant)``: the grant expires ``lease`` seconds from then.
- ``claim(grant_id, descriptors) -> slots``: the client commits. Every
  descriptor must name a still-pending slot of that grant with exactly the
  granted offset, length and hash, else PERMISSION_DENIED and nothing changes;
  an unknown or expired grant is FAILED_PRECONDITION. Claimed slots move to
  COMMITTING, so expiry never takes them back mid-copy.
- ``settle(grant, slots)``: the claimed slots are done (committed or aborted);
  their ranges are free again and a grant whose slots are all done is gone.
- ``fail(grant) -> items``: abort what is still pending (after an error);
  ``end(ids) -> items`` the same for the grants of a put stream that ended.
- ``grant_get() / add_get(grant, n) -> offset | None``: ranges the server
  fills for a Get; ``release(ids)`` when the client is done with them. Get
  grants have no lease: they hold no store resources, only room in the
  client's own region, where the client may still be reading the bytes in
  place (``shm_loans``); they end on release or when the lane closes.
- ``expire(now) -> items``: pending put items of expired put grants (the
  caller aborts their store tickets).
- ``close() -> items``: everything pending, for the lane's close.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvstore.lanes.base import LaneError

PENDING, COMMITTING, DONE = 0, 1, 2
ALIGN = 4096


class RangeAllocator:
    """First-fit allocator of aligned byte ranges in a region of ``size`` bytes; ``reserve(end)``, when given, is
    asked before a range ending at ``end`` is handed out (the region's pages reserved that far) and a False makes
    that allocation fail as if the region were full."""

    def __init__(self, size: int, align: int = ALIGN, reserve: Callable[[int], bool] | None = None):
        self.size, self.align, self._reserve = size, align, reserve
        self._starts: list[int] = [0]  # free ranges, sorted by start, coalesced
        self._lengths: list[int] = [size]
        self._used: dict[int, int] = {}

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def allocate(self, nbytes: int, written: bool = True) -> int | None:
        """The offset of ``nbytes`` (rounded up to ``align``), or None; ``written=False``: a range nobody writes
        (a direct Put's, whose bytes come from the client's memory) needs no reserved pages."""
        need = -(-max(nbytes, 1) // self.align) * self.align
        for i, length in enumerate(self._lengths):
            if length >= need:
                start = self._starts[i]
                if written and self._reserve is not None and not self._reserve(start + need):
                    return None
                if length == need:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += need
                    self._lengths[i] -= need
                self._used[start] = need
                return start
        return None

    def free(self, offset: int) -> None:
        length = self._used.pop(offset)
        i = bisect.bisect_left(self._starts, offset)
        self._starts.insert(i, offset)
        self._lengths.insert(i, length)
        if i + 1 < len(self._starts) and offset + length == self._starts[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == offset:
            self._lengths[i - 1] += self._lengths.pop(i)
            self._starts.pop(i)


@dataclass(slots=True)
class Slot:
    index: int
    offset: int  # -1: no range (final result, or a missing get block)
    length: int
    hash: bytes
    item: Any = None  # put: the store reservation to commit or abort
    state: int = PENDING


@dataclass
class Grant:
    id: int
    kind: str  # "put" or "get"
    expires: float
    slots: list[Slot] = field(default_factory=list)


class GrantTable:
    def __init__(self, region_bytes: int, lease_seconds: float, reserve: Callable[[int], bool] | None = None):
        self.ranges = RangeAllocator(region_bytes, reserve=reserve)
        self.lease = lease_seconds
        self._grants: dict[int, Grant] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._grants)

    # -- put ------------------------------------------------------------------------
    def open_put(self) -> Grant:
        """A put grant that does not expire until ``arm`` (slots are being reserved)."""
        with self._lock:
            grant = Grant(next(self._ids), "put", float("inf"))
            self._grants[grant.id] = grant
            return grant

    def add_put(self, grant: Grant, key: bytes, length: int, item: Any, written: bool = True) -> bool:
        """Append a slot: with a range when ``item`` (a reservation) needs the bytes written (``written=False``: a
        direct Put's, read from the client's memory, so its pages are not reserved), without one when its result
        is already final. False when the region is full."""
        with self._lock:
            index = len(grant.slots)
            if item is None:
                grant.slots.append(Slot(index, -1, length, key, None, DONE))
                return True
            offset = self.ranges.allocate(length, written)
            if offset is None:
                return False
            grant.slots.append(Slot(index, offset, length, key, item))
            return True

    def arm(self, grant: Grant) -> None:
        """Start the lease; a grant with nothing to commit is gone at once."""
        with self._lock:
            grant.expires = time.monotonic() + self.lease
            self._drop_if_done(grant)

    def claim(self, grant_id: int, descriptors: Sequence[Any]) -> tuple[Grant, list[Slot]]:
        with self._lock:
            grant = self._grants.get(grant_id)
            if grant is None or grant.kind != "put" or grant.expires < time.monotonic():
                raise LaneError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"put grant {grant_id} is unknown, finished or expired (leases last "
                    f"{self.lease:g}s): reserve the blocks again",
                )
            slots: list[Slot] = []
            seen: set[int] = set()
            for d in descriptors:
                slot = grant.slots[d.index] if d.index < len(grant.slots) else None
                if (
                    slot is None
                    or slot.offset < 0
                    or d.index in seen
                    or slot.offset != d.offset
                    or slot.length != d.length
                    or slot.hash != d.hash
                ):
                    raise LaneError(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"descriptor of block {d.index} (offset {d.offset}, length {d.length}) does "
                        f"not match a slot granted in grant {grant_id}",
                    )
                if slot.state != PENDING:
                    raise LaneError(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"block {d.index} of grant {grant_id} was already committed or aborted",
                    )
                seen.add(d.index)
                slots.append(slot)
            for slot in slots:
                slot.state = COMMITTING
            return grant, slots

    def settle(self, grant: Grant, slots: Sequence[Slot]) -> None:
        with self._lock:
            for slot in slots:
                self._done(slot)
            self._drop_if_done(grant)

    def fail(self, grant: Grant) -> list[Any]:
        with self._lock:
            items = [s.item for s in grant.slots if s.state == PENDING]
            for slot in grant.slots:
                if slot.state == PENDING:
                    self._done(slot)
            self._drop_if_done(grant)
            return items

    def end(self, grant_ids: Sequence[int]) -> list[Any]:
        """The stream that made these put grants ended: what is still pending is taken back."""
        with self._lock:
            grants = [self._grants.get(gid) for gid in grant_ids]
        items: list[Any] = []
        for grant in grants:
            if grant is not None and grant.kind == "put":
                items += self.fail(grant)
        return items

    # -- get ------------------------------------------------------------------------
    def grant_get(self) -> Grant:
        with self._lock:
            grant = Grant(next(self._ids), "get", time.monotonic() + self.lease)
            self._grants[grant.id] = grant
            return grant

    def add_get(self, grant: Grant, index: int, key: bytes, nbytes: int) -> int | None:
        with self._lock:
            offset = self.ranges.allocate(nbytes)
            if offset is not None:
                grant.slots.append(Slot(index, offset, nbytes, key, None, COMMITTING))
            return offset

    def release(self, grant_ids: Sequence[int]) -> None:
        with self._lock:
            for gid in grant_ids:
                grant = self._grants.get(gid)
                if grant is not None and grant.kind == "get":
                    self._free_get(grant)

    # -- expiry ----------------------------------------------------------------------
    def expire(self, now: float | None = None) -> list[Any]:
        now = time.monotonic() if now is None else now
        items: list[Any] = []
        with self._lock:
            for grant in [g for g in self._grants.values() if g.kind == "put" and g.expires < now]:
                for slot in grant.slots:
                    if slot.state == PENDING:
                        items.append(slot.item)
                        self._done(slot)
                self._drop_if_done(grant)
        return items

    def close(self) -> list[Any]:
        with self._lock:
            for grant in list(self._grants.values()):
                if grant.kind == "get":
                    self._free_get(grant)
                else:
                    grant.expires = 0.0
        return self.expire(1.0)

    # -- internals (lock held) -----------------------------------------------------
    def _done(self, slot: Slot) -> None:
        if slot.state != DONE and slot.offset >= 0:
            self.ranges.free(slot.offset)
        slot.state = DONE

    def _drop_if_done(self, grant: Grant) -> None:
        if all(s.state == DONE for s in grant.slots):
            self._grants.pop(grant.id, None)

    def _free_get(self, grant: Grant) -> None:
        for slot in grant.slots:
            self._done(slot)
        self._grants.pop(grant.id, None)
