"""Blocks in several buffers on the lanes (``kvstore.payload.Segments``): the bookkeeping both ends share.

A block may live in several pieces of memory (a vLLM block is one slice per layer); the lanes move it without
gathering it into one buffer first. What they share:

- ``pieces(lengths, piece, iov_max)``: the concatenation of buffers of ``lengths`` cut into runs of at most
  ``piece`` bytes and ``iov_max`` entries, each entry (buffer, offset in it, length), never empty. A run is one
  ``process_vm_readv``/``writev`` or ``recvmsg_into`` call, CRC32C'd right after it moved, while it is in cache
  (Linux takes at most IOV_MAX = 1024 entries per call).
- ``clip(spans, n)``: the first ``n`` bytes of a list of (address, length) spans; ``skip(spans, n)`` all but them;
  ``page_aligned(spans, n)``: whether they lie in page-aligned spans of whole pages (O_DIRECT reads them in place).
- ``gather(dst, views, crc, spans)`` / ``scatter(views, src, crc)``: segments copied into or out of one
  contiguous range (the shm lane's region), with the CRC32C of the contiguous side taken in one call;
  ``copy_to_spans(spans, address, check)``: the same out of host memory at a known address, into (address,
  length) spans. Where the segments' addresses are known and ``kvstore.memops_jit``'s kernels are compiled,
  ``gather`` and ``copy_to_spans`` fold each span into the CRC32C as they copy it: one read of the bytes.
- On the wire (lanes.proto), a direct put names each block's memory in ``LaneReserve`` either as one address
  per block (``addresses``: old clients) or as ``segment_counts`` (one per block) over flattened
  ``segment_addresses``/``segment_lengths``; a direct Get names its destinations as ``out_addresses`` and
  ``out_lengths`` (one per hash) or as ``out_segment_counts`` over ``out_segment_addresses``/
  ``out_segment_lengths``; a commit's ``BlockDescriptor`` carries ``address`` or ``segment_addresses``/
  ``segment_lengths``. ``flatten`` builds the segmented form; ``reserve_sources``, ``get_destinations`` and
  ``descriptor_spans`` read either form back as one ``Spans`` per block, raising ``LaneError``
  (INVALID_ARGUMENT) when the counts or lengths do not add up.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import overload

import grpc
import numpy as np

from kvstore import memops_jit
from kvstore.checksum import crc32c
from kvstore.lanes.base import LaneError
from kvstore.memops import copy_into
from kvstore.v1 import lanes_pb2 as lpb

IOV_MAX = 1024
Span = tuple[int, int]  # (address, length)
Spans = tuple[Span, ...]
Entry = tuple[int, int, int]  # (buffer index, offset in that buffer, length)


def pieces(lengths: Sequence[int], piece: int, iov_max: int = IOV_MAX) -> Iterator[list[Entry]]:
    """Runs of at most ``piece`` bytes and ``iov_max`` entries covering the buffers' bytes in order.

    A run ends when it holds ``piece`` bytes (runs start at multiples of ``piece`` in the concatenation until
    an ``iov_max`` cut shifts them) or ``iov_max`` entries; empty buffers get no entry."""
    run: list[Entry] = []
    size = 0
    for index, n in enumerate(lengths):
        offset = 0
        while offset < n:
            take = min(n - offset, piece - size)
            run.append((index, offset, take))
            size += take
            offset += take
            if size == piece or len(run) == iov_max:
                yield run
                run, size = [], 0
    if run:
        yield run


def clip(spans: Spans, n: int) -> Spans:
    """The spans of the first ``n`` bytes (all of them when they hold no more)."""
    out: list[Span] = []
    for address, length in spans:
        if n <= 0:
            break
        out.append((address, min(length, n)))
        n -= length
    return tuple(out)


def skip(spans: Spans, n: int) -> Spans:
    """The spans without their first ``n`` bytes."""
    out: list[Span] = []
    for address, length in spans:
        if n >= length:
            n -= length
            continue
        out.append((address + n, length - n))
        n = 0
    return tuple(out)


def page_aligned(spans: Spans, n: int, page: int = 4096) -> bool:
    """Whether the first ``n`` bytes of ``spans`` (``n`` a multiple of ``page``) lie in page-aligned spans of
    whole pages (where O_DIRECT reads them in place)."""
    left = n
    for address, length in spans:
        if left <= 0:
            break
        take = min(length, left)
        if address % page or take % page:
            return False
        left -= take
    return left <= 0


def clip_table(table: np.ndarray, n: int) -> np.ndarray:
    """``clip`` of an (address, length) int64 table: its rows that hold the first ``n`` bytes."""
    lengths = table[:, 1]
    starts = np.cumsum(lengths) - lengths
    held = starts < n
    kept: np.ndarray = table[held].copy()
    kept[:, 1] = np.minimum(kept[:, 1], n - starts[held])
    return kept


def flatten(blocks: Sequence[Spans]) -> tuple[list[int], list[int], list[int]]:
    """(counts, addresses, lengths) of the segmented wire form (a vLLM Get names 30 spans a block: the pairs are
    split in C, not a Python step each)."""
    counts = [len(spans) for spans in blocks]
    pairs = list(chain.from_iterable(blocks))
    addresses, lengths = (list(column) for column in zip(*pairs)) if pairs else ([], [])
    return counts, addresses, lengths


class SpanTable(Sequence[Spans]):
    """One Spans per block, kept as the segmented wire form's arrays: ``table``, every span's (address, length)
    as a C-contiguous uint64 array of rows, block ``k``'s from row ``starts[k]`` to ``starts[k + 1]``, and
    ``held``, each block's bytes. ``self[k]`` makes block k's tuple of spans when asked; ``rows(k)`` is a view.
    A vLLM Get names 30 spans a block: the tuples of every one took a fifth of the store's time on a Get of
    62 such blocks of small pages (py-spy), where the writes take the table as it is. The client builds its
    request from one too (``outputs.direct_outs``): 535 -> 258 us a 62-block request of 30 spans a block."""

    def __init__(self, counts: Sequence[int], table: np.ndarray):
        self.table = np.ascontiguousarray(table, dtype=np.uint64).reshape(-1, 2)
        self.starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.starts[1:])
        total = np.zeros(len(self.table) + 1, dtype=np.uint64)
        np.cumsum(self.table[:, 1], out=total[1:])
        self.held = (total[self.starts[1:]] - total[self.starts[:-1]]).astype(np.int64)

    @classmethod
    def singles(cls, addresses: Sequence[int], lengths: Sequence[int]) -> SpanTable:
        """One span a block (a buffer each, the common Get): no counts to add up."""
        table = cls.__new__(cls)
        table.table = np.empty((len(addresses), 2), dtype=np.uint64)
        table.table[:, 0] = addresses
        table.table[:, 1] = lengths
        table.starts = np.arange(len(addresses) + 1, dtype=np.int64)
        table.held = np.array(lengths, dtype=np.int64)
        return table

    @classmethod
    def from_wire(cls, counts: Sequence[int], addresses: Sequence[int], lengths: Sequence[int]) -> SpanTable:
        table = np.empty((len(addresses), 2), dtype=np.uint64)
        table[:, 0] = addresses
        table[:, 1] = lengths
        return cls(counts, table)

    @classmethod
    def of(cls, blocks: Sequence[Spans]) -> SpanTable:
        return cls.from_wire(*flatten(blocks))

    def __len__(self) -> int:
        return len(self.starts) - 1

    @overload
    def __getitem__(self, k: int) -> Spans: ...
    @overload
    def __getitem__(self, k: slice) -> list[Spans]: ...
    def __getitem__(self, k: int | slice) -> Spans | list[Spans]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        return tuple(map(tuple, self.rows(k).tolist()))

    def rows(self, k: int) -> np.ndarray:
        """Block ``k``'s spans as (address, length) rows of ``table`` (a view)."""
        return self.table[self.starts[k] : self.starts[k + 1]]

    def counts(self) -> np.ndarray:
        return np.diff(self.starts)


