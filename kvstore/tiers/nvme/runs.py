"""The NVMe tier's reads of raw payloads straight into page-aligned host memory, one compiled call a piece.

``read_into(log, backend, pool, buffers, threads, locs, lengths, crcs, addresses) -> (failed, pieces) | None``
(``NvmeTier.read_into``): the payloads at ``locs`` read into the memory at ``addresses`` (int64, each page
aligned, each length whole pages), each checked against ``crcs`` (the index's CRC32C: a raw block's bytes), cut
into pieces in file order as the general read cuts them, each piece planned, read with one ``preadv`` and checked
by one call of ``payload_run_kernels.read_run`` without the GIL, on the caller's thread and up to ``threads - 1``
of the tier's readers. Returns the positions that were not read in full or failed their check (the caller reads those
the general way, ``NvmeTier.read``, which tells a corrupt record from a short read and drops it), or None when the
batch is not such a run (a location gone, records farther apart than ``GAP_BYTES``, an unaligned destination, a
backend other than POSIX, or the kernels still compiling): ``read`` takes it then.

Why: a store-read Get into a client's shared pool (``LowerReads.materialize`` with ``final_dests``) spent about a
millisecond of Python before its first ``preadv``, part of it the tier's per-record plans and per-piece Python and
hand-offs, which this does not have. Against that general read, in ``bench.nvme_get`` (three runs, medians): 32 x
64 KiB / 512 KiB / 2 MiB pool Gets 1.025 / 1.056 / 1.066x as fast (docs/nvme_log.md, forty-eighth session).
Every ``preadv`` has returned before ``read_into`` does, whatever failed: nothing lands in the caller's memory
after.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor, Future, wait
from typing import Any

import numpy as np

from kvstore import payload_runs
from kvstore.tiers.nvme.format import HEADER_BYTES, OFFSET_MASK
from kvstore.tiers.nvme.io import IoBackend, PosixBackend
from kvstore.tiers.nvme.log import SegmentLog
from kvstore.tiers.nvme.pipeline import BufferPool

# Pieces as the tier's general read cuts them (``reader.plan_pieces``): at most ``PIECE_BYTES``, at least one per
# reading thread where each is still ``MIN_PIECE_BYTES``, all about the same size. Pieces of at most 1 MiB and of
# 4 MiB were slower through the general read (forty-eighth session: 32 x 512 KiB Gets into a shared pool, 12.6 /
# 13.2 ms and 15.6 / 17.3 against 2 MiB); a 32 x 64 KiB prefix cut at 2 MiB (31 records and 1) was 3-5 % slower
# than the general read's two halves in ``bench.nvme_get``.
PIECE_BYTES = 2 << 20
MIN_PIECE_BYTES = 1 << 20
GAP_BYTES = 128 << 10  # neighbours this close are read through (a record's 4 KiB header lies between payloads)
MAX_BLOCKS = 512  # a piece's preadv has a payload and a gap per block, and IOV_MAX is 1024
NO_LIMIT = 1 << 62  # ``read_run``'s alone_bytes for a piece ``cut_run`` already cut: read it whole


def read_into(
    log: SegmentLog,
    backend: IoBackend,
    pool: Executor,
    buffers: BufferPool,
    threads: int,
    locs: Sequence[int],
    lengths: np.ndarray,
    crcs: np.ndarray,
    addresses: np.ndarray,
) -> tuple[list[int], int] | None:
    """(failed positions, pieces read), or None: see the module's docstring."""
    n = len(locs)
    if not n or not isinstance(backend, PosixBackend) or not payload_runs.ready():
        return None
    kernels = payload_runs.kernels()
    resolved, pinned = log.pin(locs)
    try:
        if any(seg is None for _, seg in resolved):
            return None  # ``read`` says which location is gone
        segment = np.fromiter((seg.id for _, seg in resolved), dtype=np.int64, count=n)  # type: ignore[union-attr]
        fds = {seg.id: seg.fh.fd for _, seg in resolved}  # type: ignore[union-attr]
        offsets = np.fromiter(((loc & OFFSET_MASK) + HEADER_BYTES for loc, _ in resolved), dtype=np.int64, count=n)
        lengths, crcs, addresses = _int64s(lengths), _int64s(crcs), _int64s(addresses)
        scratch = buffers.get(PIECE_BYTES)  # the headers between a piece's payloads (a piece's gaps fit PIECE_BYTES)
        try:
            pieces = _cut(kernels, segment, fds, offsets, lengths, crcs, addresses, threads)
            if pieces is None:
                return None
            return _read(kernels, pieces, pool, buffers, threads, scratch), len(pieces)
        finally:
            buffers.put(scratch)
    finally:
        log.unpin(pinned)


