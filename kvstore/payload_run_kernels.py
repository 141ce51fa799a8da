"""The numba kernels that read a run of NVMe record payloads of one file straight into page-aligned memory: the run
cut into pieces (``cut_run``), each planned, read with one ``preadv`` and checked in one compiled call that holds
no GIL (``read_run``). Two callers: the ``--share-nvme`` client reading the store's files itself
(``DiskReader.read_run``, kvstore/lanes/client/disk.py) and the store's own reads into a client's shared pool
(``NvmeTier.read_into``, kvstore/tiers/nvme/runs.py). Loaded through ``kvstore.payload_runs``.

Imported only once ``kvstore.memops_jit`` has found numba and a CPU with SSE4.2 and PCLMULQDQ, and only when first
wanted, like every kernel here (importing numba at start broke vLLM's scan of
module globals). Why compiled: the same run planned with numpy array operations and checked by a call per block
spent 0.14 ms of a 1.8 ms 32 x 64 KiB Get on them in a hot loop and 0.3 ms of 3.1 after a pause (docs/nvme_log.md).

The CRC32C is memops' folding loop even where ``memops_jit.library_crc_faster()`` prefers the `crc32c` package:
that choice is timed over bytes in cache, and these bytes were just written by the disk's DMA. Over 32 x 64 KiB
right after an O_DIRECT read the two took the same time (0.272 ms the loop, 0.279 the package called a row at
a time; 2026-12-04, when the package ran 2x the loop in cache), and only the loop can run inside the kernel.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvstore.memops_kernels import READ, STREAM, copy_crc

PAGE = 4096
NOT_A_RUN = -1
TOO_LONG = -2  # a run, but longer than one preadv should take: cut it (``cut_run``) and read the pieces at once

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)


@intrinsic
def _preadv(typingctx: Any, fd: Any, iov: Any, count: Any, offset: Any) -> Any:
    """libc's ``preadv(fd, iov, count, offset)``: bytes read, or -1."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fnty = ir.FunctionType(_I64, [_I32, _I8.as_pointer(), _I32, _I64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "preadv")
        fd, iov, count, offset = args
        call = [builder.trunc(fd, _I32), builder.inttoptr(iov, _I8.as_pointer()), builder.trunc(count, _I32), offset]
        return builder.call(fn, call)

    return types.int64(types.int64, types.int64, types.int64, types.int64), codegen


@numba.njit(nogil=True, cache=True)
def _in_file_order(offsets: Any) -> Any:
    """The blocks' indices by offset (a prefix demoted together lies in file order: no sort as a rule)."""
    n = offsets.shape[0]
    for k in range(1, n):
        if offsets[k] < offsets[k - 1]:
            return np.argsort(offsets, kind="mergesort")
    return np.arange(n)


@numba.njit(nogil=True, cache=True)
def cut_run(
    offsets: Any, lengths: Any, addresses: Any, gap_bytes: int, scratch_bytes: int, piece_bytes: int, order: Any,
    cuts: Any,
) -> int:  # fmt: skip
    """Blocks ``k`` of one file (int64 arrays: payload offset, length, destination address) cut into pieces of one
    preadv each: ``order`` gets their indices in file order and ``cuts`` where each piece starts in it, then
    ``n``; returns how many pieces, or ``NOT_A_RUN`` unless every payload is whole pages into a page-aligned
    destination and neighbours are at most ``gap_bytes`` apart in the file. A piece ends before the block that
    starts ``piece_bytes`` past its first, or whose gap would take the piece's gaps past ``scratch_bytes``."""
    n = offsets.shape[0]
    order[:] = _in_file_order(offsets)
    pieces = held = 0
    start = end = offsets[order[0]]
    for j in range(n):
        k = order[j]
        gap = offsets[k] - end
        if lengths[k] <= 0 or lengths[k] % PAGE or addresses[k] % PAGE or gap < 0 or gap > gap_bytes:
            return NOT_A_RUN
        if j == 0 or offsets[k] - start >= piece_bytes or held + gap > scratch_bytes:
            cuts[pieces] = j
            pieces += 1
            start = offsets[k]
            held = 0
        else:
            held += gap
        end = offsets[k] + lengths[k]
    cuts[pieces] = n
    return pieces


