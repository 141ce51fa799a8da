"""A compiled loop for the frequency sketch (numba, optional): a Get's 32 counts in one call, not 32.

``count(r0, r1, r2, r3, shift, fps, counted, added, out) -> done`` walks ``fps`` in order exactly as
``FrequencySketch.add`` (where ``counted``) and ``estimate`` (elsewhere) would, one at a time: the four
multiply-shift slots, the minimum, the conservative update of the minimal counters; ``out[i]`` is the count
each returns. It stops after the addition that brings ``added`` (the sketch's running count) to a multiple
of 1024, where the sketch's aging is due, and returns how many it did (the caller ages the sketch, fixes that
one count and calls again for the rest). ``AVAILABLE`` says whether numba is importable (``kvstore[fast]``);
kvstore/store/frequency.py runs the same steps in Python otherwise.
"""

from __future__ import annotations

from typing import Any

from kvstore.jit import AVAILABLE as AVAILABLE  # re-exported: callers ask the kernel module
from kvstore.jit import numba

count: Any = None

if AVAILABLE:
    _U = numba.uint64
    _M = (_U(0x9E3779B97F4A7C15), _U(0xC2B2AE3D27D4EB4F), _U(0x165667B19E3779F9), _U(0xD6E8FEB86659FD93))
    M0, M1, M2, M3 = _M

    @numba.njit(cache=True, inline="always")
    def bump(r0, r1, r2, r3, sh, fp, counted):  # type: ignore[no-untyped-def]
        """The sketch's count of ``fp`` before this use; with ``counted`` the conservative update of its
        minimal counters (shared by the touch kernel, kvstore/store/policy_jit.py)."""
        s0, s1, s2, s3 = (fp * M0) >> sh, (fp * M1) >> sh, (fp * M2) >> sh, (fp * M3) >> sh
        c0, c1, c2, c3 = r0[s0], r1[s1], r2[s2], r3[s3]
        low = min(min(c0, c1), min(c2, c3))
        if counted and low < 255:
            up = numba.uint8(low + 1)
            if c0 == low:
                r0[s0] = up
            if c1 == low:
                r1[s1] = up
            if c2 == low:
                r2[s2] = up
            if c3 == low:
                r3[s3] = up
        return numba.int64(low)

    @numba.njit(cache=True, nogil=True)
    def _count(r0, r1, r2, r3, shift, fps, counted, added, out):  # type: ignore[no-untyped-def]
        sh = numba.uint64(shift)
        for i in range(len(fps)):
            low = bump(r0, r1, r2, r3, sh, numba.uint64(fps[i]), counted[i])
            if not counted[i]:
                out[i] = low
                continue
            out[i] = min(low + 1, 255)
            added += 1
            if added & 1023 == 0:
                return i + 1
        return len(fps)

    count = _count
