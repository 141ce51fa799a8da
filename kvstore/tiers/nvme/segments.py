"""Segments: the files of the log and the per-record accounting of each.

A segment is a preallocated file ``seg-<id>.log`` (ids only grow, so a location
is never reused). Its life: ACTIVE (records are appended at ``end``) ->
SEALED (no more appends; its summary ``seg-<id>.sum`` lists every record) ->
RETIRING (compaction moved its live records; deleted once no read of it is in
flight) -> gone.

``RecordTable`` keeps what the tier must know per record in flat numpy arrays
(9 bytes a record, no Python object per block): offset and length in pages and
a live flag; ``live_bytes`` is kept up to date for the compaction policy.
"""

from __future__ import annotations

import enum
import fcntl
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore.arena_index_layout import SEGMENT_FILE
from kvstore.tiers.nvme.format import PAGE, Header
from kvstore.tiers.nvme.io import FileHandle

_SEG_RE = re.compile(r"^seg-(\d{10})\.log$")


def segment_path(data_dir: Path, seg_id: int) -> Path:
    return data_dir / SEGMENT_FILE.format(seg_id)  # the DRAM index names segments by id, the same way


def summary_path(data_dir: Path, seg_id: int) -> Path:
    return data_dir / f"seg-{seg_id:010d}.sum"


def list_segment_ids(data_dir: Path) -> list[int]:
    ids = [int(m.group(1)) for name in os.listdir(data_dir) if (m := _SEG_RE.match(name))]
    return sorted(ids)


def lock_dir(data_dir: Path) -> int:
    """Take the directory's exclusive lock (released when the fd closes or the process dies)."""
    fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"{data_dir} is in use by another NVMe tier (its LOCK is held)") from None
    return fd


def fsync_dir(data_dir: Path) -> None:
    fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentState(enum.Enum):
    ACTIVE = "active"
    SEALED = "sealed"
    RETIRING = "retiring"


