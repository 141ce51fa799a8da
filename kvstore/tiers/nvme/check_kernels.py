"""The numba kernel behind ``reader.finish_into``: every record of one piece checked in one compiled call that
holds no GIL (``check_piece``), as the Python path checks them: header magic, version and CRC; the payload length
and CRC32C the caller expects; the payload's CRC32C over its parts; then each passing record's tail (the bytes past
its last whole page, read into scratch) copied into its buffer.

Imported only once ``kvstore.memops_jit`` has found numba and a CPU with SSE4.2 and PCLMULQDQ, and only when first
wanted (reader.py's ``BackgroundCompile``), like every kernel here. Why compiled: function timers in a store
serving 32 x 64 KiB NVMe Gets on the shm lane (docs/nvme_log.md) put 5.4 ms of a 10.5 ms Get in the Python checks of
its four pieces, summed over the reading threads: each piece's checks held the GIL the other readers wanted.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from kvstore.memops_kernels import READ, STORE, copy_crc
from kvstore.tiers.nvme.format import HEADER_BYTES, MAGIC, MAX_NAMESPACE_BYTES, PAGE, VERSION

# a record's status (``reader`` words each as its Python path does)
OK, NO_HEADER, WRONG_LENGTH, INDEX_CRC, PAST_END, BAD_PAYLOAD = 0, 1, 2, 3, 4, 5
# the rows' columns
REL, HEADER, FIRST, FIRST_BYTES, TAIL, LENGTH, NBYTES, CRC = range(8)
COLUMNS = 8

# where format.py's header keeps what the checks read (its table in docs/nvme.md)
_MAGIC = int.from_bytes(MAGIC, "little")
_VERSION_AT, _STORED_LENGTH_AT, _STORED_CRC_AT, _NAMESPACE_LENGTH_AT = 4, 76, 88, 92
_FIXED_BYTES = 94  # through the namespace length; the header CRC covers these and the namespace


@numba.njit(nogil=True, cache=True, inline="always")
def _uint(buf: Any, at: int, size: int) -> Any:
    """The little-endian unsigned integer of ``size`` bytes at ``buf[at]``."""
    value = np.int64(0)
    for k in range(size - 1, -1, -1):
        value = (value << 8) | np.int64(buf[at + k])
    return value


@numba.njit(nogil=True, cache=True, inline="always")
def _valid_header(scratch: Any, hdr: int) -> Any:  # a bool (numba's types are not mypy's)
    """Magic, version and the header's own CRC32C, as ``format.check_header``."""
    if _uint(scratch, hdr, 4) != _MAGIC or _uint(scratch, hdr + _VERSION_AT, 2) != VERSION:
        return False
    end = _FIXED_BYTES + _uint(scratch, hdr + _NAMESPACE_LENGTH_AT, 2)
    if end > _FIXED_BYTES + MAX_NAMESPACE_BYTES:
        return False
    return np.int64(copy_crc(scratch.ctypes.data + hdr, 0, end, 0, READ)) == _uint(scratch, hdr + end, 4)


@numba.njit(nogil=True, cache=True)
def check_piece(scratch: Any, rows: Any, got: int, status: Any, lengths: Any) -> int:
    """Check the records of one piece after its preadv returned ``got`` bytes (int64 ``rows``, one per record:
    the record's offset in the piece, its header page's position in ``scratch``, the address its payload's
    whole pages were read to (0: all of the payload is in scratch), how many bytes that is, the position of the
    rest in ``scratch``, the length expected (-1: any), the record's bytes, the CRC32C expected (-1: any)).
    Writes each record's status and stored length (when its header is valid); returns how many failed."""
    failed = 0
    for k in range(rows.shape[0]):
        rel, hdr, nbytes = rows[k, REL], rows[k, HEADER], rows[k, NBYTES]
        want_length, want_crc = rows[k, LENGTH], rows[k, CRC]
        first, first_bytes, tail = rows[k, FIRST], rows[k, FIRST_BYTES], scratch.ctypes.data + rows[k, TAIL]
        if rel + HEADER_BYTES > got or not _valid_header(scratch, hdr):
            status[k] = NO_HEADER
            failed += 1
            continue
        n = lengths[k] = _uint(scratch, hdr + _STORED_LENGTH_AT, 8)
        stored_crc = _uint(scratch, hdr + _STORED_CRC_AT, 4)
        result = OK
        if (want_length >= 0 and n != want_length) or HEADER_BYTES + -(-n // PAGE) * PAGE != nbytes:  # record_bytes
            result = WRONG_LENGTH
        elif want_crc >= 0 and stored_crc != want_crc:
            result = INDEX_CRC
        elif rel + nbytes > got:
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
        failed += result != OK
    return failed


def warm_up() -> None:
    """Compile ``check_piece`` (or load it from numba's cache) for the types ``finish_into`` passes."""
    scratch = np.zeros(2 * HEADER_BYTES, dtype=np.uint8)  # no valid header: compiles the whole of it all the same
    rows = np.zeros((1, COLUMNS), dtype=np.int64)
    check_piece(scratch, rows, 0, np.empty(1, dtype=np.int64), np.empty(1, dtype=np.int64))