@numba.njit(nogil=True, cache=True)
def read_run(
    fd: int,
    offsets: Any,
    lengths: Any,
    crcs: Any,
    addresses: Any,
    scratch: int,
    scratch_bytes: int,
    gap_bytes: int,
    alone_bytes: int,
    failed: Any,
    gather_block: int,
) -> int:
    """Blocks ``k`` of one file (int64 arrays: payload offset, length, CRC32C, destination address) read with one
    preadv from the first payload to the last, each payload straight into its destination and what lies between
    them (record headers) into ``scratch``; then each block's CRC32C. Writes the indices ``k`` of the blocks that
    were not read in full or failed their check into ``failed`` and returns how many. Nothing is read when the
    blocks are not one piece as ``cut_run`` cuts with ``alone_bytes``: ``NOT_A_RUN``, or ``TOO_LONG`` for a run
    of several pieces. A run of blocks of at most ``gather_block`` bytes (0: none) whose whole span fits in
    ``scratch`` is read there in one piece of memory instead, each payload then copied out with its check."""
    n = offsets.shape[0]
    order, cuts = np.empty(n, dtype=np.int64), np.empty(n + 1, dtype=np.int64)
    pieces = cut_run(offsets, lengths, addresses, gap_bytes, scratch_bytes, alone_bytes, order, cuts)
    if pieces != 1:
        return NOT_A_RUN if pieces < 0 else TOO_LONG
    first = offsets[order[0]]
    last = order[n - 1]
    span = offsets[last] + lengths[last] - first
    if gather_block > 0 and span <= scratch_bytes and lengths.max() <= gather_block:
        # the whole span into scratch in one piece of memory, each payload then copied out as it is checked: on
        # this VM's virtual disk a read into 64 pieces of memory (32 payloads, the headers between them) cost more
        # than the copy: 32 x 64 KiB 0.68 against 0.61 ms, 128 KiB 1.24 / 1.14, 256 KiB 2.45 / 2.32, and 512 KiB
        # 4.66 / 4.78, 2 MiB 18.0 / 18.9 the other way (fifty-first session, docs/nvme_log.md)
        iov = np.empty((1, 2), dtype=np.int64)
        iov[0, 0], iov[0, 1] = scratch, span
        got = _preadv(fd, iov.ctypes.data, 1, first)
        gathered: int = _check_rows(offsets, lengths, crcs, addresses, order, got, failed, scratch)
        return gathered
    iov = np.empty((2 * n, 2), dtype=np.int64)  # struct iovec: (address, length)
    parts = payload_iovecs(offsets, lengths, addresses, order, 0, n, scratch, iov)
    got = _preadv(fd, iov.ctypes.data, parts, first)
    bad: int = _check_rows(offsets, lengths, crcs, addresses, order, got, failed, 0)
    return bad


@numba.njit(nogil=True, cache=True)
def payload_iovecs(
    offsets: Any, lengths: Any, addresses: Any, order: Any, lo: int, hi: int, scratch: int, iov: Any
) -> int:
    """Into ``iov``, the iovecs of one read from the payload of block ``order[lo]`` to that of ``order[hi - 1]``
    (in file order): each payload into its destination address, each gap between two (the record headers) into
    ``scratch``, one after another; how many (at most ``2 * (hi - lo) - 1``)."""
    parts = 0
    end = offsets[order[lo]]
    for j in range(lo, hi):
        k = order[j]
        gap = offsets[k] - end
        if gap:
            iov[parts, 0], iov[parts, 1] = scratch, gap
            scratch += gap
            parts += 1
        iov[parts, 0], iov[parts, 1] = addresses[k], lengths[k]
        parts += 1
        end = offsets[k] + lengths[k]
    return parts


@numba.njit(nogil=True, cache=True)
def _check_rows(
    offsets: Any, lengths: Any, crcs: Any, addresses: Any, order: Any, got: int, failed: Any, gathered: int
) -> int:
    """The CRC32Cs of the blocks of a run ``read_run`` read (``got`` bytes from its first payload in file order,
    -1 when the read failed), on one thread (two gained nothing: the checks run at the memory's speed): each in
    its destination, or with ``gathered`` (the scratch the whole span was read into; 0: none) copied from there
    into its destination as it is checked (non-temporal stores: destinations are page aligned, ``cut_run``). A
    block not read in full is neither checked nor copied; the indices ``k`` that were not read in full or failed
    go into ``failed`` (a failed block's destination then holds bytes nobody may serve); returns how many."""
    first = offsets[order[0]]
    bad = 0
    for j in range(order.shape[0]):
        k = order[j]
        whole = got >= 0 and offsets[k] + lengths[k] - first <= got
        crc = np.uint64(0)
        if whole and gathered:
            crc = copy_crc(gathered + offsets[k] - first, addresses[k], lengths[k], 0, STREAM)
        elif whole:
            crc = copy_crc(addresses[k], 0, lengths[k], 0, READ)
        if not whole or np.int64(crc) != crcs[k]:
            failed[bad] = k
            bad += 1
    return bad


def warm_up() -> None:
    """Compile ``read_run`` (or load it from numba's cache) for the types ``DiskReader`` passes: a read of /dev/null."""
    import os

    page = np.zeros(2 * PAGE, dtype=np.uint8)
    address = (int(page.ctypes.data) + PAGE - 1) // PAGE * PAGE
    one = np.ones(1, dtype=np.int64)
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        read_run(fd, one * 0, one * PAGE, one * 0, one * address, 0, 0, 0, 1 << 20, np.empty(1, dtype=np.int64), 0)
        cut_run(one * 0, one * PAGE, one * address, 0, 0, PAGE, one * 0, np.empty(2, dtype=np.int64))
    finally:
        os.close(fd)
