"""The NVMe tier's reads of raw payloads straight into page-aligned host memory, one compiled call a piece.

``plan(resolved, lengths, crcs, dests, backend, threads, max_bytes) -> [RunPiece] | None``: when every payload ``NvmeTier.read``
is asked for is raw (its CRC32C known), whole pages, and bound for page-aligned writable host memory, the records
cut into pieces in file order as the general read cuts them (``reader.plan_pieces``); else None, and ``read`` plans
them itself. ``read_piece`` and ``verified`` are how ``pipeline.read_pipelined`` reads such a piece and which of its
blocks passed: one call of ``payload_run_kernels.read_run`` without the GIL plans the piece's ``preadv`` (each
payload straight into its destination, the record headers between them into scratch), reads and checks each payload
against its CRC32C (the index's, which only that record's payload matches: its header is not checked again, as the
``--share-nvme`` client's reads do not check it). A block that fails is read again by ``read``'s general pieces, which tell a corrupt record from a
short read, zero what landed and name it in ``CorruptBlock``.

Why: the general read spent Python on every record (its ``Wanted``, its part of a piece's plan, its checks' loop)
and on every piece (``plan_into``); a 32 x 512 KiB store-read Get into a client's shared pool had about a millisecond
of Python before its first ``preadv``. Against that read, in three runs of ``bench.nvme_get`` (forty-eighth
session, medians; docs/nvme_log.md): Gets even to 1.09x as fast on every lane, and the NVMe store's CPU per Get
3-15 % lower (13.75 against 14.17 ms at 32 x 512 KiB, 37.0 against 43.5 at 32 x 2 MiB).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore import payload_runs
from kvstore.memops import host_view
from kvstore.tiers.nvme.format import HEADER_BYTES, OFFSET_MASK
from kvstore.tiers.nvme.io import IoBackend, PosixBackend
from kvstore.tiers.nvme.segments import Segment

# Pieces as the general read cuts them: none past the tier's ``max_read_bytes`` (2 MiB: pieces of at most 1 MiB and
# of 4 MiB were slower, forty-eighth session, 32 x 512 KiB Gets into a shared pool, 12.6 / 13.2 ms and 15.6 / 17.3
# against 2 MiB), at least one per reading thread where each is still ``MIN_PIECE_BYTES``, about the same size: a
# 32 x 64 KiB prefix cut at 2 MiB (31 records and 1) was 3-5 % slower than in two halves in ``bench.nvme_get``.
MIN_PIECE_BYTES = 1 << 20
GAP_BYTES = 128 << 10  # neighbours this close are read through (a record's 4 KiB header lies between payloads)
MAX_BLOCKS = 512  # a piece's preadv has a payload and a gap per block, and IOV_MAX is 1024
NO_LIMIT = 1 << 62  # ``read_run``'s alone_bytes for a piece ``cut_run`` already cut: read it whole
FAILED = "not read in full, or its payload fails its CRC32C (read again record by record)"


@dataclass(slots=True)
class RunPiece:
    """Blocks of one segment file read with one ``preadv``, in file order: the caller's indices (``at``), payload
    offsets, lengths, CRC32Cs and destination addresses (int64 columns), and the scratch its gaps need."""

    fd: int
    at: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    crcs: np.ndarray
    addresses: np.ndarray
    nbytes: int  # the most its gaps take of a reader's scratch


def plan(
    resolved: Sequence[tuple[int, Segment | None]],
    lengths: Sequence[int],
    crcs: Sequence[int | None] | None,
    dests: Sequence[Any],
    backend: IoBackend,
    threads: int,
    max_bytes: int,
) -> list[RunPiece] | None:
    n = len(resolved)
    if not n or crcs is None or not isinstance(backend, PosixBackend) or not payload_runs.ready():
        return None
    if any(c is None for c in crcs) or any(seg is None for _, seg in resolved):
        return None
    addresses = _host_addresses(dests, lengths)
    if addresses is None:
        return None
    kernels = payload_runs.kernels()
    segment = np.fromiter((seg.id for _, seg in resolved), dtype=np.int64, count=n)  # type: ignore[union-attr]
    fds = {seg.id: seg.fh.fd for _, seg in resolved}  # type: ignore[union-attr]
    offsets = np.fromiter(((loc & OFFSET_MASK) + HEADER_BYTES for loc, _ in resolved), dtype=np.int64, count=n)
    sizes = np.fromiter(lengths, dtype=np.int64, count=n)
    checks = np.fromiter(crcs, dtype=np.int64, count=n)
    pieces: list[RunPiece] = []
    ids = [int(segment[0])] if (segment == segment[0]).all() else np.unique(segment).tolist()
    for sid in ids:  # one segment as a rule; two where a segment's end cut a prefix
        at = np.arange(n) if len(ids) == 1 else np.flatnonzero(segment == sid)
        m = len(at)
        order, cuts = np.empty(m, dtype=np.int64), np.empty(m + 1, dtype=np.int64)
        span = int((offsets[at] + sizes[at]).max() - offsets[at].min())
        k = max(-(-span // max_bytes), min(threads, span // MIN_PIECE_BYTES), 1)
        # a block joins a piece that began less than this before it: no piece ends past max_bytes
        piece_bytes = max(1, min(-(-span // k), max_bytes - int(sizes[at].max()) + 1))
        count = kernels.cut_run(offsets[at], sizes[at], addresses[at], GAP_BYTES, max_bytes, piece_bytes, order, cuts)
        if count < 0 or int(np.diff(cuts[: count + 1]).max()) > MAX_BLOCKS:
            return None  # not whole pages into page-aligned memory, records too far apart, a location twice, ...
        at = at[order]
        off, size, crc, address = offsets[at], sizes[at], checks[at], addresses[at]
        for lo, hi in zip(cuts[:count].tolist(), cuts[1 : count + 1].tolist()):
            piece = slice(lo, hi)
            pieces.append(RunPiece(fds[sid], at[piece], off[piece], size[piece], crc[piece], address[piece], max_bytes))
    return pieces


def read_piece(
    backend: IoBackend, piece: RunPiece, buf: np.ndarray, dests: Sequence[Any]
) -> tuple[list[tuple[int, str]], np.ndarray]:
    """One piece, planned, read and checked by one compiled call (``backend`` and ``dests`` are ``read_one``'s:
    the addresses are the piece's own). The targets that failed, and the scratch used."""
    failed = np.empty(len(piece.at), dtype=np.int64)
    bad = payload_runs.kernels().read_run(
        piece.fd, piece.offsets, piece.lengths, piece.crcs, piece.addresses, int(buf.ctypes.data), len(buf),
        GAP_BYTES, NO_LIMIT, failed, payload_runs.GATHER_BLOCK_BYTES,
    )  # fmt: skip
    lost = piece.at.tolist() if bad < 0 else piece.at[failed[:bad]].tolist()
    return [(t, FAILED) for t in lost], buf


def verified(piece: RunPiece, failed: list[tuple[int, str]]) -> list[int]:
    if not failed:
        return piece.at.tolist()  # type: ignore[no-any-return]
    lost = {t for t, _ in failed}
    return [t for t in piece.at.tolist() if t not in lost]


def _host_addresses(dests: Sequence[Any], lengths: Sequence[int]) -> np.ndarray | None:
    """Each destination's address when every one is writable, contiguous host memory (``memops.host_view``: a
    memoryview, numpy array, bytearray or CPU tensor) of at least its length and not empty, else None (a CUDA
    tensor, read-only bytes, a strided view)."""
    out = np.empty(len(dests), dtype=np.int64)
    for k, (d, n) in enumerate(zip(dests, lengths)):
        try:
            view = host_view(d)
        except (TypeError, ValueError):  # not contiguous: no one address for it
            return None
        if view is None or view.readonly or not view.c_contiguous or view.nbytes < max(n, 1):  # empty: no address
            return None
        out[k] = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return out
