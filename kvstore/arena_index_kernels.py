"""The numba kernels behind ``kvstore.arena_index`` (its readers' ``ArenaIndexView``, the store's ``ArenaIndex``;
imported only when first wanted, as ``kvstore.memops_kernels`` is: importing numba early breaks vLLM's scan of
module globals).

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

The store's writes (``ArenaIndex``, the only writer):

- ``publish(entries, mask, keys, offsets, lencrcs, out) -> written``: name each key (in order) in its bucket: in
  the way that names it already, else in the bucket's first free way (a key whose bucket is full is skipped);
  ``out[0]`` counts the keys that took a free way.
- ``withdraw(entries, mask, keys) -> n``: clear the way that names each key (those named).

Each entry changes under its seqlock: ``seq`` + 1 (an atomic store), a release fence, the fields, ``seq`` + 2 (a
release store). The atomics keep the compiler from dropping the odd ``seq`` (a plain store that the even one
overwrites) or moving a field's store past either; x86-64 keeps stores in program order. The bucket's own words
say which ways are free (key 0, 0), so the writer keeps no table of its own beside the file.
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


def _store_ordered(ordering: str) -> Any:
    """An intrinsic storing the uint64 ``value`` at ``address`` as an atomic store of this LLVM ordering."""

    @intrinsic
    def store(typingctx: Any, address: Any, value: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
            builder.store_atomic(args[1], ptr, ordering, 8)
            return context.get_dummy_value()

        return numba.types.void(numba.types.int64, numba.types.uint64), codegen

    return store


_store_atomic = _store_ordered("monotonic")  # never dropped or merged with a later store
_store_release = _store_ordered("release")  # no earlier store moves after it


@intrinsic
def _fence_release(typingctx: Any) -> Any:
    """No later store moves before an earlier one (the odd ``seq`` goes out before the fields change)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        builder.fence("release")
        return context.get_dummy_value()

    return numba.types.void(), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _way_of(entries, first, k0, k1):  # type: ignore[no-untyped-def]
    """(the way of the bucket at ``first`` that names (k0, k1), its first free way), each -1 when none."""
    free = -1
    for e in range(first, first + WAYS):
        e0, e1 = entries[e, KEY0], entries[e, KEY1]
        if e0 == k0 and e1 == k1:
            return e, free
        if free < 0 and e0 == 0 and e1 == 0:
            free = e
    return -1, free


@numba.njit(cache=True, nogil=True, inline="always")
def _write(entries, e, k0, k1, offset, lencrc):  # type: ignore[no-untyped-def]
    at = entries.ctypes.data + e * (ENTRY_WORDS * 8) + SEQ * 8
    seq = entries[e, SEQ]
    _store_atomic(at, seq + numba.uint64(1))
    _fence_release()
    entries[e, KEY0] = k0
    entries[e, KEY1] = k1
    entries[e, OFFSET] = offset
    entries[e, LENCRC] = lencrc
    _store_release(at, seq + numba.uint64(2))


@numba.njit(cache=True, nogil=True)
def publish(entries, mask, keys, offsets, lencrcs, out):  # type: ignore[no-untyped-def]
    written = 0
    taken = 0
    for i in range(keys.shape[0]):
        k0, k1 = keys[i, 0], keys[i, 1]
        e, free = _way_of(entries, numba.int64(k0 & mask) * WAYS, k0, k1)
        if e < 0:
            if free < 0:
                continue  # the bucket is full
            e = free
            taken += 1
        _write(entries, e, k0, k1, offsets[i], lencrcs[i])
        written += 1
    out[0] = taken
    return written


@numba.njit(cache=True, nogil=True)
def withdraw(entries, mask, keys):  # type: ignore[no-untyped-def]
    n = 0
    zero = numba.uint64(0)
    for i in range(keys.shape[0]):
        k0, k1 = keys[i, 0], keys[i, 1]
        e, _ = _way_of(entries, numba.int64(k0 & mask) * WAYS, k0, k1)
        if e >= 0:
            _write(entries, e, zero, zero, zero, zero)
            n += 1
    return n


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
