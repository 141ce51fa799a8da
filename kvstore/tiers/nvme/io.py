"""I/O backends of the NVMe tier: one small interface, two implementations.

Verbs (all offsets and lengths 4 KiB aligned, buffers page aligned):

- ``create(path, size) -> FileHandle``: a new file, preallocated to ``size``
  (fallocate, so later writes inside it never grow the file).
- ``open(path) -> FileHandle``: an existing file.
- ``pwrite(fh, buf, offset)`` / ``pread(fh, buf, offset) -> n``: whole-buffer
  transfers (short transfers are retried; ``pread`` returns less only at EOF).
- ``sync(fh)``: fdatasync.
- ``close(fh)``.

``PosixBackend`` (the default): os.pread/os.pwrite with O_DIRECT (both release
the GIL, so a small thread pool overlaps them). Where a filesystem refuses
O_DIRECT it falls back to buffered I/O for that file, logs it once, and
``FileHandle.direct`` says so (the tier then always fdatasyncs before acking).

``KvikioBackend``: kvikio ``CuFile`` (GPUDirect Storage, or kvikio's POSIX
compatibility mode, which its name reports), chosen only when kvikio imports
and a CUDA device exists. It accepts host or device buffers.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.hugepages import huge_buffer

log = logging.getLogger("kvstore.nvme")


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A zeroed, page-aligned uint8 buffer (anonymous mmap), usable for O_DIRECT; in huge pages where the kernel
    grants them (``kvstore/hugepages.py``: an O_DIRECT read into 4 KiB pages ran at 0.4x the speed here)."""
    return huge_buffer(nbytes)


@dataclass(eq=False)
class FileHandle:
    path: str
    fd: int
    direct: bool
    native: Any = None  # backend-specific object (kvikio CuFile)
    retired_fds: list[int] = field(default_factory=list)  # O_DIRECT fds replaced by buffered ones


class IoBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def create(self, path: str, size: int) -> FileHandle: ...

    @abstractmethod
    def open(self, path: str) -> FileHandle: ...

    @abstractmethod
    def pwrite(self, fh: FileHandle, buf: Any, offset: int) -> None: ...

    @abstractmethod
    def pread(self, fh: FileHandle, buf: Any, offset: int) -> int: ...

    def pwritev(self, fh: FileHandle, bufs: Sequence[Any], offset: int) -> None:
        """Write the buffers back to back from ``offset`` (one syscall where the backend can)."""
        for buf in bufs:
            self.pwrite(fh, buf, offset)
            offset += _nbytes(buf)

    def preadv(self, fh: FileHandle, bufs: Sequence[Any], offset: int) -> int:
        """Read into the buffers back to back from ``offset`` (one syscall where the backend can);
        returns the bytes read, less than their total only at end of file."""
        done = 0
        for buf in bufs:
            want = _nbytes(buf)
            n = self.pread(fh, buf, offset + done)
            done += n
            if n < want:
                break
        return done

    def sync(self, fh: FileHandle) -> None:
        os.fdatasync(fh.fd)

    def close(self, fh: FileHandle) -> None:
        os.close(fh.fd)


def array_address(a: np.ndarray) -> int:
    """Where an array's bytes start (the ctypes route is ~3x cheaper than ``a.ctypes.data`` when writable)."""
    if a.flags.writeable and a.flags.c_contiguous:
        # numpy types ndarray as a Buffer only from Python 3.12 (PEP 688); at run time it is one, and ``a.data``
        # here would cost a second memoryview (~50% more per call, on the per-record read path)
        return ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]
    return int(a.ctypes.data)


def _rest(views: list[memoryview], skip: int) -> list[memoryview]:
    """The buffers past the first ``skip`` bytes (after a short transfer)."""
    out = []
    for v in views:
        if skip >= len(v):
            skip -= len(v)
            continue
        out.append(v[skip:] if skip else v)
        skip = 0
    return out


def _open_fd(path: str, flags: int, direct: bool) -> tuple[int, bool]:
    # 0600: a segment holds every tenant's blocks; only the store's user (and --share-nvme clients of it) reads them
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.warning("O_DIRECT refused on %s (%s): buffered I/O + fdatasync for this file", path, e)
    return os.open(path, flags, 0o600), False


def preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes (ENOSPC surfaces here, not in a later write)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


