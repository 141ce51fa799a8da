"""A shm lane's client pools (``kvstore.lanes.shared_pool.SharedPool``): client memory the store maps, so a
direct Get's NVMe blocks reach the client's buffers without ``process_vm_writev`` (``ShmColumnGets._get_read_written``).

``MappedPools.add(peer, fd, address, length)`` (a POOL frame on the lane's channel) takes the client's ``fd``
(``DirectPeer.take_fd``: pidfd_getfd, the permission a direct lane already has) and maps it only if

- it is sealed against shrinking (``F_SEAL_SHRINK``, which only a memfd can carry): our mapping of a file cut
  short would fault this process on its next write;
- it holds at least ``length`` bytes, and ``length`` is a positive multiple of the page size;
- the client maps that very file, from offset 0, shared and writable, over ``[address, address + length)``
  (``/proc/PID/smaps``: device, inode and offset), so bytes written here are the bytes the client reads there.

Each check that fails is INVALID_ARGUMENT with its reason (the lane goes on: Gets into that memory are written
with ``process_vm_writev`` as before); more than ``MAX_POOLS`` pools is RESOURCE_EXHAUSTED. ``view(spans, n,
huge)`` is our mapping of a block's destination when it is one span inside a pool (in huge pages, or not, when
``huge`` says which: NVMe reads land in place only in huge pages), else None. ``close()`` drops the mappings;
each unmaps once no Get still holds a view of it (an ``mmap`` is not closed under an export).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
from dataclasses import dataclass

import grpc
import numpy as np

from kvstore.lanes.base import LaneError
from kvstore.lanes.direct import DirectPeer
from kvstore.lanes.segments import Spans
from kvstore.lanes.shared_pool import mapping_of

MAX_POOLS = 16


@dataclass(frozen=True, slots=True)
class MappedPool:
    address: int  # where the client maps it
    length: int
    view: memoryview  # our mapping of the same bytes
    huge: bool  # in huge pages: O_DIRECT reads land in it as fast as in the store's own buffers
    base: int  # our mapping's address (its bytes stay mapped while this pool, and so ``view``, is held)


class MappedPools:
    def __init__(self) -> None:
        self._pools: list[MappedPool] = []
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._pools)

    def add(self, peer: DirectPeer, fd: int, address: int, length: int) -> None:
        if length <= 0 or length % mmap.PAGESIZE or address % mmap.PAGESIZE:
            raise _invalid(f"a pool must be whole pages at a page boundary (address {address:#x}, {length} bytes)")
        with self._lock:
            if len(self._pools) >= MAX_POOLS:
                raise LaneError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a lane maps at most {MAX_POOLS} shared pools")
            if any(address < p.address + p.length and p.address < address + length for p in self._pools):
                raise _invalid(f"the pool at {address:#x} overlaps one this lane maps already")
        ours = peer.take_fd(fd)
        try:
            try:
                seals = fcntl.fcntl(ours, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if not seals & fcntl.F_SEAL_SHRINK:
                raise _invalid(f"fd {fd} is not a memfd sealed against shrinking (F_SEAL_SHRINK)")
            st = os.fstat(ours)
            if st.st_size < length:
                raise _invalid(f"fd {fd} holds {st.st_size} bytes, fewer than the {length} named")
            why_not, huge = mapping_of(peer.pid, address, length, st)
            if why_not:
                raise _invalid(why_not)
            view = memoryview(mmap.mmap(ours, length))
        finally:
            os.close(ours)
        with self._lock:
            base = ctypes.addressof(ctypes.c_char.from_buffer(view))
            self._pools.append(MappedPool(address, length, view, huge, base))

    def view(self, spans: Spans, n: int, huge: bool | None = None) -> memoryview | None:
        """Our mapping of the first ``n`` bytes of a destination given as one span inside a pool (in huge pages,
        or not, when ``huge`` says which), else None."""
        if len(spans) != 1:
            return None
        address, length = spans[0]
        return self.at(int(address), min(n, int(length)), huge)

    def at(self, address: int, n: int, huge: bool | None = None) -> memoryview | None:
        """Our mapping of the ``n`` client bytes at ``address`` when a pool holds them all, else None."""
        for p in self._pools:
            if p.address <= address and address + n <= p.address + p.length and huge in (None, p.huge):
                return p.view[address - p.address : address - p.address + n]
        return None

    def addresses(self, heads: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, list[MappedPool]]:
        """``at`` of many destinations at once (client addresses ``heads``, ``sizes`` bytes each, int64): our
        address of each that one pool holds whole, 0 for the others; and the pools used, which the caller holds
        until it is done with those addresses (a pool's mapping lasts while it is referenced)."""
        ours = np.zeros(len(heads), dtype=np.int64)
        used: list[MappedPool] = []
        ends = heads + sizes
        for p in self._pools:  # at most MAX_POOLS
            inside = (heads >= p.address) & (ends <= p.address + p.length) & (ours == 0)
            if inside.any():
                ours[inside] = heads[inside] - p.address + p.base
                used.append(p)
        return ours, used

    def close(self) -> None:
        with self._lock:
            self._pools = []


def _invalid(message: str) -> LaneError:
    return LaneError(grpc.StatusCode.INVALID_ARGUMENT, f"shared pool: {message}")
