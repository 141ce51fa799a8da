"""Client side of the shared-memory lane.

``put`` is one LanePut stream, in rounds of at most one region: ``reserve``
(the headers; the server answers with a region offset per block it wants, or
the block's final result), then each granted block is copied payload ->
region (one copy, no CRC: the commits say ``crc_from_server``, and the server
computes each CRC32C on the bytes as they land in its arena) and, every
``COMMIT_BYTES``, a ``commit`` is sent without waiting, so the server copies
into its arena while the client writes the next blocks; the results are
collected at the end of the round. Closing the stream takes back anything
reserved and not committed. (``write`` still fuses a CRC into the copy, for
commits that vouch for their CRCs.)

``get`` sends LaneGet (over the lane's channel, ``shm_channel``, when the
direct handshake opened one; else as a gRPC call) with ``crc_at_copy`` when verifying: the server
computes each block's CRC32C in the same pass as its copy into the region
and the client compares it with the header's, so the check reads no byte
twice. With ``out`` buffers the client copies each block into its buffer and
releases the grant with its next request on the lane. Without them the
blocks are lent in place (``shm_loans``: no copy on the client) while at most
half the region is on loan, and copied into fresh memory beyond that; a
loan's grant is released once the caller drops its views. A region smaller
than the batch means more rounds. Only this client and the server map the
region (0600, unlinked once mapped), so a CRC taken on either side of it
checks the same bytes.

The lane is used by one call at a time (``negotiate.LanePool``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvstore.checksum import crc32c
from kvstore.errors import KVStoreError, corrupt_block, short_buffer
from kvstore.lanes.base import Lane, LaneBroken, lane_failure
from kvstore.lanes.buffers import alloc_blocks
from kvstore.lanes.client.channel import ShmChannel
from kvstore.lanes.client.disk import DiskBlock, DiskReader
from kvstore.lanes.client.loans import Lender, Loan
from kvstore.lanes.client.outputs import SpanCopy, copy_out, copy_pool, direct_outs
from kvstore.lanes.cma import address_of
from kvstore.lanes.direct import handshake
from kvstore.lanes.segments import Spans, clip, flatten, gather, span_bytes
from kvstore.lanes.shm_region import RegionError, ShmRegion, attach
from kvstore.memops import copy_crc, copy_into, host_view
from kvstore.payload import Segments, as_bytes_view
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from kvstore.v1 import lanes_pb2_grpc as lpb_grpc
from kvstore.wire import put_result

if TYPE_CHECKING:
    from kvstore.lanes.cuda_region import DeviceRegion

log = logging.getLogger(__name__)
COMMIT_BYTES = 16 << 20
T = TypeVar("T")


class ShmClientLane(Lane):
    kind = "shm"
    commit_bytes = COMMIT_BYTES  # a commit is sent every this many bytes written
    _channel: ShmChannel | None = None  # Gets as frames on the direct handshake's socket, not gRPC calls
    dram: ShmRegion | None = None  # the store's shared DRAM arena, mapped read-only (serve --share-dram)
    disk: DiskReader | None = None  # reads the store's NVMe files itself (serve --share-nvme)

    def __init__(
        self,
        stub: lpb_grpc.KVStoreLanesStub,
        opened: lpb.OpenLaneResponse,
        metadata: tuple[tuple[str, str], ...],
        timeout: float,
    ):
        region = attach(opened.shm_path, opened.shm_bytes)
        self.region: ShmRegion | DeviceRegion = region  # a DeviceRegion in the cuda_ipc lane
        self.ref = lpb.LaneRef(lane_id=opened.lane_id, token=opened.token)
        self._stub, self._metadata, self._timeout = stub, metadata, timeout
        self._release: list[int] = []
        self._release_lock = threading.Lock()
        self._lender = Lender(region, self._give_back, budget=region.size // 2)
        self.direct = False  # puts name client memory for the server to read (one copy)
        self.direct_segments = opened.direct_segments  # ... and blocks in several buffers (Segments)
        if opened.direct_socket:
            why_not, sock = handshake(opened.direct_socket, opened.lane_id, opened.token)
            self.direct = why_not is None
            if sock is not None:
                self._channel = ShmChannel(sock, timeout)
            if why_not:
                log.info("shm lane %s: puts copy through the region (%s)", opened.lane_id, why_not)
        if opened.nvme_dir:
            self.disk = DiskReader(opened.nvme_dir)
        if opened.dram_path:
            try:
                self.dram = attach(opened.dram_path, opened.dram_bytes, readonly=True)
            except RegionError as err:
                log.info("shm lane %s: Gets copy through the region (%s)", opened.lane_id, err)

    # -- put ------------------------------------------------------------------------------
    def put(
        self, namespace: str, headers: Sequence[pb.BlockHeader], payloads: Sequence[memoryview | Segments]
    ) -> list[Any]:
        results: list[Any] = [None] * len(headers)
        # a server that predates Segments reads only one address per block: they go through its region
        direct = self.direct and (self.direct_segments or not any(isinstance(p, Segments) for p in payloads))
        stream = self.open_put()
        try:
            start = 0
            while start < len(headers):
                if direct:  # one round trip: the server reads the granted blocks from our memory
                    start = self._direct_round(stream, namespace, headers, payloads, start, results)
                    continue
                grant = stream.reserve(namespace, headers[start:], self._take_release())
                descriptors: list[lpb.BlockDescriptor] = []
                commits: list[list[int]] = []
                indices: list[int] = []
                batch = 0
                for j, slot in enumerate(grant.slots):
                    i = start + j
                    if slot.result.status != pb.PUT_STATUS_UNSPECIFIED:
                        results[i] = put_result(slot.result)
                        continue
                    self._place(slot, payloads[i])
                    descriptors.append(
                        lpb.BlockDescriptor(index=j, hash=headers[i].hash, offset=slot.offset, length=slot.length)
                    )
                    indices.append(i)
                    batch += slot.length
                    if batch >= self.commit_bytes:  # the server copies these while we write the next ones
                        self._settle()
                        stream.send_commit(grant.grant_id, descriptors, crc_from_server=True)
                        commits.append(indices)
                        descriptors, indices, batch = [], [], 0
                if descriptors:
                    self._settle()
                    stream.send_commit(grant.grant_id, descriptors, crc_from_server=True)
                    commits.append(indices)
                for indices in commits:
                    for i, r in zip(indices, stream.committed()):
                        results[i] = put_result(r)
                start += len(grant.slots)
        finally:
            stream.close()
        return results

    def _direct_round(
        self,
        stream: PutStream,
        namespace: str,
        headers: Sequence[pb.BlockHeader],
        payloads: Sequence[Any],
        start: int,
        results: list[Any],
    ) -> int:
        """One reserve naming where each payload is; the server reads and commits what it grants."""
        rest = payloads[start:]
        if any(isinstance(p, Segments) for p in rest):  # blocks in several buffers: every block's segments
            counts, addresses, lengths = flatten([_spans_of(p) for p in rest])
            grant = stream.reserve(
                namespace, headers[start:], self._take_release(), segments=(counts, addresses, lengths)
            )
        else:
            addresses = [address_of(p)[0] for p in rest]
            grant = stream.reserve(namespace, headers[start:], self._take_release(), addresses=addresses)
        committed = iter(stream.committed())
        for j, slot in enumerate(grant.slots):
            if slot.result.status != pb.PUT_STATUS_UNSPECIFIED:
                results[start + j] = put_result(slot.result)
            else:
                results[start + j] = put_result(next(committed))
        return start + len(grant.slots)

    def open_put(self) -> PutStream:
        """A LanePut conversation on this lane (its phases are public for tests and tools): over the lane's
        channel while it is open, else a gRPC stream."""
        if self._channel is not None and self._channel.claim():
            return ChannelPut(self, self._channel)
        return PutStream(self)

    def _settle(self) -> None:
        """Wait for writes into the region still in flight (none here: shm copies are synchronous)."""

    def write(self, slot: lpb.SlotGrant, payload: memoryview | Segments) -> int:
        """Copy one payload into its granted offset; its CRC32C (for a commit that vouches for its CRCs).
        Segments are copied one after the other, each copy with its CRC32C fused in, chained."""
        dst = self.region.view[slot.offset : slot.offset + slot.length]
        if isinstance(payload, Segments):
            return gather(dst, payload.views, crc=True)
        return copy_crc(dst, payload)

    def _place(self, slot: lpb.SlotGrant, payload: Any) -> None:
        """Copy one payload into its granted offset for a ``crc_from_server`` commit: no CRC here."""
        dst = self.region.view[slot.offset : slot.offset + slot.length]
        if isinstance(payload, Segments):
            gather(dst, payload.views, crc=False)
        else:
            copy_into(dst, payload)

    # -- get ------------------------------------------------------------------------------
    def get(
        self, namespace: str, hashes: Sequence[bytes], out: Sequence[Any] | None, allow_missing: bool, verify: bool
    ) -> list[Any]:
        spans = direct_outs(out) if out is not None and (self.direct or self.disk is not None) else None
        read_disk = self.disk is not None and spans is not None  # NVMe blocks read by us, from the store's files
        failed: list[int] = []  # read from disk but not readable or not matching their CRC32C
        results = self._get(namespace, hashes, out, allow_missing, verify, spans, read_disk, failed)
        if self.disk is not None and self.disk.unusable:  # another mount namespace, say: the store reads them
            log.info("shm lane %s: %s; Gets of NVMe blocks go through the store", self.ref.lane_id, self.disk.unusable)
            self.disk.close()
            self.disk = None
        if failed:  # the store reads these itself: a corrupt record is dropped there and reported as DATA_LOSS
            again = self._get(
                namespace, [hashes[i] for i in failed], [out[i] for i in failed] if out is not None else None,
                allow_missing, verify, [spans[i] for i in failed] if spans is not None else None, False, [],
            )  # fmt: skip
            for i, result in zip(failed, again):
                results[i] = result
        return results

    def _get(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        out: Sequence[Any] | None,
        allow_missing: bool,
        verify: bool,
        spans: list[Spans] | None,
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
            )
            if outs is not None and segmented:  # the server writes each block across our buffers itself
                counts, addresses, lengths = flatten(outs[start:])
                request.out_segment_counts.extend(counts)
                request.out_segment_addresses.extend(addresses)
                request.out_segment_lengths.extend(lengths)
            elif outs is not None:  # the server writes each block into our buffer itself
                request.out_addresses.extend(spans[0][0] for spans in outs[start:])
                request.out_lengths.extend(spans[0][1] for spans in outs[start:])
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
        spans: list[Spans] | None = None,
        failed: list[int] | None = None,
    ) -> int:
        handled = -1
        for msg in self._replies(request):
            if msg.HasField("written"):
                self._take_columns(msg.written, request.request.hashes, start, out, verify, results)
            present = [d for d in msg.blocks if not d.header.missing]
            if any(d.disk_file for d in present):
                self._take_disk([d for d in present if d.disk_file], start, out, spans, results, failed)
                present = [d for d in present if not d.disk_file]
            lend = out is None and bool(present) and self._lender.can_lend(sum(d.length for d in present))
            loan = self._lender.open(msg.grant_id) if lend else None
            try:
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
        named: list[lpb.BlockDescriptor],
        start: int,
        out: Sequence[Any] | None,
        spans: list[Spans] | None,
        results: list[Any],
        failed: list[int] | None,
    ) -> None:
        """Blocks the store named in its NVMe files: read each straight into our buffer and check its CRC32C
        (the store read nothing); those that fail go in ``failed``, for the store to read itself."""
        if self.disk is None or out is None or spans is None or failed is None:
            raise KVStoreError(grpc.StatusCode.INTERNAL, "the store named blocks on disk for a Get that did not ask")
        blocks = []
        for d in named:
            i = start + d.index
            if span_bytes(spans[i]) < d.length:
                raise short_buffer(i, span_bytes(spans[i]), d.length)
            blocks.append(DiskBlock(i, d.disk_file, d.disk_offset, d.length, d.crc32c, clip(spans[i], d.length)))
            results[i] = out[i]
        failed.extend(self.disk.read(blocks))

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
            source = self.dram if d.in_dram else self.region
            if source is None or d.offset + d.length > source.size:
                raise KVStoreError(grpc.StatusCode.INTERNAL, f"block {i} is named outside the memory this lane maps")
            src = source.view[d.offset : d.offset + d.length]
            target = out[i] if out is not None else None
            if isinstance(target, Segments) and target.on_host and isinstance(source, ShmRegion):
                if target.nbytes < d.length:
                    raise short_buffer(i, target.nbytes, d.length)
                dst: Any = SpanCopy(clip(target.spans, d.length), source.address + d.offset)
            else:
                dst = self._out_view(out, i, d.length) if out is not None else next(fresh)
            copies.append((dst, src, check))
            checked.append((i, d))
            results[i] = out[i] if out is not None else dst
        crcs = copy_pool().run(copy_out, copies, [len(c[1]) for c in copies])
        for (i, d), (_, _, check), crc in zip(checked, copies, crcs):
            if check and crc != d.header.crc32c:
                raise corrupt_block(i, d.hash)

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

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        try:
            self._stub.CloseLane(lpb.CloseLaneRequest(lane=self.ref), timeout=5, metadata=self._metadata)
        except grpc.RpcError:
            pass  # the server closes it at its idle timeout
        self.region.close()
        if self.dram is not None:
            self.dram.detach()  # the name is the store's: it stays
        if self.disk is not None:
            self.disk.close()

    def _give_back(self, grant_id: int) -> None:
        """A get grant the client is done with: released with the next request on the lane."""
        with self._release_lock:
            self._release.append(grant_id)

    def _take_release(self) -> list[int]:
        with self._release_lock:
            release, self._release = self._release, []
        return release

    @staticmethod
    def _call(fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as err:
            raise _from_rpc(err) from None


def _spans_of(payload: memoryview | Segments) -> Spans:
    """Where a payload is in our memory: its segments' spans, or one (address, length)."""
    if isinstance(payload, Segments):
        return payload.spans
    return (address_of(payload),)


