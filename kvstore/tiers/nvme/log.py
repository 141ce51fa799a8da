"""The segment log: appends, accounting, reader pins, forwarding and retirement.

Verbs (thread-safe; ``NvmeTier`` and the compactor are the only callers):

- ``append(items, use_reserve, force_sync) -> locs``: place a batch at the end
  of the log (rolling over to new preallocated segments as needed), write it
  through the write-combining buffer and fdatasync per the write policy. On
  return every record is on disk; on ``TierFull`` nothing was written; on
  ``OSError`` nothing of the batch is committed, the segment that was being
  appended to is sealed at its last committed record (so no later write lands
  behind a partly written one) and segments created for the batch are deleted.
- ``kill(locs)``: mark records dead (a forwarded location kills its new copy).
- ``pin(locs)`` / ``unpin(segs)``: resolve locations (through forwards) for a
  read and hold their segments against deletion until the read is done.
- ``commit_moves(pairs)``: after compaction copied records, make each old
  location forward to its copy (or kill the copy if the old one was freed
  meanwhile). ``retire(seg)``: delete a segment once no read of it is in flight.
- ``checkpoint()``, ``close()``.

Capacity is counted in whole segment files: the log never holds more than
``max_segments`` of them. Foreground appends leave ``reserve_segments`` free
for compaction, which needs room to copy live records into before it can
delete their old segment.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.checksum import crc32c as _crc32c
from kvstore.tiers.base import BlockMeta, TierFull
from kvstore.tiers.nvme.format import (
    HEADER_BYTES,
    OFFSET_BITS,
    PAGE,
    Header,
    encode_header,
    record_bytes,
    split_loc,
    validate_meta,
)
from kvstore.tiers.nvme.io import IoBackend
from kvstore.tiers.nvme.recovery import Recovered, recover_log
from kvstore.tiers.nvme.segments import Segment, SegmentState, fsync_dir, lock_dir, segment_path, summary_path
from kvstore.tiers.nvme.sidecar import Checkpoint, write_checkpoint, write_summary
from kvstore.tiers.nvme.writer import Chunk, WriteCombiner

log = logging.getLogger("kvstore.nvme")


@dataclass(slots=True)
class Pending:
    """A record to append: a new block (meta + stored CRC) or a verbatim copy (header given)."""

    payload: np.ndarray  # the stored bytes, uint8
    meta: BlockMeta | None = None
    stored_crc: int | None = None  # None: computed while the record is written
    header: bytes | None = None  # a copy's header bytes, as on disk
    decoded: Header | None = None  # ... and decoded

    @property
    def nbytes(self) -> int:
        return record_bytes(self.payload.nbytes)


class SegmentLog:
    def __init__(
        self,
        data_dir: Path,
        backend: IoBackend,
        *,
        segment_bytes: int,
        max_segments: int,
        reserve_segments: int,
        write_io_bytes: int,
        write_buffers: int,
        sync_writes: bool,
        sync_interval_s: float,
    ):
        self.data_dir = data_dir
        self.backend = backend
        self.segment_bytes = segment_bytes
        self.max_segments = max_segments
        self.reserve_segments = reserve_segments
        self.sync_writes = sync_writes
        self.sync_interval_s = sync_interval_s
        self._dirty: dict[int, Segment] = {}  # written without fdatasync since the last sync
        self._last_sync = time.monotonic()
        self.lock = threading.Lock()  # segment table, accounting, forwards, pins
        self.write_lock = threading.Lock()  # one append at a time
        self._dir_lock = lock_dir(data_dir)
        try:
            rec: Recovered = recover_log(data_dir, backend)
        except BaseException:
            os.close(self._dir_lock)
            raise
        self.recovered: Recovered | None = rec
        self.segments: dict[int, Segment] = rec.segments
        self.next_seq = rec.next_seq
        self.next_segment_id = rec.next_segment_id
        self.active: Segment | None = None
        self.forwards: dict[int, tuple[int, float]] = {}  # old loc -> (new loc, when)
        self.disk_bytes = sum(s.size for s in self.segments.values())
        self.live_bytes = sum(s.live_bytes for s in self.segments.values())
        self.combiner = WriteCombiner(backend, write_io_bytes, write_buffers)
        self.bytes_appended = 0
        self.syncs = 0

    # -- appends -------------------------------------------------------------------
    def append(self, items: Sequence[Pending], *, use_reserve: bool = False, force_sync: bool = False) -> list[int]:
        with self.write_lock:
            sizes = [HEADER_BYTES + -(-p.payload.nbytes // PAGE) * PAGE for p in items]  # record_bytes, inlined
            self._ensure_room(sizes, use_reserve)
            seq0 = self.next_seq
            self._validate(items)  # ValueError here: nothing touched yet
            decoded: dict[int, Header] = {}  # item index -> its header, filled as written
            runs: list[tuple[Segment, int, list[int]]] = []  # (segment, start offset, item indices)
            created: list[Segment] = []
            offsets: list[int] = []
            seg, pos = self.active, (self.active.end if self.active else 0)
            try:
                for i in range(len(items)):
                    if seg is None or pos + sizes[i] > seg.size:
                        seg, pos = self._new_segment(), 0
                        created.append(seg)
                    if not runs or runs[-1][0] is not seg:
                        runs.append((seg, pos, []))
                    runs[-1][2].append(i)
                    offsets.append(pos)
                    pos += sizes[i]
                for run_seg, start, idxs in runs:
                    self.combiner.write(run_seg.fh, start, self._chunks(items, seq0, decoded, idxs))
                    if self.sync_writes or force_sync or not run_seg.fh.direct:
                        self._sync(run_seg)
                    else:
                        self._dirty[run_seg.id] = run_seg
                if self._dirty and time.monotonic() - self._last_sync >= self.sync_interval_s:
                    self.sync_dirty()
            except BaseException:
                self._abandon(created)
                raise
            self.next_seq = seq0 + len(items)
            return self._commit(runs, created, sizes, decoded, offsets)

    @staticmethod
    def _validate(items: Sequence[Pending]) -> None:
        """Raise ValueError for a record that cannot be encoded, before anything is written."""
        seen: set[tuple[str, str]] = set()
        for p in items:
            if p.header is None or p.decoded is None:
                m = p.meta
                assert m is not None
                if len(m.hash) != 16 or len(m.parent) not in (0, 16) or (m.namespace, m.dtype) not in seen:
                    validate_meta(m)
                    seen.add((m.namespace, m.dtype))

    def _sync(self, seg: Segment) -> None:
        self.backend.sync(seg.fh)
        self.syncs += 1
        self._dirty.pop(seg.id, None)

    def sync_dirty(self) -> None:
        """fdatasync every segment written since its last sync (bounds what a power loss can take)."""
        for seg in list(self._dirty.values()):
            if seg.id in self.segments:
                self._sync(seg)
        self._dirty.clear()
        self._last_sync = time.monotonic()

    @staticmethod
    def _chunks(items: Sequence[Pending], seq0: int, decoded: dict[int, Header], idxs: list[int]) -> Iterator[Chunk]:
        """Header, payload and padding of each record, encoded as the combiner consumes them.

        A new block's payload CRC is computed here, just before its header is staged, so
        checksumming overlaps the I/Os already in flight instead of preceding all of them.
        """
        for i in idxs:
            p = items[i]
            payload = p.payload
            if p.header is not None and p.decoded is not None:
                h = p.header
                decoded[i] = p.decoded
            else:
                m = p.meta
                assert m is not None  # a new block: _validate checked it has its meta
                crc = _crc32c(payload) if p.stored_crc is None else p.stored_crc
                h = encode_header(m, seq0 + i, crc)
                decoded[i] = Header(seq0 + i, m, crc, len(h))
            yield h, payload

    def _ensure_room(self, sizes: list[int], use_reserve: bool) -> None:
        new = 0
        free = self.active.size - self.active.end if self.active else 0
        for n in sizes:
            if n > self.segment_bytes:
                raise ValueError(f"a record of {n} bytes does not fit in a {self.segment_bytes}-byte segment")
            if n > free:
                new, free = new + 1, self.segment_bytes
            free -= n
        limit = self.max_segments - (0 if use_reserve else self.reserve_segments)
        if new and len(self.segments) + new > limit:
            self.drop_empty()
            if len(self.segments) + new > limit:
                raise TierFull(
                    f"nvme tier full: the batch needs {new} new segment(s), {len(self.segments)} of "
                    f"{self.max_segments} exist ({self.reserve_segments} reserved for compaction); "
                    f"free blocks and compact()"
                )

    def _new_segment(self) -> Segment:
        seg_id = self.next_segment_id
        self.next_segment_id += 1
        path = segment_path(self.data_dir, seg_id)
        fh = self.backend.create(str(path), self.segment_bytes)
        fsync_dir(self.data_dir)
        seg = Segment(seg_id, path, fh, self.segment_bytes)
        with self.lock:
            self.segments[seg_id] = seg
            self.disk_bytes += seg.size
        return seg

    def _commit(
        self,
        runs: list[tuple[Segment, int, list[int]]],
        created: list[Segment],
        sizes: list[int],
        headers: dict[int, Header],
        offsets: list[int],
    ) -> list[int]:
        locs = [0] * len(sizes)
        with self.lock:
            for seg, _, idxs in runs:
                run_offsets = [offsets[i] for i in idxs]
                run_sizes = [sizes[i] for i in idxs]
                seg.records.extend(run_offsets, run_sizes)
                assert seg.headers is not None
                seg.headers.extend(zip(run_offsets, [headers[i] for i in idxs]))
                base = seg.id << OFFSET_BITS
                for i, off in zip(idxs, run_offsets):
                    locs[i] = base | off
                seg.end = run_offsets[-1] + run_sizes[-1]
                self.live_bytes += sum(run_sizes)
                self.bytes_appended += sum(run_sizes)
            old, to_seal = self.active, []
            if created:
                to_seal = ([old] if old is not None else []) + created[:-1]
                self.active = created[-1]
        for seg in to_seal:
            self._seal(seg)
        return locs

    def _abandon(self, created: list[Segment]) -> None:
        """A failed append: drop what it created, seal the segment it was appending to."""
        with self.lock:
            old, self.active = self.active, None
            for seg in created:
                del self.segments[seg.id]
                self._dirty.pop(seg.id, None)
                self.disk_bytes -= seg.size
        for seg in created:
            self.backend.close(seg.fh)
            seg.path.unlink(missing_ok=True)
        if old is not None:
            self._seal(old)

    def _seal(self, seg: Segment) -> None:
        with self.lock:
            seg.state = SegmentState.SEALED
            headers, seg.headers = seg.headers, None
        if headers:
            try:
                write_summary(self.data_dir, seg.id, seg.end, headers)
            except OSError as e:  # the summary only speeds up recovery
                log.warning("summary of segment %d not written (%s): recovery will scan it", seg.id, e)

    # -- frees, pins, forwards ---------------------------------------------------------
    def _resolve(self, loc: int) -> int:
        for _ in range(16):
            fwd = self.forwards.get(loc)
            if fwd is None:
                return loc
            loc = fwd[0]
        return loc

    def _kill_one(self, loc: int) -> int:
        seg_id, off = split_loc(loc)
        seg = self.segments.get(seg_id)
        n = seg.records.kill(off) if seg is not None else 0
        self.live_bytes -= n
        return n

    def kill(self, locs: Sequence[int]) -> int:
        freed = 0
        with self.lock:
            for loc in locs:
                if loc in self.forwards:
                    freed += self._kill_one(self._resolve(loc))
                freed += self._kill_one(loc)
        return freed

    def pin(self, locs: Sequence[int]) -> tuple[list[tuple[int, Segment | None]], list[Segment]]:
        """Resolve each location to (loc, segment or None if gone) and pin those segments."""
        out: list[tuple[int, Segment | None]] = []
        pinned: dict[int, Segment] = {}
        with self.lock:
            forwards, segments = self.forwards, self.segments
            for loc in locs:
                r = self._resolve(loc) if forwards else loc
                seg = segments.get(r >> OFFSET_BITS)
                if seg is not None and seg.state is SegmentState.RETIRING:
                    seg = None
                if seg is not None and seg.id not in pinned:
                    seg.readers += 1
                    pinned[seg.id] = seg
                out.append((r, seg))
        return out, list(pinned.values())

    def pin_segment(self, seg: Segment) -> bool:
        """Pin one segment as a read does (False: it is being retired, or gone)."""
        with self.lock:
            if self.segments.get(seg.id) is not seg or seg.state is SegmentState.RETIRING:
                return False
            seg.readers += 1
            return True

    def unpin(self, segs: Sequence[Segment]) -> None:
        """End reads of ``segs``; the last one of a segment being retired deletes it."""
        with self.lock:
            for seg in segs:
                seg.readers -= 1
            gone = [self._forget(seg) for seg in segs if seg.readers == 0 and seg.state is SegmentState.RETIRING]
        self._delete([seg for seg in gone if seg is not None])

    def live_records(self, seg: Segment) -> list[tuple[int, int]]:
        with self.lock:
            return list(seg.records.live())

    def commit_moves(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Old records whose copies are durable: forward them; returns the pairs still live."""
        kept = []
        now = time.monotonic()
        with self.lock:
            for old, new in pairs:
                if self._kill_one(old):
                    self.forwards[old] = (new, now)
                    kept.append((old, new))
                else:  # freed while being copied: the copy is garbage
                    self._kill_one(new)
        return kept

    def expire_forwards(self, ttl_s: float) -> None:
        cutoff = time.monotonic() - ttl_s
        with self.lock:
            for old in [k for k, (_, t) in self.forwards.items() if t < cutoff]:
                del self.forwards[old]

    # -- retirement ------------------------------------------------------------------
    def retire(self, seg: Segment) -> None:
        """Delete a segment: new reads of it are refused at once; reads in flight, and readers outside the process
        (``NvmeTier.extents``), keep its file until the last of them unpins it, which deletes it then. Never
        waits: a caller may hold the BlockStore's lock, which an outside reader's release can need (a lane
        closing took it before giving back its segment pins: retire's wait for them hung the store). A segment
        another thread is retiring, or retired, is left to it."""
        with self.lock:
            if self.segments.get(seg.id) is not seg or seg.state is SegmentState.RETIRING:
                return
            seg.state = SegmentState.RETIRING  # still in ``segments``: its file counts against the tier's room
            gone = self._forget(seg) if seg.readers == 0 else None
        self._delete([gone] if gone is not None else [])

    def _forget(self, seg: Segment) -> Segment | None:
        """Take a retiring segment nobody reads out of the table (lock held): the caller deletes its file."""
        if self.segments.get(seg.id) is not seg:
            return None  # another thread got there first
        del self.segments[seg.id]
        self._dirty.pop(seg.id, None)
        self.disk_bytes -= seg.size
        self.live_bytes -= seg.live_bytes
        return seg

    def _delete(self, segs: Sequence[Segment]) -> None:
        for seg in segs:
            self.backend.close(seg.fh)
            seg.path.unlink(missing_ok=True)
            summary_path(self.data_dir, seg.id).unlink(missing_ok=True)
        if segs:
            fsync_dir(self.data_dir)

    def drop_empty(self) -> int:
        """Delete sealed segments with nothing live and no read in flight; returns how many."""
        with self.lock:
            empty = [
                s
                for s in self.segments.values()
                if s.state is SegmentState.SEALED and s.records.live_count == 0 and s.readers == 0
            ]
        for seg in empty:
            self.retire(seg)
        return len(empty)

    # -- persistence -----------------------------------------------------------------
    def checkpoint(self) -> None:
        with self.write_lock, self.lock:
            dead = {sid: s.records.dead_offsets() for sid, s in self.segments.items()}
            ckpt = Checkpoint(self.next_seq, self.next_segment_id, {k: v for k, v in dead.items() if len(v)})
        write_checkpoint(self.data_dir, ckpt)

    def close(self) -> None:
        with self.write_lock:
            self.sync_dirty()
            active, self.active = self.active, None
        if active is not None:
            self._seal(active)
        self.drop_empty()
        with self.lock:  # retired, still pinned by a reader outside: its records were moved, nobody reads it now
            retired = [self._forget(s) for s in list(self.segments.values()) if s.state is SegmentState.RETIRING]
        self._delete([s for s in retired if s is not None])
        self.checkpoint()
        with self.lock:
            segs = list(self.segments.values())
        for seg in segs:
            self.backend.close(seg.fh)
        self.combiner.close()
        os.close(self._dir_lock)
