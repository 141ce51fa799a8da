"""Compaction: copy the live records of mostly-dead segments forward, then delete them.

``compact_log(...)`` picks sealed segments whose live fraction is below the
threshold (emptiest first; under space pressure, the single emptiest segment
whatever its fraction), and for each:

1. reads its live records in coalesced pieces and verifies every CRC;
2. appends verbatim copies to the head of the log (same header, same sequence
   number, fdatasync'ed whatever the write policy), using the segment reserve;
3. ``commit_moves``: each old location now *forwards* to its copy. A read or a
   free of the old location from here on goes to the copy; a record freed
   while it was being copied has its copy killed instead;
4. calls the owner's ``on_relocate([(old, new), ...])`` so it switches its
   index to the new locations (``new == DROPPED`` means the record failed its
   CRC while being copied and is gone: drop it from the index);
5. retires the segment: new reads of it are refused (they resolve through the
   forwards anyway); the last read in flight, or outside reader, to let go of
   it deletes the file (at once when there is none). Retiring never waits.

Forwards live ``forward_ttl_s`` after the move, long enough for any read that
picked up an old location just before the owner switched.

Without an ``on_relocate`` hook only segments with nothing live are deleted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.tiers.base import TierFull
from kvstore.tiers.nvme.format import make_loc
from kvstore.tiers.nvme.io import IoBackend
from kvstore.tiers.nvme.log import Pending, SegmentLog
from kvstore.tiers.nvme.pipeline import BufferPool
from kvstore.tiers.nvme.reader import Checked, Wanted, plan_pieces, read_piece
from kvstore.tiers.nvme.segments import Segment, SegmentState

log = logging.getLogger("kvstore.nvme")

DROPPED = -1  # new location of a record lost during compaction (equals the store's NO_LOC)
RelocateHook = Callable[[list[tuple[int, int]]], None]


@dataclass
class CompactionReport:
    segments_compacted: int = 0  # live records copied forward, then the file deleted
    segments_dropped: int = 0  # deleted with nothing live in them
    records_moved: int = 0
    bytes_moved: int = 0
    records_lost: int = 0  # failed their CRC while being copied (reported as DROPPED)
    bytes_freed: int = 0  # disk bytes released
    seconds: float = 0.0
    stopped: str = ""  # why it stopped early, if it did


def select_victims(log_: SegmentLog, threshold: float, max_segments: int, pressure: bool) -> list[Segment]:
    with log_.lock:
        sealed = [s for s in log_.segments.values() if s.state is SegmentState.SEALED]
    below = sorted((s for s in sealed if s.live_fraction < threshold), key=lambda s: s.live_fraction)
    if not below and pressure:
        below = sorted((s for s in sealed if s.live_bytes < s.size), key=lambda s: s.live_fraction)[:1]
    return below[:max_segments]


def compact_log(
    log_: SegmentLog,
    backend: IoBackend,
    pool: BufferPool,
    hook: RelocateHook | None,
    *,
    threshold: float,
    max_segments: int,
    pressure: bool,
    max_read_bytes: int,
    forward_ttl_s: float,
) -> CompactionReport:
    t0 = time.perf_counter()
    report = CompactionReport()
    log_.expire_forwards(forward_ttl_s)
    disk0 = log_.disk_bytes
    report.segments_dropped = log_.drop_empty()
    for seg in select_victims(log_, threshold, max_segments, pressure):
        live = log_.live_records(seg)
        if live and hook is None:
            report.stopped = "no on_relocate hook: segments with live records cannot be moved"
            break
        # Pinned like a read while its records are copied: a writer making room drops empty segments
        # (drop_empty), and this one empties as its records move or die; it must not be retired (its file
        # closed, its descriptor reused) under the copy.
        if not log_.pin_segment(seg):
            continue  # retired meanwhile
        try:
            stopped = _move_segment(log_, backend, pool, hook, seg, live, max_read_bytes, report)
        finally:
            log_.unpin([seg])
        if stopped:
            report.stopped = stopped
            break
        with log_.lock:
            still_live = seg.records.live_count
        if still_live:
            report.stopped = f"segment {seg.id} still has {still_live} live records"
            break
        log_.retire(seg)  # unless a writer's drop_empty did, as soon as it was unpinned
        report.segments_compacted += 1
    report.bytes_freed = max(0, disk0 - log_.disk_bytes)
    report.seconds = time.perf_counter() - t0
    if report.segments_compacted or report.segments_dropped:
        log.info("nvme compaction: %s", report)
    return report


def _move_segment(
    log_: SegmentLog,
    backend: IoBackend,
    pool: BufferPool,
    hook: RelocateHook | None,
    seg: Segment,
    live: Sequence[tuple[int, int]],
    max_read_bytes: int,
    report: CompactionReport,
) -> str:
    """Copy one segment's live records forward; returns why it stopped early, or ""."""
    pairs: list[tuple[int, int]] = []
    stopped = ""
    try:
        for piece in plan_pieces(seg, [Wanted(off, n) for off, n in live], max_read_bytes, 0):
            buf = pool.get(piece.nbytes)
            try:
                checked = read_piece(backend, piece, buf, decode=True)
                good = [c for c in checked if c.record is not None]
                for c in checked:
                    if c.record is None:
                        old = make_loc(seg.id, c.wanted.offset)
                        log.error("nvme compaction: record %#x lost: %s", old, c.reason)
                        log_.kill([old])
                        pairs.append((old, DROPPED))
                        report.records_lost += 1
                if not good:
                    continue
                items = [_verbatim(c) for c in good]
                try:
                    new_locs = log_.append(items, use_reserve=True, force_sync=True)
                except TierFull as e:
                    stopped = f"no room to copy into: {e}"
                    break
                old_locs = [make_loc(seg.id, c.wanted.offset) for c in good]
                kept = log_.commit_moves(list(zip(old_locs, new_locs)))
                pairs.extend(kept)
                report.records_moved += len(kept)
                report.bytes_moved += sum(c.wanted.nbytes for c in good)
            finally:
                pool.put(buf)
    finally:
        if pairs and hook is not None:
            hook(pairs)
    return stopped


def _verbatim(c: Checked) -> Pending:
    """A copy of a valid record read with ``decode=True``: its payload, with its header as on disk."""
    assert c.record is not None and c.header is not None
    return Pending(c.payload, header=bytes(c.record[: c.header.header_len]), decoded=c.header)
