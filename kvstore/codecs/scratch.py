"""Per-thread reusable work buffers for the codecs' numpy passes.

Fresh multi-hundred-KiB temporaries come from mmap and are returned to the OS
on free, so every block would page-fault its temporaries in again; on this
machine that made fp8 encoding 5-10x slower than its arithmetic (measured:
1,400 minor faults per 360 KiB block). Each call site asks for its buffer by a
name of its own; a thread's buffer only grows, to the largest block it has
coded (fp8 encoding keeps about 19 bytes per element, decoding 8; byteplane
about twice the block).
Contents are undefined on return and must not outlive the codec call.
"""

from __future__ import annotations

import threading

import numpy as np

_local = threading.local()
_MIN_BYTES = 64 * 1024


def scratch(name: str, count: int, dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """``count`` elements of ``dtype`` from this thread's buffer ``name`` (contents undefined)."""
    dt = np.dtype(dtype)
    nbytes = count * dt.itemsize
    pool: dict[str, np.ndarray] | None = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    buf = pool.get(name)
    if buf is None or buf.nbytes < nbytes:
        size = max(nbytes + nbytes // 8, _MIN_BYTES)  # some headroom: blocks vary a little in size
        buf = pool[name] = np.empty(size, dtype=np.uint8)
    return buf[:nbytes].view(dt)


def scratch_bytes() -> int:
    """Bytes this thread holds in work buffers."""
    pool = getattr(_local, "pool", {})
    return sum(b.nbytes for b in pool.values())