def unflatten(
    what: str, blocks: int, counts: Sequence[int], addresses: Sequence[int], lengths: Sequence[int]
) -> SpanTable:
    """The segmented wire form back as one Spans per block (INVALID_ARGUMENT when it does not add up)."""
    if len(counts) != blocks:
        raise _invalid(f"{what} gives segment counts for {len(counts)} of {blocks} blocks")
    if len(addresses) != len(lengths) or sum(counts) != len(addresses):
        raise _invalid(
            f"{what} has {len(addresses)} segment addresses and {len(lengths)} lengths for {sum(counts)} segments"
        )
    return SpanTable.from_wire(counts, addresses, lengths)


def reserve_sources(reserve: lpb.LaneReserve) -> Sequence[Spans]:
    """Where each block of a direct reserve is in the client's memory, either wire form."""
    headers = reserve.headers
    if reserve.segment_counts:
        sources = unflatten(
            "a direct reserve", len(headers), reserve.segment_counts, reserve.segment_addresses, reserve.segment_lengths
        )
        wrong = np.nonzero(sources.held != np.array([h.stored_length for h in headers], dtype=np.int64))[0]
        if len(wrong):
            i = int(wrong[0])
            raise _invalid(
                f"block {i}: its segments hold {int(sources.held[i])} bytes; the block is {headers[i].stored_length}"
            )
        return sources
    if len(reserve.addresses) != len(headers):
        raise _invalid(f"a direct reserve names {len(reserve.addresses)} addresses for {len(headers)} blocks")
    return [((a, h.stored_length),) for a, h in zip(reserve.addresses, headers)]


