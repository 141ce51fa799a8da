"""NvmeTier: the tier verbs over the segment log (see docs/nvme.md).

- ``write(metas, sources) -> locs``: one batch, appended in large aligned
  O_DIRECT writes. Returns when the batch is *acknowledged*: under
  ``write_policy="direct"`` (default) every byte went through O_DIRECT (it
  survives a crash of the process; segments are fdatasync'ed within
  ``sync_interval_s``, so after an OS crash or power loss blocks acked in the
  last moments may be missing, never wrong); under ``"fdatasync"`` the
  segment was also fdatasync'ed (it survives a power loss). ``TierFull`` when the batch
  needs more segment files than the capacity allows (nothing written; free
  blocks and ``compact()``); ``TierFault`` on an I/O error (nothing of the batch
  stays allocated; the tier turns degraded and fails writes fast until a
  write after ``probe_interval_s`` succeeds). Reads keep working meanwhile.
- ``read(locs, lengths, dests)``: coalesced, parallel preads; every record's
  header and payload CRC are verified before its dest is filled; failures
  raise ``CorruptBlock`` naming the bad locations (other dests are filled).
  Raw payloads (their CRC32Cs given) bound for page-aligned host memory are
  read by one compiled call a piece (``runs.py``), the rest record by record.
- ``free(locs)``: records die; their space returns through compaction.
- ``compact(max_segments, threshold, wait=True) -> CompactionReport``: run by
  the owner from a background thread; moves are reported through
  ``on_relocate``. ``wait=False`` returns at once (``stopped`` says so) when
  another compaction is running: a caller that holds a lock ``on_relocate``
  takes (the store's, while it makes room for a Put) must not wait for it.
- ``extents(locs) -> (where, pins)`` / ``release_extents(pins)``: where each payload lies in its segment
  file, for a process that reads it itself (a shm lane client of ``--share-nvme``), the segments pinned.
- ``recover()``: the blocks found on disk at open, once.
- ``reclaimable() -> ReclaimInfo``, ``stats()``, ``checkpoint()``, ``close()``.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.tiers.base import NVME, BlockMeta, CorruptBlock, Tier, TierFault, TierFull, TierStats
from kvstore.tiers.nvme import runs
from kvstore.tiers.nvme.compaction import CompactionReport, RelocateHook, compact_log
from kvstore.tiers.nvme.format import HEADER_BYTES, OFFSET_BITS, OFFSET_MASK, PAGE, record_bytes
from kvstore.tiers.nvme.gds import is_device_dest, read_split
from kvstore.tiers.nvme.io import IoBackend, select_backend
from kvstore.tiers.nvme.log import Pending, SegmentLog
from kvstore.tiers.nvme.pipeline import BufferPool, read_pipelined
from kvstore.tiers.nvme.reader import Wanted, compiled_checks, plan_pieces
from kvstore.tiers.nvme.segments import Segment, SegmentState
from kvstore.tiers.nvme.sidecar import RecordColumns

# Reads and checks a read's compiled runs itself: the (verified, failed) targets, or None (``NvmeTier.read``).
RunReader = Callable[[list[runs.RunPiece]], tuple[list[int], list[int]] | None]

log = logging.getLogger("kvstore.nvme")

WRITE_POLICIES = ("fdatasync", "direct")
_U8 = np.dtype(np.uint8)


@dataclass(frozen=True)
class ReclaimInfo:
    """What the owner needs to decide between evicting and compacting."""

    capacity_bytes: int
    disk_bytes: int  # whole segment files on disk
    live_bytes: int
    dead_bytes: int  # in sealed segments: freed records and unused tails
    free_segments: int  # new segment files that still fit (the compaction reserve excluded)
    empty_segments: int  # sealed with nothing live: compact() deletes them without copying
    compactable_segments: int  # sealed with live fraction below the threshold
    compactable_gain_bytes: int  # disk bytes compacting those would release (net of the copies)


@dataclass
class ExtentPins:
    """Segments pinned for readers outside the process (``NvmeTier.extents``); ended once, by ``release_extents``."""

    segments: list[Segment]


def as_source(src: Any) -> np.ndarray:
    """A flat uint8 view of a payload (bytes-like, numpy array or torch tensor)."""
    if type(src) is np.ndarray and src.dtype == _U8 and src.ndim == 1 and src.flags.c_contiguous:
        return src  # the common case, checked cheaply
    if hasattr(src, "detach") and hasattr(src, "is_cuda"):  # torch tensor
        import torch

        src = src.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
    if isinstance(src, np.ndarray):
        arr = src if src.flags.c_contiguous else np.ascontiguousarray(src)
        return arr.reshape(-1).view(np.uint8)
    return np.frombuffer(src, dtype=np.uint8)


class NvmeTier(Tier):
    rank = NVME
    name = "nvme"

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        segment_bytes: int = 256 << 20,
        write_policy: str = "direct",
        sync_interval_s: float = 1.0,
        compact_threshold: float = 0.5,
        reserve_segments: int = 1,
        write_io_bytes: int = 1 << 20,
        write_buffers: int = 4,
        read_threads: int = 4,
        max_read_bytes: int = 2 << 20,
        coalesce_gap_bytes: int = 128 << 10,
        probe_interval_s: float = 5.0,
        forward_ttl_s: float = 60.0,
        backend: IoBackend | str = "auto",
        on_relocate: RelocateHook | None = None,
    ):
        if segment_bytes % PAGE or segment_bytes < 4 * PAGE:
            raise ValueError("segment_bytes must be a multiple of 4 KiB and at least 16 KiB")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        max_segments = capacity_bytes // segment_bytes
        if max_segments < reserve_segments + 1:
            raise ValueError(
                f"capacity {capacity_bytes} holds {max_segments} segments of {segment_bytes} bytes; "
                f"at least {reserve_segments + 1} are needed (one is the compaction reserve)"
            )
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._capacity = capacity_bytes
        self.segment_bytes = segment_bytes
        self.write_policy = write_policy
        self.compact_threshold = compact_threshold
        self.max_read_bytes = max(max_read_bytes, PAGE)
        self.read_threads = read_threads
        self.coalesce_gap_bytes = coalesce_gap_bytes
        self.probe_interval_s = probe_interval_s
        self.forward_ttl_s = forward_ttl_s
        self.on_relocate = on_relocate
        self.backend = select_backend(backend) if isinstance(backend, str) else backend
        self._log = SegmentLog(
            self.data_dir,
            self.backend,
            segment_bytes=segment_bytes,
            max_segments=max_segments,
            reserve_segments=reserve_segments,
            write_io_bytes=write_io_bytes,
            write_buffers=write_buffers,
            sync_writes=write_policy == "fdatasync",
            sync_interval_s=sync_interval_s,
        )
        self._pool = ThreadPoolExecutor(read_threads, thread_name_prefix="nvme-read")
        self._buffers = BufferPool(read_threads + 1, self.max_read_bytes)
        compiled_checks()  # starts compiling the reads' record checks in the background (until then: Python's)
        self._compact_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._fault = ""
        self._probe_at = 0.0
        self._pressure = False
        self._closed = False
        self._counts = dict(
            writes=0,
            blocks_written=0,
            reads=0,
            blocks_read=0,
            read_ios=0,
            run_read_ios=0,  # of read_ios, pieces read by one compiled call (runs.py)
            corrupt=0,
            write_faults=0,
            compactions=0,
            relocated=0,
            extents_lent=0,
        )
        self._read_bytes, self._read_seconds = 0, 0.0  # for the load planner's NVMe speed prior (Stats)
        rec = self._log.recovered
        assert rec is not None
        self.recovery_seconds = rec.seconds
        log.info(
            "nvme tier %s: backend %s, %d segments (%d from summaries, %d scanned), %d blocks recovered "
            "in %.3f s, write policy %s",
            self.data_dir,
            self.backend.name,
            len(rec.segments),
            rec.summarized,
            rec.scanned,
            rec.count,
            rec.seconds,
            write_policy,
        )
        for note in rec.notes:
            log.info("nvme recovery: %s", note)

    # -- accounting ---------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes of live records (headers and padding included); disk use is in ``stats().extra``."""
        return self._log.live_bytes

    @property
    def degraded(self) -> bool:
        return bool(self._fault)

    def fits(self, nbytes: int) -> bool:
        return record_bytes(nbytes) <= self.segment_bytes

    def freed_with(self, loc: int) -> tuple[int, int] | None:
        """The locations of ``loc``'s segment (a location is the segment id above ``OFFSET_BITS``); None while
        it is the segment being written, whose space no eviction gives back."""
        segment = loc >> OFFSET_BITS
        active = self._log.active  # read without the log's lock: a segment sealed meanwhile is only taken later
        if active is not None and active.id == segment:
            return None
        return segment << OFFSET_BITS, (segment + 1) << OFFSET_BITS

    # -- write ----------------------------------------------------------------------
    def write(self, metas: Sequence[BlockMeta], sources: Sequence[Any]) -> list[int]:
        if len(metas) != len(sources):
            raise ValueError(f"{len(metas)} metas but {len(sources)} sources")
        if not metas:
            return []
        self._fail_fast()
        items = []
        for meta, src in zip(metas, sources):
            payload = as_source(src)
            if payload.nbytes != meta.stored_length:
                raise ValueError(f"source holds {payload.nbytes} bytes, meta says stored_length={meta.stored_length}")
            items.append(Pending(payload, meta))  # its CRC32C is computed as it is written
        try:
            locs = self._log.append(items)
        except TierFull:
            self._pressure = True
            raise
        except OSError as e:
            raise self._degrade(e) from e
        self._healed()
        self._counts["writes"] += 1
        self._counts["blocks_written"] += len(locs)
        return locs

    def _fail_fast(self) -> None:
        with self._state_lock:
            if self._fault and time.monotonic() < self._probe_at:
                wait = self._probe_at - time.monotonic()
                raise TierFault(f"nvme tier degraded: {self._fault}; next write attempt in {wait:.1f} s")

    def _degrade(self, e: OSError) -> TierFault:
        name = errno.errorcode.get(e.errno or 0, "EIO")
        reason = f"{name}: {e.strerror or e} ({e.filename or self.data_dir})"
        with self._state_lock:
            self._fault = reason
            self._probe_at = time.monotonic() + self.probe_interval_s
            self._counts["write_faults"] += 1
        log.error("nvme tier degraded: %s; writes fail fast for %.1f s", reason, self.probe_interval_s)
        return TierFault(f"nvme write failed, batch discarded: {reason}")

    def _healed(self) -> None:
        if self._fault:
            with self._state_lock:
                log.warning("nvme tier healthy again (was: %s)", self._fault)
                self._fault = ""

    # -- read -----------------------------------------------------------------------
    streams_reads = True  # read() takes on_ready: blocks are handed on piece by piece, as they are verified

    def read(
        self,
        locs: Sequence[int],
        lengths: Sequence[int],
        dests: Sequence[Any],
        on_ready: Callable[[list[int]], None] | None = None,
        crcs: Sequence[int | None] | None = None,
        on_caller: bool = False,
        run_reader: RunReader | None = None,
    ) -> None:
        """Fill ``dests[i]`` with the verified payload at ``locs[i]``; ``on_ready(indices)`` (optional) is called
        from a reading thread, or with ``on_caller`` from this one (``pipeline.read_pipelined``), as each piece's
        records pass their checks (failed ones left out). ``crcs[i]`` (optional) is the payload CRC32C the caller's index holds:
        a record whose own differs fails too, so a verified payload's CRC32C is known to the caller without
        computing it again. ``run_reader`` (optional) reads and checks the compiled runs (``runs.RunPiece``) on this
        thread instead of the tier's readers, as a lane that sends each piece as it lands does
        (``kvstore.send_runs``): it returns the (verified, failed) targets, or None to leave them to the tier;
        ``on_ready`` then names the verified ones at once, and the failed ones are read again record by record."""
        if not (len(locs) == len(lengths) == len(dests)):
            raise ValueError("locs, lengths and dests must have the same length")
        if self.backend.name.startswith("kvikio") and any(is_device_dest(d) for d in dests):
            read_split(self, locs, lengths, dests)  # GPUDirect Storage into the CUDA dests (gds.py)
            if on_ready is not None:
                on_ready(list(range(len(locs))))
            return
        began = time.perf_counter()
        resolved, pinned = self._log.pin(locs)
        bad: dict[int, str] = {}
        try:
            todo: Iterable[int] = range(len(locs))
            run_pieces = runs.plan(resolved, lengths, crcs, dests, self.backend, self.read_threads, self.max_read_bytes)
            handled = run_reader(run_pieces) if run_reader is not None and run_pieces is not None else None
            if handled is not None:
                verified, failed_runs = handled
                if on_ready is not None and verified:
                    on_ready(verified)
                todo = sorted(failed_runs)
                self._counts["run_read_ios"] += len(run_pieces)  # type: ignore[arg-type]
            elif run_pieces is not None:  # one compiled call a piece; what fails is read again below, record by record
                retry = read_pipelined(
                    self.backend, self._pool, self._buffers, run_pieces, dests, self.read_threads, on_ready, on_caller,
                    runs.read_piece, runs.verified,
                )  # fmt: skip
                todo = sorted({i for i, _ in retry})
                self._counts["run_read_ios"] += len(run_pieces)
            groups: dict[int, tuple[Any, dict[tuple[int, int], Wanted]]] = {}
            for i in todo:
                (loc, seg), length = resolved[i], lengths[i]
                if seg is None:
                    bad[locs[i]] = "no such location (never written, or compacted away)"
                    continue
                off = loc & OFFSET_MASK
                group = groups.get(seg.id)
                if group is None:
                    group = groups[seg.id] = (seg, {})
                wanted = group[1]
                w = wanted.get((off, length))
                if w is None:  # record_bytes(length), inlined
                    crc = None if crcs is None else crcs[i]
                    wanted[(off, length)] = Wanted(off, HEADER_BYTES + -(-length // PAGE) * PAGE, length, [i], crc)
                else:
                    w.targets.append(i)
            pieces = [
                p
                for seg, wanted in groups.values()
                for p in plan_pieces(
                    seg, list(wanted.values()), self.max_read_bytes, self.coalesce_gap_bytes, self.read_threads
                )
            ]
            failures = read_pipelined(
                self.backend, self._pool, self._buffers, pieces, dests, self.read_threads, on_ready, on_caller
            )
        finally:
            self._log.unpin(pinned)
        for i, reason in failures:
            bad[locs[i]] = reason
        self._counts["reads"] += 1
        self._counts["blocks_read"] += len(locs)
        self._counts["read_ios"] += len(pieces) + (len(run_pieces) if run_pieces is not None else 0)
        self._read_bytes += sum(lengths)
        self._read_seconds += time.perf_counter() - began
        if bad:
            self._counts["corrupt"] += len(bad)
            first = next(iter(bad.items()))
            raise CorruptBlock(
                f"{len(bad)} of {len(locs)} nvme records failed verification (first: loc {first[0]:#x}: {first[1]})",
                list(bad),
            )

    def extents(self, locs: Sequence[int]) -> tuple[list[tuple[str, int] | None], ExtentPins]:
        """Where each record's payload lies in its segment file, for a reader outside this process: (file name in
        ``data_dir``, byte offset of the payload; page aligned), None where the location is gone. The segments
        are pinned (never retired, so their bytes are not rewritten) until ``release_extents`` of the second
        item. The reader must check the payload's CRC32C itself: nothing here read it."""
        resolved, pinned = self._log.pin(locs)
        out: list[tuple[str, int] | None] = [
            None if seg is None else (seg.path.name, (loc & OFFSET_MASK) + HEADER_BYTES) for loc, seg in resolved
        ]
        self._counts["extents_lent"] += sum(x is not None for x in out)
        return out, ExtentPins(pinned)

    @staticmethod
    def payload_places(locs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(segment ids, payload offsets in their files) of records, as ``extents`` names them, without pins:
        for a table that names them while they live (the DRAM index's disk entries)."""
        locs = np.asarray(locs, dtype=np.int64)
        return locs >> OFFSET_BITS, (locs & OFFSET_MASK) + HEADER_BYTES

    def release_extents(self, pins: ExtentPins) -> None:
        segments, pins.segments = pins.segments, []
        if segments:
            self._log.unpin(segments)

    # -- free, compaction ---------------------------------------------------------------
    def free(self, locs: Sequence[int]) -> None:
        self._log.kill(locs)

    def compact(
        self, max_segments: int | None = None, threshold: float | None = None, *, wait: bool = True
    ) -> CompactionReport:
        """Compact up to ``max_segments`` (default: all eligible) segments below ``threshold``."""
        if not self._compact_lock.acquire(blocking=wait):
            return CompactionReport(stopped="another compaction is running")
        try:
            return self._compact(max_segments, threshold)
        finally:
            self._compact_lock.release()

    def _compact(self, max_segments: int | None, threshold: float | None) -> CompactionReport:
        if self._fault:  # no copying while writes fail; deleting empty segments still frees space
            return CompactionReport(segments_dropped=self._log.drop_empty(), stopped=f"tier degraded: {self._fault}")
        try:
            report = compact_log(
                self._log,
                self.backend,
                self._buffers,
                self.on_relocate,
                threshold=self.compact_threshold if threshold is None else threshold,
                max_segments=max_segments or self._log.max_segments,
                pressure=self._pressure,
                max_read_bytes=self.max_read_bytes,
                forward_ttl_s=self.forward_ttl_s,
            )
        except OSError as e:
            raise self._degrade(e) from e
        if report.bytes_freed:
            self._pressure = False
        self._counts["compactions"] += 1
        self._counts["relocated"] += report.records_moved
        if report.segments_compacted or report.segments_dropped:
            self._log.checkpoint()
        return report

    def reclaimable(self) -> ReclaimInfo:
        lg = self._log
        with lg.lock:
            sealed = [s for s in lg.segments.values() if s.state is SegmentState.SEALED]
            below = [s for s in sealed if s.live_fraction < self.compact_threshold]
            return ReclaimInfo(
                capacity_bytes=self._capacity,
                disk_bytes=lg.disk_bytes,
                live_bytes=lg.live_bytes,
                dead_bytes=sum(s.size - s.live_bytes for s in sealed),
                free_segments=max(0, lg.max_segments - lg.reserve_segments - len(lg.segments)),
                empty_segments=sum(1 for s in sealed if s.records.live_count == 0),
                compactable_segments=len(below),
                compactable_gain_bytes=sum(s.size - s.live_bytes for s in below),
            )

    # -- recovery, lifecycle ----------------------------------------------------------
    def recover(self) -> Iterator[tuple[BlockMeta, int]]:
        rec, self._log.recovered = self._log.recovered, None
        if rec is not None:
            yield from rec.winners

    def recover_columns(self) -> RecordColumns | None:
        """``recover`` as numpy columns (``offsets`` holds each block's location): for millions of blocks."""
        rec, self._log.recovered = self._log.recovered, None
        return None if rec is None or rec.columns is None else rec.columns.records

    def checkpoint(self) -> None:
        """Persist the free list now (it is also written on close and after compaction)."""
        self._log.checkpoint()

    def stats(self) -> TierStats:
        info = self.reclaimable()
        with self._log.lock:
            segs = list(self._log.segments.values())
        buffered = sum(1 for s in segs if not s.fh.direct)
        backend = self.backend.name + (f" ({buffered} files buffered: O_DIRECT refused)" if buffered else "")
        extra: dict[str, float] = {
            "disk_bytes": info.disk_bytes,
            "dead_bytes": info.dead_bytes,
            "segments": len(segs),
            "records": sum(s.records.live_count for s in segs),
            "bytes_appended": self._log.bytes_appended,
            "fdatasyncs": self._log.syncs,
            "recovery_seconds": self.recovery_seconds,
            "index_bytes": sum(s.records.nbytes() for s in segs),
            "read_bytes": self._read_bytes,
            "read_seconds": self._read_seconds,
            **self._counts,
        }
        return TierStats(
            self.name,
            self._capacity,
            self.used_bytes,
            backend=backend,
            degraded=self.degraded,
            fault=self._fault,
            extra=extra,
        )

    def close(self) -> None:
        with self._compact_lock:
            if self._closed:
                return
            self._closed = True
            self._pool.shutdown(wait=True)
            self._log.close()
