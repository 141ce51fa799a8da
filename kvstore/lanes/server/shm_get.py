"""The Get half of the shared-memory lane (``ShmServerLane.get``; the lane and its Puts are in shm.py).

``get(request, release, crc_at_copy, outs, read_dram, read_disk, columns, named_columns, disk_columns) ->
iterator of LaneGetResponse``: lease the blocks, then answer in one message of columns where the Get allows it
(shm_get_columns.py: raw DRAM hits written into a direct client's memory or named in the shared arena, raw
NVMe-only blocks named in their segment files or read and written into the client's memory); otherwise

- each block gets a descriptor: copied into a range of the region (one copy, its CRC32C in the same pass with
  ``crc_at_copy``), written into the client's memory (``outs``), named in the shared DRAM arena (``read_dram``)
  or in the NVMe tier's files (``read_disk``); NVMe-only blocks are read straight where they go while the disk
  reads the next ones, a block bound for one of the client's shared pools (``pools.py``) straight into it;
  messages go out after ``FIRST_YIELD_BYTES``, then about every ``YIELD_BYTES``, each with its own get grant that
  the client releases; fewer than all blocks when the region is full (``handled`` says how far).

Leases end once the copies are done (the last message's just after it is sent, with the eviction policies'
touch of the Get's blocks, off the reply's path).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from kvstore.lanes.base import LaneError
from kvstore.lanes.segments import Spans, clip, span_bytes
from kvstore.lanes.server.access import LaneAccess
from kvstore.lanes.server.copyout import CopyOut, copy_one, copy_out, runnable
from kvstore.lanes.server.disk_names import DiskBatch, all_raw_on_disk
from kvstore.lanes.server.grants import Grant
from kvstore.lanes.server.shm_get_columns import ShmColumnGets
from kvstore.lanes.server.storeops import accepted_codecs
from kvstore.lanes.server.written import host_sources, raw_in_host_or_lower
from kvstore.lanes.shm_region import short_of_memory
from kvstore.memops import host_view
from kvstore.store import Lease
from kvstore.store.readahead import has_cold
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb

if TYPE_CHECKING:
    from kvstore.lanes.cuda_region import DeviceRegion
    from kvstore.lanes.shm_region import ShmRegion

YIELD_BYTES = 16 << 20
FIRST_YIELD_BYTES = 2 << 20


class ShmGets(ShmColumnGets):
    """Mixed into ShmServerLane; uses its region, store ops, grants, direct peer and named-block tables."""

    if TYPE_CHECKING:  # provided by ShmServerLane
        crcs_at_copy: bool
        streams_cold: bool
        region: ShmRegion | DeviceRegion
        access: LaneAccess

        def _end_grants(self, grant_ids: Sequence[int]) -> list[Lease]: ...
        def _settle(self) -> None: ...

    def get(
        self,
        request: pb.GetRequest,
        release: Sequence[int],
        crc_at_copy: bool = False,
        outs: Sequence[Spans] = (),
        read_dram: bool = False,
        read_disk: bool = False,
        columns: bool = False,
        named_columns: bool = False,
        disk_columns: bool = False,
    ) -> Iterator[lpb.LaneGetResponse]:
        ended = self._end_grants(release)  # their DRAM-arena leases end after this Get's reply, off its path
        accepted = accepted_codecs(request)
        crc_at_copy = crc_at_copy and self.crcs_at_copy
        # DRAM hits named in the shared arena; the rest go into the region or, on a direct Get, the client's memory
        pins: list[int] | None = [] if read_dram and self.pins is not None else None
        named = 0  # bytes named in the DRAM arena
        on_disk: list[int] | None = [] if read_disk and self.disk is not None else None  # named in NVMe files
        batches: list[DiskBatch] = []  # their segment pins, until a sent message's grant holds them
        disk_bytes = 0
        try:
            if outs:
                if self.direct is None:
                    raise LaneError(
                        grpc.StatusCode.PERMISSION_DENIED,
                        "a Get names client memory on a lane without a direct handshake",
                    )
                if len(outs) != len(request.hashes):
                    raise LaneError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"a direct Get names {len(outs)} destinations for {len(request.hashes)} hashes",
                    )
            _, leases = self.ops.acquire(request, self.access, touch=False)  # touched as released, after the copies
        except BaseException:
            self.ops.release(ended, touch=True)  # a refused Get still ends what the client released with it
            raise
        if columns and outs and pins is None and self.direct is not None:
            sources = host_sources(leases)
            if sources is not None:  # all raw DRAM hits: one message of columns (``written``)
                yield from self._get_written(leases, sources, ended, outs, crc_at_copy)  # type: ignore[arg-type]
                return
        if named_columns and pins is not None and leases:
            offsets = self._arena_offsets(leases)
            if offsets is not None:  # all raw DRAM hits in the shared arena: one message of columns (``named``)
                yield from self._get_named(leases, offsets, ended)  # type: ignore[arg-type]
                return
        if disk_columns and on_disk is not None and self.disk is not None and leases and all_raw_on_disk(leases):
            try:
                batch = self.disk.name(leases)
            except BaseException:  # nothing holds the leases yet: they end here
                self.ops.release(leases)
                self.ops.release(ended, touch=True)
                raise
            if all(where is not None for where in batch.where):  # all named: one message of columns (``disk``)
                yield from self._get_disk(leases, batch, ended)  # type: ignore[arg-type]
                return
            self.disk.drop(batch)  # past the lane's budget: the general way names what fits and reads the rest
        if (
            columns
            and outs
            and self.direct is not None
            and on_disk is None
            and self.streams_cold
            and (pins is None or not any(x is not None and x.buffer is not None for x in leases))  # none to name
            and raw_in_host_or_lower(leases)
        ):  # raw blocks, some only on NVMe: read, written into the client's memory, one message of columns
            yield from self._get_read_written(leases, ended, outs, crc_at_copy)  # type: ignore[arg-type]
            return
        grant: Grant | None
        grant = self.grants.grant_get()
        released = 0
        handled = 0
        sent = 0
        written_direct = bool(outs)
        pending = lpb.LaneGetResponse(grant_id=grant.id, crcs_at_copy=crc_at_copy, written_direct=written_direct)
        pending_bytes = 0
        copies: list[CopyOut] = []
        due = FIRST_YIELD_BYTES  # the first message goes early so the client starts checking while we copy

        def hold_pins(grant: Grant) -> None:
            nonlocal named, disk_bytes
            if on_disk is not None and self.disk is not None:
                disk_bytes += self.disk.hold(
                    grant.id, [lease for k in on_disk if (lease := leases[k]) is not None], batches
                )
                for k in on_disk:
                    leases[k] = None
                on_disk.clear()
            batches.clear()
            if pins:
                assert self.pins is not None
                pinned = [lease for k in pins if (lease := leases[k]) is not None]  # all of them: named in the arena
                named += sum(lease.stored_length for lease in pinned)
                self.pins.hold(grant.id, pinned)  # the grant's release ends them, not this Get
                for k in pins:
                    leases[k] = None
                pins.clear()

        counted = False

        def count() -> None:
            nonlocal counted
            counted = True
            self.ops.metrics.add(f"lane_{self.kind}_get_bytes", sent)
            if outs and sent > named + disk_bytes:  # written into the client's memory by this store
                self.ops.metrics.add("lane_shm_direct_get_bytes", sent - named - disk_bytes)
            if named:
                self.ops.metrics.add("lane_shm_dram_get_bytes", named)
            if disk_bytes:
                self.ops.metrics.add("lane_shm_disk_get_bytes", disk_bytes)
            self.ops.metrics.bytes_out(sent)

        try:
            full = False
            for window in self.ops.windows(leases):
                streamed = (
                    self.streams_cold and has_cold(window) and all(x is None or x.codec in accepted for x in window)
                )
                if streamed:  # NVMe blocks: read straight where they go, each moved on once verified
                    assert grant is not None
                    n, placed = self._read_out(
                        grant, handled, window, accepted, pending, crc_at_copy, copies, outs, pins, on_disk, batches
                    )
                    handled += placed
                    sent += n
                    pending_bytes += n
                    full = placed < len(window)
                else:
                    self.ops.materialize(window)
                for lease in [None] if streamed else window:
                    if not streamed:
                        assert grant is not None
                        n = self._place_out(grant, handled, lease, accepted, pending, crc_at_copy, copies, outs, pins)
                        if n < 0:
                            full = True
                            break
                        handled += 1
                        sent += n
                        pending_bytes += n
                    if not full and pending_bytes >= due and handled < len(leases):  # never an empty last message
                        due = YIELD_BYTES
                        self._copy_out(copies)
                        copies = []
                        hold_pins(grant)
                        self.ops.release(leases[released:handled], touch=True)
                        released = handled
                        yield pending
                        grant = self.grants.grant_get()  # one grant per message: released separately
                        pending = lpb.LaneGetResponse(
                            grant_id=grant.id, crcs_at_copy=crc_at_copy, written_direct=written_direct
                        )
                        pending_bytes = 0
                if full:
                    break
            if handled == 0 and leases:  # the client's region is taken by blocks it still holds: another lane
                raise LaneError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"block 0 does not fit what is free of the lane's {self.region.size}-byte region"
                    f"{short_of_memory(self.region)}",
                )
            pending.handled, pending.last = handled, True
            self._copy_out(copies)
            copies = []
            hold_pins(grant)
            count()  # before the reply: a caller that reads the counters after its Get sees this one
            yield pending  # the reply goes before the last leases end (their bytes are copied: nothing reads them)
            grant = None
            self.ops.release(leases[released:], touch=True)
            released = len(leases)
        finally:
            if grant is not None:  # its descriptors never reached the client: nobody would release it
                self._release_grants([grant.id])
            if pins and self.pins is not None:  # named in a message that was never sent
                self.pins.unpin([lease for k in pins if (lease := leases[k]) is not None])
            if self.disk is not None:
                for batch in batches:  # named in a message that was never sent: their leases end below
                    self.disk.drop(batch)
            if released < len(leases):
                self._settle()  # no copy may still read a slot whose lease goes (copies not run: never started)
            self.ops.release(leases[released:], touch=True)
            self.ops.release(ended, touch=True)
            if not counted:
                count()

    def _place_out(
        self,
        grant: Grant,
        index: int,
        lease: Lease | None,
        accepted: set[int],
        reply: lpb.LaneGetResponse,
        crc_at_copy: bool,
        copies: list[CopyOut],
        outs: Sequence[Spans] = (),
        pins: list[int] | None = None,
    ) -> int:
        """Give one leased block a range of the region and describe it; -1 when the region is full.

        With ``pins`` (the client maps the shared DRAM arena) a DRAM hit sent as stored is named where it
        lies instead: no copy, its index goes in ``pins`` and its lease lasts until the message's grant ends.

        The copy itself is queued in ``copies`` and run with the rest of the message's (``_copy_out``).
        With ``crc_at_copy`` the descriptor gets the CRC32C of the bytes as they reached the region (computed
        in the same pass as the copy) for the client to compare with the header's."""
        if lease is None:
            reply.blocks.append(lpb.BlockDescriptor(index=index, header=pb.BlockHeader(missing=True)))
            return 0
        raw = lease.codec == pb.CODEC_NONE or lease.codec not in accepted  # sent as raw bytes: the header's CRC
        n = lease.stored_length if lease.codec in accepted else lease.raw_length
        if pins is not None and lease.codec in accepted and self.pins is not None:
            at = self.pins.offset_of(lease, n)
            if at is not None:
                d = reply.blocks.add(
                    index=index, hash=lease.hash, offset=at, length=n, crc32c=lease.crc32c, in_dram=True
                )
                self.ops.serve_into(d.header, lease, accepted)
                pins.append(index)
                return n
        if outs:  # straight into the client's buffer: no region range
            capacity = span_bytes(outs[index])
            if n > capacity:
                raise LaneError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"output buffer {index} holds {capacity} bytes; block is {n}"
                )
            d = reply.blocks.add(index=index, hash=lease.hash, length=n, crc32c=lease.crc32c)
            buf = self.ops.serve_into(d.header, lease, accepted)
            copies.append(CopyOut(None, buf, d, crc_at_copy and raw, clip(outs[index], n)))
            return n
        offset = self.grants.add_get(grant, index, lease.hash, n)
        if offset is None:
            return -1
        d = reply.blocks.add(index=index, hash=lease.hash, offset=offset, length=n, crc32c=lease.crc32c)
        buf = self.ops.serve_into(d.header, lease, accepted)
        copies.append(CopyOut(self.region.view[offset : offset + n], buf, d, crc_at_copy and raw))
        return n

    def _read_out(
        self,
        grant: Grant,
        first: int,
        window: Sequence[Lease | None],
        accepted: set[int],
        reply: lpb.LaneGetResponse,
        crc_at_copy: bool,
        copies: list[CopyOut],
        outs: Sequence[Spans],
        pins: list[int] | None = None,
        on_disk: list[int] | None = None,
        batches: list[DiskBatch] | None = None,
    ) -> tuple[int, int]:
        """A window with NVMe-only blocks: place every block first (a region range, or the client's address),
        then read the NVMe ones straight where they go and move each on as its read is verified, while the
        disk reads the next ones: into its region range in place (nothing to copy) unless a DRAM slot took it
        (a promotion: copied from there) or the region is in 4 KiB pages (``small_pages``: read into staging,
        where O_DIRECT ran twice as fast here, and copied), or written into the client's buffer (direct). Their
        CRC32C is the index's, which the tier checked the record against, so it is not computed again. The DRAM hits of
        the window are queued in ``copies`` as usual. With ``on_disk`` (the client reads the NVMe tier's files)
        its NVMe-only raw blocks are named by file and offset instead (their positions go in ``on_disk``, their
        segment pins in ``batches``) and nothing is read for them. Returns (bytes, blocks placed): fewer blocks
        than the window when the region is full."""
        cold: dict[int, CopyOut] = {}
        n_bytes = placed = 0
        where: list[tuple[str, int] | None] = []
        if on_disk is not None and batches is not None and self.disk is not None:
            batch = self.disk.name(window)
            batches.append(batch)
            where = batch.where
        for j, lease in enumerate(window):
            if where and (at := where[j]) is not None:
                assert lease is not None
                d = reply.blocks.add(
                    index=first + j, hash=lease.hash, length=lease.stored_length, crc32c=lease.crc32c,
                    disk_file=at[0], disk_offset=at[1],
                )  # fmt: skip
                self.ops.serve_into(d.header, lease, accepted)
                assert on_disk is not None
                on_disk.append(first + j)
                placed += 1
                n_bytes += lease.stored_length
                continue
            cold_one = lease is not None and lease.buffer is None
            n = self._place_out(grant, first + j, lease, accepted, reply, crc_at_copy, copies, outs, pins)
            if n < 0:
                break
            placed += 1
            n_bytes += n
            if cold_one:
                cold[j] = copies.pop()
        if not cold:
            return n_bytes, placed

        in_place = not self.region.small_pages  # O_DIRECT into 4 KiB pages ran at half speed: staging, then a copy

        def dest_for(j: int) -> Any:
            c = cold.get(j)
            return None if c is None or not in_place else c.dst  # the region range itself (None on a direct Get)

        def on_ready(positions: list[int]) -> None:
            run: list[CopyOut] = []  # bound for the client's memory: one process_vm_writev for the piece
            for j in positions:
                c, lease = cold[j], window[j]
                assert lease is not None
                if c.dst is None or lease.buffer is not c.dst:  # not read in place: one copy, no CRC pass
                    c.src = lease.buffer
                    if runnable(c):
                        run.append(c)
                    else:
                        verified, c.crc = c.crc, False
                        copy_one(c, self.direct)
                        c.crc = verified
                if c.crc:
                    c.descriptor.crc32c = lease.crc32c
            if run:
                assert self.direct is not None
                self.direct.write_many([(c.spans[0][0], host_view(c.src)[: c.descriptor.length]) for c in run])  # type: ignore[index]

        self.ops.materialize(
            [None if where and where[j] is not None else x for j, x in enumerate(window[:placed])], on_ready, dest_for
        )
        return n_bytes, placed

    def _copy_out(self, copies: Sequence[CopyOut]) -> None:
        """Run one message's copies into the region or the client's memory and wait for them (``copyout``)."""
        copy_out(copies, self.direct, self.ops.copies)
