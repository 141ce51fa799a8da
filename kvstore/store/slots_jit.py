"""Compiled probe loops of the slot index (numba, optional): the same table, the same bits, no numpy calls per batch.

A vectorized numpy probe of a 64-key prefix costs about 40 numpy calls (hash,
window gather, tag compare, candidate key gather, ...), each a few
microseconds whatever its size, so pure numpy tops out near 0.2-1M keys/s per
64-key batch here (``python -m bench.index_scale`` measures both paths). These
kernels walk the same slots in compiled loops when numba is importable
(``pip install kvstore[fast]``; wheels, no compiler needed); ``AVAILABLE``
says whether they are, and kvstore/store/slots.py falls back to numpy when not.

Kernels (all take the slot words, ``nslots`` and the table's ``seed``):

- ``find(words, nslots, seed, lo, hi, ns, keys, nss, out)``: the entry of
  each key or -1, comparing keys with rows of the key and ns columns;
- ``place(words, nslots, seed, lo, hi, ns, ids, limit) -> (ok, reused tombstones)``:
  put each id in the first free slot of its probe run (False: one ran past ``limit``);
- ``remove(words, nslots, seed, lo, hi, ns, ids) -> found``: tombstone each id's slot;
- ``find_joined(words, params, j0, j1, nsq, keys, nss, out) -> 1 | 0``: ``find`` of 16-byte keys read
  straight out of two ``bytes.join`` of them (what ``EntryTable.find_many`` calls: no numpy call per batch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.jit import AVAILABLE as AVAILABLE  # re-exported: callers ask the kernel module
from kvstore.jit import numba

ID_BITS = 28
MAX_DEPTH = 0xFF  # the index's depth column is one byte, saturating
FORM_LIMIT = 16  # codec ids and dtype ids below this share the index's one-byte form column
_LOW = (1 << ID_BITS) - 1
_TOMB = 0xFFFFFFFF


if AVAILABLE:
    from llvmlite import ir
    from numba.extending import intrinsic

    @intrinsic
    def _prefetch(typingctx: Any, address: Any) -> Any:
        """Start loading the cache line at ``address`` (a read, kept in every cache level); nothing waits."""

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            try:
                fn = builder.module.get_global("llvm.prefetch.p0i8")
            except KeyError:
                fn = ir.Function(
                    builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8"
                )
            builder.call(
                fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)]
            )
            return context.get_dummy_value()

        return numba.types.void(numba.types.int64), codegen

    _U = numba.uint64
    M1, M2, M3, M4 = _U(0x9E3779B97F4A7C15), _U(0xC2B2AE3D27D4EB4F), _U(0x165667B19E3779F9), _U(0xD6E8FEB86659FD93)

    @numba.njit(cache=True, inline="always")
    def _hash(lo: Any, hi: Any, ns: Any, seed: Any, nslots: Any) -> tuple[Any, Any]:
        h = (lo * M1) ^ (hi * M2) ^ ((numba.uint64(ns) + seed) * M3)
        h ^= h >> numba.uint64(31)
        h *= M4
        pos = ((h >> numba.uint64(32)) * numba.uint64(nslots)) >> numba.uint64(32)
        tag = ((h >> numba.uint64(28)) & numba.uint64(0xF)) << numba.uint64(ID_BITS)
        return numba.int64(pos), numba.uint32(tag)

    @numba.njit(cache=True, inline="always")
    def _find1(words, nslots, seed, lo, hi, ns, keys, nss):  # type: ignore[no-untyped-def]
        pos, tag = _hash(lo, hi, ns, seed, nslots)
        while True:
            w = words[pos]
            if w == 0:
                return -1
            if w != _TOMB and (w & numba.uint32(0xF0000000)) == tag:
                e = numba.int64(w & numba.uint32(_LOW)) - 1
                if keys[e, 0] == lo and keys[e, 1] == hi and nss[e] == ns:
                    return e
            pos += 1

    @numba.njit(cache=True, nogil=True)
    def find_one(words, nslots, seed, lo, hi, ns, keys, nss):  # type: ignore[no-untyped-def]
        return _find1(words, nslots, seed, numba.uint64(lo), numba.uint64(hi), numba.uint16(ns), keys, nss)

    @numba.njit(cache=True, nogil=True)
    def find(words, nslots, seed, lo, hi, ns, keys, nss, out):  # type: ignore[no-untyped-def]
        for i in range(len(lo)):
            out[i] = _find1(words, nslots, seed, lo[i], hi[i], ns[i], keys, nss)

    @numba.njit(cache=True, nogil=True)
    def find_keys(words, nslots, seed, q, ns, keys, nss, out):  # type: ignore[no-untyped-def]
        """``find`` of keys given as (n, 2) words, all in namespace ``ns``."""
        for i in range(len(q)):
            out[i] = _find1(words, nslots, seed, q[i, 0], q[i, 1], ns, keys, nss)

    from kvstore.numba_words import word_at as _word

    @numba.njit(cache=True, nogil=True)
    def find_joined(words, params, j0, j1, nsq, keys, nss, out):  # type: ignore[no-untyped-def]
        """``find_keys`` of 16-byte keys given as two joins of them, with a 0 byte and with a 1 byte between
        keys (``b"\\x00".join(keys)``, ``b"\\x01".join(keys)``), ``out`` one row per key: 1, or 0 with ``out``
        untouched unless every key is 16 bytes. (The check is exact: for n keys every position 17 i + 16
        must hold 0 in one join and 1 in the other, which only a separator can, and there are only n - 1.)
        ``params``: the table's ``nslots`` and ``seed`` (and a spare word); ``nsq``: the namespace, plus 1 << 16
        when namespaces must be compared (a table of one namespace need not). Few arguments: each costs the
        dispatcher time on every call.

        Passes that start every key's memory reads before any waits for one (a load that misses stalls the
        core once enough of them queue up; a prefetch does not): hash every key and prefetch its first
        slots; find its first tag match (cache-hot now) and prefetch that entry's key row (and namespace); compare, and a
        false match probes again as ``find`` does. Against loads in the first two passes: 5.06-5.24M against
        4.84-5.06M lookups/s at 100M entries, 5.8-5.9M against 5.25-5.3M at 10M (64-key prefixes, 2026-12-02)."""
        n = (len(j0) + 1) // 17
        if len(j0) != 17 * n - 1 or len(j1) != len(j0) or n != len(out):  # out: one row per key
            return 0
        for i in range(n - 1):
            if j0[17 * i + 16] != 0 or j1[17 * i + 16] != 1:
                return 0
        nslots, seed = params[0], params[1]
        ns, check_ns = nsq & 0xFFFF, nsq >> 16
        slots, rows, spaces = words.ctypes.data, keys.ctypes.data, nss.ctypes.data
        for i in range(n):  # no scratch arrays: out holds each key's start and tag, then its candidate
            pos, tag = _hash(_word(j0, 17 * i), _word(j0, 17 * i + 8), ns, seed, nslots)
            out[i] = pos | numba.int64(tag) << 32  # pos < 2**32: a table holds at most 2**28 entries
            _prefetch(slots + 4 * pos)
        for i in range(n):
            pos, tag, e = out[i] & 0xFFFFFFFF, numba.uint32(out[i] >> 32), -1
            while True:
                w = words[pos]
                if w == 0:
                    break
                if w != _TOMB and (w & numba.uint32(0xF0000000)) == tag:
                    e = numba.int64(w & numba.uint32(_LOW)) - 1
                    _prefetch(rows + 16 * e)
                    if check_ns:
                        _prefetch(spaces + nss.itemsize * e)
                    break
                pos += 1
            out[i] = e
        for i in range(n):
            e = out[i]
            if e >= 0:
                lo, hi = _word(j0, 17 * i), _word(j0, 17 * i + 8)
                if not (keys[e, 0] == lo and keys[e, 1] == hi and (not check_ns or nss[e] == ns)):
                    out[i] = _find1(words, nslots, seed, lo, hi, numba.uint16(ns), keys, nss)  # a false tag match
        return 1

    @numba.njit(cache=True, nogil=True)
    def insert_rows(  # type: ignore[no-untyped-def]
        words, nslots, seed, ids, q, fields, dtypes, parents, has_parent, ns, cols
    ):
        """Write the rows of new entries ``ids`` (keys ``q``) and link each to its parent: the entry just
        before when its key matches, else one in the index (``words``), else an earlier one of the batch.
        False, and nothing written, when a codec or dtype id does not fit the form byte."""
        keys, nss, stored, raw, crc, form, leases, parent, pgen, gen, depth, flags = cols
        for i in range(len(ids)):
            if not (0 <= fields[i, 3] < FORM_LIMIT and 0 <= dtypes[i] < FORM_LIMIT):
                return False
        for i in range(len(ids)):
            e = ids[i]
            keys[e, 0], keys[e, 1] = q[i, 0], q[i, 1]
            nss[e] = ns
            stored[e], raw[e], crc[e] = fields[i, 0], fields[i, 1], fields[i, 2]
            form[e] = fields[i, 3] | dtypes[i] << 4
            leases[e] = 0
            pid = -1
            if has_parent[i]:
                plo, phi = parents[i, 0], parents[i, 1]
                if i > 0 and plo == q[i - 1, 0] and phi == q[i - 1, 1]:
                    pid = ids[i - 1]
                else:
                    pid = _find1(words, nslots, seed, plo, phi, ns, keys, nss)
                    if pid < 0:
                        for j in range(i):
                            if q[j, 0] == plo and q[j, 1] == phi:
                                pid = ids[j]
                                break
            if pid >= 0:
                parent[e] = pid + 1
                pgen[e] = gen[pid]
                depth[e] = min(numba.int64(depth[pid]) + 1, MAX_DEPTH)
                flags[e] = 1 | 4 | (flags[pid] & 2)
            else:
                parent[e] = 0
                pgen[e] = 0
                depth[e] = 0
                flags[e] = 1 | 4 | (0 if has_parent[i] else 2)
        return True

    @numba.njit(cache=True, nogil=True)
    def place(words, nslots, seed, lo, hi, ns, ids, limit):  # type: ignore[no-untyped-def]
        reused = 0
        for i in range(len(lo)):
            pos, tag = _hash(lo[i], hi[i], ns[i], seed, nslots)
            while pos < limit:
                w = words[pos]
                if w == 0 or w == _TOMB:
                    if w == _TOMB:
                        reused += 1
                    words[pos] = tag | numba.uint32(ids[i] + 1)
                    break
                pos += 1
            if pos >= limit:
                return False, reused
        return True, reused

    @numba.njit(cache=True, nogil=True)
    def place_keys(words, nslots, seed, q, ns, ids, limit):  # type: ignore[no-untyped-def]
        """``place`` of keys given as (n, 2) words, all in namespace ``ns`` (every key's first slots prefetched
        before any is placed, as ``find_joined`` does)."""
        reused = 0
        slots = words.ctypes.data
        for i in range(len(q)):
            _prefetch(slots + 4 * _hash(q[i, 0], q[i, 1], ns, seed, nslots)[0])
        for i in range(len(q)):
            pos, tag = _hash(q[i, 0], q[i, 1], ns, seed, nslots)
            while pos < limit:
                w = words[pos]
                if w == 0 or w == _TOMB:
                    if w == _TOMB:
                        reused += 1
                    words[pos] = tag | numba.uint32(ids[i] + 1)
                    break
                pos += 1
            if pos >= limit:
                return False, reused
        return True, reused

    @numba.njit(cache=True, nogil=True)
    def remove(words, nslots, seed, lo, hi, ns, ids):  # type: ignore[no-untyped-def]
        found = 0
        for i in range(len(lo)):
            pos, tag = _hash(lo[i], hi[i], ns[i], seed, nslots)
            want = tag | numba.uint32(ids[i] + 1)
            while True:
                w = words[pos]
                if w == want:
                    words[pos] = numba.uint32(_TOMB)
                    found += 1
                    break
                if w == 0:
                    break
                pos += 1
        return found
else:  # pragma: no cover
    find = find_one = find_keys = find_joined = insert_rows = place = place_keys = remove = None


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel once, so no request pays for it."""
    if not AVAILABLE:
        return
    words = np.zeros(64, dtype=np.uint32)
    z64, z16 = np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint16)
    ids = np.zeros(1, dtype=np.int64)
    keys, nss = np.zeros((4, 2), dtype=np.uint64), np.zeros(4, dtype=np.uint16)
    place(words, 16, np.uint64(1), z64, z64, z16, ids, 48)
    find(words, 16, np.uint64(1), z64, z64, z16, keys, nss, np.zeros(1, dtype=np.int64))
    find_one(words, 16, np.uint64(1), np.uint64(1), np.uint64(1), 0, keys, nss)
    find_keys(words, 16, np.uint64(1), np.zeros((1, 2), dtype=np.uint64), 0, keys, nss, np.zeros(1, dtype=np.int64))
    place_keys(words, 16, np.uint64(1), np.zeros((1, 2), dtype=np.uint64), 0, ids, 48)
    remove(words, 16, np.uint64(1), z64, z64, z16, ids)
    params = np.array([16, 1, 0], dtype=np.uint64)
    find_joined(words, params, bytes(16), bytes(16), 1 << 16, keys, nss, np.zeros(1, dtype=np.int64))
