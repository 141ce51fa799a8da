"""Server side of the shared-memory lane: one region per lane, grants over it, the store verbs.

Verbs of ``ShmServerLane`` (called by ``servicer.LaneServicer``):

- ``reserve(ns, headers, release) -> LaneGrant``: validate all headers,
  then for each block in order ``begin_put`` and a region range to write it
  at; blocks already present or rejected get their final result and no range.
  Stops early when the region is full, or when the top tier is (its room is
  held by this grant's own uncommitted slots): the client reserves the rest
  after committing these, as the gRPC Put would have evicted or demoted
  committed blocks to make room. The grant's lease starts when the reply is built.
- ``commit(grant_id, descriptors) -> LaneCommitted``: descriptors must
  match granted slots exactly (else PERMISSION_DENIED, nothing touched). Each
  block is copied region -> arena slot with its CRC32C computed on the slot's
  bytes (one copy, fused CRC), verified against the descriptor's CRC and
  committed. A mismatch aborts that block and every still-pending block of the
  grant (INVALID_ARGUMENT); blocks committed before it stay.
- ``end_stream(grant_ids)``: the put stream that made these grants ended;
  slots still uncommitted are taken back at once (a killed client's too).
- ``get(request, release) -> iterator of LaneGetResponse``: lease the blocks,
  copy each into a range of the region (one copy), drop the lease as soon as
  the copy is done, and stream descriptors about every ``YIELD_BYTES`` so the
  client takes blocks while the server copies the next ones. Each message has
  its own get grant, which the client releases when it is done with those
  blocks. Stops early when the region is full (``handled`` says how far).
- ``expire(now)`` / ``close()``: abort the store tickets of expired or
  outstanding put grants; ``close`` also unlinks and unmaps the region.
"""
from __future__ import annotations

import threading
from typing import Iterator, Sequence

import grpc

from kvstore.lanes.base import LaneError, ServerLane
from kvstore.lanes.grants import Grant, GrantTable, Slot
from kvstore.lanes.memops import copy_crc, copy_into, host_view
from kvstore.lanes.shm_region import ShmRegion
from kvstore.lanes.storeops import Reservation, StoreOps, accepted_codecs
from kvstore.store import Lease
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb

YIELD_BYTES = 16 << 20


