"""CRC32C (Castagnoli) of any buffer: memoryview, bytearray, numpy array or bytes.

Uses the `crc32c` package (hardware SSE4.2/ARMv8 CRC instructions) because it
takes any buffer without a copy; google-crc32c's C extension accepts only
`bytes`, which would force a copy of every block. On this project's 2-core
AMD EPYC VM both run at about 6 GB/s a core (1 MiB buffers, 2026-12-01; an
earlier note said 16 GB/s, from another host): a Get's CRC32Cs cost about as
much as its copy. Buffers of ``JIT_BYTES`` or more go through ``kvstore.memops_jit`` instead when its
kernels are compiled and outrun the package on this CPU (``memops_jit.library_crc_faster``: PCLMULQDQ folding ran
9-10 GB/s a core here against the package's 6-6.7 on 2026-12-01; 7.7 against 15.6 on 2026-12-04, another host).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from crc32c import crc32c as _crc32c

from kvstore import memops_jit

JIT_BYTES = 64 << 10  # below this the call's overhead eats the kernel's gain (even at 48 KiB, 6.7 us both)


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of `data`, continuing from `value` (the CRC of the bytes before it)."""
    n = data.nbytes if isinstance(data, (memoryview, np.ndarray)) else len(data)
    if n >= JIT_BYTES and memops_jit.ready() and not memops_jit.library_crc_faster():
        try:  # a writable buffer's address in 0.8 us
            return memops_jit.crc_at(ctypes.addressof(ctypes.c_char.from_buffer(data)), n, value)
        except (TypeError, ValueError):
            pass
        try:  # read-only (bytes, a mapped file): numba takes the array's address
            return memops_jit.crc_of(np.frombuffer(data, dtype=np.uint8), value)
        except (TypeError, ValueError):  # strided
            pass
    return _crc32c(data, value)
