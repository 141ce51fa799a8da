"""The store verbs every lane runs: the same validation, checksums and leases as the gRPC service.

Verbs (``StoreOps``, thread-safe like the BlockStore under it):

- ``namespace(ns, access)``, ``headers(ns, headers)``: validation
  (``kvstore.server.validate``; INVALID_ARGUMENT names the block) and the
  tenant's right to the namespace (``access.LaneAccess``), before anything
  is reserved.
- ``reserve(ns, meta, index, access) -> Reservation``: the tenant's quota,
  then ``begin_put``: a reservation holds a ticket (a writable arena slot,
  invisible until committed) or a final result (already present; rejected
  with RESOURCE_EXHAUSTED over capacity or quota).
- ``finish_many([(res, crc, computed)], committed, access) -> [BlockResult]``: ``crc`` is the CRC32C the
  client claims for the raw bytes, ``computed`` the CRC32C of the bytes that
  landed in the slot (codec none). On a match the block is committed (all the
  matching ones of the batch in one ``commit_puts``); on a mismatch (or a
  payload that does not decode) the slot is given back and that block alone is
  rejected (INVALID_ARGUMENT in its result, as on the gRPC Put); the rest go on.
  A stored block is charged to the tenant's quota.
- ``abort(reservations)``: give back the slots of uncommitted reservations.
- ``persist(entries)``: write-through to the durable tier before acknowledging.
- ``copies``: the ``CopyPool`` the region lanes spread a batch's copies over.
- ``touch(touched, access) -> n``: DRAM hits a client read through the arena's index, reported after.
- ``acquire / materialize / release``: leases for reading, as the gRPC Get,
  with NOT_FOUND and DATA_LOSS mapped to ``LaneError``; ``read_ahead(leases)``:
  the windows with their NVMe reads running in the background (``ReadAhead``); ``servable(lease,
  accepted)`` the bytes to send, decoded when the block's codec is one the reader does not accept
  (``serve_into`` the same, setting the fields of a header inside the reply being built).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import grpc

from kvstore.arena_index import ArenaIndex
from kvstore.codecs.verify import crc_mismatch_reason, verify_crc
from kvstore.lanes.base import LaneError
from kvstore.lanes.copypool import CopyPool
from kvstore.lanes.server.access import LaneAccess
from kvstore.server import validate
from kvstore.server.metrics import Metrics
from kvstore.server.validate import InvalidRequest, Limits
from kvstore.store import BlockStore, CapacityError, DataLossError, Lease, NotFoundError, PutTicket
from kvstore.store.blockstore import ALREADY_PRESENT
from kvstore.store.leases import lease_windows
from kvstore.store.readahead import ReadAhead
from kvstore.tiers.arena import ArenaTier, SharedArena
from kvstore.tiers.base import BlockMeta, TierFault
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb

R = TypeVar("R")


@dataclass(slots=True)
class Reservation:
    index: int
    meta: BlockMeta
    ticket: PutTicket | None
    result: pb.BlockResult | None  # final when there is no ticket
    full: bool = False  # rejected for want of room: may fit once earlier reservations are committed


class StoreOps:
    def __init__(
        self,
        store: BlockStore,
        limits: Limits,
        metrics: Metrics,
        copies: CopyPool | None = None,
        share_nvme: bool = False,
    ):
        self.store, self.limits, self.metrics = store, limits, metrics
        self.share_nvme = share_nvme  # shm clients may read the NVMe tier's files (serve --share-nvme)
        self.copies = copies or CopyPool()  # the region lanes' bulk copies, a few threads wide
        self.readers = ThreadPoolExecutor(4, thread_name_prefix="kvstore-get-read")  # ReadAhead's window reads

    # -- validation ---------------------------------------------------------------------
    @staticmethod
    def check(fn: Callable[..., R], *args: Any) -> R:
        try:
            return fn(*args)
        except InvalidRequest as err:
            raise LaneError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None

    def namespace(self, ns: str, access: LaneAccess) -> str:
        """A well-formed namespace the lane's tenant may use (INVALID_ARGUMENT / PERMISSION_DENIED)."""
        ns = self.check(validate.namespace, ns)
        access.check(ns)
        return ns

    def hashes(self, keys: Sequence[bytes]) -> list[bytes]:
        return self.check(validate.hashes, keys, self.limits)

    def headers(self, ns: str, headers: Sequence[pb.BlockHeader]) -> list[BlockMeta]:
        if len(headers) > self.limits.max_hashes:
            raise LaneError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(headers)} blocks in one request; the limit is {self.limits.max_hashes}",
            )
        metas = [self.check(validate.header, ns, h, i, self.limits) for i, h in enumerate(headers)]
        total = sum(m.stored_length for m in metas)
        if total > self.limits.max_stream_bytes:
            raise LaneError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{total} bytes in one request exceed {self.limits.max_stream_bytes}; split it",
            )
        return metas

    # -- put ----------------------------------------------------------------------------------
    def reserve(self, ns: str, meta: BlockMeta, index: int, access: LaneAccess) -> Reservation:
        over = access.admit(ns, meta.stored_length)
        if over is not None:  # before begin_put: a tenant over quota never evicts anyone's blocks
            if self.store.lookup(ns, [meta.hash])[0] == 1:
                return Reservation(index, meta, None, pb.BlockResult(hash=meta.hash, status=pb.PUT_ALREADY_PRESENT))
            return Reservation(
                index,
                meta,
                None,
                validate.over_capacity(meta.hash, over),
            )
        try:
            ticket = self.store.begin_put(ns, meta)
        except CapacityError as err:
            return Reservation(
                index,
                meta,
                None,
                validate.over_capacity(meta.hash, str(err)),
                full=True,
            )
        if ticket is None:
            return Reservation(index, meta, None, pb.BlockResult(hash=meta.hash, status=pb.PUT_ALREADY_PRESENT))
        return Reservation(index, meta, ticket, None)

    def finish_many(
        self, blocks: Sequence[tuple[Reservation, int, int]], committed: list[int], access: LaneAccess
    ) -> list[pb.BlockResult]:
        """Verify and commit each reserved block (reservation, claimed CRC32C, CRC32C as it landed in
        ``res.ticket.buffer``), in order: every block verified
        alone (a bad one is refused and the rest go on), the good ones committed in one ``commit_puts`` (one
        index insert and one policy insert for the batch: committing 64 blocks one by one cost 3.7 ms with
        ``freq`` and 6.1 with ``adaptive`` here, in a batch 0.8 and 1.2)."""
        results: list[pb.BlockResult | None] = [None] * len(blocks)
        verified: list[tuple[int, Reservation, PutTicket]] = []
        for k, (res, crc, computed) in enumerate(blocks):
            if res.ticket is None:
                assert res.result is not None
                results[k] = res.result
                continue
            ticket, res.ticket = res.ticket, None
            if crc != ticket.meta.crc32c:
                m = ticket.meta
                ticket.meta = BlockMeta(
                    m.namespace, m.hash, m.parent, m.codec, m.dtype, m.raw_length, m.stored_length, crc
                )
            try:
                ok = verify_crc(ticket.meta, ticket.buffer, computed)
            except Exception:  # an encoded block that does not decode (codec, dtype): the sender's fault
                ok = False
            if not ok:  # this block alone is refused, as on the gRPC Put; the request goes on
                self.store.abort_put(ticket)
                results[k] = pb.BlockResult(
                    hash=res.meta.hash,
                    status=pb.PUT_REJECTED,
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                    reason=crc_mismatch_reason(res.index, res.meta),
                )
                continue
            verified.append((k, res, ticket))
        if verified:
            outcomes = self.store.commit_puts([ticket for _, _, ticket in verified])
            top = self.store.top.rank
            for (k, res, _), (status, entry) in zip(verified, outcomes):
                if status == ALREADY_PRESENT:
                    results[k] = pb.BlockResult(hash=res.meta.hash, status=pb.PUT_ALREADY_PRESENT)
                    continue
                committed.append(entry)
                access.charge(res.meta.namespace, res.meta.stored_length)
                # protoc's .pyi types enum fields as Tier | str and Codec | str; protobuf takes (and stores) the ints
                results[k] = pb.BlockResult(hash=res.meta.hash, status=pb.PUT_STORED, tier=top)  # type: ignore[arg-type]
        return cast(list[pb.BlockResult], results)

    def abort(self, reservations: Sequence[Reservation | None]) -> None:
        for res in reservations:
            if res is not None and res.ticket is not None:
                ticket, res.ticket = res.ticket, None
                self.store.abort_put(ticket)

    def persist(self, entries: list[int]) -> None:
        self.store.persist(entries)

    # -- get ------------------------------------------------------------------------------------
    def acquire(self, request: pb.GetRequest, access: LaneAccess, touch: bool = True) -> tuple[str, list[Lease | None]]:
        """``touch=False``: the policies' bookkeeping waits for ``release(leases, touch=True)``, after the reply."""
        ns = self.namespace(request.namespace, access)
        keys = self.hashes(request.hashes)
        try:
            return ns, self.store.acquire(ns, keys, allow_missing=request.allow_missing, touch=touch)
        except NotFoundError as err:
            raise LaneError(grpc.StatusCode.NOT_FOUND, str(err.args[0])) from None

    def materialize(
        self,
        leases: Sequence[Lease | None],
        on_ready: Callable[[list[int]], None] | None = None,
        dest_for: Callable[[int], Any] | None = None,
        on_caller: bool = False,
        final_dests: bool = False,
        run_reader: Any = None,
    ) -> None:
        """``BlockStore.materialize`` (NVMe reads straight into place, handed on piece by piece) with DATA_LOSS
        and UNAVAILABLE (an I/O error) as ``LaneError``."""
        try:
            self.store.materialize(leases, on_ready, dest_for, on_caller, final_dests, run_reader)
        except DataLossError as err:
            raise LaneError(grpc.StatusCode.DATA_LOSS, f"{err}; the block was dropped") from None
        except (TierFault, OSError) as err:
            raise LaneError(
                grpc.StatusCode.UNAVAILABLE, f"reading blocks from a lower tier failed ({err}); retry, or recompute"
            ) from None

    def read_ahead(self, leases: Sequence[Lease | None]) -> tuple[list[list[Lease | None]], ReadAhead]:
        """The Get's windows, with their NVMe reads started in the background one window ahead of the sender."""
        windows = list(lease_windows(list(leases)))
        return windows, ReadAhead(self.materialize, windows, self.readers)

    def release(self, leases: Sequence[Lease | None], touch: bool = False) -> None:
        self.store.release(leases, touch)

    def touch(self, touched: Sequence[lpb.TouchedBlocks], access: LaneAccess) -> int:
        """Hits a client read through the DRAM index, reported afterwards (a TOUCH frame): counted, and told to
        the eviction policies. A namespace the tenant may not read, or malformed, is skipped."""
        n = 0
        for blocks in touched:
            try:
                ns = self.namespace(blocks.namespace, access)
                keys = self.hashes(blocks.hashes)
            except LaneError:
                continue
            n += self.store.touch(ns, keys)
        self.metrics.add("lane_shm_index_hits", n)
        return n

    def shared_dram(self) -> SharedArena | None:
        """The store's DRAM arena when clients may map it (``serve --share-dram``), else None."""
        for tier in self.store.tiers:
            if isinstance(tier, ArenaTier) and tier.shared is not None:
                return tier.shared
        return None

    def disk_index(self) -> ArenaIndex | None:
        """The table of NVMe-only blocks clients may find their Gets' blocks in, unasked, when no shared DRAM arena
        holds it (``serve --share-nvme`` without ``--share-dram``), else None."""
        for tier in self.store.tiers:
            if (
                isinstance(tier, ArenaTier)
                and not tier.index_names_memory
                and tier.index is not None
                and self.share_nvme
            ):
                return tier.index
        return None

    def disk_dir(self) -> str | None:
        """The NVMe tier's directory when shm clients may read its files (``serve --share-nvme``), else None."""
        return self.store.disk_dir() if self.share_nvme else None

    windows = staticmethod(lease_windows)

    @staticmethod
    def servable(lease: Lease, accepted: set[int]) -> Any:
        """The bytes to send for a leased block, decoded when the reader cannot decode it (its header, which
        ``header_of`` gives, went ahead in the reply: none is built here, 1.6 us a block)."""
        if lease.codec in accepted:
            return lease.buffer
        from kvstore.codecs import decode

        return memoryview(decode(lease.codec, lease.buffer, lease.dtype, lease.raw_length))

    @staticmethod
    def serve_into(header: pb.BlockHeader, lease: Lease, accepted: set[int]) -> Any:
        """``servable`` for a reply being built: the fields are set on ``header`` (a message's own field, so
        nothing is built and copied per block); returns the bytes to send."""
        codec, stored, buf = lease.codec, lease.stored_length, lease.buffer
        if codec not in accepted:
            from kvstore.codecs import decode

            buf = memoryview(decode(codec, buf, lease.dtype, lease.raw_length))
            codec, stored = pb.CODEC_NONE, lease.raw_length
        header.hash = lease.hash
        if codec:
            header.codec = codec  # type: ignore[assignment]  # protoc's .pyi: Codec | str; an int is what it takes
        header.raw_length = lease.raw_length
        header.stored_length = stored
        header.crc32c = lease.crc32c
        header.dtype = lease.dtype
        return buf

    @staticmethod
    def header_of(lease: Lease | None, accepted: set[int]) -> pb.BlockHeader:
        """The header a reader will see for a lease, without touching its bytes."""
        if lease is None:
            return pb.BlockHeader(missing=True)
        if lease.codec in accepted:
            return pb.BlockHeader(
                hash=lease.hash,
                codec=lease.codec,  # type: ignore[arg-type]  # protoc's .pyi: Codec | str; an int is what it takes
                raw_length=lease.raw_length,
                stored_length=lease.stored_length,
                crc32c=lease.crc32c,
                dtype=lease.dtype,
            )
        return pb.BlockHeader(
            hash=lease.hash,
            codec=pb.CODEC_NONE,
            raw_length=lease.raw_length,
            stored_length=lease.raw_length,
            crc32c=lease.crc32c,
            dtype=lease.dtype,
        )


def accepted_codecs(request: pb.GetRequest) -> set[int]:
    return set(request.accepted_codecs) | {pb.CODEC_NONE}