class PosixBackend(IoBackend):
    """pread/pwrite with O_DIRECT from aligned buffers (buffered where refused)."""

    def __init__(self, direct: bool = True):
        self.direct = direct
        self.name = "posix-odirect" if direct else "posix-buffered"

    def create(self, path: str, size: int) -> FileHandle:
        fd, direct = _open_fd(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, self.direct)
        try:
            preallocate(fd, size)
            os.fsync(fd)  # the size and extents are durable before any record is acked in them
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return FileHandle(path, fd, direct)

    def open(self, path: str) -> FileHandle:
        fd, direct = _open_fd(path, os.O_RDWR, self.direct)
        return FileHandle(path, fd, direct)

    def pwrite(self, fh: FileHandle, buf: Any, offset: int) -> None:
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            try:
                n = os.pwrite(fh.fd, view[done:], offset + done)
            except OSError as e:
                if not self._demoted(fh, e):
                    raise
                continue
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite returned {n}", fh.path)
            done += n

    def pwritev(self, fh: FileHandle, bufs: Sequence[Any], offset: int) -> None:
        views = [memoryview(b).cast("B") for b in bufs]
        total = sum(len(v) for v in views)
        try:
            n = os.pwritev(fh.fd, views, offset)
        except OSError as e:
            if not self._demoted(fh, e):
                raise
            n = 0
        if n < total:  # short or refused: finish buffer by buffer
            pos = 0
            for v in views:
                if pos + len(v) > n:
                    skip = max(0, n - pos)
                    self.pwrite(fh, v[skip:], offset + pos + skip)
                pos += len(v)

    def pread(self, fh: FileHandle, buf: Any, offset: int) -> int:
        return self.preadv(fh, [buf], offset)

    def preadv(self, fh: FileHandle, bufs: Sequence[Any], offset: int) -> int:
        total = sum(map(_nbytes, bufs))
        done = 0
        while done < total:
            try:  # the buffers as given first (no per-buffer views on the common, whole read)
                n = os.preadv(
                    fh.fd, _rest([memoryview(b).cast("B") for b in bufs], done) if done else bufs, offset + done
                )
            except OSError as e:
                if not self._demoted(fh, e):
                    raise
                continue
            if n == 0:
                break
            done += n
        return done

    @staticmethod
    def _demoted(fh: FileHandle, e: OSError) -> bool:
        """Some filesystems accept O_DIRECT at open and refuse it per I/O: reopen buffered."""
        if e.errno != errno.EINVAL or not fh.direct:
            return False
        log.warning("O_DIRECT I/O refused on %s (%s): buffered I/O + fdatasync for this file", fh.path, e)
        old, fh.fd, fh.direct = fh.fd, os.open(fh.path, os.O_RDWR), False
        fh.retired_fds.append(old)
        return True

    def close(self, fh: FileHandle) -> None:
        for fd in fh.retired_fds:
            os.close(fd)
        os.close(fh.fd)


def cuda_device_present() -> bool:
    """Whether a CUDA device is usable (checked through torch or cupy, whichever imports)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        pass
    try:
        import cupy

        count: int = cupy.cuda.runtime.getDeviceCount()
        return count > 0
    except Exception:  # noqa: BLE001 - no cupy, no driver: no device
        return False


class KvikioBackend(IoBackend):
    """kvikio CuFile: GPUDirect Storage into host or device buffers (or kvikio's compat mode)."""

    def __init__(self) -> None:
        import kvikio
        import kvikio.defaults

        self._kvikio = kvikio
        self.name = "kvikio-compat" if self._compat_requested() is True else "kvikio-gds"

    def _compat_requested(self) -> bool | None:
        """True (POSIX), False (cuFile) or None (AUTO: decided per file), across kvikio versions."""
        defaults = self._kvikio.defaults
        mode = defaults.get("compat_mode") if hasattr(defaults, "get") else defaults.compat_mode()
        if isinstance(mode, bool):
            return mode
        text = str(mode).upper()
        return True if text.endswith("ON") else False if text.endswith("OFF") else None

    def _wrap(self, path: str, fd: int) -> FileHandle:
        f = self._kvikio.CuFile(path, "r+")
        preferred = getattr(f, "is_compat_mode_preferred", None)
        if callable(preferred):
            name = "kvikio-compat" if preferred() else "kvikio-gds"
            if name != self.name:
                log.info("kvikio backend: %s (was %s)", name, self.name)
                self.name = name
        return FileHandle(path, fd, True, f)

    def create(self, path: str, size: int) -> FileHandle:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            preallocate(fd, size)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return self._wrap(path, fd)

    def open(self, path: str) -> FileHandle:
        return self._wrap(path, os.open(path, os.O_RDWR))

    def pwrite(self, fh: FileHandle, buf: Any, offset: int) -> None:
        n = fh.native.pwrite(buf, file_offset=offset).get()
        if n != _nbytes(buf):
            raise OSError(errno.EIO, f"kvikio pwrite wrote {n} of {_nbytes(buf)} bytes", fh.path)

    def pread(self, fh: FileHandle, buf: Any, offset: int) -> int:
        return int(fh.native.pread(buf, file_offset=offset).get())

    def close(self, fh: FileHandle) -> None:
        fh.native.close()
        os.close(fh.fd)


def _nbytes(buf: Any) -> int:
    return int(getattr(buf, "nbytes", None) or memoryview(buf).nbytes)


def select_backend(kind: str = "auto") -> IoBackend:
    """``auto``: kvikio when it imports and a CUDA device exists, else POSIX O_DIRECT."""
    if kind in ("auto", "kvikio"):
        try:
            import kvikio  # noqa: F401 - probe first: cheaper than looking for a device

            if cuda_device_present():
                return KvikioBackend()
            reason = "no CUDA device"
        except ImportError as e:
            reason = f"kvikio not importable ({e})"
        if kind == "kvikio":
            raise RuntimeError(f"kvikio backend requested but unavailable: {reason}")
        log.info("nvme backend: POSIX O_DIRECT (kvikio skipped: %s)", reason)
        return PosixBackend()
    if kind == "posix":
        return PosixBackend()
    if kind == "posix-buffered":
        return PosixBackend(direct=False)
    raise ValueError(f"unknown nvme I/O backend {kind!r} (auto, posix, posix-buffered, kvikio)")