class RecordTable:
    """Append-only table of (offset, length, live) for one segment's records, offsets ascending."""

    def __init__(self, capacity: int = 64):
        self._off = np.zeros(capacity, dtype=np.uint32)  # in pages
        self._len = np.zeros(capacity, dtype=np.uint32)  # in pages
        self._live = np.zeros(capacity, dtype=np.bool_)
        self.count = 0
        self.live_count = 0
        self.live_bytes = 0

    @classmethod
    def bulk(cls, offsets: list[int] | np.ndarray, nbytes: list[int] | np.ndarray) -> RecordTable:
        """A table of live records, built at once (offsets ascending)."""
        t = cls(capacity=max(len(offsets), 64))
        n = len(offsets)
        t._off[:n] = np.asarray(offsets, dtype=np.int64) // PAGE
        t._len[:n] = np.asarray(nbytes, dtype=np.int64) // PAGE
        t._live[:n] = True
        if n > 1 and np.any(np.diff(t._off[:n].astype(np.int64)) <= 0):
            raise ValueError("records must be in ascending offset order")
        t.count = t.live_count = n
        t.live_bytes = int(t._len[:n].sum(dtype=np.int64)) * PAGE
        return t

    def kill_pages(self, pages: np.ndarray) -> None:
        """Mark dead every record starting at one of these page numbers (unknown ones ignored)."""
        off = self._off[: self.count]
        pages = np.asarray(pages, dtype=np.uint32)
        idx = np.searchsorted(off, pages)
        ok = idx < self.count
        idx, pages = idx[ok], pages[ok]
        for i in np.unique(idx[off[idx] == pages]).tolist():
            self.kill_index(i)

    def kill_index(self, i: int) -> int:
        if not self._live[i]:
            return 0
        self._live[i] = False
        nbytes = int(self._len[i]) * PAGE
        self.live_count -= 1
        self.live_bytes -= nbytes
        return nbytes

    def live_mask(self) -> list[bool]:
        live: list[bool] = self._live[: self.count].tolist()
        return live

    def live_flags(self) -> np.ndarray:
        """``live_mask`` as a numpy bool array (a copy)."""
        return self._live[: self.count].copy()

    def extend(self, offsets: list[int], nbytes: list[int]) -> None:
        """Append records at ascending offsets, all at once."""
        n = len(offsets)
        if not n:
            return
        if self.count and offsets[0] < int(self._off[self.count - 1]) * PAGE:
            raise ValueError("records must be appended in offset order")
        if self.count + n > len(self._off):
            grow = max(64, self.count, n)
            self._off = np.concatenate([self._off, np.zeros(grow, np.uint32)])
            self._len = np.concatenate([self._len, np.zeros(grow, np.uint32)])
            self._live = np.concatenate([self._live, np.zeros(grow, np.bool_)])
        i, j = self.count, self.count + n
        self._off[i:j] = np.asarray(offsets, dtype=np.int64) // PAGE
        self._len[i:j] = np.asarray(nbytes, dtype=np.int64) // PAGE
        self._live[i:j] = True
        self.count = j
        self.live_count += n
        self.live_bytes += sum(nbytes)

    def append(self, offset: int, nbytes: int) -> None:
        if self.count and offset < int(self._off[self.count - 1]) * PAGE:
            raise ValueError("records must be appended in offset order")
        if self.count == len(self._off):
            grow = max(64, self.count)
            self._off = np.concatenate([self._off, np.zeros(grow, np.uint32)])
            self._len = np.concatenate([self._len, np.zeros(grow, np.uint32)])
            self._live = np.concatenate([self._live, np.zeros(grow, np.bool_)])
        i = self.count
        self._off[i], self._len[i], self._live[i] = offset // PAGE, nbytes // PAGE, True
        self.count += 1
        self.live_count += 1
        self.live_bytes += nbytes

    def find(self, offset: int) -> int:
        """Index of the record starting at ``offset``, or -1."""
        page = offset // PAGE
        i = int(np.searchsorted(self._off[: self.count], page))
        return i if i < self.count and int(self._off[i]) == page and offset % PAGE == 0 else -1

    def is_live(self, offset: int) -> bool:
        i = self.find(offset)
        return i >= 0 and bool(self._live[i])

    def kill(self, offset: int) -> int:
        """Mark the record at ``offset`` dead; returns its bytes (0 if unknown or already dead)."""
        i = self.find(offset)
        return self.kill_index(i) if i >= 0 else 0

    def live(self) -> Iterator[tuple[int, int]]:
        """(offset, record bytes) of every live record, ascending."""
        idx = np.flatnonzero(self._live[: self.count])
        for off, n in zip(self._off[idx].tolist(), self._len[idx].tolist()):
            yield off * PAGE, n * PAGE

    def dead_offsets(self) -> np.ndarray:
        """Offsets (in pages) of dead records, for the checkpoint."""
        return self._off[: self.count][~self._live[: self.count]].copy()

    def nbytes(self) -> int:
        return self._off.nbytes + self._len.nbytes + self._live.nbytes


@dataclass(eq=False)
class Segment:
    id: int
    path: Path
    fh: FileHandle
    size: int  # bytes on disk (preallocated)
    end: int = 0  # append position: records occupy [0, end)
    state: SegmentState = SegmentState.ACTIVE
    records: RecordTable = field(default_factory=RecordTable)
    readers: int = 0  # reads in flight
    headers: list[tuple[int, Header]] | None = field(default_factory=list)  # (offset, header) for the summary

    @property
    def live_bytes(self) -> int:
        return self.records.live_bytes

    @property
    def live_fraction(self) -> float:
        return self.records.live_bytes / self.size if self.size else 0.0

    @property
    def free_bytes(self) -> int:
        return self.size - self.end if self.state is SegmentState.ACTIVE else 0