def get_destinations(request: lpb.LaneGetRequest) -> Sequence[Spans]:
    """Where a direct Get writes each block in the client's memory (none: the region), either wire form."""
    if request.out_segment_counts:
        return unflatten(
            "a direct Get",
            len(request.request.hashes),
            request.out_segment_counts,
            request.out_segment_addresses,
            request.out_segment_lengths,
        )
    if len(request.out_addresses) != len(request.out_lengths):
        raise _invalid("out_addresses and out_lengths differ in length")
    return [((a, n),) for a, n in zip(request.out_addresses, request.out_lengths)]


def describe_source(descriptor: lpb.BlockDescriptor, spans: Spans) -> lpb.BlockDescriptor:
    """Name a block's client memory in its commit descriptor: one address, or its segments."""
    if len(spans) == 1:
        descriptor.address = spans[0][0]
    else:
        descriptor.segment_addresses.extend(a for a, _ in spans)
        descriptor.segment_lengths.extend(n for _, n in spans)
    return descriptor


def descriptor_spans(descriptor: lpb.BlockDescriptor) -> Spans:
    """The client memory a commit descriptor names (empty: the block is in the region)."""
    if descriptor.segment_addresses or descriptor.segment_lengths:
        spans = tuple(zip(descriptor.segment_addresses, descriptor.segment_lengths))
        if len(descriptor.segment_addresses) != len(descriptor.segment_lengths):
            raise _invalid(f"block {descriptor.index}: segment addresses and lengths differ in number")
        if sum(n for _, n in spans) != descriptor.length:
            raise _invalid(
                f"block {descriptor.index}: its segments hold {sum(n for _, n in spans)} bytes; the block is "
                f"{descriptor.length}"
            )
        return spans
    return ((descriptor.address, descriptor.length),) if descriptor.address else ()


def span_bytes(spans: Spans) -> int:
    return sum(n for _, n in spans)


def gather(dst: memoryview, views: Sequence[memoryview], crc: bool, spans: Spans | None = None) -> int:
    """Copy ``views`` one after the other into ``dst``; the CRC32C of what landed in ``dst`` when asked, else 0.
    ``spans``, the views' (address, length) when the caller knows them, lets the compiled kernel do it.

    The CRC32C runs over ``dst`` in one call after the copies, not fused with each (often small) copy: a
    call on a large buffer lets go of the GIL, so other threads' copies run beside it (on 30 pages of 48 KiB
    a block, fused per page took 32 ms for 91 MB in two threads as in one; this takes 19 ms in two)."""
    offset = 0
    for view in views:
        n = len(view)
        if n:
            copy_into(dst[offset : offset + n], view)
        offset += n
    return crc32c(dst[:offset]) if crc else 0


def scatter(views: Sequence[memoryview], src: memoryview, crc: bool) -> int:
    """Copy ``src`` across ``views`` in turn (they hold ``len(src)`` bytes in all); the CRC32C of ``src`` when
    asked, else 0 (in one call before the copies, for the reason ``gather`` gives)."""
    value = crc32c(src) if crc else 0
    offset = 0
    for view in views:
        n = len(view)
        copy_into(view, src[offset : offset + n])
        offset += n
    return value


def copy_to_spans(spans: Spans | np.ndarray, source: int, check: bool = False) -> int:
    """Copy the bytes at address ``source`` across ``spans`` (host memory) in turn; their CRC32C when
    ``check``, else 0. Through the compiled kernel when it is ready (each span copied and CRC'd in one pass:
    62 vLLM blocks of 30 x 48 KiB pages in 12 ms on two threads, against 16.6 for the copies alone and 16
    more for the CRC32Cs), else one ``memmove`` a span, each letting go of the GIL (a memoryview assignment
    holds it: two threads scattering 30 pages of 48 KiB a block took 15 ms for 91 MB, as one thread did;
    these took 12.6), after one CRC32C of the source."""
    if memops_jit.ready():
        return memops_jit.copy_to_spans(source, _span_array(spans), check)
    if isinstance(spans, np.ndarray):
        spans = tuple((address, length) for address, length in spans.tolist())
    value = crc32c((ctypes.c_char * span_bytes(spans)).from_address(source)) if check else 0
    for address, length in spans:
        ctypes.memmove(address, source, length)
        source += length
    return value


def _span_array(spans: Spans | np.ndarray) -> np.ndarray:
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2)


def _invalid(message: str) -> LaneError:
    return LaneError(grpc.StatusCode.INVALID_ARGUMENT, message)
