"""Where a shm lane Get's blocks go in the caller's memory, and the copies that put them there.

- ``direct_outs(out) -> spans | None``: the (address, bytes) spans of each output buffer (a ``Segments``'s
  parts in order), or None when one is not plain host memory: what a direct Get names for the store to write
  and a ``--share-nvme`` Get reads into.
- ``buffer_addresses(out, lengths) -> int64 array | None``: each buffer's address when each is one span of host
  memory of at least its block's length (a ``--share-nvme`` Get's compiled read), else None.
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
from kvstore.lanes.segments import Spans, copy_to_spans, scatter
from kvstore.memops import copy_crc, copy_into, host_view, run_rows
from kvstore.payload import Segments


def direct_outs(out: Sequence[Any]) -> list[Spans] | None:
    """((address, bytes), ...) of each output buffer (its segments' for ``Segments``), or None when one is
    not plain host memory."""
    outs: list[Spans] = []
    for buf in out:
        if type(buf) is np.ndarray and (address := _array_address(buf)) is not None:  # the common case, one step
            outs.append(((address, buf.nbytes),))
            continue
        if isinstance(buf, Segments):
            if not buf.on_host:
                return None
            outs.append(buf.spans)
            continue
        view = host_view(buf)
        if view is None:
            return None
        outs.append((address_of(view),))
    return outs


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
    """A copy out of mapped memory at ``source`` (an address) into host spans: a Segments of host parts."""

    spans: Spans
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
    rows: list[tuple[int, int, int, int]] = []
    results: list[int | None] = [None] * len(copies)
    rowed: list[int] = []
    for k, (dst, _, _) in enumerate(copies):
        if not isinstance(dst, SpanCopy):  # segment views, a tensor: copied alone
            results[k] = copy_out(copies[k])
            continue
        source = dst.source
        for address, length in dst.spans:
            rows.append((source, address, length, k))
            source += length
        rowed.append(k)
    if rows:
        crcs = run_rows(rows, len(copies), any(copies[k][2] for k in rowed))
        for k in rowed:
            results[k] = crcs[k] if copies[k][2] else None
    return results


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
