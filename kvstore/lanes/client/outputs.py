"""Where a shm lane Get's blocks go in the caller's memory, and the copies that put them there.

- ``direct_outs(out) -> SpanTable | None``: the (address, bytes) spans of each output buffer (a ``Segments``'s
  parts in order), or None when one is not plain host memory: what a direct Get names for the store to write
  and a ``--share-nvme`` Get reads into.
- ``buffer_addresses(out, lengths) -> int64 array | None``: each buffer's address when each is one span of host
  memory of at least its block's length (a ``--share-nvme`` Get's compiled read), else None.
- ``buffer_extents(out) -> (addresses, sizes) | None``: each buffer's address and size, when all are writable
  contiguous numpy arrays (the one-call Get of blocks the index names, which checks the sizes itself).
- ``SpanCopy(spans, source)``: a copy out of mapped memory at an address into host spans.
- ``copy_outs(copies) -> [crc | None]``: ``copy_out`` of a batch over ``copy_pool()``, a thread's run of blocks in one
  compiled call.
- ``copy_out((dst, src, check)) -> crc | None``: one block out of the region or the DRAM arena into its
  destination (a view, a list of segment views, or a ``SpanCopy``), with its CRC32C when ``check``;
  ``copy_pool()`` the process's threads that run them side by side.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from kvstore import memops_jit
from kvstore.lanes.cma import address_of
from kvstore.lanes.copypool import CopyPool
from kvstore.lanes.segments import Spans, SpanTable, copy_to_spans, scatter
from kvstore.memops import copy_crc, copy_into, host_view, run_rows
from kvstore.payload import Segments


def direct_outs(out: Sequence[Any]) -> SpanTable | None:
    """The (address, bytes) spans of each output buffer (its segments' for ``Segments``) as one table, or None
    when one is not plain host memory. A ``Segments``'s span table (known already for a vLLM block, from
    ``SegmentRows``) joins the table as it is: a tuple per span cost 0.25 ms a 62-block load."""
    addresses: list[int] = []
    lengths: list[int] = []
    for buf in out:  # the common case first, every buffer a writable contiguous array: 65 -> 40 us for 32
        if type(buf) is not np.ndarray or (address := _array_address(buf)) is None:
            break
        addresses.append(address)
        lengths.append(buf.nbytes)
    else:
        return SpanTable.singles(addresses, lengths)
    counts: list[int] = []
    tables: list[np.ndarray] = []
    singles: list[tuple[int, int]] = []  # one-span buffers since the last Segments, joined as one array

    def join_singles() -> None:
        if singles:
            tables.append(np.array(singles, dtype=np.int64))
            singles.clear()

    for buf in out:
        if type(buf) is np.ndarray and (address := _array_address(buf)) is not None:  # the common case, one step
            singles.append((address, buf.nbytes))
        elif isinstance(buf, Segments):
            if not buf.on_host:
                return None
            join_singles()
            tables.append(buf.span_table)
        elif (view := host_view(buf)) is not None:
            singles.append(address_of(view))
        else:
            return None
        counts.append(len(tables[-1]) if isinstance(buf, Segments) else 1)
    join_singles()
    return SpanTable(counts, np.concatenate(tables) if tables else np.empty((0, 2), dtype=np.int64))


def buffer_addresses(out: Sequence[Any], lengths: np.ndarray) -> np.ndarray | None:
    addresses = []
    for buf, n in zip(out, lengths.tolist()):
        if type(buf) is np.ndarray and buf.nbytes >= n:  # the common case: no spans built (0.11 ms of 32 cold)
            address = _array_address(buf)
            if address is None:  # read-only or strided: the general path says what it is
                return None
            addresses.append(address)
            continue
        spans = direct_outs((buf,))
        if spans is None or len(spans[0]) != 1 or spans[0][0][1] < n:
            return None
        addresses.append(spans[0][0][0])
    return np.array(addresses, dtype=np.int64)


def buffer_extents(out: Sequence[Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """Each buffer's address and size (int64 columns), when every one is a writable contiguous numpy array; else
    None (the general paths take the others)."""
    addresses, sizes = [], []
    for buf in out:
        if type(buf) is not np.ndarray:
            return None
        address = _array_address(buf)
        if address is None:
            return None
        addresses.append(address)
        sizes.append(buf.nbytes)
    return np.array(addresses, dtype=np.int64), np.array(sizes, dtype=np.int64)


def _array_address(buf: np.ndarray) -> int | None:
    """A writable contiguous array's address in one step (host_view + address_of cost 3x this), else None."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(cast(Any, buf)))
    except (TypeError, ValueError):
        return None


