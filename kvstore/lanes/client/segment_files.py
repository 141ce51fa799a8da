"""The store's NVMe segment files as a ``--share-nvme`` client holds them open, and the ``preadv`` it reads them with.

``SegmentFiles(directory)``: ``fd(name)`` opens a segment file on first use (``O_RDONLY | O_DIRECT``, buffered where
the file system refuses O_DIRECT, as tmpfs does) and keeps it open, at most ``MAX_OPEN_FILES`` at once (the oldest
closed first: segment ids only grow). ``sweep_if_due()`` closes, at most every ``SWEEP_SECONDS``, the files the
store has deleted since (segments retired by compaction), so an open descriptor does not keep their disk space from
the store; the reader calls it between reads, where no thread uses a descriptor. ``unusable`` says why this process
cannot open the store's files at all (the directory is not there, as in a container that does not mount it, or not
readable), or is "". ``table``: the open descriptors for compiled code, an int64 row (segment id, fd) per file at
``segment & (FILE_SLOTS - 1)`` ((-1, -1) where none; two open files of one row keep the later there), cleared
before a descriptor is closed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import threading
import time

import numpy as np

MAX_OPEN_FILES = 64
SEGMENT_NAME = re.compile(r"seg-[0-9]+\.log")
SWEEP_SECONDS = 1.0  # how often open files are checked for having been deleted
FILE_SLOTS = 256  # rows of ``table``: more than MAX_OPEN_FILES, a power of two


class SegmentFiles:
    def __init__(self, directory: str):
        self.directory = directory
        self.unusable = ""  # why this process cannot open the store's files (another mount namespace, say)
        self._files: dict[str, int] = {}
        self._lock = threading.Lock()
        self.table = np.full((FILE_SLOTS, 2), -1, dtype=np.int64)
        self._swept = time.monotonic()

    def fd(self, name: str) -> int:
        """The open descriptor of segment file ``name``; ValueError for a name that is not a segment file's (no
        path of the store's choosing leaves its directory), OSError when it cannot be opened."""
        if not SEGMENT_NAME.fullmatch(name):
            raise ValueError(f"not a segment file name: {name!r}")
        with self._lock:
            fd = self._files.get(name)
            if fd is not None:
                self._list(name, fd)
                return fd
        path = os.path.join(self.directory, name)
        try:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                fd = os.open(path, os.O_RDONLY)  # a file system without O_DIRECT (tmpfs): buffered reads
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EPERM) or not os.path.isdir(self.directory):
                self.unusable = f"cannot read the store's NVMe files in {self.directory}: {err.strerror}"
            raise
        with self._lock:
            if name in self._files:
                os.close(fd)
                return self._files[name]
            if len(self._files) >= MAX_OPEN_FILES:
                oldest = next(iter(self._files))
                self._close(oldest, self._files.pop(oldest))
            self._files[name] = fd
            self._list(name, fd)
        return fd

    def opened(self) -> dict[str, int]:
        """The files open now, by name."""
        with self._lock:
            return dict(self._files)

    def sweep_if_due(self) -> None:
        """Close the files the store has deleted since they were opened, once ``SWEEP_SECONDS`` have passed since
        the last sweep. Only between reads: no thread may be reading a file this closes."""
        if time.monotonic() - self._swept < SWEEP_SECONDS:
            return
        self._swept = time.monotonic()
        with self._lock:
            for name, fd in list(self._files.items()):
                try:
                    gone = os.fstat(fd).st_nlink == 0
                except OSError:
                    gone = True
                if gone:
                    del self._files[name]
                    self._close(name, fd)

    def close(self) -> None:
        with self._lock:
            files, self._files = self._files, {}
            self.table[:] = -1
        for fd in files.values():
            os.close(fd)

    def _list(self, name: str, fd: int) -> None:
        """(lock held) In ``table``, in place of another file of its row."""
        row = self.table[_segment(name) & (FILE_SLOTS - 1)]
        if row[1] != fd:
            row[:] = (_segment(name), fd)

    def _close(self, name: str, fd: int) -> None:
        """(lock held) Out of ``table`` first: compiled code never reads a closed number, nor one reused."""
        row = self.table[_segment(name) & (FILE_SLOTS - 1)]
        if row[1] == fd:
            row[:] = -1
        os.close(fd)


def _segment(name: str) -> int:
    return int(name[4:-4])  # a SEGMENT_NAME: seg-<id>.log


_libc = ctypes.CDLL(None, use_errno=True)
_libc.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
_libc.preadv.restype = ctypes.c_ssize_t


def preadv(fd: int, vectors: np.ndarray, offset: int) -> int:
    """``os.preadv`` of (address, length) rows (int64, C order: ``struct iovec``), without a memoryview per part
    (it lets go of the GIL too)."""
    vectors = np.ascontiguousarray(vectors, dtype=np.int64)
    got = _libc.preadv(fd, vectors.ctypes.data, len(vectors), offset)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(got)
