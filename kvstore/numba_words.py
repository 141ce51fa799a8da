"""numba helpers shared by the compiled kernels (``kvstore/store/slots_jit.py``,
``kvstore/arena_index_kernels.py``). It imports numba: only kernel modules import it."""

from __future__ import annotations

from typing import Any

import numba


@numba.njit(cache=True, inline="always")
def word_at(buf: Any, at: Any) -> Any:
    """The little-endian uint64 at byte ``at`` of a bytes object (or uint8 array)."""
    w = numba.uint64(0)
    for k in range(8):
        w |= numba.uint64(buf[at + k]) << numba.uint64(8 * k)
    return w
