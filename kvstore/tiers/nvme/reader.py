"""The read path: plan coalesced reads, run them, verify every record before use.

``plan_pieces(seg, wanted, max_bytes, gap_bytes, parallel)`` sorts the records
wanted from one segment by offset, coalesces them into runs of adjacent records
(or records at most ``gap_bytes`` apart, read through), and cuts each run into
a few balanced *pieces* of at most ``max_bytes``, at least ``parallel`` of them
when the run is large enough: a 32-block prefix written together is a few
reads, issued at once.

``read_piece(backend, piece, buf)`` (compaction's read) issues one pread for
the piece into an aligned bounce buffer and checks each record in it: header
magic and CRC, the stored length the caller expects, and the CRC32C of the
payload. It returns a ``Checked`` per record: the payload view on success, the
reason otherwise. Callers copy a payload out only after its check passed, so a
caller buffer never receives bytes that failed verification.

The tier's read, per piece: ``plan_into`` lays out one preadv with the
page-aligned part of each payload straight in its caller's buffer when that is
page-aligned host memory and the rest (header pages, tails, gaps) in scratch;
``finish_into`` runs the same checks once the bytes landed, then copies the
tails in; a record that fails has whatever was read into its buffer zeroed.
``read_one`` is the two around one preadv. How a Get's pieces are spread over
threads is ``pipeline``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore import memops_jit
from kvstore.background_compile import BackgroundCompile
from kvstore.checksum import crc32c as _crc32c
from kvstore.tiers.nvme.format import (
    HEADER_BYTES,
    PAGE,
    Header,
    align_up,
    check_header,
    crc32c,
    decode_header,
    record_bytes,
)
from kvstore.tiers.nvme.io import IoBackend, aligned_buffer, array_address
from kvstore.tiers.nvme.segments import Segment

# Pieces are not cut smaller than this for parallelism (the client's reader found the same, lanes/client/disk.py).
# A 32 x 64 KiB prefix (2.2 MB) in 2 pieces instead of 4: the tier's read 1.08 against 1.19 ms (its four concurrent
# preadvs shared the disk, each as slow as one of two; the plans and checks of four cost 0.48 against 0.20 ms);
# bench.disk's interleaved 64 KiB prefix reads 0.596 / 0.596 of the raw extent read against 0.541 / 0.553.
MIN_PIECE = 1 << 20
# why a record failed, in both ways of checking it (here and ``check_kernels``)
NO_HEADER = "no valid record header at this location"
INDEX_CRC = "record's CRC32C differs from the index's"
PAST_END = "record extends past the end of the segment file"
BAD_PAYLOAD = "payload fails its CRC32C"


def _wrong_length(n: int, expected: int | None) -> str:
    return f"record holds {n} bytes, caller expects {expected}"


@dataclass(slots=True)
class Wanted:
    """One record to read: where, how big, the payload length expected (None: any), and for whom."""

    offset: int
    nbytes: int  # record bytes
    length: int | None = None
    targets: list[int] = field(default_factory=list)  # indices into the caller's dests
    crc: int | None = None  # the payload CRC32C the caller expects (its index's), checked beside the record's

    @classmethod
    def block(cls, offset: int, length: int) -> Wanted:
        return cls(offset, record_bytes(length), length)


@dataclass(slots=True)
class Piece:
    seg: Segment
    offset: int
    nbytes: int
    records: list[Wanted]


@dataclass(slots=True)
class Checked:
    wanted: Wanted
    header: Header | None  # decoded only when asked for
    record: np.ndarray | None  # the whole record (header page, payload, pad) when valid
    reason: str = ""
    length: int = 0  # payload bytes, when valid

    @property
    def payload(self) -> np.ndarray:
        assert self.record is not None
        return self.record[HEADER_BYTES : HEADER_BYTES + self.length]


def plan_pieces(
    seg: Segment,
    wanted: Sequence[Wanted],
    max_bytes: int,
    gap_bytes: int,
    parallel: int = 1,
    min_piece: int = MIN_PIECE,
) -> list[Piece]:
    """Coalesce into runs, then cut each run into balanced pieces at record boundaries.

    A run is cut into ``k`` pieces of about equal size, where ``k`` is enough to keep
    pieces within ``max_bytes`` and, for runs large enough, at least ``parallel`` (so
    one prefix keeps that many reads in flight) without going below ``min_piece``.
    """
    runs: list[list[Wanted]] = []
    end = -1
    for w in sorted(wanted, key=lambda w: w.offset):
        if runs and end <= w.offset <= end + gap_bytes:
            runs[-1].append(w)
        else:
            runs.append([w])
        end = w.offset + w.nbytes
    pieces: list[Piece] = []
    for run in runs:
        total = run[-1].offset + run[-1].nbytes - run[0].offset
        k = max(-(-total // max_bytes), min(parallel, total // max(min_piece, 1)), 1)
        target = -(-total // k)
        cur: Piece | None = None
        for w in run:
            if cur is not None:
                size = w.offset + w.nbytes - cur.offset
                if size <= max_bytes and cur.nbytes < target:
                    cur.nbytes = size
                    cur.records.append(w)
                    continue
            cur = Piece(seg, w.offset, w.nbytes, [w])
            pieces.append(cur)
    return pieces


def check_record(buf: np.ndarray, rel: int, w: Wanted, decode: bool = False) -> Checked:
    """Validate the record at ``buf[rel:]`` against what the caller expects.

    ``decode=True`` also returns the decoded header (compaction needs it); reads only
    need the lengths and CRCs, which are cheaper to get.
    """
    header: Header | None = None
    if decode:
        header = decode_header(buf, rel)
        fields = None if header is None else (header.meta.stored_length, header.stored_crc)
    else:
        fields = check_header(buf, rel)
    if fields is None:
        return Checked(w, None, None, NO_HEADER)
    n, stored_crc = fields
    if (w.length is not None and n != w.length) or record_bytes(n) != w.nbytes:
        return Checked(w, header, None, _wrong_length(n, w.length))
    record = buf[rel : rel + w.nbytes]
    if len(record) < w.nbytes:
        return Checked(w, header, None, PAST_END)
    if crc32c(record[HEADER_BYTES : HEADER_BYTES + n]) != stored_crc:
        return Checked(w, header, None, BAD_PAYLOAD)
    return Checked(w, header, record, length=n)


def read_piece(backend: IoBackend, piece: Piece, buf: np.ndarray, decode: bool = False) -> list[Checked]:
    """One pread for the whole piece, then a check of every record in it."""
    view = buf[: piece.nbytes]
    try:
        got = backend.pread(piece.seg.fh, view, piece.offset)
    except OSError as e:
        return [Checked(w, None, None, f"read failed: {e}") for w in piece.records]
    view = view[:got]
    return [check_record(view, w.offset - piece.offset, w, decode) for w in piece.records]


IOV_MAX = 1024  # Linux's limit on buffers per preadv
_UINT8 = np.dtype(np.uint8)


def host_view(dest: Any) -> np.ndarray | None:
    """A writable flat uint8 view of a host-memory dest, or None (device tensor, read-only, strided)."""
    if isinstance(dest, np.ndarray):
        flags = dest.flags
        if not (flags.c_contiguous and flags.writeable):
            return None
        return dest if dest.dtype is _UINT8 and dest.ndim == 1 else dest.reshape(-1).view(np.uint8)
    if hasattr(dest, "is_cuda"):  # torch tensors take the bounce path
        return None
    try:
        out = np.frombuffer(dest, dtype=np.uint8)
    except (TypeError, ValueError):
        return None
    return out if out.flags.writeable else None


@dataclass(slots=True)
class PlannedRead:
    """One piece ready for its preadv: the buffers in file order, and per record where its parts land."""

    piece: Piece
    scratch: np.ndarray
    iov: list[np.ndarray]
    plan: list[tuple[Wanted, int, int, np.ndarray | None, int]]  # (w, header pos, tail pos, view, n aligned)
    addresses: list[int]  # per record, where its view starts (0: no view); taken once, for the compiled checks


def plan_into(piece: Piece, scratch: np.ndarray, dests: Sequence[Any], direct: bool = True) -> PlannedRead:
    """Lay out one piece's preadv: the page-aligned part of each payload straight into its first target's
    buffer when that is host memory, page aligned and large enough (``host_view``); header pages, payload
    tails, read-through gaps and the payloads of other records into ``scratch`` (at least ``piece.nbytes``)."""
    iov: list[np.ndarray] = []
    plan: list[tuple[Wanted, int, int, np.ndarray | None, int]] = []
    addresses: list[int] = []
    sp = 0  # scratch position
    run = 0  # start of the scratch span not yet in iov
    pos = piece.offset
    for w in piece.records:
        sp += w.offset - pos  # a read-through gap
        n = w.length if w.length is not None else 0
        hdr = sp
        sp += HEADER_BYTES
        al = n // PAGE * PAGE
        view = host_view(dests[w.targets[0]]) if direct and w.targets and w.length is not None and al else None
        address = array_address(view) if view is not None else 0
        if view is not None and (view.nbytes < n or address % PAGE or w.nbytes != record_bytes(n)):
            view, address = None, 0
        addresses.append(address)
        if view is None:
            plan.append((w, hdr, hdr + HEADER_BYTES, None, 0))
            sp += w.nbytes - HEADER_BYTES
        else:
            if sp > run:
                iov.append(scratch[run:sp])
            iov.append(view if view.nbytes == al else view[:al])
            plan.append((w, hdr, sp, view, al))
            run = sp  # the tail, its pad and what follows go on in scratch
            sp += w.nbytes - HEADER_BYTES - al
        pos = w.offset + w.nbytes
    if sp > run:
        iov.append(scratch[run:sp])
    if len(iov) > IOV_MAX:  # too many pieces for one call: read it all into scratch instead
        return plan_into(piece, scratch, dests, direct=False)
    return PlannedRead(piece, scratch, iov, plan, addresses)


def finish_into(planned: PlannedRead, got: int | OSError, dests: Sequence[Any]) -> list[tuple[int, str]]:
    """Check every record of a piece after its preadv returned ``got`` bytes (or failed): header magic and
    CRC, the length expected, the payload CRC32C over both parts; then copy tails in and fill other targets.
    A record that fails has the bytes read into its buffer zeroed, so no caller buffer is left holding bytes
    that failed verification. Returns the failed (target, reason)."""
    piece, scratch = planned.piece, planned.scratch
    if isinstance(got, OSError):
        for _, _, _, view, al in planned.plan:
            if view is not None:
                view[:al] = 0
        return [(t, f"read failed: {got}") for w in piece.records for t in w.targets]
    kernels = compiled_checks()
    if kernels is not None:
        return _finish_compiled(kernels, planned, got, dests)
    end = piece.offset + got
    failed: list[tuple[int, str]] = []
    for w, hdr, tail, view, al in planned.plan:
        reason = ""
        fields = check_header(scratch, hdr) if w.offset + HEADER_BYTES <= end else None
        if fields is None:
            reason = NO_HEADER
        else:
            n, stored_crc = fields
            if (w.length is not None and n != w.length) or record_bytes(n) != w.nbytes:
                reason = _wrong_length(n, w.length)
            elif w.crc is not None and stored_crc != w.crc:
                reason = INDEX_CRC
            elif w.offset + w.nbytes > end:
                reason = PAST_END
            elif view is None:
                payload = scratch[tail : tail + n]
                if _crc32c(payload) != stored_crc:
                    reason = BAD_PAYLOAD
                else:
                    for t in w.targets:
                        copy_into(dests[t], payload)
            else:
                crc = _crc32c(view if view.nbytes == al else view[:al])
                if n > al:
                    rest = scratch[tail : tail + n - al]
                    crc = _crc32c(rest, crc)
                if crc != stored_crc:
                    reason = BAD_PAYLOAD
                else:
                    if n > al:
                        view[al:n] = rest
                    for t in w.targets[1:]:
                        copy_into(dests[t], view[:n])
        if reason:
            if view is not None:
                view[:al] = 0
            failed.extend((t, reason) for t in w.targets)
    return failed


def _finish_compiled(kernels: Any, planned: PlannedRead, got: int, dests: Sequence[Any]) -> list[tuple[int, str]]:
    """``finish_into`` through ``check_kernels.check_piece``: the checks and tail copies in one call without the
    GIL; a payload read only into scratch, or wanted by more than one target, is copied out here."""
    piece, scratch, plan = planned.piece, planned.scratch, planned.plan
    rows = np.array(
        [
            (w.offset - piece.offset, hdr, address, al, tail,
             -1 if w.length is None else w.length, w.nbytes, -1 if w.crc is None else w.crc)
            for (w, hdr, tail, _, al), address in zip(plan, planned.addresses)
        ],
        dtype=np.int64,
    )  # fmt: skip
    status, lengths = np.empty(len(plan), dtype=np.int64), np.empty(len(plan), dtype=np.int64)
    kernels.check_piece(scratch, rows, got, status, lengths)
    failed: list[tuple[int, str]] = []
    for k, (w, _, tail, view, al) in enumerate(plan):
        if status[k] == kernels.OK:
            if view is None:
                for t in w.targets:
                    copy_into(dests[t], scratch[tail : tail + int(lengths[k])])
            elif len(w.targets) > 1:
                n = int(lengths[k])
                for t in w.targets[1:]:
                    copy_into(dests[t], view[:n])
            continue
        if view is not None:
            view[:al] = 0
        if status[k] == kernels.WRONG_LENGTH:
            reason = _wrong_length(int(lengths[k]), w.length)
        else:
            words = {kernels.NO_HEADER: NO_HEADER, kernels.INDEX_CRC: INDEX_CRC, kernels.PAST_END: PAST_END}
            reason = words.get(int(status[k]), BAD_PAYLOAD)  # the Python path's words
        failed.extend((t, reason) for t in w.targets)
    return failed


def read_one(
    backend: IoBackend, piece: Piece, buf: np.ndarray, dests: Sequence[Any]
) -> tuple[list[tuple[int, str]], np.ndarray]:
    """Plan, read and check one piece into ``dests`` with ``buf`` as scratch: the failed (target, reason), and the
    scratch used (a larger one, to keep, where ``buf`` was too small for the piece)."""
    if len(buf) < piece.nbytes:
        buf = aligned_buffer(align_up(piece.nbytes))
    planned = plan_into(piece, buf, dests)
    try:
        got: int | OSError = backend.preadv(piece.seg.fh, planned.iov, piece.offset)
    except OSError as e:
        got = e
    return finish_into(planned, got, dests), buf


def _compile() -> None:
    from kvstore.tiers.nvme import check_kernels as kernels

    kernels.warm_up()


_compiled = BackgroundCompile("kvstore-nvme-check-jit", memops_jit.AVAILABLE, _compile)


def compiled_checks() -> Any:
    """``check_kernels`` once compiled (the first call starts compiling it in the background), else None."""
    if not _compiled.ready():
        return None
    from kvstore.tiers.nvme import check_kernels as kernels

    return kernels


def copy_into(dest: Any, payload: np.ndarray) -> None:
    """Copy verified payload bytes into a caller buffer (bytes-like, numpy array or torch tensor)."""
    n = payload.nbytes
    if hasattr(dest, "copy_") and hasattr(dest, "is_cuda"):  # torch tensor
        import torch

        flat = dest.view(torch.uint8).reshape(-1)
        flat[:n].copy_(torch.from_numpy(payload))
        return
    if isinstance(dest, np.ndarray):
        if not dest.flags.c_contiguous:
            raise ValueError("destination arrays must be C-contiguous")
        out = dest.reshape(-1).view(np.uint8)
    else:
        out = np.frombuffer(dest, dtype=np.uint8)
    if out.nbytes < n:
        raise ValueError(f"destination holds {out.nbytes} bytes, the block has {n}")
    np.copyto(out[:n], payload)
