"""The numba kernels behind ``kvstore.arena_index.ArenaIndexView`` (imported only when first wanted, as
``kvstore.memops_kernels`` is: importing numba early breaks vLLM's scan of module globals).

- ``find(entries, mask, joined, mix0, mix1, out) -> n``: for each 16-byte hash of ``joined`` (in order, stopping
  at the first that is not named), ``out[i]`` = (offset, lencrc, entry, seq). Each entry's ``seq`` is an acquire
  load, so its fields are read after it (the seqlock's first read), whatever the compiler would reorder.
- ``unchanged(entries, out, n) -> bool``: every one of those entries still has its ``seq`` (the second read,
  a separate call after the caller's copy).
- ``one_file(rows, offsets, lengths, crcs) -> segment``: when every row of a ``find`` names a record of one NVMe
  segment file (a prefix demoted together), its segment id, with each block's payload offset, length and CRC32C
  written to the three int64 columns; else -1. Where the same as numpy array operations took 0.13 ms of a
  32-block Get after a pause.

A 32-hash ``find`` costs about a microsecond plus the call, where the numpy path costs about a hundred.
"""

from __future__ import annotations

from typing import Any

import numba
from llvmlite import ir
from numba.extending import intrinsic

from kvstore.arena_index_layout import (
    ENTRY_WORDS,
    FILE_OFFSETS,
    KEY0,
    KEY1,
    LENCRC,
    OFFSET,
    ON_DISK,
    SEGMENT_IDS,
    SEGMENT_SHIFT,
    SEQ,
    WAYS,
)
from kvstore.numba_words import word_at as _word


@intrinsic
def _load_acquire(typingctx: Any, address: Any) -> Any:
    """The uint64 at ``address``, read with acquire ordering: no later load moves before it."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load_atomic(ptr, "acquire", 8)

    return numba.types.uint64(numba.types.int64), codegen


@numba.njit(cache=True, nogil=True)
def find(entries, mask, joined, mix0, mix1, out):  # type: ignore[no-untyped-def]
    n = len(joined) // 16
    base = entries.ctypes.data
    stride = ENTRY_WORDS * 8
    for i in range(n):
        k0 = _word(joined, 16 * i) ^ mix0
        k1 = _word(joined, 16 * i + 8) ^ mix1
        if k0 == 0 and k1 == 0:
            k1 = numba.uint64(1)
        first = numba.int64(k0 & mask) * WAYS
        found = False
        for e in range(first, first + WAYS):
            seq = _load_acquire(base + e * stride + SEQ * 8)
            if seq & numba.uint64(1):
                continue
            if entries[e, KEY0] == k0 and entries[e, KEY1] == k1:
                out[i, 0] = entries[e, OFFSET]
                out[i, 1] = entries[e, LENCRC]
                out[i, 2] = numba.uint64(e)
                out[i, 3] = seq
                found = True
                break
        if not found:
            return i
    return n


@numba.njit(cache=True, nogil=True)
def unchanged(entries, out, n):  # type: ignore[no-untyped-def]
    for i in range(n):
        e = numba.int64(out[i, 2])
        if e >= len(entries) or entries[e, SEQ] != out[i, 3]:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def one_file(rows, offsets, lengths, crcs):  # type: ignore[no-untyped-def]
    n = rows.shape[0]
    if n == 0 or not rows[0, 0] & numba.uint64(ON_DISK):
        return -1
    segment = (rows[0, 0] >> numba.uint64(SEGMENT_SHIFT)) & numba.uint64(SEGMENT_IDS)
    for i in range(n):
        word = rows[i, 0]
        in_file = (word >> numba.uint64(SEGMENT_SHIFT)) & numba.uint64(SEGMENT_IDS)
        if not word & numba.uint64(ON_DISK) or in_file != segment:
            return -1
        offsets[i] = numba.int64(word & numba.uint64(FILE_OFFSETS))
        lengths[i] = numba.int64(rows[i, 1] & numba.uint64(0xFFFFFFFF))
        crcs[i] = numba.int64(rows[i, 1] >> numba.uint64(32))
    return numba.int64(segment)
