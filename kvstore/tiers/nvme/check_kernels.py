"""The numba kernel behind ``reader.finish_into``: every record of one piece checked in one compiled call that
holds no GIL (``check_piece``), as the Python path checks them: header magic, version and CRC; the payload length
and CRC32C the caller expects; the payload's CRC32C over its parts; then each passing record's tail (the bytes past
its last whole page, read into scratch) copied into its buffer.

Imported only once ``kvstore.memops_jit`` has found numba and a CPU with SSE4.2 and PCLMULQDQ, and only when first
wanted (reader.py's ``BackgroundCompile``), like every kernel here. Why compiled: function timers in a store
serving 32 x 64 KiB NVMe Gets on the shm lane (docs/nvme.md) put 5.4 ms of a 10.5 ms Get in the Python checks of
its four pieces, summed over the reading threads: each piece's checks held the GIL the other readers wanted.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from kvstore.memops_kernels import READ, STORE, copy_crc

# a record's status (what ``reader.finish_into`` says of it)
OK, NO_HEADER, WRONG_LENGTH, INDEX_CRC, PAST_END, BAD_PAYLOAD = 0, 1, 2, 3, 4, 5
# the rows' columns
REL, HEADER, FIRST, FIRST_BYTES, TAIL, LENGTH, NBYTES, CRC = range(8)
COLUMNS = 8

HEADER_BYTES = 4096
PAGE = 4096
FIXED_BYTES = 94  # format.py's header through the namespace length
MAGIC = int.from_bytes(b"KVSR", "little")
VERSION = 1
MAX_NAMESPACE_BYTES = 1024


@numba.njit(nogil=True, cache=True, inline="always")
def _uint(buf: Any, at: int, size: int) -> Any:
    """The little-endian unsigned integer of ``size`` bytes at ``buf[at]``."""
    value = np.int64(0)
    for k in range(size - 1, -1, -1):
        value = (value << 8) | np.int64(buf[at + k])
    return value


@numba.njit(nogil=True, cache=True)
def check_piece(scratch: Any, rows: Any, got: int, status: Any, lengths: Any) -> int:
    """Check the records of one piece after its preadv returned ``got`` bytes (int64 ``rows``, one per record:
    the record's offset in the piece, its header page's position in ``scratch``, the address its payload's
    whole pages were read to (0: all of the payload is in scratch), how many bytes that is, the position of the
    rest in ``scratch``, the length expected (-1: any), the record's bytes, the CRC32C expected (-1: any)).
    Writes each record's status and stored length (when its header is valid); returns how many failed."""
    base = scratch.ctypes.data
    failed = 0
    for k in range(rows.shape[0]):
        hdr = rows[k, HEADER]
        result = NO_HEADER
        if (
            rows[k, REL] + HEADER_BYTES <= got
            and _uint(scratch, hdr, 4) == MAGIC
            and _uint(scratch, hdr + 4, 2) == VERSION
        ):
            end = FIXED_BYTES + _uint(scratch, hdr + 92, 2)
            if end <= FIXED_BYTES + MAX_NAMESPACE_BYTES and np.int64(copy_crc(base + hdr, 0, end, 0, READ)) == _uint(
                scratch, hdr + end, 4
            ):
                result = OK
        if result == OK:
            n = _uint(scratch, hdr + 76, 8)
            stored_crc = _uint(scratch, hdr + 88, 4)
            lengths[k] = n
            first, first_bytes, tail = rows[k, FIRST], rows[k, FIRST_BYTES], base + rows[k, TAIL]
            if (rows[k, LENGTH] >= 0 and n != rows[k, LENGTH]) or HEADER_BYTES + -(-n // PAGE) * PAGE != rows[
                k, NBYTES
            ]:
                result = WRONG_LENGTH
            elif rows[k, CRC] >= 0 and stored_crc != rows[k, CRC]:
                result = INDEX_CRC
            elif rows[k, REL] + rows[k, NBYTES] > got:
                result = PAST_END
            else:
                if first == 0:
                    crc = np.int64(copy_crc(tail, 0, n, 0, READ))
                else:
                    crc = np.int64(copy_crc(first, 0, first_bytes, 0, READ))
                    if n > first_bytes:
                        crc = np.int64(copy_crc(tail, 0, n - first_bytes, crc, READ))
                if crc != stored_crc:
                    result = BAD_PAYLOAD
                elif first != 0 and n > first_bytes:  # verified: the tail goes in after the whole pages
                    copy_crc(tail, first + first_bytes, n - first_bytes, 0, STORE)
        status[k] = result
        if result != OK:
            failed += 1
    return failed


def warm_up() -> None:
    """Compile ``check_piece`` (or load it from numba's cache) for the types ``finish_into`` passes."""
    scratch = np.zeros(2 * HEADER_BYTES, dtype=np.uint8)
    rows = np.zeros((1, COLUMNS), dtype=np.int64)
    check_piece(scratch, rows, 0, np.empty(1, dtype=np.int64), np.empty(1, dtype=np.int64))
