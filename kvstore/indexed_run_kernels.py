"""The numba kernel behind a ``--share-nvme`` client's unasked Get of a prefix that the store's index names whole in
one NVMe segment file: the probe, the read, the checks and the seqlock's second read in one call without the GIL
(``DiskReader.read_indexed``, kvstore/lanes/client/disk.py). Loaded through ``kvstore.indexed_runs``.

- ``find_and_read(entries, mask, joined, mix0, mix1, rows, files, offsets, lengths, crcs, addresses, sizes,
  scratch, scratch_bytes, gap_bytes, alone_bytes, failed, gather_block, marks, info) -> status``:
  ``arena_index_kernels.find`` into ``rows``; when every block lies in one segment file (``one_file``) whose
  descriptor ``files`` holds (rows of (segment id, fd), the row ``segment & (len - 1)``), and each fits its
  destination (``sizes``), the blocks are read and checked as ``payload_run_kernels.read_run`` does, then
  ``unchanged``. Returns how many blocks failed their read or check (0: all served) or why nothing was read:
  ``NOT_NAMED`` (a block the index does not name: ``rows`` is not filled), ``NOT_ONE_FILE``, ``NO_FILE``
  (``info[0]`` = the segment, not open yet), ``NOT_A_RUN`` or ``TOO_LONG`` (``read_run``'s, a destination too small
  included) and ``CHANGED`` (an entry moved while it was read: the bytes are not to be served). After
  ``NOT_ONE_FILE``, ``NO_FILE`` and the two of ``read_run`` the rows are the probe's, for the caller's general path.
  Served, ``info[1]`` says whether this reader had read one of those records before (``read_before``).
- ``read_before(marks, rows) -> bool``: whether ``marks`` (each entry's ``seq`` as this reader last read its
  record, uint32) holds one of the probed records as it is now; marks them all (``IndexedGets``: a reread's hits
  go to the store at once).

Where the same Get took four calls (``find``, ``one_file``, ``read_run``, ``unchanged``) and the Python between
them: a 32 x 64 KiB Get after 0.1 s idle, the two switched Get by Get in one process, 1.44 against 1.21 ms; 32 x
512 KiB 6.16 against 5.78 (fifty-seventh session, docs/nvme_log.md).
"""

from __future__ import annotations

from typing import Any

import numba

from kvstore import arena_index_kernels, payload_run_kernels

# statuses below 0 (0 and above: how many blocks failed their read or check)
NOT_A_RUN, TOO_LONG = payload_run_kernels.NOT_A_RUN, payload_run_kernels.TOO_LONG
NOT_NAMED, NOT_ONE_FILE, NO_FILE, CHANGED = -10, -11, -12, -13
ROWS_USABLE = (NOT_A_RUN, TOO_LONG, NOT_ONE_FILE, NO_FILE)  # named, not as one run of one open file


@numba.njit(nogil=True, cache=True)
def find_and_read(
    entries: Any, mask: Any, joined: Any, mix0: Any, mix1: Any, rows: Any, files: Any, offsets: Any, lengths: Any,
    crcs: Any, addresses: Any, sizes: Any, scratch: int, scratch_bytes: int, gap_bytes: int, alone_bytes: int,
    failed: Any, gather_block: int, marks: Any, info: Any,
) -> int:  # fmt: skip
    n = len(joined) // 16
    if arena_index_kernels.find(entries, mask, joined, mix0, mix1, rows) < n:
        return NOT_NAMED
    segment = arena_index_kernels.one_file(rows, offsets, lengths, crcs)
    if segment < 0:
        return NOT_ONE_FILE
    slot = segment & (files.shape[0] - 1)
    if files[slot, 0] != segment:
        info[0] = segment
        return NO_FILE
    for i in range(n):
        if lengths[i] > sizes[i]:
            return NOT_A_RUN
    bad: int = payload_run_kernels.read_run(
        files[slot, 1], offsets, lengths, crcs, addresses, scratch, scratch_bytes, gap_bytes, alone_bytes, failed,
        gather_block,
    )  # fmt: skip
    if bad < 0:
        return bad
    if not arena_index_kernels.unchanged(entries, rows, n):
        return CHANGED
    if bad == 0:
        info[1] = read_before(marks, rows)
    return bad


@numba.njit(nogil=True, cache=True)
def read_before(marks: Any, rows: Any) -> bool:
    """Whether one of these probed records (rows of ``find``) was read before, as ``marks`` says (each entry's
    ``seq`` when last read, uint32); marks them all."""
    again = False
    for i in range(rows.shape[0]):
        e = numba.int64(rows[i, 2])
        seq = numba.uint32(rows[i, 3] & numba.uint64(0xFFFFFFFF))
        again |= marks[e] == seq
        marks[e] = seq
    return again


def warm_up() -> None:
    """Compile ``find_and_read`` (or load it from numba's cache) for the types ``DiskReader`` passes: a probe of an
    empty table, which names nothing."""
    import numpy as np

    from kvstore.arena_index_layout import ENTRY_WORDS, WAYS

    entries = np.zeros((WAYS * 2, ENTRY_WORDS), dtype=np.uint64)
    entries.flags.writeable = False  # as a client maps the table
    rows = np.zeros((1, 4), dtype=np.uint64)
    columns = np.zeros((5, 1), dtype=np.int64)  # offsets, lengths, CRC32Cs, addresses, sizes
    files = np.full((2, 2), -1, dtype=np.int64)
    find_and_read(
        entries, np.uint64(1), bytes(16), np.uint64(0), np.uint64(0), rows, files, *columns, 0, 0, 0, 0,
        np.zeros(1, dtype=np.int64), 0, np.zeros(2, dtype=np.uint32), np.zeros(2, dtype=np.int64),
    )  # fmt: skip
    read_before(np.zeros(2, dtype=np.uint32), rows)