_pool: CopyPool | None = None
_pool_lock = threading.Lock()


def copy_pool() -> CopyPool:
    """Copies out of the region, spread over a few threads (one pool per process)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = CopyPool()
        return _pool


@dataclass(frozen=True, slots=True)
class SpanCopy:
    """A copy out of mapped memory at ``source`` (an address) into host spans: one buffer's, or a Segments'
    host parts as its (address, length) int64 table (``Segments.span_table``)."""

    spans: Spans | np.ndarray
    source: int


def copy_outs(copies: Sequence[tuple[Any, memoryview, bool]]) -> list[int | None]:
    """``copy_out`` of each, in order, over the copy threads; with the kernels compiled, the ``SpanCopy``
    destinations of a thread's run go in one call (``memops.run_rows``) instead of one a block."""
    pool = copy_pool()
    weights = [len(c[1]) for c in copies]
    if len(copies) < 2 or not memops_jit.ready():
        return pool.run(copy_out, copies, weights)
    return pool.run_batches(_copy_run, copies, weights)


def _copy_run(copies: Sequence[tuple[Any, memoryview, bool]]) -> list[int | None]:
    rows: list[tuple[int, int, int, int]] = []  # (source, destination, bytes, block) of the one-buffer copies
    tables: list[np.ndarray] = []  # and the span tables of Segments', whose rows numpy works out
    sources: list[int] = []
    owners: list[int] = []
    results: list[int | None] = [None] * len(copies)
    rowed: list[int] = []
    for k, (dst, _, _) in enumerate(copies):
        if not isinstance(dst, SpanCopy):  # segment views, a tensor: copied alone
            results[k] = copy_out(copies[k])
            continue
        rowed.append(k)
        if isinstance(dst.spans, np.ndarray):
            if len(dst.spans):
                tables.append(dst.spans)
                sources.append(dst.source)
                owners.append(k)
            continue
        source = dst.source
        for address, length in dst.spans:
            rows.append((source, address, length, k))
            source += length
    if rowed:
        parts = [np.array(rows, dtype=np.int64).reshape(-1, 4)] if rows else []
        if tables:
            parts.append(_table_rows(tables, sources, owners))
        table = np.concatenate(parts) if parts else np.empty((0, 4), np.int64)
        crcs = run_rows(table, len(copies), any(copies[k][2] for k in rowed))
        for k in rowed:
            results[k] = crcs[k] if copies[k][2] else None
    return results


def _table_rows(tables: list[np.ndarray], sources: list[int], owners: list[int]) -> np.ndarray:
    """The (source, destination, bytes, block) rows of span tables, each block's bytes read in turn from its
    source: one numpy pass instead of a Python step a span (30 a vLLM block)."""
    spans = np.concatenate(tables)
    counts = np.array([len(t) for t in tables], dtype=np.int64)
    lengths = spans[:, 1]
    starts = np.cumsum(lengths) - lengths  # each span's place in all the blocks' bytes, end to end
    firsts = np.repeat(starts[np.cumsum(counts) - counts], counts)  # its block's first span's place
    rows = np.empty((len(spans), 4), dtype=np.int64)
    rows[:, 0] = np.repeat(np.array(sources, dtype=np.int64), counts) + starts - firsts
    rows[:, 1] = spans[:, 0]
    rows[:, 2] = lengths
    rows[:, 3] = np.repeat(np.array(owners, dtype=np.int64), counts)
    return rows


def copy_out(c: tuple[Any, memoryview, bool]) -> int | None:
    dst, src, check = c
    if isinstance(dst, SpanCopy):
        crc = copy_to_spans(dst.spans, dst.source, check)
        return crc if check else None
    if isinstance(dst, list):  # segments
        crc = scatter(dst, src, crc=check)
        return crc if check else None
    if check:
        return copy_crc(dst, src)
    copy_into(dst, src)
    return None
