"""The shm lane's Gets answered in one message of columns (``ShmServerLane.get`` picks them; shm_get.py has the
general path, a descriptor a block):

- ``_get_written``: all raw DRAM hits of a direct Get whose client reads columns, written into the client's memory
  and described in one message's ``WrittenBlocks`` (kvstore/lanes/server/written.py);
- ``_get_read_written``: raw blocks of such a Get, some only on NVMe (and no DRAM hit to name in the shared arena):
  each window's NVMe reads written into the client's memory piece by piece as they are verified, the DRAM hits as
  above, all in one message's ``WrittenBlocks``; a block bound for one of the client's shared pools (``pools.py``)
  never takes a process_vm_writev: read straight into it from NVMe (a pool in huge pages), else copied through
  the store's mapping of it;
- ``_get_named``: all raw DRAM hits in the shared arena of a ``read_dram`` Get whose client reads
  ``named_columns``: named where they lie in one message's ``NamedBlocks``, pinned until the client releases its
  grant;
- ``_get_disk``: all raw blocks only on NVMe, of a ``read_disk`` Get whose client reads ``disk_columns``, within
  the lane's budget: named in their segment files in one message's ``DiskBlocks``, held until the client releases
  its grant.

Each releases its leases after the reply (the eviction policies' touches off its path), and a message never sent
releases its grant.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast

from kvstore.lanes.direct import DirectPeer
from kvstore.lanes.segments import Spans
from kvstore.lanes.server.copyout import host_bytes, write_blocks
from kvstore.lanes.server.disk_names import DiskBatch, DiskNames
from kvstore.lanes.server.dram_pins import DramPins
from kvstore.lanes.server.grants import Grant, GrantTable
from kvstore.lanes.server.pools import MappedPools
from kvstore.lanes.server.storeops import StoreOps
from kvstore.lanes.server.written import checked_targets, columns_reply, host_sources, write_reply
from kvstore.store import Lease
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb


class ShmColumnGets:
    """Mixed into ShmServerLane (through ShmGets); uses its store ops, grants, direct peer, pools and pin tables."""

    if TYPE_CHECKING:  # provided by ShmServerLane
        kind: str
        ops: StoreOps
        grants: GrantTable
        direct: DirectPeer | None
        pins: DramPins | None
        disk: DiskNames | None
        pools: MappedPools

        def _release_grants(self, grant_ids: Sequence[int]) -> None: ...

    def _get_written(
        self,
        leases: list[Lease],
        sources: list[memoryview],
        ended: list[Lease],
        outs: Sequence[Spans],
        crc_at_copy: bool,
    ) -> Iterator[lpb.LaneGetResponse]:
        """``get`` of raw DRAM hits into the client's memory, described as columns (``written``)."""
        assert self.direct is not None
        grant: Grant | None = self.grants.grant_get()
        pooled: list[int] = []
        try:
            reply = write_reply(leases, sources, outs, self.direct, self.ops.copies, crc_at_copy, self.pools, pooled)
            assert grant is not None
            yield self._written(reply, grant, sum(reply.written.length), pooled)
            grant = None  # the client releases it
        finally:
            if grant is not None:
                self._release_grants([grant.id])
            self.ops.release(leases, touch=True)  # after the reply: the policies' bookkeeping is off its path
            self.ops.release(ended, touch=True)

    def _get_read_written(
        self, leases: list[Lease], ended: list[Lease], outs: Sequence[Spans], crc_at_copy: bool
    ) -> Iterator[lpb.LaneGetResponse]:
        """``get`` of raw blocks, some only on NVMe, into the client's memory, described as columns (``written``):
        window by window, the DRAM hits written as ``_get_written`` writes them, the NVMe-only blocks read
        (``materialize``) and written piece by piece as each read is verified; no descriptor or copy record a
        block. An NVMe block's CRC32C is the index's, which the tier checked its record against. Each window's
        leases but the last end before the next is read (their slots bound what a long Get holds). A block bound
        for a client's shared pool (``pools``) is read straight into it when the pool is in huge pages, else
        copied into it here with memcpy: no process_vm_writev either way."""
        direct = self.direct
        assert direct is not None
        lengths = [lease.stored_length for lease in leases]
        crcs = [lease.crc32c for lease in leases]
        grant: Grant | None = self.grants.grant_get()
        released = first = 0
        pooled: list[int] = []  # bytes that reached a shared pool without process_vm_writev (threads append)
        try:
            targets = checked_targets(outs, lengths)  # every buffer checked before anything is read or written
            for window in self.ops.windows(cast(list[Lease | None], leases)):
                hot = [j for j, lease in enumerate(window) if lease is not None and lease.buffer is not None]
                if hot:
                    sources = host_sources([window[j] for j in hot])
                    assert sources is not None  # raw_in_host_or_lower
                    written = write_blocks(
                        [targets[first + j] for j in hot],
                        sources,
                        direct,
                        self.ops.copies,
                        crc_at_copy,
                        self.pools,
                        pooled,
                    )
                    if crc_at_copy:
                        for j, crc in zip(hot, written):
                            crcs[first + j] = crc

                in_pool: dict[int, memoryview] = {}  # blocks read straight into the client's shared pool

                def dest_for(j: int, first: int = first) -> memoryview | None:
                    view = self.pools.view(targets[first + j], lengths[first + j], huge=True)
                    if view is not None:
                        in_pool[j] = view
                    return view

                def on_ready(positions: list[int], first: int = first) -> None:
                    moved: list[int] = []
                    for j in positions:
                        if leases[first + j].buffer is in_pool.get(j):  # read in place
                            pooled.append(lengths[first + j])
                        else:  # into the client's memory, or a pool in 4 KiB pages through our mapping
                            moved.append(j)
                    if moved:
                        blocks = [host_bytes(leases[first + j].buffer, lengths[first + j]) for j in moved]
                        targets_of = [targets[first + j] for j in moved]
                        write_blocks(targets_of, blocks, direct, None, False, self.pools, pooled)

                # the copies on this thread, reads beside; a block bound for a shared pool in huge pages is read there
                self.ops.materialize(window, on_ready, dest_for if self.pools else None, True, True)
                first += len(window)
                if first < len(leases):
                    self.ops.release(leases[released:first], touch=True)
                    released = first
            assert grant is not None
            yield self._written(columns_reply(leases, lengths, crcs, crc_at_copy), grant, sum(lengths), pooled)
            grant = None  # the client releases it
        finally:
            if grant is not None:
                self._release_grants([grant.id])
            self.ops.release(leases[released:], touch=True)  # after the reply: promotions and touches off its path
            self.ops.release(ended, touch=True)

    def _written(self, reply: lpb.LaneGetResponse, grant: Grant, sent: int, pooled: list[int]) -> lpb.LaneGetResponse:
        """A ``written`` reply under ``grant``, its bytes counted (``pooled``: those that reached a shared pool)."""
        reply.grant_id = grant.id
        self._count_sent(sent, "lane_shm_direct_get_bytes")
        if pooled:
            self.ops.metrics.add("lane_shm_pool_get_bytes", sum(pooled))
        return reply

    def _count_sent(self, sent: int, path: str) -> None:
        """A columns reply's bytes: the lane's, its path's (``path`` names the counter) and the store's out."""
        self.ops.metrics.add(f"lane_{self.kind}_get_bytes", sent)
        self.ops.metrics.add(path, sent)
        self.ops.metrics.bytes_out(sent)

    def _arena_offsets(self, leases: Sequence[Lease | None]) -> list[int] | None:
        """Each block's offset in the shared arena when all are present, raw and pinned there (counted in the
        pin budget); else None, with nothing left counted."""
        assert self.pins is not None
        offsets: list[int] = []
        for k, lease in enumerate(leases):
            at = None
            if lease is not None and lease.codec == pb.CODEC_NONE:
                at = self.pins.offset_of(lease, lease.stored_length)
            if at is None:
                self.pins.unpin([x for x in leases[:k] if x is not None])
                return None
            offsets.append(at)
        return offsets

    def _get_named(self, leases: list[Lease], offsets: list[int], ended: list[Lease]) -> Iterator[lpb.LaneGetResponse]:
        """``get`` of raw DRAM hits named where they lie in the shared arena, described as columns (``named``).
        Their leases go with the message's grant: the client's release of it ends them."""
        assert self.pins is not None
        issued = self.grants.grant_get()
        grant: Grant | None = issued
        held = False
        try:
            lengths = [lease.stored_length for lease in leases]
            reply = lpb.LaneGetResponse(grant_id=issued.id, handled=len(leases), last=True)
            named = reply.named
            named.index.extend(range(len(leases)))
            named.offset.extend(offsets)
            named.length.extend(lengths)
            named.crc32c.extend(lease.crc32c for lease in leases)
            self.pins.hold(issued.id, leases)  # from here the grant's release ends them, sent or not
            held = True
            self._count_sent(sum(lengths), "lane_shm_dram_get_bytes")
            yield reply
            grant = None  # the client releases it
        finally:
            if grant is not None:  # never sent
                if not held:  # counted in the pin budget only: nothing else ends them
                    self.pins.unpin(leases)
                    self.ops.release(leases)
                self._release_grants([grant.id])  # ends the held ones' leases too
            self.ops.release(ended, touch=True)

    def _get_disk(self, leases: list[Lease], batch: DiskBatch, ended: list[Lease]) -> Iterator[lpb.LaneGetResponse]:
        """``get`` of raw blocks only NVMe holds, named where they lie in its segment files (``batch``, every one
        named), described as columns (``disk``). Their leases and the segments' pins go with the message's grant:
        the client's release of it ends them. Against a descriptor a block, a 32 x 64 KiB Get in one process,
        switched Get by Get: 3.57 -> 3.45 ms (forty-ninth session)."""
        assert self.disk is not None
        issued = self.grants.grant_get()
        grant: Grant | None = issued
        held = False
        try:
            where = cast(list[tuple[str, int]], batch.where)
            files: dict[str, int] = {}
            for name, _ in where:
                files.setdefault(name, len(files))
            reply = lpb.LaneGetResponse(grant_id=issued.id, handled=len(leases), last=True)
            disk = reply.disk
            disk.index.extend(range(len(leases)))
            disk.files.extend(files)
            disk.file.extend([files[name] for name, _ in where])
            disk.offset.extend([offset for _, offset in where])
            disk.length.extend([lease.stored_length for lease in leases])
            disk.crc32c.extend([lease.crc32c for lease in leases])
            nbytes = self.disk.hold(issued.id, leases, [batch])  # from here the grant's release ends them
            held = True
            self._count_sent(nbytes, "lane_shm_disk_get_bytes")
            yield reply
            grant = None  # the client releases it
        finally:
            if grant is not None:  # never sent
                if not held:
                    self.disk.drop(batch)
                    self.ops.release(leases)
                self._release_grants([grant.id])  # ends the held ones' leases and pins too
            self.ops.release(ended, touch=True)
