"""Server side of the shared-memory lane: one region per lane, grants over it, the store verbs.

Verbs of ``ShmServerLane`` (called by ``servicer.LaneServicer``):

- ``reserve(ns, headers, release) -> LaneGrant``: validate all headers,
  then for each block in order ``begin_put`` and a region range to write it
  at; blocks already present or rejected get their final result and no range.
  Stops early when the region is full, or when the top tier is (its room is
  held by this grant's own uncommitted slots): the client reserves the rest
  after committing these, as the gRPC Put would have evicted or demoted
  committed blocks to make room. The grant's lease starts when the reply is built.
- ``commit(grant_id, descriptors, crc_from_server) -> LaneCommitted``:
  descriptors must match granted slots exactly (else PERMISSION_DENIED,
  nothing touched). Each block is copied region -> arena slot with its CRC32C
  computed on the slot's bytes (one copy, fused CRC) and committed; that CRC
  is the block's own with ``crc_from_server`` (what our client sends), else
  it is verified against the descriptor's. A mismatch aborts that block and
  every still-pending block of the grant (INVALID_ARGUMENT); blocks committed
  before it stay.
- ``end_stream(grant_ids)``: the put stream that made these grants ended;
  slots still uncommitted are taken back at once (a killed client's too).
- ``get(request, release, crc_at_copy, ...) -> iterator of LaneGetResponse``: lease the blocks and send
  them (written as columns, copied into the region, written into the client's memory or named in the shared
  DRAM arena or NVMe files), each message with its own get grant (kvstore/lanes/server/shm_get.py and
  shm_get_columns.py).
- ``add_pool(pool)``: map a client's shared pool (a POOL frame on the channel; ``pools.py``).
- ``expire(now)`` / ``close()``: abort the store tickets of expired or
  outstanding put grants; ``close`` also unlinks and unmaps the region and lets go of the pools.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, cast

import grpc

from kvstore.lanes.base import LaneError
from kvstore.lanes.direct import DirectPeer
from kvstore.lanes.segments import Spans, describe_source, descriptor_spans, reserve_sources
from kvstore.lanes.server.disk_names import DiskNames
from kvstore.lanes.server.dram_pins import DramPins
from kvstore.lanes.server.grants import GrantTable, Slot
from kvstore.lanes.server.lane import ServerLane
from kvstore.lanes.server.pools import MappedPools
from kvstore.lanes.server.shm_get import ShmGets
from kvstore.lanes.server.storeops import Reservation, StoreOps
from kvstore.lanes.shm_region import ShmRegion, short_of_memory
from kvstore.memops import copy_crc, copy_into, crcs_of, host_view
from kvstore.store import Lease
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb

if TYPE_CHECKING:
    from kvstore.lanes.cuda_region import DeviceRegion


class ShmServerLane(ShmGets, ServerLane):
    kind = "shm"
    crcs_at_copy = True  # can compute a Get block's CRC32C while copying it into the region
    streams_cold = True  # NVMe reads go straight into the region or are written to the client as verified

    def __init__(self, region: ShmRegion | DeviceRegion, ops: StoreOps, lease_seconds: float):
        super().__init__()
        self.region, self.ops, self.lease = region, ops, lease_seconds
        reserve = region.reserve if isinstance(region, ShmRegion) else None  # reserved as it is granted
        self.grants = GrantTable(region.size, lease_seconds, reserve)
        self._attached = threading.Event()
        self._created = self.last_used
        self.direct: DirectPeer | None = None  # set by the direct handshake: puts may name client addresses
        self._channel: socket.socket | None = None
        dram = ops.shared_dram() if isinstance(region, ShmRegion) else None
        self.pins = DramPins(dram, region.size) if dram is not None else None  # Gets named in the DRAM arena
        shares_disk = isinstance(region, ShmRegion) and ops.disk_dir() is not None
        self.disk = DiskNames(ops.store, region.size) if shares_disk else None  # Gets named in NVMe files
        self.pools = MappedPools()  # client memory mapped here: NVMe reads of direct Gets land in it

    def bind_direct(self, peer: DirectPeer) -> None:
        if self.direct is not None:
            self.direct.close()
        self.direct = peer

    def bind_channel(self, conn: socket.socket) -> None:
        """The handshake's socket now carries this lane's Gets and Puts (``shm_channel``); it closes with the lane."""
        old, self._channel = self._channel, conn
        if old is not None:
            _shutdown(old)
        if self.closed.is_set():
            _shutdown(conn)

    def attached(self) -> None:
        """The client sent a request, so it has the region mapped: its name can go."""
        if not self._attached.is_set():
            self._attached.set()
            self.region.unlink()

    def add_pool(self, pool: lpb.LanePool) -> None:
        """A POOL frame: map the client's shared pool (``pools.MappedPools.add``); only a direct lane can."""
        if self.direct is None:
            raise LaneError(grpc.StatusCode.FAILED_PRECONDITION, "shared pools need the lane's direct handshake")
        self.pools.add(self.direct, pool.fd, pool.address, pool.length)

    def touched(self, touch: lpb.LaneTouch) -> None:
        """A TOUCH frame: the grants the client is done with, and the hits it read through the DRAM index."""
        self._release_grants(touch.release)
        self.ops.touch(touch.touched, self.access)

    # -- put --------------------------------------------------------------------------
    def reserve(
        self, namespace: str, headers: Sequence[pb.BlockHeader], release: Sequence[int], direct: bool = False
    ) -> lpb.LaneGrant:
        """A grant of region ranges for the blocks the store wants (``direct``: a direct reserve, committed from the
        client's memory at once: its ranges are never written, so their pages are not reserved)."""
        self._release_grants(release)
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
                if not self.grants.add_put(
                    grant, meta.hash, meta.stored_length, res if res.ticket else None, written=not direct
                ):
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
            raise LaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"block 0 of {metas[0].stored_length} bytes does not fit what is free of the lane's "
                f"{self.region.size}-byte region{short_of_memory(self.region)}",
            )
        return reply

    def commit(
        self, grant_id: int, descriptors: Sequence[lpb.BlockDescriptor], crc_from_server: bool = False
    ) -> lpb.LaneCommitted:
        grant, slots = self.grants.claim(grant_id, descriptors)
        reply = lpb.LaneCommitted()
        committed: list[int] = []
        done = direct = 0
        try:
            blocks: list[tuple[Reservation, int, int]] = []
            for d, slot, computed in zip(descriptors, slots, self._land(slots, descriptors)):
                claimed = computed if crc_from_server else self._claimed_crc(d, computed)
                blocks.append((slot.item, claimed, computed))
                done += slot.length
                direct += slot.length if d.address or d.segment_addresses else 0
            reply.results.extend(self.ops.finish_many(blocks, committed, self.access))  # one commit for them all
        except BaseException:
            self.ops.abort([s.item for s in slots])
            self.ops.abort(self.grants.fail(grant))
            raise
        finally:
            self.grants.settle(grant, slots)
            self.ops.metrics.add(f"lane_{self.kind}_put_bytes", done)
            if direct:
                self.ops.metrics.add("lane_shm_direct_put_bytes", direct)
            self.ops.metrics.bytes_in(done)
        self.ops.persist(committed)
        return reply

    def commit_direct(
        self, grant: lpb.LaneGrant, headers: Sequence[pb.BlockHeader], sources: Sequence[Spans]
    ) -> lpb.LaneCommitted:
        """Commit every block a direct reserve was granted, read from its ``sources`` (one per header:
        ``segments.reserve_sources``)."""
        descriptors = [
            describe_source(
                lpb.BlockDescriptor(index=j, hash=headers[j].hash, offset=slot.offset, length=slot.length), sources[j]
            )
            for j, slot in enumerate(grant.slots)
            if slot.result.status == pb.PUT_STATUS_UNSPECIFIED
        ]
        if not descriptors:  # every block already present or refused: the grant holds nothing
            return lpb.LaneCommitted()
        return self.commit(grant.grant_id, descriptors, crc_from_server=True)

    def end_stream(self, grant_ids: Sequence[int]) -> None:
        self.ops.abort(self.grants.end(grant_ids))

    def _land(self, slots: Sequence[Slot], descriptors: Sequence[lpb.BlockDescriptor]) -> list[int]:
        """Copy each granted block into its arena slot (from the region, or from the client's memory at the
        descriptor's address on a direct lane); the CRC32C of each as it landed."""
        if any(d.address or d.segment_addresses for d in descriptors) and self.direct is None:
            raise LaneError(
                grpc.StatusCode.PERMISSION_DENIED, "a commit names client memory on a lane without a direct handshake"
            )
        sources = [descriptor_spans(d) for d in descriptors]
        targets = [host_view(slot.item.ticket.buffer) if slot.item.ticket is not None else None for slot in slots]
        if self.direct is not None and all(len(src) == 1 for src in sources) and all(t is not None for t in targets):
            direct = self.direct  # every block in one buffer of the client's, every slot in host memory

            def read_run(run: Sequence[int]) -> list[int]:  # one process_vm_readv, then one batch of CRC32Cs
                views = [cast(memoryview, targets[k])[: slots[k].length] for k in run]
                direct.read_many([(sources[k][0][0], view) for k, view in zip(run, views)])
                return crcs_of(views)

            return self.ops.copies.run_batches(read_run, range(len(slots)), [s.length for s in slots])
        return self.ops.copies.run(
            lambda k: self._copy_in(slots[k], slots[k].item, sources[k]), range(len(slots)), [s.length for s in slots]
        )

    @staticmethod
    def _claimed_crc(d: lpb.BlockDescriptor, computed: int) -> int:
        """The CRC32C the client vouches for (checked against the landed bytes)."""
        return d.crc32c

    def _settle(self) -> None:
        """Wait for copies into the region still in flight (none here: shm copies are synchronous)."""

    def _copy_in(self, slot: Slot, res: Reservation, source: Spans = ()) -> int:
        """Region (or the client memory ``source`` names) -> arena slot; the CRC32C of the bytes as they landed."""
        assert res.ticket is not None
        host = host_view(res.ticket.buffer)
        staging = host is None  # device slot (HBM tier): land and check on the host, then upload
        dst = memoryview(bytearray(slot.length)) if host is None else host
        if len(source) == 1:
            assert self.direct is not None
            crc = self.direct.read_into(dst, source[0][0])
        elif source:  # a block in several buffers: one pass, many iovecs
            assert self.direct is not None
            crc = self.direct.read_spans(dst, source)
        else:
            crc = copy_crc(dst, self.region.view[slot.offset : slot.offset + slot.length])
        if staging:
            copy_into(res.ticket.buffer, dst)
        return crc

    # -- expiry -------------------------------------------------------------------------
    def _release_grants(self, grant_ids: Sequence[int]) -> None:
        """The client is done with these get grants: their region ranges and DRAM-arena leases end."""
        self.ops.release(self._end_grants(grant_ids), touch=True)

    def _end_grants(self, grant_ids: Sequence[int]) -> list[Lease]:
        """Free these get grants' region ranges now; their DRAM-arena leases are returned for the caller to end
        (a release counts the blocks' use in the eviction policy, which need not delay a reply)."""
        self.grants.release(grant_ids)
        if not grant_ids:
            return []
        ended = self.pins.release(grant_ids) if self.pins is not None else []
        return ended + self.disk.release(grant_ids) if self.disk is not None else ended

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
        if self.pins is not None:
            self.ops.release(self.pins.close(), touch=True)
        if self.disk is not None:
            self.ops.release(self.disk.close(), touch=True)
        self.region.close()
        self.pools.close()
        if self.direct is not None:
            self.direct.close()
        if self._channel is not None:
            _shutdown(self._channel)  # its thread sees the end and exits


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def put_conversation(
    lane_for: Callable[[lpb.LaneRef], ShmServerLane], requests: Iterator[lpb.LanePutRequest]
) -> Generator[lpb.LanePutResponse, None, None]:
    """The replies of one LanePut conversation (over gRPC or a lane's channel): a grant per reserve (then,
    for a direct reserve, its results at once), results per commit. The lane comes from the first message;
    whatever was reserved and not committed is taken back when the conversation ends, however it ends."""
    lane: ShmServerLane | None = None
    grants: list[int] = []
    try:
        for msg in requests:
            if lane is None:
                lane = lane_for(msg.lane)
            step = msg.WhichOneof("step")
            if step == "reserve":
                r = msg.reserve
                direct = bool(r.addresses or r.segment_counts)
                grant = lane.reserve(r.namespace, r.headers, r.release, direct)
                grants.append(grant.grant_id)
                yield lpb.LanePutResponse(grant=grant)
                if direct:  # a direct round: read and commit what was granted, now
                    yield lpb.LanePutResponse(committed=lane.commit_direct(grant, r.headers, reserve_sources(r)))
            elif step == "commit":
                c = msg.commit
                yield lpb.LanePutResponse(committed=lane.commit(c.grant_id, c.blocks, c.crc_from_server))
            else:
                raise LaneError(grpc.StatusCode.INVALID_ARGUMENT, "LanePut message without reserve or commit")
    finally:
        if lane is not None:
            lane.end_stream(grants)
