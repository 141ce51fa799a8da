"""The gRPC KVStore service: Lookup, Put, Get, Delete, Stats (DESIGN 2.3).

Put is a two-phase write per block: the header reserves a slot in the top tier
(``BlockStore.begin_put``), data chunks are copied straight into it while their
CRC32C is accumulated, and the block becomes visible only at ``commit_put``
after the checksum matched. Every block whose bytes arrived whole gets a
result in the reply, in stream order: stored, already present, or rejected
with a code and reason (RESOURCE_EXHAUSTED over capacity or quota,
INVALID_ARGUMENT for a CRC32C mismatch or an encoded block that does not
decode; the stream goes on with the next block). A malformed stream (framing,
sizes, a header that fails validation, the stream byte limit) is aborted
instead; the error names block k, says blocks 0..k-1 were handled (each
stored, already present or rejected, as a Lookup shows) and nothing from
block k on was stored, and carries k in the trailing metadata key
``kvstore-put-blocks-handled``. Blocks committed before the fault are
written through to the durable tier before the abort, as on success.

With a ``gate`` (kvstore/server/auth.py) every handler authorizes the
request's namespace before touching the store (PERMISSION_DENIED otherwise),
a Put block over its tenant's byte quota is rejected with RESOURCE_EXHAUSTED,
and Stats is per namespace, or whole-node for admin tenants only.

Codecs (kvstore/codecs/transfer_server.py): a Put's encoded blocks are
decoded to verify their CRC32C and the decode time goes back in
``PutResponse.decode_timings``; a lossy block in a namespace outside
``--lossy-namespaces`` is INVALID_ARGUMENT (``validate.header``). A Get whose
reader accepts codecs beyond ``none`` is coded per batch by the node's
controller (``ServerCoding``), which also learns from the reader's
``decode_report``. Namespace Stats carry ``codec_lossy_allowed`` (1 or 0).

The messages that carry block bytes are made and read by hand (``kvstore/block_messages.py``): a raw Get's
responses leave already encoded (the block bytes copied once, into the message, where protobuf objects copied
them twice) and a Put's requests are read as views of what gRPC received (no parsed copy);
``add_to_server`` registers the service so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc

from kvstore import block_messages
from kvstore.block_messages import PutMessage
from kvstore.codecs.transfer import DecodeTally
from kvstore.codecs.transfer_server import ServerCoding
from kvstore.codecs.verify import crc_mismatch_reason
from kvstore.server import validate
from kvstore.server.auth import Gatekeeper
from kvstore.server.block_stream import Encoded, Packer, chunks, header_of, land
from kvstore.server.metrics import Metrics
from kvstore.server.quotas import namespace_usage
from kvstore.server.validate import InvalidRequest, Limits
from kvstore.store import BlockStore, CapacityError, DataLossError, Lease, NotFoundError, PutTicket
from kvstore.store.blockstore import ALREADY_PRESENT
from kvstore.store.leases import lease_windows
from kvstore.store.readahead import ReadAhead
from kvstore.tiers.base import BlockMeta, TierFault
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
R = TypeVar("R")


PUT_HANDLED_KEY = "kvstore-put-blocks-handled"  # trailing metadata of an aborted Put: blocks before the fault


def _handled_note(handled: int) -> str:
    if handled == 0:
        return "no block of this stream was stored"
    return (
        f"blocks 0..{handled - 1} of this stream were handled (each stored, already present or rejected; "
        f"Lookup shows which are present) and nothing from block {handled} on was stored"
    )


class _StreamFault(Exception):
    """A Put stream that cannot be read on: aborted with ``code`` once what was committed is made durable."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _PutState:
    """The block being received on one Put stream."""

    __slots__ = ("index", "meta", "ticket", "received", "crc", "result")

    def __init__(self, index: int, meta: BlockMeta, ticket: PutTicket | None, result: pb.BlockResult | None):
        self.index, self.meta, self.ticket, self.result = index, meta, ticket, result
        self.received = 0
        self.crc = 0


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(
        self,
        store: BlockStore,
        limits: Limits,
        metrics: Metrics,
        node_id: str = "",
        gate: Gatekeeper | None = None,
        get_codec: str = "auto",
    ):
        self.store, self.limits, self.metrics, self.node_id = store, limits, metrics, node_id
        self.gate = gate  # None: no authorization at all (an embedded service without the interceptor)
        self.coding = ServerCoding(metrics, limits.lossy, get_codec)
        self._readers = ThreadPoolExecutor(4, thread_name_prefix="kvstore-grpc-get-read")  # ReadAhead's reads

    # -- Lookup ------------------------------------------------------------------------
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        with self.metrics.rpc("Lookup", context):
            ns = self._authorized(context, request.namespace)
            keys = self._check(context, validate.hashes, request.hashes, self.limits)
            n, ranks = self.store.lookup(ns, keys)
            return pb.LookupResponse(prefix_length=n, tiers=ranks)  # type: ignore[arg-type]  # .pyi: Tier | str; ints go

    # -- Put ----------------------------------------------------------------------------
    def Put(self, request_iterator: Iterator[PutMessage], context: grpc.ServicerContext) -> pb.PutResponse:
        with self.metrics.rpc("Put", context):
            results: list[pb.BlockResult] = []
            state: _PutState | None = None
            ns: str | None = None
            total = 0
            committed: list[int] = []
            decoded = DecodeTally()
            try:
                for msg in request_iterator:
                    if ns is None:
                        ns = self._authorized(context, msg.namespace)
                    for header, data in self._message_parts(msg, state, len(results)):
                        if header is not None:
                            if state is not None:
                                raise _StreamFault(
                                    grpc.StatusCode.INVALID_ARGUMENT,
                                    f"block {state.index}: header of the next block arrived after "
                                    f"{state.received} of {state.meta.stored_length} bytes",
                                )
                            state = self._start_block(ns, header, len(results))
                        total += len(data)
                        state = self._take(state, data, total, committed, decoded, results)
                if state is not None:
                    raise _StreamFault(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"stream ended in the middle of block {state.index} "
                        f"({state.received} of {state.meta.stored_length} bytes)",
                    )
            except _StreamFault as fault:
                self.store.persist(committed)  # what was committed stays, durable as on success
                self.metrics.bytes_in(total)
                handled = len(results)
                context.set_trailing_metadata(((PUT_HANDLED_KEY, str(handled)),))
                self._abort(context, fault.code, f"{fault.message}; {_handled_note(handled)}")
            else:
                self.store.persist(committed)
                self.metrics.bytes_in(total)
                self.coding.put_decoded(decoded)
                return pb.PutResponse(
                    results=results,
                    decode_timings=DecodeTally.to_wire(decoded.timings()),
                    packed_bytes=self.limits.send_chunk_bytes,
                )
            finally:
                if state is not None and state.ticket is not None:
                    self.store.abort_put(state.ticket)

    def _message_parts(
        self, msg: PutMessage, state: _PutState | None, index: int
    ) -> list[tuple[pb.BlockHeader | None, memoryview]]:
        """A Put message as (header or None, data) parts: itself, or in the packed form each of its whole blocks
        with its bytes (``index``: the stream's next block)."""
        if not msg.blocks:
            return [(msg.header, msg.data)]
        if msg.header is not None or state is not None:
            where = f"block {state.index}" if state is not None else f"block {index}"
            raise _StreamFault(
                grpc.StatusCode.INVALID_ARGUMENT, f"{where}: packed blocks in a message with a header or mid-block"
            )
        data = msg.data
        if len(data) > self.limits.max_chunk_bytes:
            raise _StreamFault(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block {index}: packed message of {len(data)} bytes exceeds {self.limits.max_chunk_bytes}",
            )
        parts: list[tuple[pb.BlockHeader | None, memoryview]] = []
        at = 0
        for k, header in enumerate(msg.blocks):
            n = header.stored_length
            if at + n > len(data):
                raise _StreamFault(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"block {index + k}: a packed message holds fewer bytes than its blocks' stored_length",
                )
            parts.append((header, data[at : at + n]))
            at += n
        if at != len(data):
            raise _StreamFault(
                grpc.StatusCode.INVALID_ARGUMENT, f"block {index}: a packed message holds more bytes than its blocks"
            )
        return parts

    def _take(
        self,
        state: _PutState | None,
        data: memoryview,
        total: int,
        committed: list[int],
        decoded: DecodeTally,
        results: list[pb.BlockResult],
    ) -> _PutState | None:
        """Land ``data`` in the current block (``total``: the stream's bytes so far, these included); the block
        is finished (its result appended) once whole: then None, else the block still being received."""
        if data:
            n = len(data)
            if state is None:
                raise _StreamFault(grpc.StatusCode.INVALID_ARGUMENT, "data chunk before any block header")
            if n > self.limits.max_chunk_bytes:
                raise _StreamFault(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"block {state.index}: chunk of {n} bytes exceeds {self.limits.max_chunk_bytes}",
                )
            if state.received + n > state.meta.stored_length:
                raise _StreamFault(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"block {state.index}: {state.received + n} bytes sent but the header "
                    f"says stored_length={state.meta.stored_length}",
                )
            if total > self.limits.max_stream_bytes:
                raise _StreamFault(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Put stream exceeds {self.limits.max_stream_bytes} bytes; split it",
                )
            if state.ticket is not None:
                state.crc = land(state.ticket.buffer, state.received, data, state.crc)
            state.received += n
        if state is not None and state.received == state.meta.stored_length:
            results.append(self._finish_block(state, committed, decoded))
            return None
        return state

    def _start_block(self, ns: str, header: pb.BlockHeader, index: int) -> _PutState:
        try:
            meta = validate.header(ns, header, index, self.limits)
        except InvalidRequest as err:
            raise _StreamFault(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        over = self.gate.admit_block(ns, meta.stored_length, meta.hash) if self.gate is not None else None
        if over is not None:  # before begin_put: a tenant over quota never evicts anyone's blocks
            return _PutState(
                index,
                meta,
                None,
                validate.over_capacity(meta.hash, over),
            )
        try:
            ticket = self.store.begin_put(ns, meta)
        except CapacityError as err:
            return _PutState(
                index,
                meta,
                None,
                validate.over_capacity(meta.hash, str(err)),
            )
        if ticket is None:
            return _PutState(index, meta, None, pb.BlockResult(hash=meta.hash, status=pb.PUT_ALREADY_PRESENT))
        return _PutState(index, meta, ticket, None)

    def _finish_block(self, state: _PutState, committed: list[int], decoded: DecodeTally) -> pb.BlockResult:
        if state.ticket is None:
            assert state.result is not None  # no ticket: already present or rejected, its bytes were drained
            return state.result
        ticket, state.ticket = state.ticket, None
        if not self.coding.verify(state.meta, ticket.buffer, state.crc, decoded):  # decode time: for the sender
            self.store.abort_put(ticket)  # this block alone is refused; the stream goes on
            return pb.BlockResult(
                hash=state.meta.hash,
                status=pb.PUT_REJECTED,
                code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                reason=crc_mismatch_reason(state.index, state.meta),
            )
        status, entry = self.store.commit_put(ticket)
        if status == ALREADY_PRESENT:
            return pb.BlockResult(hash=state.meta.hash, status=pb.PUT_ALREADY_PRESENT)
        committed.append(entry)
        if self.gate is not None:
            self.gate.charge(state.meta.namespace, state.meta.stored_length)
        # protoc's .pyi types enum fields as Tier | str (Codec | str below); protobuf takes the ints
        return pb.BlockResult(hash=state.meta.hash, status=pb.PUT_STORED, tier=self.store.top.rank)  # type: ignore[arg-type]

    # -- Get -------------------------------------------------------------------------------
    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[bytes | pb.GetResponse]:
        with self.metrics.rpc("Get", context):
            ns = self._authorized(context, request.namespace)
            keys = self._check(context, validate.hashes, request.hashes, self.limits)
            try:
                leases = self.store.acquire(ns, keys, allow_missing=request.allow_missing)
            except NotFoundError as err:
                self._abort(context, grpc.StatusCode.NOT_FOUND, str(err.args[0]))
            sent = 0
            self.coding.observe_report(request.decode_report)
            coded = self.coding.begin_get(ns, request.accepted_codecs)  # None: the reader takes raw bytes only
            windows = list(lease_windows(leases))
            reads = ReadAhead(self.store.materialize, windows, self._readers)  # NVMe reads a window ahead
            try:
                for w, window in enumerate(windows):
                    if coded is not None:
                        for j in range(len(window)):
                            self._wait_read(context, reads, w, j)
                        for coded_msg in coded.messages(window, self.limits.send_chunk_bytes):
                            sent += len(coded_msg.data)
                            yield coded_msg
                        continue
                    accepted = set(request.accepted_codecs) | {pb.CODEC_NONE}
                    packed = Packer(self.limits.send_chunk_bytes) if request.packed else None
                    for j, lease in enumerate(window):
                        if packed is not None and packed.held and not self._read_now(reads, w, j):
                            msg, n = packed.take()  # what is verified goes before the wait for the rest
                            sent += n
                            yield msg
                        self._wait_read(context, reads, w, j)  # each block is sent once it is verified
                        for msg, n in self._block_messages(lease, accepted, packed):
                            sent += n
                            yield msg
                    if packed is not None and packed.held:
                        msg, n = packed.take()
                        sent += n
                        yield msg
            finally:
                reads.close()
                if coded is not None:
                    coded.close()
                self.store.release(leases)
                self.metrics.bytes_out(sent)

    def _wait_read(self, context: grpc.ServicerContext, reads: ReadAhead, w: int, j: int) -> None:
        try:
            reads.wait(w, j)
        except DataLossError as err:
            self._abort(context, grpc.StatusCode.DATA_LOSS, f"{err}; the block was dropped")
        except (TierFault, OSError) as err:  # e.g. EIO: the copy may read fine later
            self._abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"reading blocks from a lower tier failed ({err}); retry, or recompute them",
            )

    @staticmethod
    def _read_now(reads: ReadAhead, w: int, j: int) -> bool:
        """Block ``j`` of window ``w`` is verified already (a read error: True, so the wait reports it)."""
        try:
            return reads.ready(w, j)
        except Exception:
            return True

    def _block_messages(
        self, lease: Lease | None, accepted: AbstractSet[int], packed: Packer | None = None
    ) -> Iterator[Encoded]:
        """The messages of one block; with ``packed``, a whole small block joins its message instead (the
        messages that come out then are full ones)."""
        if lease is None:
            if packed is not None:
                return packed.add(pb.BlockHeader(missing=True), b"")
            return iter([(block_messages.encode_get(pb.BlockHeader(missing=True)), 0)])
        if lease.codec not in accepted:  # stored encoded, the reader cannot decode it: decode here
            from kvstore.codecs import decode

            raw = decode(lease.codec, lease.buffer, lease.dtype, lease.raw_length)
            lease = Lease(
                lease.entry,
                lease.hash,
                pb.CODEC_NONE,
                lease.dtype,
                lease.raw_length,
                lease.raw_length,
                lease.crc32c,
                lease.rank,
                memoryview(raw),
            )
        if packed is not None:
            return packed.add(header_of(lease), lease.buffer)
        return chunks(lease, self.limits.send_chunk_bytes)

    # -- Delete / Stats ---------------------------------------------------------------------
    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        with self.metrics.rpc("Delete", context):
            ns = self._authorized(context, request.namespace)
            keys = self._check(context, validate.hashes, request.hashes, self.limits)
            return pb.DeleteResponse(deleted=self.store.delete(ns, keys))

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        with self.metrics.rpc("Stats", context):
            if request.namespace:
                return self._namespace_stats(self._authorized(context, request.namespace))
            if self.gate is not None:
                self.gate.authorize_node(context)
            s = self.store.stats()
            tiers = [
                pb.TierStats(
                    name=t["name"],
                    capacity_bytes=t["capacity_bytes"],
                    used_bytes=t["used_bytes"],
                    blocks=t["blocks"],
                    hits=t["hits"],
                    evictions=t["evictions"],
                    backend=t["backend"],
                    degraded=t["degraded"],
                    fault=t["fault"],
                )
                for t in s["tiers"]
            ]
            counters = {k: float(v) for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            counters.update(self.metrics.counters())
            for t in s["tiers"]:  # per-tier figures the message has no field for (e.g. NVMe read speed)
                counters.update({f"tier_{t['name']}_{k}": float(v) for k, v in t.items() if type(v) in (int, float)})
            return pb.StatsResponse(
                tiers=tiers,
                blocks=s["blocks"],
                lookups=s["lookups"],
                lookup_hits=s["lookup_hits"],
                lookup_misses=s["lookup_misses"],
                lookup_hashes=s["lookup_hits"] + s["lookup_misses"],
                bytes_in=int(self.metrics.total_in),
                bytes_out=int(self.metrics.total_out),
                counters=counters,
                node_id=self.node_id,
            )

    def _namespace_stats(self, ns: str) -> pb.StatsResponse:
        """One namespace's blocks and bytes per tier (node-wide counters would show other tenants' traffic)."""
        use = namespace_usage(self.store, ns)
        tiers = [
            pb.TierStats(name=t.name, capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes, blocks=t.blocks)
            for t in use.tiers
        ]
        counters = {
            "namespace_bytes": float(use.bytes),
            "codec_lossy_allowed": 1.0 if self.limits.lossy.allows(ns) else 0.0,
        }
        if self.gate is not None:
            counters.update(self.gate.quota_counters(ns))
        return pb.StatsResponse(tiers=tiers, blocks=use.blocks, counters=counters, node_id=self.node_id)

    # -- helpers ------------------------------------------------------------------------------
    def _authorized(self, context: grpc.ServicerContext, namespace: str) -> str:
        """A well-formed namespace the caller may use; INVALID_ARGUMENT or PERMISSION_DENIED otherwise."""
        ns = self._check(context, validate.namespace, namespace)
        if self.gate is not None:
            self.gate.authorize(context, ns)
        return ns

    @staticmethod
    def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
        context.abort(code, message)
        raise AssertionError("unreachable")  # context.abort raises

    def _check(self, context: grpc.ServicerContext, fn: Callable[..., R], *args: Any) -> R:
        try:
            return fn(*args)
        except InvalidRequest as err:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))


