"""Shared-memory regions of the shm lane: created by the server, mapped by both sides.

``ShmRegion.create(dir, size, reserved=None)`` (server): a file ``<dir>/kvstore-lane-<server
pid>-<32 hex digits>`` (``shmfile.name_of``) opened with O_CREAT|O_EXCL|O_NOFOLLOW and
mode 0600 (only this uid can open it; the name is unguessable), its pages
reserved with ``posix_fallocate`` (a full /dev/shm fails there with ENOSPC,
never later as SIGBUS), and mapped shared. With ``reserved`` only that much
is reserved at once, and ``reserve(end)`` reserves more, ``RESERVE_STEP`` at
a time, before anything past it is granted (a lane's region: the store's
``lanes/server/grants.py`` asks): False, with ``reserve_failure`` saying why,
when the directory is full. ``unlink()`` removes the name once
the client has mapped it (or the lane closes): from then on only the two
mappings keep the memory, and it is freed when both are gone, even if a
process is killed.

``attach(path, size)`` (client): opens the file without following links and
checks it is a regular file of this uid, mode 0600 and the announced size
before mapping it.

``sweep(dir)`` (server start): a server killed with SIGKILL before its client
mapped a region leaves the name behind; files of this uid whose server is gone
(``shmfile.maker_is_gone``: its pid no longer runs, or is this process's under another mark) are removed.
"""

from __future__ import annotations

import errno
import functools
import logging
import mmap
import os
import stat
import threading
from dataclasses import dataclass, field

import numpy as np

from kvstore import shmfile
from kvstore.hugepages import files_get_huge_pages

log = logging.getLogger(__name__)

RESERVE_STEP = 16 << 20  # what a region's reserve grows by (about 4 ms of posix_fallocate on tmpfs here)
PREFIX = shmfile.LANE_PREFIX
DRAM_PREFIX = shmfile.DRAM_PREFIX  # a store's shared DRAM arena (kvstore/tiers/arena.py), mapped read-only


class RegionError(OSError):
    """The region cannot be created or attached (the lane falls back to another kind)."""


@dataclass
class ShmRegion:
    path: str
    size: int
    mapping: mmap.mmap
    array: np.ndarray  # uint8 view of the whole region
    view: memoryview  # flat byte view of the whole region
    small_pages: bool = False  # in 4 KiB pages: the store reads NVMe blocks elsewhere first (O_DIRECT ran slow here)
    reserved: int = -1  # bytes from the start whose pages are reserved (-1: all of them)
    reserve_failure: str = ""  # why the last ``reserve`` failed
    _fd: int = -1  # the file, kept open to reserve more
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def create(cls, directory: str, size: int, reserved: int | None = None) -> ShmRegion:
        """A new region of ``size`` bytes, all of it reserved, or only ``reserved`` bytes of it (see the module
        docstring)."""
        want = size if reserved is None else min(reserved, size)
        try:
            if reserved is None:
                path, mapping = shmfile.create(directory, PREFIX, size)
                fd = -1
            else:
                path, mapping, fd = shmfile.create_growing(directory, PREFIX, size, want)
        except OSError as err:
            raise RegionError(err.errno, f"cannot reserve {want} bytes in {directory}: {err.strerror}") from None
        array = np.frombuffer(mapping, dtype=np.uint8)
        huge = files_get_huge_pages(directory)
        return cls(path, size, mapping, array, array.data, huge is False, -1 if fd < 0 else want, _fd=fd)

    def reserve(self, end: int) -> bool:
        """The pages of bytes ``[0, end)`` reserved (see the module docstring)."""
        if self.reserved < 0 or end <= self.reserved:
            return True
        with self._lock:
            if end <= self.reserved:
                return True
            if self._fd < 0:
                return False  # closed
            upto = min(self.size, -(-end // RESERVE_STEP) * RESERVE_STEP)
            try:
                os.posix_fallocate(self._fd, self.reserved, upto - self.reserved)
            except OSError as err:
                self.reserve_failure = f"the shm directory could not reserve more of it: {err.strerror}"
                log.warning("lane region %s: %s (%d of %d bytes reserved)", self.path, self.reserve_failure,
                            self.reserved, self.size)  # fmt: skip
                return False
            self.reserved, self.reserve_failure = upto, ""
            return True

    @functools.cached_property
    def address(self) -> int:
        """Where the mapping starts in this process (numpy takes 3 us to say: asked once a block)."""
        return int(self.array.ctypes.data)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unlink and drop this side's references; the pages go when the last mapping does."""
        self.unlink()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        self.detach()

    def detach(self) -> None:
        """Drop this side's mapping, leaving the name (a client's view of a store's shared DRAM arena)."""
        self.array = np.empty(0, np.uint8)
        try:
            self.view.release()
            self.mapping.close()
        except BufferError:  # a copy in flight still holds a view; the mapping goes with the last one
            pass


def short_of_memory(region: object) -> str:
    """ "; why" when ``region`` could not reserve more of itself (for a region-full error), else ""."""
    failure = region.reserve_failure if isinstance(region, ShmRegion) else ""
    return f"; {failure}" if failure else ""


def attach(path: str, size: int, *, readonly: bool = False) -> ShmRegion:
    """Map a region the server announced (``readonly``: a shared DRAM arena); RegionError when it is not ours
    or not as announced."""
    if not os.path.basename(path).startswith(DRAM_PREFIX if readonly else PREFIX):
        raise RegionError(errno.EINVAL, f"{path} is not a kvstore {'DRAM arena' if readonly else 'lane region'}")
    try:
        fd = os.open(path, (os.O_RDONLY if readonly else os.O_RDWR) | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise RegionError(err.errno, f"cannot open lane region {path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.geteuid()
            or stat.S_IMODE(st.st_mode) != 0o600
            or st.st_size != size
        ):
            raise RegionError(errno.EPERM, f"lane region {path} is not a {size}-byte file of this user with mode 0600")
        prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    array = np.frombuffer(mapping, dtype=np.uint8)
    return ShmRegion(path, size, mapping, array, array.data)


def sweep(directory: str, prefixes: tuple[str, ...] = (PREFIX, shmfile.DIRECT_PREFIX, DRAM_PREFIX)) -> int:
    """Remove region files (direct-put sockets, shared DRAM arenas) of this uid left by servers that are gone
    (``shmfile.maker_is_gone``); how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.geteuid() or not shmfile.maker_is_gone(name, prefix):
                continue
            os.unlink(path)
            removed += 1
        except OSError:
            continue  # gone already
    return removed
