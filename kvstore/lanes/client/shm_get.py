"""The Get half of the shared-memory lane's client (``ShmClientLane.get``; the lane and its Puts are in shm.py).

``get`` sends LaneGet (over the lane's channel, ``shm_channel``, when the direct handshake opened one; else as
a gRPC call) with ``crc_at_copy`` when verifying, and takes each reply's blocks:

- written into ``out`` by the store (a direct lane): as ``WrittenBlocks`` columns (``written_columns``), whose
  CRC32C of what was written is compared with the block's own, or as descriptors;
- named in the NVMe tier's files (``serve --share-nvme``): read into ``out`` by ``DiskReader`` and checked;
  those that fail are asked for again without ``read_disk``, so the store reads them (and drops a corrupt one);
- named in the shared DRAM arena (``serve --share-dram``; all of a Get's blocks as ``NamedBlocks`` columns when
  every one is a raw DRAM hit, ``named_columns``) or copied into the region: copied into ``out`` with
  the CRC32C fused in (or compared with the one the server took as it copied into the region); without ``out``
  lent in place (``shm_loans``) while at most half the region is on loan, copied into fresh memory beyond that.

A grant is released with the next request on the lane. A region smaller than the batch means more rounds.
Only this client and the server map the region (0600, unlinked once mapped), so a CRC taken on either side of
it checks the same bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np

from kvstore.arena_index import ArenaIndexView, OnDisk
from kvstore.arena_index_layout import segment_name
from kvstore.checksum import crc32c
from kvstore.errors import KVStoreError, corrupt_block, short_buffer
from kvstore.indexed_runs import IndexedRead
from kvstore.lanes.base import LaneBroken
from kvstore.lanes.buffers import alloc_blocks
from kvstore.lanes.client.channel import ShmChannel
from kvstore.lanes.client.disk import DiskBlock, DiskReader
from kvstore.lanes.client.disk_gets import DiskColumns, read_named
from kvstore.lanes.client.indexed import IndexedGets
from kvstore.lanes.client.loans import Lender, Loan
from kvstore.lanes.client.outputs import SpanCopy, buffer_addresses, buffer_extents, copy_outs, direct_outs
from kvstore.lanes.cma import address_of
from kvstore.lanes.segments import SpanTable, clip, clip_table, span_bytes
from kvstore.lanes.shm_region import ShmRegion
from kvstore.memops import host_view
from kvstore.payload import Segments, as_bytes_view
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from kvstore.v1 import lanes_pb2_grpc as lpb_grpc

if TYPE_CHECKING:
    from kvstore.lanes.cuda_region import DeviceRegion

log = logging.getLogger("kvstore.lanes.client.shm")
T = TypeVar("T")


class ShmGets:
    """Mixed into ShmClientLane; uses its region, mapped arena, disk reader, channel, lender and stub."""

    if TYPE_CHECKING:  # provided by ShmClientLane
        region: ShmRegion | DeviceRegion
        dram: ShmRegion | None
        disk: DiskReader | None
        indexed: IndexedGets | None
        direct: bool
        ref: lpb.LaneRef
        _stub: lpb_grpc.KVStoreLanesStub
        _metadata: tuple[tuple[str, str], ...]
        _timeout: float
        _channel: ShmChannel | None
        _lender: Lender
        _read_files: bool  # the asked Get under way read blocks from the NVMe files

        def _give_back(self, grant_id: int) -> None: ...
        def _take_release(self) -> list[int]: ...
        @staticmethod
        def _call(fn: Callable[[], T]) -> T: ...

    def get(
        self, namespace: str, hashes: Sequence[bytes], out: Sequence[Any] | None, allow_missing: bool, verify: bool
    ) -> list[Any]:
        if self.indexed is not None and out is not None:
            if self._channel is None or not self._channel.alive():  # a store that is gone keeps no index
                raise LaneBroken("the store closed the lane's channel: its DRAM index is not kept any more")
            reads = self.disk is not None and not self.disk.unusable and self.disk.ready
            read_disk, read_indexed = (self._read_named_on_disk, self._read_indexed) if reads else (None, None)
            copy_from = self._copy_from_arena if self.dram is not None else None  # (an index of NVMe blocks alone)
            found = self.indexed.get(namespace, hashes, out, verify, copy_from, read_disk, read_indexed)
            if found is not None:  # (a second read of a record from the files is reported at once: it is promoted)
                self._send_touches()
                return found
        results = self._get_asked(namespace, hashes, out, allow_missing, verify)
        if self.indexed is not None:
            self.indexed.allow(namespace)  # the store served it: this lane's tenant may read the namespace
        return results

    def _copy_from_arena(self, offset: int, n: int, out: Sequence[Any], i: int) -> tuple[Any, memoryview]:
        return self._copy_from(self.dram, offset, n, out, i, None)

    def _read_indexed(
        self, view: ArenaIndexView, namespace: str, hashes: Sequence[bytes], out: Sequence[Any], marks: np.ndarray
    ) -> IndexedRead | None:
        """A Get named whole in one segment file, read in one compiled call (``DiskReader.read_indexed``); None
        when ``out`` is not numpy arrays (the general path takes it)."""
        assert self.disk is not None
        extents = buffer_extents(out[: len(hashes)])
        return self.disk.read_indexed(view, namespace, hashes, *extents, marks) if extents is not None else None

    def _read_named_on_disk(self, named: OnDisk, out: Sequence[Any]) -> bool:
        """Blocks the DRAM index names in the NVMe tier's files, read straight into ``out`` and checked; False
        when one could not be (the Get is then asked of the store)."""
        assert self.disk is not None
        picked = out if named.segment >= 0 else [out[i] for i in named.positions.tolist()]
        addresses = buffer_addresses(picked, named.lengths)
        if addresses is not None:
            columns = (named.positions, named.offsets, named.lengths, named.crcs, addresses)
            if named.segment >= 0 or (named.segments == named.segments[0]).all():  # one file, as a rule
                failed = self.disk.read_run(segment_name(int(named.segments[0])), *columns)
            else:  # a prefix demoted together, which a segment's end cut in two
                failed = self.disk.read_runs(named.segments, segment_name, *columns)
            if failed is not None:
                return not failed
        spans = direct_outs(out)
        if spans is None:
            return False
        positions, lengths = named.positions.tolist(), named.lengths.tolist()
        todo = []
        for i, segment, offset, n, crc in zip(
            positions, named.segments.tolist(), named.offsets.tolist(), lengths, named.crcs.tolist()
        ):
            where = spans[i]
            if len(where) != 1 or where[0][1] != n:  # one buffer of the block's size, as a rule: nothing to clip
                if span_bytes(where) < n:
                    return False  # asked, the store's reply says which buffer is short
                where = clip(where, n)
            todo.append(DiskBlock(i, segment_name(segment), offset, n, crc, where))
        return not self.disk.read(todo)

    def _send_touches(self, force: bool = False) -> None:
        """Report the hits read through the index, when enough are pending (``IndexedGets.take_touches``), and end
        what the last asked Get held now, not at the next request."""
        if self._channel is None:
            return
        release = self._take_release()
        touched = (self.indexed.take_touches(force or bool(release)) or []) if self.indexed is not None else []
        if not (release or touched):
            return
        if not self._channel.send_touch(lpb.LaneTouch(lane=self.ref, touched=touched, release=release)):
            if self.indexed is not None:
                self.indexed.put_back(touched)
            for grant_id in release:
                self._give_back(grant_id)

    def _get_asked(
        self, namespace: str, hashes: Sequence[bytes], out: Sequence[Any] | None, allow_missing: bool, verify: bool
    ) -> list[Any]:
        """A Get the store answers (the index did not serve it)."""
        reads = self.disk is not None and self.disk.ready  # (until its kernels are, the store reads them)
        spans = direct_outs(out) if out is not None and (self.direct or reads) else None
        read_disk = reads and spans is not None  # NVMe blocks read by us, from the store's files
        failed: list[int] = []  # read from disk but not readable or not matching their CRC32C
        self._read_files = False
        results = self._get(namespace, hashes, out, allow_missing, verify, spans, read_disk, failed)
        if self.disk is not None and self.disk.unusable:  # another mount namespace, say: the store reads them
            log.info("shm lane %s: %s; Gets of NVMe blocks go through the store", self.ref.lane_id, self.disk.unusable)
            self.disk.close()
            self.disk = None
            if self.dram is None:  # an index of NVMe blocks alone names nothing this lane can read now
                self.indexed = None
        if failed:  # the store reads these itself: a corrupt record is dropped there and reported as DATA_LOSS
            again = self._get(
                namespace, [hashes[i] for i in failed], [out[i] for i in failed] if out is not None else None,
                allow_missing, verify, SpanTable.of([spans[i] for i in failed]) if spans is not None else None, False,
                [],
            )  # fmt: skip
            for i, result in zip(failed, again):
                results[i] = result
        if self._read_files:  # their leases and segment pins end now: a second read is promoted, not a third
            self._send_touches()
        return results

    def _get(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        out: Sequence[Any] | None,
        allow_missing: bool,
        verify: bool,
        spans: SpanTable | None,
        read_disk: bool,
        failed: list[int],
    ) -> list[Any]:
        results: list[Any] = [None] * len(hashes)
        read_dram = self.dram is not None and out is not None  # DRAM hits copied once, by us, from the arena
        outs = spans if self.direct else None  # the rest written by the store
        segmented = out is not None and any(isinstance(o, Segments) for o in out)
        start = 0
        while start < len(hashes):
            request = lpb.LaneGetRequest(
                lane=self.ref,
                release=self._take_release(),
                request=pb.GetRequest(namespace=namespace, hashes=hashes[start:], allow_missing=allow_missing),
                crc_at_copy=verify,
                read_dram=read_dram,
                read_disk=read_disk,
                written_columns=outs is not None,
                named_columns=read_dram,
                disk_columns=read_disk,
            )
            if outs is not None and segmented:  # the server writes each block across our buffers itself
                rows = outs.table[outs.starts[start] :]
                request.out_segment_counts.extend(outs.counts()[start:].tolist())
                request.out_segment_addresses.extend(rows[:, 0].tolist())
                request.out_segment_lengths.extend(rows[:, 1].tolist())
            elif outs is not None:  # the server writes each block into our buffer itself (one span each)
                heads = outs.table[outs.starts[start:-1]]
                request.out_addresses.extend(heads[:, 0].tolist())
                request.out_lengths.extend(heads[:, 1].tolist())
            handled = self._call(lambda: self._receive(request, start, out, verify, results, spans, failed))
            start += handled
        return results

    def _receive(
        self,
        request: lpb.LaneGetRequest,
        start: int,
        out: Sequence[Any] | None,
        verify: bool,
        results: list[Any],
        spans: SpanTable | None = None,
        failed: list[int] | None = None,
    ) -> int:
        handled = -1
        for msg in self._replies(request):
            loan: Loan | None = None
            try:  # whatever fails, the grant (the store's leases and pins for this message) goes back
                if msg.HasField("written"):
                    self._take_columns(msg.written, request.request.hashes, start, out, verify, results)
                if msg.HasField("disk"):  # a Get of blocks all only on NVMe, named as columns
                    self._take_disk(DiskColumns.of_message(msg.disk, start), out, spans, results, failed)
                present = [d for d in msg.blocks if not d.header.missing]
                if any(d.disk_file for d in present):
                    named = [d for d in present if d.disk_file]
                    self._take_disk(DiskColumns.of_descriptors(named, start), out, spans, results, failed)
                    present = [d for d in present if not d.disk_file]
                lend = out is None and bool(present) and self._lender.can_lend(sum(d.length for d in present))
                loan = self._lender.open(msg.grant_id) if lend else None
                if msg.HasField("named"):
                    self._take_named(msg.named, request.request.hashes, start, out, verify, results)
                if msg.written_direct:  # blocks named in the DRAM arena are ours to copy; the store wrote the rest
                    named = [d for d in present if d.in_dram]
                    if named:
                        self._take_blocks(named, start, out, verify, results, None, msg.crcs_at_copy)
                    self._take_written([d for d in present if not d.in_dram], start, out, verify, results)
                else:
                    self._take_blocks(present, start, out, verify, results, loan, msg.crcs_at_copy)
            finally:
                if loan is not None:
                    loan.close()  # its grant is released once the caller drops the lent views
                else:
                    self._give_back(msg.grant_id)
            if msg.last:
                handled = msg.handled
        if handled <= 0:
            raise KVStoreError(grpc.StatusCode.DATA_LOSS, "lane Get stream ended without its last message")
        return handled

    def _replies(self, request: lpb.LaneGetRequest) -> Iterator[lpb.LaneGetResponse]:
        """The Get's replies: over the lane's channel while it is open, else one LaneGet call."""
        if self._channel is not None and self._channel.claim():  # claimed only once iterated: a generator
            yield from self._channel.get(request)
        else:
            yield from self._stub.LaneGet(request, timeout=self._timeout, metadata=self._metadata)

    def _take_disk(
        self,
        columns: DiskColumns,
        out: Sequence[Any] | None,
        spans: SpanTable | None,
        results: list[Any],
        failed: list[int] | None,
    ) -> None:
        """Blocks the store named in its NVMe files: read each straight into our buffer and check its CRC32C
        (the store read nothing); those that fail go in ``failed``, for the store to read itself."""
        if self.disk is None or out is None or spans is None or failed is None:
            raise KVStoreError(grpc.StatusCode.INTERNAL, "the store named blocks on disk for a Get that did not ask")
        failed.extend(read_named(self.disk, columns, spans))
        self._read_files = True
        for i in columns.positions.tolist():
            results[i] = out[i]

    @staticmethod
    def _take_columns(
        written: lpb.WrittenBlocks,
        hashes: Sequence[bytes],
        start: int,
        out: Sequence[Any] | None,
        verify: bool,
        results: list[Any],
    ) -> None:
        """Raw blocks the server wrote into our buffers, as columns: compare each CRC32C it took with the
        block's own (``hashes`` are the request's, from ``start``)."""
        if out is None:
            raise KVStoreError(grpc.StatusCode.INTERNAL, "the store wrote blocks into buffers a Get did not name")
        index = list(written.index)
        if verify and list(written.crc32c) != list(written.stored_crc32c):
            k = next(k for k, (a, b) in enumerate(zip(written.crc32c, written.stored_crc32c)) if a != b)
            raise corrupt_block(start + index[k], hashes[index[k]])
        for i in index:
            results[start + i] = out[start + i]

    def _take_named(
        self,
        named: lpb.NamedBlocks,
        hashes: Sequence[bytes],
        start: int,
        out: Sequence[Any] | None,
        verify: bool,
        results: list[Any],
    ) -> None:
        """Raw DRAM hits named in the shared arena, as columns: copy each into its buffer with its CRC32C fused in
        and compare that with the block's own (``hashes`` are the request's, from ``start``)."""
        dram = self.dram
        if dram is None or out is None:
            raise KVStoreError(grpc.StatusCode.INTERNAL, "the store named arena blocks for a Get that did not ask")
        index = list(named.index)
        copies = [
            (*self._copy_from(dram, offset, n, out, start + j, None), verify)
            for j, offset, n in zip(index, named.offset, named.length)
        ]
        crcs = copy_outs(copies)
        if verify:
            for j, crc, stored in zip(index, crcs, named.crc32c):
                if crc != stored:
                    raise corrupt_block(start + j, hashes[j])
        for j in index:
            results[start + j] = out[start + j]

    @staticmethod
    def _take_written(
        present: list[lpb.BlockDescriptor], start: int, out: Sequence[Any] | None, verify: bool, results: list[Any]
    ) -> None:
        """Blocks the server wrote into our buffers: check each CRC32C it took of what it wrote."""
        assert out is not None
        for d in present:
            i = start + d.index
            if verify:
                h = d.header
                if h.codec == pb.CODEC_NONE and d.crc32c != h.crc32c:
                    raise corrupt_block(i, d.hash)
            results[i] = out[i]

    def _take_blocks(
        self,
        present: list[lpb.BlockDescriptor],
        start: int,
        out: Sequence[Any] | None,
        verify: bool,
        results: list[Any],
        loan: Loan | None,
        crcs_at_copy: bool,
    ) -> None:
        """Lend (no copy) or copy out the blocks of one LaneGet message, checking each CRC32C.

        With ``crcs_at_copy`` the server computed each CRC32C as it copied the block into the region, which
        only it and this client map: comparing that with the header's checks the block without reading it."""
        fresh = iter(alloc_blocks([d.length for d in present]) if out is None and loan is None else ())
        copies: list[tuple[Any, memoryview, bool]] = []  # (destination, region range, compute its CRC)
        checked: list[tuple[int, lpb.BlockDescriptor]] = []
        for d in present:
            i = start + d.index
            check = verify and d.header.codec == pb.CODEC_NONE
            if check and crcs_at_copy and not d.in_dram:
                if d.crc32c != d.header.crc32c:
                    raise corrupt_block(i, d.hash)
                check = False
            if loan is not None:
                results[i] = view = loan.view(d.offset, d.length)  # the bytes stay where the server put them
                if check and crc32c(view) != d.header.crc32c:
                    raise corrupt_block(i, d.hash)
                continue
            spare = next(fresh) if out is None else None
            source = self.dram if d.in_dram else self.region
            copies.append((*self._copy_from(source, d.offset, d.length, out, i, spare), check))
            checked.append((i, d))
            results[i] = out[i] if out is not None else spare
        crcs = copy_outs(copies)
        for (i, d), (_, _, check), crc in zip(checked, copies, crcs):
            if check and crc != d.header.crc32c:
                raise corrupt_block(i, d.hash)

    def _copy_from(
        self,
        source: ShmRegion | DeviceRegion | None,
        offset: int,
        n: int,
        out: Sequence[Any] | None,
        i: int,
        spare: Any,
    ) -> tuple[Any, memoryview]:
        """The copy of block ``i``'s ``n`` bytes at ``offset`` of a mapped region (the lane's or the DRAM arena)
        into ``out[i]``, or into ``spare`` without ``out``: (destination as ``copy_out`` takes it, source range)."""
        if source is None or offset + n > source.size:
            raise KVStoreError(grpc.StatusCode.INTERNAL, f"block {i} is named outside the memory this lane maps")
        src = source.view[offset : offset + n]
        target = out[i] if out is not None else None
        if isinstance(target, Segments) and target.on_host and isinstance(source, ShmRegion):
            if target.nbytes < n:
                raise short_buffer(i, target.nbytes, n)
            table = target.span_table if target.nbytes == n else clip_table(target.span_table, n)
            return SpanCopy(table, source.address + offset), src
        dst = self._out_view(out, i, n) if out is not None else spare
        return _by_address(dst, source, offset), src

    @staticmethod
    def _out_view(out: Sequence[Any], i: int, n: int) -> memoryview | list[memoryview]:
        target = out[i]
        if isinstance(target, Segments):  # scattered across its segments
            if target.nbytes < n:
                raise short_buffer(i, target.nbytes, n)
            views: list[memoryview] = target.head_views(n)
            return views
        dst = host_view(target) or as_bytes_view(target)[0]  # host_view: no dtype name worked out per block
        if len(dst) < n:
            raise short_buffer(i, len(dst), n)
        return dst[:n]


def _by_address(dst: Any, source: Any, offset: int) -> Any:
    """A plain view's copy out of a mapped region as a ``SpanCopy``: the source's address is the mapping's plus
    the offset (taking a read-only view's address costs numpy 3 us a block)."""
    if isinstance(dst, memoryview) and isinstance(source, ShmRegion) and not dst.readonly and len(dst):
        return SpanCopy(((address_of(dst)[0], len(dst)),), source.address + offset)
    return dst
