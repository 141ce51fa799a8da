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

``get`` (kvstore/lanes/client/shm_get.py) sends LaneGet and takes the blocks the replies describe: written
into ``out`` by the store (as columns, or descriptors), copied out of the region or the store's shared DRAM
arena, read from the store's NVMe files, or lent in place.

The lane is used by one call at a time (``negotiate.LanePool``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvstore import arena_index
from kvstore.background_compile import warm_up_logged
from kvstore.lanes.base import Lane, LaneBroken, lane_failure
from kvstore.lanes.client.channel import ShmChannel
from kvstore.lanes.client.disk import DiskReader
from kvstore.lanes.client.indexed import IndexedGets
from kvstore.lanes.client.loans import Lender
from kvstore.lanes.client.shm_get import ShmGets
from kvstore.lanes.cma import address_of
from kvstore.lanes.direct import handshake
from kvstore.lanes.segments import Spans, flatten, gather
from kvstore.lanes.shm_region import RegionError, ShmRegion, attach
from kvstore.memops import copy_crc, copy_into
from kvstore.payload import Segments
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from kvstore.v1 import lanes_pb2_grpc as lpb_grpc
from kvstore.wire import put_result

if TYPE_CHECKING:
    from kvstore.lanes.cuda_region import DeviceRegion
    from kvstore.lanes.shared_pool import SharedPool

DRAIN_SECONDS = 1.0  # how long closing waits for the store to read the channel's last frames (its last hits)
log = logging.getLogger(__name__)
COMMIT_BYTES = 16 << 20
T = TypeVar("T")


class ShmClientLane(ShmGets, Lane):
    kind = "shm"
    commit_bytes = COMMIT_BYTES  # a commit is sent every this many bytes written
    _channel: ShmChannel | None = None  # Gets as frames on the direct handshake's socket, not gRPC calls
    dram: ShmRegion | None = None  # the store's shared DRAM arena, mapped read-only (serve --share-dram)
    disk: DiskReader | None = None  # reads the store's NVMe files itself (serve --share-nvme)
    indexed: IndexedGets | None = None  # finds DRAM hits in the store's index itself (serve --share-dram)
    _index_region: ShmRegion | None = None

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
        self._offered: set[int] = set()  # the shared pools offered to the store (ids)
        self._read_files = False  # the asked Get under way read blocks from the NVMe files (shm_get)
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
        # the index names the arena's blocks (and NVMe's), or with no arena offered NVMe's alone, read from their files
        readable = self.dram is not None or (not opened.dram_path and self.disk is not None)
        if readable and opened.dram_index_path and self._channel is not None:
            try:  # its hits are reported on the channel: without one, every Get asks the store
                index = attach(opened.dram_index_path, opened.dram_index_bytes, readonly=True)
                self._index_region = index
                self.indexed = IndexedGets(arena_index.ArenaIndexView.attach(index.view))
            except (RegionError, ValueError) as err:
                log.info("shm lane %s: DRAM hits are asked of the store (%s)", opened.lane_id, err)

    def share(self, pools: Sequence[SharedPool]) -> None:
        """Offer each pool not offered yet to the store, on the lane's channel (a direct lane only): once mapped
        there, NVMe blocks of Gets into it are read straight into it. A refusal is logged once and the pool's
        Gets are written as any buffer's."""
        if self._channel is None or not self.direct:
            return
        for pool in pools:
            if id(pool) in self._offered or pool.fd < 0:
                continue
            self._offered.add(id(pool))
            msg = lpb.LanePool(lane=self.ref, fd=pool.fd, address=pool.address, length=pool.nbytes)
            why_not = self._channel.send_pool(msg)
            if why_not:
                log.warning("shm lane %s: the store did not map a shared pool (%s)", self.ref.lane_id, why_not)

    def warm_up(self) -> None:
        """The reader of the store's NVMe files started (``DiskReader.start``) and the DRAM index's kernels
        compiled, where this lane has them; a failure is logged (the first Gets set up what is left, as before)."""
        if self.disk is not None and not self.disk.unusable:
            warm_up_logged(self.disk.start, f"shm lane {self.ref.lane_id}'s reader of the NVMe files")
        if self.indexed is not None:
            warm_up_logged(arena_index.warm_up, "the DRAM index's kernels")

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
            return gather(dst, payload.views, crc=True, spans=payload.spans if payload.on_host else None)
        return copy_crc(dst, payload)

    def _place(self, slot: lpb.SlotGrant, payload: Any) -> None:
        """Copy one payload into its granted offset for a ``crc_from_server`` commit: no CRC here."""
        dst = self.region.view[slot.offset : slot.offset + slot.length]
        if isinstance(payload, Segments):
            gather(dst, payload.views, crc=False, spans=payload.spans if payload.on_host else None)
        else:
            copy_into(dst, payload)

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        self._send_touches(force=True)
        if self._channel is not None:
            self._channel.drain(DRAIN_SECONDS)
        try:
            self._stub.CloseLane(lpb.CloseLaneRequest(lane=self.ref), timeout=5, metadata=self._metadata)
        except grpc.RpcError:
            pass  # the server closes it at its idle timeout
        self.region.close()
        if self.dram is not None:
            self.dram.detach()  # the name is the store's: it stays
        if self._index_region is not None:
            self._index_region.detach()
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