# (fd, positions, payload offsets, lengths, CRC32Cs, addresses) of one piece, in file order
Piece = tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _cut(
    kernels: Any, segment: np.ndarray, fds: dict[int, int], offsets: np.ndarray, lengths: np.ndarray,
    crcs: np.ndarray, addresses: np.ndarray, threads: int,
) -> list[Piece] | None:  # fmt: skip
    """Each segment's blocks cut into pieces of about equal size (one segment as a rule; two where a segment's end
    cut a prefix)."""
    pieces: list[Piece] = []
    ids = [int(segment[0])] if (segment == segment[0]).all() else np.unique(segment).tolist()
    for sid in ids:
        at = np.arange(len(segment)) if len(ids) == 1 else np.flatnonzero(segment == sid)
        m = len(at)
        order, cuts = np.empty(m, dtype=np.int64), np.empty(m + 1, dtype=np.int64)
        span = int((offsets[at] + lengths[at]).max() - offsets[at].min())
        k = max(-(-span // PIECE_BYTES), min(threads, span // MIN_PIECE_BYTES), 1)
        count = kernels.cut_run(
            offsets[at], lengths[at], addresses[at], GAP_BYTES, PIECE_BYTES, -(-span // k), order, cuts
        )
        if count < 0 or int(np.diff(cuts[: count + 1]).max()) > MAX_BLOCKS:
            return None
        at = at[order]
        columns = (at, offsets[at], lengths[at], crcs[at], addresses[at])
        for lo, hi in zip(cuts[:count].tolist(), cuts[1 : count + 1].tolist()):
            pieces.append((fds[sid], *(c[lo:hi] for c in columns)))  # type: ignore[arg-type]
    return pieces


def _read(
    kernels: Any, pieces: list[Piece], pool: Executor, buffers: BufferPool, threads: int, scratch: np.ndarray
) -> list[int]:
    """The pieces on this thread and on as many readers as have a scratch buffer free at once (none is waited for
    while holding one); every read has returned before this does."""
    todo = deque(pieces)
    most = max(len(piece[1]) for piece in pieces)

    def work(buf: np.ndarray) -> list[int]:
        address, failed = int(buf.ctypes.data), np.empty(most, dtype=np.int64)
        out: list[int] = []
        while True:
            try:
                fd, at, offsets, lengths, crcs, addresses = todo.popleft()
            except IndexError:
                return out
            bad = kernels.read_run(
                fd, offsets, lengths, crcs, addresses, address, len(buf), GAP_BYTES, NO_LIMIT, failed
            )
            out.extend(at.tolist() if bad < 0 else at[failed[:bad]].tolist())

    jobs: list[tuple[np.ndarray, Future[list[int]]]] = []
    try:
        for _ in range(min(threads, len(pieces)) - 1):
            buf = buffers.try_get(PIECE_BYTES)
            if buf is None:
                break
            jobs.append((buf, pool.submit(work, buf)))
        failed = work(scratch)
        for _, job in jobs:
            if not job.cancel():  # cancelled: still queued behind other reads, and every piece is done
                failed.extend(job.result())
        return failed
    finally:
        todo.clear()  # after a failure no piece starts
        wait([job for _, job in jobs if not job.cancelled()])
        for buf, _ in jobs:
            buffers.put(buf)


def _int64s(values: np.ndarray) -> np.ndarray:
    """A column as the kernel was compiled for (contiguous int64): another layout would compile anew."""
    return values if values.dtype == np.int64 and values.flags.c_contiguous else np.ascontiguousarray(values, np.int64)