def _from_rpc(err: grpc.RpcError) -> Exception:
    """A failed lane RPC as the client raises it (``lane_failure``)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    return lane_failure(code, str(err.details()) if hasattr(err, "details") else str(err))  # details: str | None


class PutStream:
    """One LanePut stream: ``reserve`` -> ``send_commit`` ... -> ``committed`` (in order) -> ``close``."""

    def __init__(self, lane: ShmClientLane):
        self._lane = lane
        self._queue: queue.SimpleQueue[lpb.LanePutRequest | None] = queue.SimpleQueue()
        self._first = True
        self._responses = lane._stub.LanePut(self._requests(), timeout=lane._timeout, metadata=lane._metadata)

    def _requests(self) -> Iterator[lpb.LanePutRequest]:
        while True:
            msg = self._queue.get()
            if msg is None:
                return
            yield msg

    def _send(self, msg: lpb.LanePutRequest) -> None:
        if self._first:
            msg.lane.CopyFrom(self._lane.ref)
            self._first = False
        self._queue.put(msg)

    def _next(self, step: str) -> Any:
        try:
            reply = next(self._responses)
        except StopIteration:
            raise LaneBroken("the LanePut stream ended early") from None
        except grpc.RpcError as err:
            raise _from_rpc(err) from None
        if reply.WhichOneof("step") != step:
            raise LaneBroken(f"LanePut stream out of step: expected {step}")
        return getattr(reply, step)

    def reserve(
        self,
        namespace: str,
        headers: Sequence[pb.BlockHeader],
        release: Sequence[int] = (),
        addresses: Sequence[int] = (),
        segments: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None,
    ) -> lpb.LaneGrant:
        """``addresses``: one per header (a direct reserve); ``segments``: (counts, addresses, lengths) of
        blocks in several buffers (``segments.flatten``) instead."""
        reserve = lpb.LaneReserve(namespace=namespace, headers=headers, release=release, addresses=addresses)
        if segments is not None:
            reserve.segment_counts.extend(segments[0])
            reserve.segment_addresses.extend(segments[1])
            reserve.segment_lengths.extend(segments[2])
        self._send(lpb.LanePutRequest(reserve=reserve))
        grant: lpb.LaneGrant = self._next("grant")
        return grant

    def send_commit(
        self, grant_id: int, descriptors: Sequence[lpb.BlockDescriptor], crc_from_server: bool = False
    ) -> None:
        self._send(
            lpb.LanePutRequest(
                commit=lpb.LaneCommit(grant_id=grant_id, blocks=descriptors, crc_from_server=crc_from_server)
            )
        )

    def committed(self) -> Sequence[pb.BlockResult]:
        """Results of the oldest commit not yet collected."""
        committed: lpb.LaneCommitted = self._next("committed")
        return committed.results

    def close(self) -> None:
        self._queue.put(None)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass  # the error, if any, was raised to the caller already


class ChannelPut(PutStream):
    """The same conversation over the lane's channel (``shm_channel``): each message is sent as it is made."""

    def __init__(self, lane: ShmClientLane, channel: ShmChannel):  # no super().__init__: it opens a gRPC stream
        self._lane, self._first = lane, True
        self._channel: ShmChannel | None = channel  # claimed until close()

    def _send(self, msg: lpb.LanePutRequest) -> None:
        if self._first:
            msg.lane.CopyFrom(self._lane.ref)
            self._first = False
        self._live().send_put(msg)

    def _next(self, step: str) -> Any:
        reply = self._live().next_put_reply()
        if reply.WhichOneof("step") != step:
            self._live().close()
            raise LaneBroken(f"LanePut conversation out of step: expected {step}")
        return getattr(reply, step)

    def close(self) -> None:
        if self._channel is None:
            return
        channel, self._channel = self._channel, None
        try:
            if not self._first:  # nothing was sent: there is no conversation to end
                channel.end_put()
        finally:
            channel.unclaim()

    def _live(self) -> ShmChannel:
        if self._channel is None:
            raise LaneBroken("this put conversation was closed")
        return self._channel
