"""Shared-memory regions of the shm lane: created by the server, mapped by both sides.

``ShmRegion.create(dir, size)`` (server): a file ``<dir>/kvstore-lane-<server
pid>-<32 hex digits from secrets.token_hex>`` opened with O_CREAT|O_EXCL|O_NOFOLLOW and
mode 0600 (only this uid can open it; the name is unguessable), its pages
reserved with ``posix_fallocate`` (a full /dev/shm fails here with ENOSPC,
never later as SIGBUS), and mapped shared. ``unlink()`` removes the name once
the client has mapped it (or the lane closes): from then on only the two
mappings keep the memory, and it is freed when both are gone, even if a
process is killed.

``attach(path, size)`` (client): opens the file without following links and
checks it is a regular file of this uid, mode 0600 and the announced size
before mapping it.

``sweep(dir)`` (server start): a server killed with SIGKILL before its client
mapped a region leaves the name behind; files of this uid whose server pid no
longer runs are removed.
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import stat
from dataclasses import dataclass

import numpy as np

from kvstore import shmfile
from kvstore.hugepages import files_get_huge_pages

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

    @classmethod
    def create(cls, directory: str, size: int) -> ShmRegion:
        try:
            path, mapping = shmfile.create(directory, PREFIX, size)
        except OSError as err:
            raise RegionError(err.errno, f"cannot reserve {size} bytes in {directory}: {err.strerror}") from None
        array = np.frombuffer(mapping, dtype=np.uint8)
        return cls(path, size, mapping, array, array.data, files_get_huge_pages(directory) is False)

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
        self.detach()

    def detach(self) -> None:
        """Drop this side's mapping, leaving the name (a client's view of a store's shared DRAM arena)."""
        self.array = np.empty(0, np.uint8)
        try:
            self.view.release()
            self.mapping.close()
        except BufferError:  # a copy in flight still holds a view; the mapping goes with the last one
            pass


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


def sweep(directory: str, prefixes: tuple[str, ...] = (PREFIX, "kvstore-direct-", DRAM_PREFIX)) -> int:
    """Remove region files (direct-put sockets, shared DRAM arenas) of this uid left by servers that are gone;
    how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        pid_text = name[len(prefix) :].partition("-")[0] if prefix else ""
        if not pid_text.isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.geteuid():
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
        except OSError:
            continue  # not ours to judge (no permission), or the file is gone already
    return removed