def add_to_server(service: KVStoreService, server: grpc.Server) -> None:
    """Register ``service`` as protoc's ``add_KVStoreServicer_to_server`` does, but for the messages that carry
    block bytes (``kvstore/block_messages.py``): Put's requests are read as views, and Get yields its responses
    encoded already (``serialize`` passes bytes through, GetResponse objects of coded transfers through protobuf)."""
    handlers = {
        "Lookup": grpc.unary_unary_rpc_method_handler(
            service.Lookup, pb.LookupRequest.FromString, pb.LookupResponse.SerializeToString
        ),
        "Put": grpc.stream_unary_rpc_method_handler(
            service.Put, block_messages.decode_put, pb.PutResponse.SerializeToString
        ),
        "Get": grpc.unary_stream_rpc_method_handler(service.Get, pb.GetRequest.FromString, block_messages.serialize),
        "Delete": grpc.unary_unary_rpc_method_handler(
            service.Delete, pb.DeleteRequest.FromString, pb.DeleteResponse.SerializeToString
        ),
        "Stats": grpc.unary_unary_rpc_method_handler(
            service.Stats, pb.StatsRequest.FromString, pb.StatsResponse.SerializeToString
        ),
    }
    name = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)  # type: ignore[attr-defined]  # grpc's stubs lag
