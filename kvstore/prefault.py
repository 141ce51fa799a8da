"""Memory made ready before it is used: page tables and pages of a large mapping, filled in the background.

A store's DRAM arena is one anonymous mapping of the tier's capacity. The kernel gives it pages only as they are
first written, so until every slot has been used once, each Put into a fresh slot pays a page fault and a
zero-fill per 4 KiB inside its copy: a Put of 64 blocks of 1.47 MB (94 MB) into a fresh store took 72-159 ms,
and 38-43 ms with the pages made (``--dram-prefault``, kvstore/config.py; three runs of bench.sglang_hicache). Pinned
arenas (a CUDA host) already have their pages; the shared arena's file has them too (``posix_fallocate``), so
there only the mapping's page tables are made.

``Prefaulter(address, size)`` asks for them with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), 16 MiB a call
on a daemon thread that lets go of the GIL during each call, so serving starts at once and runs beside it. The
call keeps what the pages hold, so Puts may land meanwhile. Without the call (an older kernel) nothing is done.
``stop()`` ends it between calls, before the mapping goes.

``populate(memory)``: the same at once, on the calling thread (a worker's KV pool, a shared pool).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import threading
import time

import numpy as np

from kvstore.hugepages import madvise

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module does not export it before 3.13
CHUNK = 16 << 20


def populate(memory: np.ndarray) -> None:
    """Make every page of ``memory`` (a writable uint8 array) now, keeping what it holds: one
    ``MADV_POPULATE_WRITE`` call over the whole pages it touches, else (an older kernel) a write of each page's
    first byte with what it holds."""
    address, n = memory.ctypes.data, memory.nbytes
    if n == 0:
        return
    first = address - address % mmap.PAGESIZE
    length = -(-(address + n - first) // mmap.PAGESIZE) * mmap.PAGESIZE
    if madvise(first, length, MADV_POPULATE_WRITE) != 0:
        memory[:: mmap.PAGESIZE] = memory[:: mmap.PAGESIZE].copy()


class Prefaulter:
    def __init__(self, address: int, size: int, *, name: str = "kvstore-prefault"):
        self._address, self._size = address, size
        self._stop = threading.Event()
        self._lock = threading.Lock()  # held across each call, so stop() returns only between calls
        self.done = 0  # bytes whose pages are in place
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:  # the mapping may go once this returns: no call is running or will start
            pass

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        start, offset = time.perf_counter(), 0
        while offset < self._size:
            n = min(CHUNK, self._size - offset)
            with self._lock:
                if self._stop.is_set():
                    return
                if madvise(self._address + offset, n, MADV_POPULATE_WRITE) != 0:
                    err = ctypes.get_errno()
                    log.info("prefault stopped at %d of %d bytes: %s", offset, self._size, errno.errorcode.get(err))
                    return
            offset += n
            self.done, self.seconds = offset, time.perf_counter() - start
        log.info("prefaulted %d bytes in %.2f s", self._size, self.seconds)
