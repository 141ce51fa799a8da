"""Reading NVMe-resident blocks straight out of the store's segment files (``kvstore serve --share-nvme``).

A Get with ``read_disk`` names each NVMe-only block by file and payload offset (``BlockDescriptor.disk_file``,
``disk_offset``) instead of the store reading and copying it: the client reads it itself, with O_DIRECT,
straight into the caller's buffers (one DMA and no copy on either side) and checks its CRC32C, as the store
would have. The store keeps the file as it is until the client releases the message's grant.

``DiskReader(directory, threads=8)`` (one per lane; files opened on first use, kept open):

- ``read(blocks) -> failed``: read every ``DiskBlock`` into its spans; returns the positions of those that could
  not be read or failed their CRC32C (the caller asks the store for them: it reads them itself, finds a corrupt
  record and drops it, so a bad copy is reported and never served).
- ``read_run(name, positions, offsets, lengths, crcs, addresses) -> failed | None``: the same for the common Get
  (whole-page payloads of one file, close together, each into a page-aligned buffer): one ``preadv`` on the
  caller's thread and the CRC32Cs in one compiled call (``kvstore/payload_run_kernels.py``) when the run is at most
  ``RUN_ALONE_BYTES`` (and its headers fit the scratch), else one such call per piece on several threads; numpy
  array operations for a single piece until the kernels are compiled, or without numba; None when the blocks are
  not such a run (``read`` takes them then). A run of blocks of up to ``payload_runs.GATHER_BLOCK_BYTES`` (128
  KiB) is read whole into the thread's scratch (``GATHER_SPAN_BYTES``, kept once grown) and each payload copied
  out with its check: on this VM's virtual disk that beat 64 separate pieces of memory in one read.
- ``read_runs(segments, name_of, positions, offsets, lengths, crcs, addresses) -> failed | None``: ``read_run``
  of blocks in several files (a prefix a segment's end cut in two), one run per file at once.
- ``read_indexed(view, namespace, hashes, addresses, sizes) -> IndexedRead | None``: a Get of blocks the store's
  index names, when they are one such run of one file, probed in the index, read, checked and confirmed unchanged
  in one compiled call (``indexed_run_kernels.find_and_read``, descriptors from ``SegmentFiles.table``); else the
  probe's rows for the caller's general path (``IndexedGets``).
- ``start()``: what the first Gets would set up, now (once): the compiled runs compiled (or loaded from numba's
  cache) on this thread, the reading threads started, each with its scratch, and ``SPARE_SCRATCHES`` more for the
  first threads that call a Get, faulted in; ``read_indexed``'s kernel compiled too.
- ``unusable``: why this process cannot open the store's files at all, or "": the lane then stops asking for
  disk reads. The open files, and the closing of those the store deleted, are ``segment_files.SegmentFiles``'.
- ``ready``: whether its compiled runs are ready: a lane asks for disk reads only then (until they are, the store
  reads, faster than the uncompiled path here).

How: the blocks are sorted by file and offset; neighbours at most ``GAP_BYTES`` apart (a record's 4 KiB header
and padding) are read in one ``preadv``, whose iovec list puts each payload's page-aligned part straight in its
destination when that is page-aligned host memory and the rest (headers, gaps, tails, unaligned destinations)
in scratch; runs are cut into pieces of at most ``MAX_PIECE_BYTES`` (at least two per thread when large),
read and checked by a few threads at once, so one piece's CRC32C overlaps other pieces' I/O (with one piece per
thread every read of a 16 MiB Get ended at about the same time and all the CRC32Cs came after).

A payload read into scratch is CRC32C'd as it is copied into its destination (one pass, and a failed check
still reports the block failed, so nothing it wrote is served); a piece's blocks are checked and copied in one
compiled call (``memops.run_rows``), not one per block, which let two threads reach half the kernel's speed. Each thread keeps
its scratch, faulted in once: torch allocates 64-byte aligned memory, so a vLLM KV cache's pages are never
page aligned and all of a load goes through scratch; a fresh mapping per piece cost a page fault every 4 KiB
(62 vLLM blocks from NVMe: 105 ms, 0.87 GB/s, where the disk reads 2.5-3 GB/s).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar, cast

import numpy as np

from kvstore import indexed_runs, payload_runs
from kvstore.arena_index import ArenaIndexView, namespace_mix
from kvstore.arena_index_layout import segment_name
from kvstore.hugepages import huge_buffer
from kvstore.lanes.client.segment_files import SegmentFiles, preadv
from kvstore.lanes.copypool import CopyPool
from kvstore.lanes.segments import Spans, clip, copy_to_spans, page_aligned, skip
from kvstore.memops import run_rows

T = TypeVar("T")
PAGE = 4096  # O_DIRECT alignment that suits every device here (logical blocks of 512 B or 4 KiB)
GAP_BYTES = 128 << 10  # neighbours this close are read through in one preadv (a record's header is 4 KiB)
# Pieces of 1 MiB on 8 threads: reads stay in flight while some threads check what they read. Against pieces of up
# to 4 MiB on 4 threads, the same blocks read in turn in one process into the same buffers (p50, ms): 2 MiB blocks
# 23.4 / 28.4 against 25.2 / 29.3, 512 KiB 7.72 / 7.97 / 8.11 / 10.24 against 8.05 / 8.42 / 8.00 / 10.38, 128 KiB
# 4.29 against 4.35. The vLLM connector's load of 62 blocks only on NVMe (all through scratch, copied and checked by
# the reading threads), loads switched between the two in one process: 66.7 against 100.5 ms, 20 loads each.
MAX_PIECE_BYTES = 1 << 20
# pieces are not cut smaller than this for parallelism, and a run shorter than ALONE_BYTES is one piece, read on
# the caller's thread: a 32 x 64 KiB Get (2.2 MB) read in 8 pieces of 275 KB on 4 threads took 2.99 / 3.22 ms,
# in 2 of 1.1 MB on 2 threads 2.43 / 2.55, and in 2 against 1 piece 2.54 / 3.55 against 2.32 / 3.34, 2.48 / 3.39
# against 2.25 / 3.36 (interleaved, one process): waking and waiting for a helper costs more than it overlaps.
# From 128 KiB blocks (4.3 MB) 4 pieces of 1 MiB came first (4.45 ms, 2 pieces 4.81, 1 piece 4.62).
MIN_PIECE_BYTES = 1 << 20
ALONE_BYTES = 3 << 20
# ``read_run`` (payloads straight into page-aligned buffers, no scratch but the headers) reads runs up to this long
# with one preadv and checks them after it, on the caller's thread: with the 256-bit CRC32C loop (26 GB/s over
# bytes the disk just wrote, kvstore/memops_kernels.py) that beat 1 MiB pieces on 8 threads, which this disk
# serves at 0.91 of one request. 32 x 512 KiB read alone against in pieces, in turn with a raw read (ms, 40
# each): 6.48 / 5.99 against 6.89 / 6.25, raw 5.44 / 5.54. Not 2 MiB blocks (66 MiB): the checks of one read run
# at the memory's speed (24.2 ms alone, on one thread or two, against 23.3 in pieces that overlap them).
RUN_ALONE_BYTES = 32 << 20
NO_LIMIT = 1 << 62  # ``read_run``'s alone_bytes for a piece ``cut_run`` already cut: read it whole
MAX_IOVECS = 1024
SCRATCH_BYTES = MAX_PIECE_BYTES + 2 * GAP_BYTES  # a thread's scratch, enough for any piece whose blocks fit
SPARE_SCRATCHES = 2  # faulted in by start for the threads that call Gets: a worker's engine and its loader


@dataclass(slots=True)
class DiskBlock:
    position: int  # the caller's index of the block
    file: str  # segment file name in the store's NVMe directory
    offset: int  # of the payload in that file, page aligned
    length: int
    crc32c: int
    spans: Spans  # where its bytes go: (address, length) of host memory, in order


@dataclass(slots=True)
class _Planned:
    iov: list[tuple[int, int]]  # (address, length) of each part of the read, in file order
    tails: list[tuple[DiskBlock, int, int]]  # (block, scratch position, bytes from there to copy in at the tail)
    scratch: _Scratch | None


class _Scratch:
    """Page-aligned anonymous memory in a whole huge page (``kvstore/hugepages.py``, as every buffer O_DIRECT reads
    into here), faulted in at creation, and its address. A vLLM-shaped load (62 blocks through scratch) took the
    same time with it as with the 4 KiB pages of a ``MAP_POPULATE`` mapping (42.0 / 40.7 ms, loads in turn): that
    load is bound by the copies out of scratch, and populating at once had drawn contiguous pages."""

    def __init__(self, size: int):
        self.memory = huge_buffer(size, whole_pages=True)
        self.memory[::PAGE] = 0  # faulted in now (a huge page at its first byte), not in a Get's read
        self.address = int(self.memory.ctypes.data)


class DiskReader:
    def __init__(self, directory: str, threads: int = 8):
        self.files = SegmentFiles(directory)
        self.threads = max(1, threads)
        self._lock = threading.Lock()
        self._pool: CopyPool | None = None
        self._local = threading.local()  # each reading thread's _Scratch
        self._spares: list[_Scratch] = []  # made by start, for the first threads that call a Get
        self._started = False

    @property
    def ready(self) -> bool:
        """Whether this reader beats the store reading: its compiled runs are ready (asking starts their compile,
        or their load from numba's cache, in the background), or there is no numba to wait for. Until then a Get
        lets the store read its NVMe blocks: the uncompiled reads here took a fresh client's first Gets of 49 x
        720 KiB to 22 ms where the store read them in 12 (``bench.first_gets``, fifty-third session)."""
        return _compiled.ready() or not _compiled.available

    def start(self) -> None:
        """See the module docstring. Without it a fresh process's first Gets read through ``read`` while the
        kernels compiled in the background (holding the GIL for much of it) and started the reading threads."""
        with self._lock:
            if self._started:
                return
            self._started = True
        _compiled.warm_up()
        indexed_runs.COMPILED.warm_up()
        self._threads().start(lambda: self._scratch(0))  # before the spares: those are for other threads
        size = max(payload_runs.GATHER_SPAN_BYTES if payload_runs.GATHER_BLOCK_BYTES else 0, SCRATCH_BYTES)
        spares = [_Scratch(size) for _ in range(SPARE_SCRATCHES)]
        with self._lock:
            self._spares = spares

    @property
    def unusable(self) -> str:
        """Why this process cannot open the store's files (another mount namespace, say), or ""."""
        return self.files.unusable

    def read(self, blocks: Sequence[DiskBlock]) -> list[int]:
        """(One read at a time per reader: a lane serves one Get at a time.)"""
        self.files.sweep_if_due()
        todo = deque(self._pieces(blocks))
        if not todo:
            return []

        # in file order, several preadvs at once: one at a time read 64 MiB in 77 ms, 4 in 34, here
        def work() -> list[int]:
            failed: list[int] = []
            while True:
                try:
                    piece = todo.popleft()
                except IndexError:
                    return failed
                failed.extend(self._check(piece, self._read(piece)))

        helpers = min(self.threads, len(todo)) - 1
        return [p for part in self._alongside(work, [work] * helpers) for p in part]

    def read_run(
        self,
        name: str,
        positions: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        crcs: np.ndarray,
        addresses: np.ndarray,
    ) -> list[int] | None:
        """``read`` of the common Get: whole-page payloads of one file, close together and short enough for one
        piece, each into a page-aligned buffer (int64 arrays, one entry per block). One preadv on the caller's
        thread, the record headers between them into scratch, and the CRC32Cs, planned, read and checked in one
        compiled call (``payload_run_kernels.read_run``, without the GIL); the positions that failed, or None when the
        blocks are not such a run (``read`` takes them then). Where a 32 x 64 KiB Get read through ``read`` spent
        more on per-block Python than on its CRC32Cs, and then on array operations 0.14-0.3 ms of 1.8-3.1."""
        if not len(offsets) or 2 * len(offsets) > MAX_IOVECS:
            return None
        self.files.sweep_if_due()
        return self._run(name, positions, offsets, lengths, crcs, addresses)

    def read_runs(
        self, segments: np.ndarray, name_of: Callable[[int], str], positions: np.ndarray, offsets: np.ndarray,
        lengths: np.ndarray, crcs: np.ndarray, addresses: np.ndarray,
    ) -> list[int] | None:  # fmt: skip
        """``read_run`` of blocks in several files (``segments``: each block's segment id, ``name_of`` its file's
        name), as a prefix whose records a segment's end cut in two: one run per file, the first on the caller's
        thread and the others on the pool's at once; None when one is not such a run (``read`` takes them all
        then). Such prefixes, read through ``read`` and this in turn: 7.54 -> 7.10 ms at 32 x 512 KiB, 26.6 ->
        24.6 at 32 x 2 MiB (as a prefix in one file, 24.6); in ``bench.nvme_get`` 4 % of the 512 KiB Gets and a
        quarter of the 2 MiB ones, whose 66 MiB cross a 256 MiB segment's end that often."""
        if not len(offsets) or 2 * len(offsets) > MAX_IOVECS:
            return None
        self.files.sweep_if_due()  # here, not in a run: no thread may close a file another is reading
        ids, which = np.unique(segments, return_inverse=True)
        groups = [np.flatnonzero(which == g) for g in range(len(ids))]

        def one(g: int) -> list[int] | None:  # g > 0 runs on the pool: its pieces stay on its thread
            at = groups[g]
            name = name_of(int(ids[g]))
            return self._run(name, positions[at], offsets[at], lengths[at], crcs[at], addresses[at], g == 0)

        results = self._alongside(partial(one, 0), [partial(one, g) for g in range(1, len(groups))])
        if any(r is None for r in results):
            return None
        return [p for r in results for p in cast(list[int], r)]

    def read_indexed(
        self, view: ArenaIndexView, namespace: str, hashes: Sequence[bytes], addresses: np.ndarray,
        sizes: np.ndarray, marks: np.ndarray,
    ) -> indexed_runs.IndexedRead | None:  # fmt: skip
        """A Get of blocks the store's index names (``view``; the caller checked that every hash has 16 bytes),
        each into its buffer (int64 columns: address, size), probed, read, checked and confirmed in one compiled
        call when they are one run of one segment file (``indexed_run_kernels.find_and_read``: a file opened
        here for the first time costs a second call), its records then marked as read in ``marks``
        (``IndexedRead.again``: one was read before); None until that kernel is ready."""
        if not indexed_runs.ready():
            return None
        self.files.sweep_if_due()
        n = len(hashes)
        mix0, mix1 = namespace_mix(namespace)
        rows = np.empty((n, 4), dtype=np.uint64)
        columns = np.empty((4, n), dtype=np.int64)  # offsets, lengths, CRC32Cs, failed
        info = np.zeros(2, dtype=np.int64)  # the segment not open yet; whether a record was read before
        gather = payload_runs.GATHER_BLOCK_BYTES
        scratch = self._scratch(payload_runs.GATHER_SPAN_BYTES if gather else 0)
        joined = b"".join(hashes)
        kernels = indexed_runs.kernels()
        for _ in range(2):
            status = kernels.find_and_read(
                view.entries, np.uint64(view.buckets - 1), joined, np.uint64(mix0), np.uint64(mix1), rows,
                self.files.table, columns[0], columns[1], columns[2], addresses, sizes, scratch.address,
                len(scratch.memory), GAP_BYTES, RUN_ALONE_BYTES, columns[3], gather, marks, info,
            )  # fmt: skip
            if status != kernels.NO_FILE:
                break
            try:
                self.files.fd(segment_name(int(info[0])))
            except (OSError, ValueError):
                break  # the general path finds it unreadable too, and asks
        return indexed_runs.IndexedRead(int(status), rows, status in kernels.ROWS_USABLE, bool(info[1]))

    def _run(
        self, name: str, positions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, crcs: np.ndarray,
        addresses: np.ndarray, helpers: bool = True,
    ) -> list[int] | None:  # fmt: skip
        """``read_run`` once the open files have been swept; without ``helpers`` (on a pool thread) a run too long
        for one preadv is read piece by piece on this thread alone."""
        n = len(offsets)
        if not _compiled.ready():
            return self._read_run_arrays(name, positions, offsets, lengths, crcs, addresses)
        try:
            fd = self.files.fd(name)
        except (OSError, ValueError):
            return _ints(positions)
        gather = payload_runs.GATHER_BLOCK_BYTES
        scratch = self._scratch(payload_runs.GATHER_SPAN_BYTES if gather else 0)
        failed = np.empty(n, dtype=np.int64)
        columns = (_int64s(offsets), _int64s(lengths), _int64s(crcs), _int64s(addresses))
        kernels = _kernels()
        bad = kernels.read_run(
            fd, *columns, scratch.address, len(scratch.memory), GAP_BYTES, RUN_ALONE_BYTES, failed, gather
        )
        if bad == kernels.TOO_LONG:
            return self._read_run_pieces(fd, positions, *columns, helpers)
        if bad < 0:
            return None
        return _ints(positions[failed[:bad]]) if bad else []

    def _read_run_pieces(
        self, fd: int, positions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, crcs: np.ndarray,
        addresses: np.ndarray, helpers: bool = True,
    ) -> list[int] | None:  # fmt: skip
        """A run too long for one preadv, cut as ``read`` cuts one (``_piece_count``) and read piece by piece on
        the caller's and the pool's threads, each piece one compiled call without the GIL. Where ``read`` planned,
        read and checked each piece through Python: 17 pieces for a 32 x 512 KiB Get."""
        kernels = _kernels()
        n = len(offsets)
        span = int((offsets + lengths).max() - offsets.min())
        order, cuts = np.empty(n, dtype=np.int64), np.empty(n + 1, dtype=np.int64)
        pieces = kernels.cut_run(
            offsets, lengths, addresses, GAP_BYTES, SCRATCH_BYTES, -(-span // _piece_count(span, self.threads)),
            order, cuts,
        )  # fmt: skip
        if pieces < 0:
            return None
        offsets, lengths, crcs, addresses = offsets[order], lengths[order], crcs[order], addresses[order]
        todo = deque(zip(cuts[:pieces].tolist(), cuts[1 : pieces + 1].tolist()))

        def work() -> list[int]:  # indices into ``order`` of the blocks that failed
            scratch, failed = self._scratch(0), np.empty(n, dtype=np.int64)
            out: list[int] = []
            while True:
                try:
                    lo, hi = todo.popleft()
                except IndexError:
                    return out
                at = slice(lo, hi)
                bad = kernels.read_run(
                    fd, offsets[at], lengths[at], crcs[at], addresses[at], scratch.address, len(scratch.memory),
                    GAP_BYTES, NO_LIMIT, failed, payload_runs.GATHER_BLOCK_BYTES,
                )  # fmt: skip
                out.extend(range(lo, hi) if bad < 0 else (failed[:bad] + lo).tolist())  # < 0: cut_run rules it out

        others = min(self.threads, pieces) - 1 if helpers else 0
        failed = [k for part in self._alongside(work, [work] * others) for k in part]
        return _ints(positions[order[failed]]) if failed else []

    def _read_run_arrays(
        self, name: str, positions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, crcs: np.ndarray,
        addresses: np.ndarray,
    ) -> list[int] | None:  # fmt: skip
        """``read_run`` without the compiled kernel (numba missing, or still compiling): numpy array operations
        and one batch of CRC32Cs."""
        n = len(offsets)
        order = np.argsort(offsets, kind="stable")
        start, length, address = offsets[order], lengths[order], addresses[order]
        end = start + length
        gap = np.empty(n, dtype=np.int64)
        gap[0] = 0
        gap[1:] = start[1:] - end[:-1]
        if (
            int(end[-1] - start[0]) >= RUN_ALONE_BYTES
            or ((length | address) % PAGE).any()
            or not length.all()
            or int(gap.min()) < 0
            or int(gap.max()) > GAP_BYTES
        ):
            return None
        vectors = np.empty((2 * n, 2), dtype=np.int64)  # (gap before the payload, payload) per block
        held = int(gap.sum())
        vectors[0::2, 0] = self._scratch(held).address + np.cumsum(gap) - gap if held else 0
        vectors[0::2, 1], vectors[1::2, 0], vectors[1::2, 1] = gap, address, length
        try:
            got = preadv(self.files.fd(name), vectors[vectors[:, 1] > 0], int(start[0]))
        except (OSError, ValueError):
            return _ints(positions)
        rows = np.zeros((n, 4), dtype=np.int64)  # (payload, 0: only read, length, block): CRC32Cs, no copies
        rows[:, 0], rows[:, 2], rows[:, 3] = address, length, np.arange(n)
        values = np.array(run_rows(rows, n), dtype=np.int64)
        bad = (end - start[0] > got) | (values != crcs[order])
        return _ints(positions[order][bad])

    def close(self) -> None:
        self.files.close()
        if self._pool is not None:
            self._pool.close()

    # -- planning ------------------------------------------------------------------------
    def _pieces(self, blocks: Sequence[DiskBlock]) -> list[list[DiskBlock]]:
        runs: list[list[DiskBlock]] = []
        for b in sorted(blocks, key=lambda b: (b.file, b.offset)):
            last = runs[-1][-1] if runs else None
            if last is not None and last.file == b.file and 0 <= b.offset - (last.offset + last.length) <= GAP_BYTES:
                runs[-1].append(b)
            else:
                runs.append([b])
        pieces: list[list[DiskBlock]] = []
        for run in runs:
            total = run[-1].offset + run[-1].length - run[0].offset
            target = -(-total // _piece_count(total, self.threads))
            cur: list[DiskBlock] | None = None
            for b in run:
                if cur is not None and b.offset - cur[0].offset < target:
                    cur.append(b)
                else:
                    cur = [b]
                    pieces.append(cur)
        return pieces

    def _scratch(self, n: int) -> _Scratch:
        """This thread's scratch, of at least ``n`` bytes (kept for its next pieces)."""
        scratch: _Scratch | None = getattr(self._local, "scratch", None)
        if scratch is None or len(scratch.memory) < n:
            with self._lock:
                spare = self._spares.pop() if self._spares and len(self._spares[-1].memory) >= n else None
            scratch = self._local.scratch = spare or _Scratch(max(n, SCRATCH_BYTES))
        return scratch

    def _plan(self, piece: list[DiskBlock]) -> _Planned:
        """One preadv from the first payload's offset to the last one's end (rounded up to a page): (address,
        length) pairs, those in scratch first as (-1 - scratch position, length), placed once its size is known."""
        iov: list[tuple[int, int]] = []
        tails: list[tuple[DiskBlock, int, int]] = []
        sp = 0  # scratch position
        pos = piece[0].offset
        for b in piece:
            if b.offset != pos:
                iov.append((-1 - sp, b.offset - pos))
                sp += b.offset - pos
            padded = -(-b.length // PAGE) * PAGE
            aligned = b.length - b.length % PAGE
            if aligned and page_aligned(b.spans, aligned):
                iov.extend(clip(b.spans, aligned))
                if padded != aligned:
                    iov.append((-1 - sp, padded - aligned))
                    tails.append((b, sp, b.length - aligned))
                    sp += padded - aligned
            else:
                iov.append((-1 - sp, padded))
                tails.append((b, sp, -1))  # the whole payload lies in scratch
                sp += padded
            pos = b.offset + padded
        scratch = self._scratch(sp) if sp else None
        if scratch is not None:
            base = scratch.address - 1
            iov = [(base - a, n) if a < 0 else (a, n) for a, n in iov]
        return _Planned(iov, tails, scratch)

    # -- reading -------------------------------------------------------------------------
    def _read(self, piece: list[DiskBlock]) -> tuple[_Planned, int] | None:
        """The piece's preadv: its plan and the bytes read, None when it could not be read."""
        try:
            fd = self.files.fd(piece[0].file)
            planned = self._plan(piece)
            if len(planned.iov) > MAX_IOVECS:  # too many spans for one call: the store reads these blocks
                return None
            return planned, preadv(fd, np.array(planned.iov, dtype=np.int64), piece[0].offset)
        except (OSError, ValueError):
            return None

    @staticmethod
    def _check(piece: list[DiskBlock], read: tuple[_Planned, int] | None) -> list[int]:
        """CRC32C of every block of a piece read, all in one batch of rows (``memops.run_rows``: payloads in
        scratch copied into their destinations as they are checked, those read in place only checked, and a
        tail in scratch moved in once its block checks out); the positions that failed."""
        if read is None:
            return [b.position for b in piece]
        planned, got = read
        end = piece[0].offset + got
        landed = [b for b in piece if b.offset + b.length <= end]
        failed = [b.position for b in piece if b.offset + b.length > end]
        tails = {id(b): (at, n) for b, at, n in planned.tails}
        base = planned.scratch.address if planned.scratch is not None else 0
        rows: list[tuple[int, int, int, int]] = []
        for k, b in enumerate(landed):
            at, n = tails.get(id(b), (0, 0))
            if n < 0:  # all in scratch
                source = base + at
                for address, length in b.spans:
                    rows.append((source, address, length, k))
                    source += length
                continue
            for address, length in clip(b.spans, b.length - n):  # read straight into place
                rows.append((address, 0, length, k))
            if n:
                rows.append((base + at, 0, n, k))
        for b, value in zip(landed, run_rows(rows, len(landed))):
            at, n = tails.get(id(b), (0, 0))
            if value != b.crc32c:
                failed.append(b.position)
            elif n > 0:
                assert planned.scratch is not None
                copy_to_spans(clip(skip(b.spans, b.length - n), n), planned.scratch.address + at)
        return failed

    def _alongside(self, mine: Callable[[], T], theirs: Sequence[Callable[[], T]]) -> list[T]:
        """``mine()`` on the caller's thread while the pool runs ``theirs``: every result, the caller's first. Each
        has ended before an exception of any propagates: no read may write into the caller's buffers after. A job
        on the pool must not call this itself: waiting there on jobs queued behind it could take every thread."""
        if not theirs:
            return [mine()]
        return self._threads().side_by_side([mine, *theirs])

    def _threads(self) -> CopyPool:
        with self._lock:
            if self._pool is None:
                self._pool = CopyPool(self.threads, name="kvstore-disk-read")
            return self._pool


def _piece_count(total: int, threads: int) -> int:
    """How many pieces a run of ``total`` bytes is read in: one when short, else pieces of at most
    ``MAX_PIECE_BYTES``, at least two per thread where each is still ``MIN_PIECE_BYTES``."""
    if total < ALONE_BYTES:
        return 1
    return max(-(-total // MAX_PIECE_BYTES), min(2 * threads, total // MIN_PIECE_BYTES), 1)


_kernels = payload_runs.kernels
_compiled = payload_runs.COMPILED  # shared with the NVMe tier's compiled runs: one compile a process


def _int64s(values: np.ndarray) -> np.ndarray:
    """A column as the kernel was compiled for (contiguous, writable int64): another layout would compile anew."""
    if values.dtype == np.int64 and values.flags.c_contiguous and values.flags.writeable:
        return values
    return np.array(values, dtype=np.int64)


def _ints(values: np.ndarray) -> list[int]:
    return cast(list[int], values.tolist())  # Python ints already: numpy's stubs say Any
