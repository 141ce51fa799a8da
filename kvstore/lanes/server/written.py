"""A direct Get of raw blocks in host memory (DRAM hits, or NVMe-only blocks once read), written into the
client's buffers and described as columns.

The general Get path (``ShmServerLane.get``) builds a BlockDescriptor, a copy record and a few calls per
block: about 10 us of Python a block here (3.7 us for the descriptor and its header alone), against about 25 us
to check and move 64 KiB. When every block of a direct Get is present, raw
(CODEC_NONE) and in host memory, and the client reads columns (``LaneGetRequest.written_columns``), the
store answers in one message whose ``WrittenBlocks`` columns say it all:

- ``host_sources(leases) -> [memoryview] | None``: each block's bytes, or None when one is missing, coded or
  not in host memory (an HBM slot, an NVMe-only block): the general path serves those. It never raises
  (the caller holds the leases).
- ``raw_in_host_or_lower(leases) -> bool``: all present and raw, each in host memory or in no memory tier (an
  NVMe-only block that ``materialize`` reads into host memory, ``copyout.host_bytes`` its bytes then): a direct
  Get the lane answers in columns after reading them (``ShmColumnGets._get_read_written``);
- ``checked_targets(outs, lengths)``: each block's destination clipped to it, INVALID_ARGUMENT for the first too
  small; ``columns_reply(leases, lengths, crcs, crc_at_copy)``: the one message that describes them;
- ``write_reply(leases, sources, outs, direct, pool, crc_at_copy, shared, pooled) -> LaneGetResponse``: check
  every destination holds its block (INVALID_ARGUMENT naming the first that does not), write them
  (``copyout.write_blocks``: one process_vm_writev per run, spread over the copy threads, each CRC32C taken
  just before its block moves; a block bound for one of the client's ``shared`` pools copied through the
  store's mapping instead) and fill the columns. The caller owns the grant and the leases.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import numpy as np

from kvstore.lanes.base import LaneError
from kvstore.lanes.copypool import CopyPool
from kvstore.lanes.direct import DirectPeer
from kvstore.lanes.segments import Spans, SpanTable, clip
from kvstore.lanes.server.copyout import write_blocks
from kvstore.lanes.server.pools import MappedPools
from kvstore.memops import host_view
from kvstore.store import Lease
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb


def host_sources(leases: Sequence[Lease | None]) -> list[memoryview] | None:
    """The bytes of each block when all are present, raw and in host memory; else None."""
    sources: list[memoryview] = []
    for lease in leases:
        if lease is None or lease.codec != pb.CODEC_NONE or lease.buffer is None:
            return None
        view = _in_host(lease.buffer)
        if view is None:
            return None
        sources.append(view[: lease.stored_length])
    return sources


def raw_in_host_or_lower(leases: Sequence[Lease | None]) -> bool:
    """Whether every block is present and raw, and each either in host memory or in no memory tier (NVMe-only:
    ``materialize`` reads it into host memory): a direct Get the store can answer in columns all the same."""
    return all(
        lease is not None
        and lease.codec == pb.CODEC_NONE
        and (lease.buffer is None or _in_host(lease.buffer) is not None)
        for lease in leases
    )


def _in_host(buf: object) -> memoryview | None:
    """A memory tier's slot as one flat host buffer; None for device memory or anything else (the general
    path says what it is)."""
    if type(buf) is memoryview:  # an arena slot is one already
        return buf
    try:
        return host_view(buf)
    except ValueError:
        return None


def write_reply(
    leases: Sequence[Lease],
    sources: Sequence[memoryview],
    outs: Sequence[Spans],
    direct: DirectPeer,
    pool: CopyPool,
    crc_at_copy: bool,
    shared: MappedPools | None = None,
    pooled: list[int] | None = None,
) -> lpb.LaneGetResponse:
    """Write every block into the client's memory (through the store's mapping where it lies in one of the
    client's ``shared`` pools: those bytes appended to ``pooled``) and describe them all in one message's columns."""
    lengths = [len(s) for s in sources]
    targets = checked_targets(outs, lengths)
    crcs = write_blocks(targets, sources, direct, pool, crc_at_copy, shared, pooled)
    return columns_reply(leases, lengths, crcs, crc_at_copy)


def checked_targets(outs: Sequence[Spans], lengths: Sequence[int]) -> Sequence[Spans]:
    """Where each block goes, clipped to its length: INVALID_ARGUMENT naming the first buffer too small for its
    block, before anything is written."""
    if isinstance(outs, SpanTable) and bool((outs.held == np.array(lengths, dtype=np.int64)).all()):
        # every block's buffers hold it exactly (a vLLM block's pages): the wire's arrays as they are, no tuple a
        # span; else the loop below checks and clips each block
        return outs
    targets: list[Spans] = []
    for i, (spans, n) in enumerate(zip(outs, lengths)):
        if len(spans) == 1:
            if spans[0][1] < n:
                raise _short(i, spans[0][1], n)
            targets.append(spans)
        else:  # several buffers: the write covers exactly the block's bytes
            held = sum(length for _, length in spans)
            if held < n:
                raise _short(i, held, n)
            targets.append(spans if held == n else clip(spans, n))  # a vLLM block's pages hold it exactly
    return targets


def columns_reply(
    leases: Sequence[Lease], lengths: Sequence[int], crcs: Sequence[int], crc_at_copy: bool
) -> lpb.LaneGetResponse:
    """The one message that describes a direct Get's blocks, all written: ``crcs`` are those taken as they were
    written (with ``crc_at_copy``; else the blocks' own go in both columns)."""
    stored = [lease.crc32c for lease in leases]
    reply = lpb.LaneGetResponse(crcs_at_copy=crc_at_copy, written_direct=True, handled=len(leases), last=True)
    written = reply.written
    written.index.extend(range(len(leases)))
    written.length.extend(lengths)
    written.crc32c.extend(crcs if crc_at_copy else stored)
    written.stored_crc32c.extend(stored)
    return reply


def _short(i: int, capacity: int, n: int) -> LaneError:
    return LaneError(grpc.StatusCode.INVALID_ARGUMENT, f"output buffer {i} holds {capacity} bytes; block is {n}")
