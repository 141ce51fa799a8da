"""``SharedPool``: host memory a local store can read NVMe blocks straight into (no copy on either side).

A direct Get (the shm lane after its handshake) has the store write each block into the caller's buffers with
``process_vm_writev``: the one CPU copy of a Get, 16 MiB a 32 x 512 KiB prefix, a third of the store's CPU per
NVMe Get on the 2-core VM. Memory the store maps itself can take its O_DIRECT reads instead. A ``SharedPool`` is
such memory: a memfd, sealed so it can never shrink (the store's mapping of a shrunk file would fault it), mapped
shared here and faulted in at once. ``NodeClient.shared_pool(nbytes)`` makes one and offers it to each shm lane
the client opens (a POOL frame on the lane's channel, ``kvstore/lanes/server/pools.py``); a Get whose ``out``
buffers lie in it then has its NVMe blocks

- read straight into them when the pool is in huge pages (each checked there, CRC32C, before the reply names it;
  one that fails is zeroed);
- else read into the store's staging (huge pages) and copied into them by the store with memcpy: O_DIRECT reads
  into 4 KiB pages ran 0.8x as fast as that here (docs/nvme.md, "Gets into a shared pool").

Huge pages come from hugetlbfs when enough are free (``HugePages_Free``: pages an administrator reserved with
``vm.nr_hugepages``), else from transparent huge pages where ``shmem_enabled`` allows them for this memory
(``advise``, ``always``, ``within_size``; this VM's default ``never`` gives 4 KiB pages). ``huge_pages`` says
which it got. Without a shm lane and its handshake (the TCP lane, a store on another host) the pool is plain
memory: Gets into it work as into any buffer.

``huge_pages_likely(nbytes)``: whether a pool made now would get huge pages (for a caller that wants no pool in
4 KiB pages). ``mapping_of(pid, address, length, st)`` (the store's check of a POOL frame, and ``huge_pages``):
whether a process maps a given file over a range, shared and writable, and in huge pages.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Any

import numpy as np

from kvstore.hugepages import HUGE_PAGE, SHMEM_ENABLED, advise_mapping, read_setting
from kvstore.prefault import populate

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SharedPool:
    """``nbytes`` (rounded up to whole pages) of shared host memory: ``array``, a flat uint8 numpy view to slice
    into Get buffers (page-aligned slices are read into with O_DIRECT; others through the store's scratch)."""

    def __init__(self, nbytes: int, name: str = "kvstore-pool", hugetlb: bool | None = None):
        """``hugetlb``: True insists on hugetlbfs pages, False never asks for them, None (default) takes them
        when enough are free."""
        if nbytes <= 0:
            raise ValueError(f"a shared pool needs a positive size, got {nbytes}")
        if hugetlb is None:
            hugetlb = _hugetlb_free_for(nbytes)
        page = HUGE_PAGE if hugetlb else mmap.PAGESIZE
        self.nbytes = nbytes = -(-nbytes // page) * page  # whole pages: what the store maps
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if hugetlb else 0)
        self.fd = os.memfd_create(name, flags)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self._map = mmap.mmap(self.fd, nbytes)  # MAP_SHARED, read and write; hugetlb pages reserved here
        except BaseException:
            os.close(self.fd)
            raise
        if not hugetlb:
            advise_mapping(self._map)  # transparent huge pages, where shmem_enabled lets advice count
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        populate(self.array)  # faulted in now, so its pages are known
        why_not, huge = mapping_of(os.getpid(), self.address, nbytes, os.fstat(self.fd))
        self.huge_pages = huge and not why_not  # why_not: our own smaps unreadable (a /proc mounted hidepid)

    def close(self) -> None:
        """Let go of the fd; the memory stays until ``array`` and every view of it are gone (and, once offered,
        until the stores' lanes close)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def mapping_of(pid: int, address: int, length: int, st: os.stat_result) -> tuple[str, bool]:
    """Why ``[address, address + length)`` of process ``pid`` is not a shared, writable mapping of the file of
    ``st`` from offset 0 ("" when it is), and whether it is in huge pages (hugetlb, or shmem THP over at least
    half of it). The range may span several mappings (an madvise of part of one splits it), each going on where
    the last ended."""
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    at, stop, huge_bytes = address, address + length, 0
    current: tuple[int, int] | None = None  # the mapping being read, while it is one of the range's
    try:
        with open(f"/proc/{pid}/smaps") as smaps:
            for line in smaps:
                fields = line.split()
                if not fields[0].endswith(":"):  # a mapping's first line: start-end perms offset dev inode [path]
                    if at >= stop:
                        break
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    current = None
                    if not start <= at < end:
                        continue
                    if (
                        fields[3] != device
                        or int(fields[4]) != st.st_ino
                        or int(fields[2], 16) + at - start != at - address
                    ):
                        return f"the client does not map the pool's file at {at:#x} (offset {at - address})", False
                    if not fields[1].startswith("rw") or fields[1][3] != "s":
                        return f"the client's mapping at {at:#x} is not shared and writable ({fields[1]})", False
                    current, at = (start, end), end
                elif current is not None and fields[0] == "KernelPageSize:" and int(fields[1]) << 10 >= HUGE_PAGE:
                    huge_bytes += current[1] - current[0]
                elif current is not None and fields[0] == "ShmemPmdMapped:":
                    huge_bytes += int(fields[1]) << 10
    except (OSError, ValueError, IndexError) as err:
        return f"cannot read the client's mappings: {err}", False
    if at < stop:
        return f"the client maps nothing at {at:#x}", False
    return "", huge_bytes * 2 >= length


def huge_pages_likely(nbytes: int, shmem_enabled: str | None = None) -> bool:
    """Whether a ``SharedPool`` of ``nbytes`` made now would get huge pages: enough hugetlb pages are free, or
    ``shmem_enabled`` (this host's, by default) gives shared memory transparent huge pages when advised."""
    if _hugetlb_free_for(nbytes):
        return True
    text = read_setting(SHMEM_ENABLED) if shmem_enabled is None else shmem_enabled
    return text is not None and any(f"[{mode}]" in text for mode in ("always", "within_size", "advise", "force"))


def _hugetlb_free_for(nbytes: int) -> bool:
    """Whether enough hugetlb pages are free for ``nbytes`` (whole pages)."""
    return _free_hugetlb_bytes() >= -(-nbytes // HUGE_PAGE) * HUGE_PAGE


def _free_hugetlb_bytes() -> int:
    try:
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info)
        return int(fields["HugePages_Free"]) * (int(fields["Hugepagesize"].split()[0]) << 10)
    except (OSError, KeyError, ValueError):
        return 0
