"""CRC32C (Castagnoli) of any buffer: memoryview, bytearray, numpy array or bytes.

Uses the `crc32c` package (hardware SSE4.2/ARMv8 CRC instructions, about
16 GB/s here) because it takes any buffer without a copy; google-crc32c's C
extension accepts only `bytes`, which would force a copy of every block.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from crc32c import crc32c as _crc32c

PARALLEL_MIN_BYTES = 4 << 20  # below this a thread hop costs more than it saves
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of `data`, continuing from `value` (the CRC of the bytes before it)."""
    return _crc32c(data, value)


def _released(data: Any) -> int:
    return _crc32c(data, 0, 1)  # gil_release_mode=1: other threads run while this one checksums


def crc32c_many(buffers: Sequence[Any]) -> list[int]:
    """The CRC32C of each buffer; several at once on a small thread pool when there is enough work.

    The extension releases the GIL, so on a many-core host (a GPU server) a batch checksums at several
    times one core's ~10-16 GB/s; on two cores it stays serial.
    """
    workers = min(8, (os.cpu_count() or 1) // 2)
    if workers < 2 or len(buffers) < 2 or sum(memoryview(b).nbytes for b in buffers) < PARALLEL_MIN_BYTES:
        return [_crc32c(b) for b in buffers]
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="crc32c")
    return list(_pool.map(_released, buffers))