class ShmServerLane(ServerLane):
    kind = "shm"

    def __init__(self, region: ShmRegion, ops: StoreOps, lease_seconds: float):
        super().__init__()
        self.region, self.ops, self.lease = region, ops, lease_seconds
        self.grants = GrantTable(region.size, lease_seconds)
        self._attached = threading.Event()
        self._created = self.last_used

    def attached(self) -> None:
        """The client sent a request, so it has the region mapped: its name can go."""
        if not self._attached.is_set():
            self._attached.set()
            self.region.unlink()

    # -- put --------------------------------------------------------------------------
    def reserve(self, namespace: str, headers: Sequence[pb.BlockHeader], release: Sequence[int]) -> lpb.LaneGrant:
        self.grants.release(release)
        ns = self.ops.namespace(namespace, self.access)
        metas = self.ops.headers(ns, headers)
        grant = self.grants.open_put()
        reply = lpb.LaneGrant(grant_id=grant.id, expires_in=self.lease)
        try:
            held = False
            for i, meta in enumerate(metas):
                res = self.ops.reserve(ns, meta, i, self.access)
                if res.full and held:
                    break  # the tier is full of this grant's own slots: commit them, then reserve the rest
                if not self.grants.add_put(grant, meta.hash, meta.stored_length, res if res.ticket else None):
                    self.ops.abort([res])
                    break
                held = held or res.ticket is not None
                slot = grant.slots[-1]
                reply.slots.append(lpb.SlotGrant(offset=max(slot.offset, 0), length=slot.length, result=res.result))
        except BaseException:
            self.ops.abort(self.grants.fail(grant))
            raise
        finally:
            self.grants.arm(grant)
        if not reply.slots and metas:  # the client's region is taken by blocks it still holds: another lane
            raise LaneError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"block 0 of {metas[0].stored_length} bytes does not fit what is free of the lane's "
                            f"{self.region.size}-byte region")
        return reply

    def commit(self, grant_id: int, descriptors: Sequence[lpb.BlockDescriptor]) -> lpb.LaneCommitted:
        grant, slots = self.grants.claim(grant_id, descriptors)
        reply = lpb.LaneCommitted()
        committed: list[int] = []
        done = 0
        try:
            for d, slot, computed in zip(descriptors, slots, self._land(slots)):
                res: Reservation = slot.item
                reply.results.append(self.ops.finish(res, self._claimed_crc(d, computed), computed, committed,
                                                     self.access))
                done += slot.length
        except BaseException:
            self.ops.abort([s.item for s in slots])
            self.ops.abort(self.grants.fail(grant))
            raise
        finally:
            self.grants.settle(grant, slots)
            self.ops.metrics.add(f"lane_{self.kind}_put_bytes", done)
            self.ops.metrics.bytes_in(done)
        self.ops.persist(committed)
        return reply

    def end_stream(self, grant_ids: Sequence[int]) -> None:
        self.ops.abort(self.grants.end(grant_ids))

    def _land(self, slots: Sequence[Slot]) -> list[int]:
        """Copy each granted block region -> arena slot; the CRC32C of each as it landed."""
        return [self._copy_in(slot, slot.item) for slot in slots]

    @staticmethod
    def _claimed_crc(d: lpb.BlockDescriptor, computed: int) -> int:
        """The CRC32C the client vouches for (checked against the landed bytes)."""
        return d.crc32c

    def _settle(self) -> None:
        """Wait for copies into the region still in flight (none here: shm copies are synchronous)."""

    def _copy_in(self, slot: Slot, res: Reservation) -> int:
        """Region -> arena slot; the CRC32C of the bytes as they landed in the slot."""
        assert res.ticket is not None
        src = self.region.view[slot.offset : slot.offset + slot.length]
        dst = host_view(res.ticket.buffer)
        if dst is not None:
            return copy_crc(dst, src)
        staging = memoryview(bytearray(slot.length))  # device slot (HBM tier): verify on host, then upload
        crc = copy_crc(staging, src)
        copy_into(res.ticket.buffer, staging)
        return crc

    # -- get --------------------------------------------------------------------------
    def get(self, request: pb.GetRequest, release: Sequence[int]) -> Iterator[lpb.LaneGetResponse]:
        self.grants.release(release)
        accepted = accepted_codecs(request)
        _, leases = self.ops.acquire(request, self.access)
        grant: Grant | None = self.grants.grant_get()
        released = 0
        handled = 0
        sent = 0
        pending = lpb.LaneGetResponse(grant_id=grant.id)
        pending_bytes = 0
        try:
            full = False
            for window in self.ops.windows(leases):
                self.ops.materialize(window)
                for lease in window:
                    assert grant is not None
                    n = self._copy_out(grant, handled, lease, accepted, pending)
                    if n < 0:
                        full = True
                        break
                    handled += 1
                    sent += n
                    pending_bytes += n
                    if pending_bytes >= YIELD_BYTES:
                        self._settle()
                        self.ops.release(leases[released:handled])
                        released = handled
                        yield pending
                        grant = self.grants.grant_get()  # one grant per message: released separately
                        pending, pending_bytes = lpb.LaneGetResponse(grant_id=grant.id), 0
                if full:
                    break
            if handled == 0 and leases:  # the client's region is taken by blocks it still holds: another lane
                raise LaneError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"block 0 does not fit what is free of the lane's {self.region.size}-byte region")
            pending.handled, pending.last = handled, True
            self._settle()
            self.ops.release(leases[released:])
            released = len(leases)
            yield pending
            grant = None
        finally:
            if grant is not None:  # its descriptors never reached the client: nobody would release it
                self.grants.release([grant.id])
            if released < len(leases):
                self._settle()  # no copy may still read a slot whose lease goes
            self.ops.release(leases[released:])
            self.ops.metrics.add(f"lane_{self.kind}_get_bytes", sent)
            self.ops.metrics.bytes_out(sent)

    def _copy_out(self, grant: Grant, index: int, lease: Lease | None, accepted: set[int],
                  reply: lpb.LaneGetResponse) -> int:
        """Copy one leased block into the region and describe it; -1 when the region is full."""
        if lease is None:
            reply.blocks.append(lpb.BlockDescriptor(index=index, header=pb.BlockHeader(missing=True)))
            return 0
        header, buf = self.ops.servable(lease, accepted)
        n = header.stored_length
        offset = self.grants.add_get(grant, index, lease.hash, n)
        if offset is None:
            return -1
        self._copy_to_region(self.region.view[offset : offset + n], buf)
        reply.blocks.append(lpb.BlockDescriptor(index=index, hash=lease.hash, offset=offset, length=n,
                                                crc32c=header.crc32c, header=header))
        return n

    def _copy_to_region(self, dst: memoryview, src: object) -> None:
        copy_into(dst, src)

    # -- expiry -------------------------------------------------------------------------
    def expire(self, now: float) -> int:
        if not self._attached.is_set() and now - self._created > self.lease:
            self.region.unlink()  # never attached: do not leave the name behind
        items = self.grants.expire(now)
        self.ops.abort(items)
        return len(items)

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self.ops.abort(self.grants.close())
        self.region.close()
