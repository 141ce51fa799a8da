"""Fault-injection and counting seam: an IoBackend wrapper for tests and benchmarks.

``InstrumentedBackend(inner)`` forwards every verb to ``inner`` and counts
calls and bytes (``preads`` (one per pread or preadv call), ``pwrites`` (one per pwrite or pwritev call),
``syncs``, ``creates``, ``bytes_read``, ``bytes_written``). Faults are armed
explicitly:

- ``fail_writes_after(nbytes, err=ENOSPC)``: writes succeed until ``nbytes``
  more bytes have been written, then raise ``OSError(err)`` (a write that
  would cross the limit writes nothing). ``create`` fails the same way while
  armed and exhausted, as a full filesystem would.
- ``fail_reads(err=EIO)``: every pread and preadv raises.
- ``heal()``: disarm everything.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from typing import Any

from kvstore.tiers.nvme.io import FileHandle, IoBackend


class InstrumentedBackend(IoBackend):
    def __init__(self, inner: IoBackend):
        self.inner = inner
        self.name = inner.name
        self._lock = threading.Lock()
        self.preads = self.pwrites = self.syncs = self.creates = 0
        self.bytes_read = self.bytes_written = 0
        self._write_budget: int | None = None
        self._write_errno = errno.ENOSPC
        self._read_errno: int | None = None

    # -- arming -----------------------------------------------------------------
    def fail_writes_after(self, nbytes: int, err: int = errno.ENOSPC) -> None:
        with self._lock:
            self._write_budget, self._write_errno = nbytes, err

    def fail_reads(self, err: int = errno.EIO) -> None:
        self._read_errno = err

    def heal(self) -> None:
        with self._lock:
            self._write_budget, self._read_errno = None, None

    def reset_counts(self) -> None:
        with self._lock:
            self.preads = self.pwrites = self.syncs = self.creates = 0
            self.bytes_read = self.bytes_written = 0

    def _raise(self, err: int, path: str) -> None:
        raise OSError(err, f"injected: {os.strerror(err)}", path)

    # -- verbs ------------------------------------------------------------------
    def create(self, path: str, size: int) -> FileHandle:
        with self._lock:
            if self._write_budget is not None and self._write_budget < size:
                self._raise(self._write_errno, path)
            self.creates += 1
        return self.inner.create(path, size)

    def open(self, path: str) -> FileHandle:
        return self.inner.open(path)

    def pwrite(self, fh: FileHandle, buf: Any, offset: int) -> None:
        self._account_write(fh, memoryview(buf).nbytes)
        self.inner.pwrite(fh, buf, offset)

    def _account_write(self, fh: FileHandle, n: int) -> None:
        with self._lock:
            if self._write_budget is not None:
                if n > self._write_budget:
                    self._write_budget = 0
                    self._raise(self._write_errno, fh.path)
                self._write_budget -= n
            self.pwrites += 1
            self.bytes_written += n

    def pwritev(self, fh: FileHandle, bufs: Sequence[Any], offset: int) -> None:
        self._account_write(fh, sum(memoryview(b).nbytes for b in bufs))
        self.inner.pwritev(fh, bufs, offset)

    def pread(self, fh: FileHandle, buf: Any, offset: int) -> int:
        if self._read_errno is not None:
            self._raise(self._read_errno, fh.path)
        n = self.inner.pread(fh, buf, offset)
        with self._lock:
            self.preads += 1
            self.bytes_read += n
        return n

    def preadv(self, fh: FileHandle, bufs: Sequence[Any], offset: int) -> int:
        if self._read_errno is not None:
            self._raise(self._read_errno, fh.path)
        n = self.inner.preadv(fh, bufs, offset)
        with self._lock:
            self.preads += 1
            self.bytes_read += n
        return n

    def sync(self, fh: FileHandle) -> None:
        with self._lock:
            self.syncs += 1
        self.inner.sync(fh)

    def close(self, fh: FileHandle) -> None:
        self.inner.close(fh)
