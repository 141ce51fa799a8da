"""Open-addressing hash slots: (namespace, 16-byte key) -> entry id, in one flat numpy array.

The table holds no keys: a slot is one uint32 word, ``tag << 28 | (entry + 1)``
(0: empty, ``TOMB``: deleted), and a probe compares the key of a candidate
entry through ``keys_of(ids) -> (lo, hi, ns)``, given by the owner (the entry
columns in kvstore/store/index.py). The 4-bit tag, taken from hash bits the
position does not use, skips 15 of 16 foreign entries without touching their
keys. So the table costs 4 bytes per slot, about 5-7 bytes per entry at its
load of 0.55-0.85.

Verbs (each vectorized over a batch of keys given as uint64 halves and ns ids):

- ``find(lo, hi, ns) -> ids``: the entry of each key, -1 where absent;
- ``add(lo, hi, ns, ids)``: map keys known to be absent (and distinct) to ids,
  growing the table first when it would pass ``MAX_LOAD``;
- ``remove(lo, hi, ns, ids)``: the slots holding these ids become tombstones;
  tombstones count as load and are reused by ``add``, and a rebuild (to a
  larger size, or the same size when tombstones are most of the load) drops them;
- ``rebuild(lo, hi, ns, ids, nslots)``: place every live entry anew;
- ``reserve(live)``: grow at once to hold ``live`` entries (at load ``RESERVE_LOAD``).

Probing is linear, ``WINDOW`` slots per vectorized step, without wrap-around
(the array has ``PAD`` spare slots past ``nslots``; a probe never runs past
them because ``add`` grows the table before it would). Positions come from a
keyed multiply-xorshift of the key (``seed`` is random per table), so keys
chosen by a client cannot be aimed at one probe run without knowing the seed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.store import slots_jit

KeysOf = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
KeyAt = Callable[[int], tuple[int, int, int]]
_M64 = (1 << 64) - 1

ID_BITS = 28
ID_MASK = np.uint32((1 << ID_BITS) - 1)
MAX_ENTRIES = (1 << ID_BITS) - 2  # id + 1 must stay below ID_MASK, which marks a tombstone
TOMB = np.uint32(0xFFFFFFFF)
WINDOW = 8
PAD = 256
MAX_LOAD = 0.85
GROWTH = 1.45
RESERVE_LOAD = 0.7
MIN_SLOTS = 1024

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xC2B2AE3D27D4EB4F)
_M3 = np.uint64(0x165667B19E3779F9)
_M4 = np.uint64(0xD6E8FEB86659FD93)
_S31, _S32, _S28 = np.uint64(31), np.uint64(32), np.uint64(28)
_TAG = np.uint64(0xF)
_STEPS = np.arange(WINDOW, dtype=np.int64)
_TOMB, _LOW = int(TOMB), (1 << ID_BITS) - 1
_HIGH = 0xFFFFFFFF ^ _LOW


def _libc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_TRIM = _libc_trim()


def release_free_heap() -> None:
    """Hand the heap's free pages back to the kernel (glibc ``malloc_trim``). A rebuild frees its scratch
    arrays (26 bytes per entry) and the old table; below glibc's mmap threshold (raised to up to 32 MiB by
    the first large free) they were carved from the heap, where freed pages stay resident: measured at
    10M entries, 1.6 bytes per entry of RSS that the index no longer used."""
    if _TRIM is not None:
        _TRIM(0)


class SlotIndex:
    def __init__(
        self,
        keys_of: KeysOf,
        key_at: KeyAt,
        nslots: int = MIN_SLOTS,
        seed: int | None = None,
        jit_keys: tuple[Any, Any] | None = None,
    ):
        """``jit_keys``: the owner's key and ns columns, when each keeps its rows in one ``base`` array the
        compiled kernels can index; without them (or without numba) every batch goes through numpy."""
        self.keys_of, self.key_at = keys_of, key_at
        self.jit_keys = jit_keys if slots_jit.AVAILABLE else None
        self.seed = np.uint64(int.from_bytes(os.urandom(8), "little") if seed is None else seed)
        self.used = 0  # live entries
        self.tombs = 0
        self._alloc(nslots)

    def _alloc(self, nslots: int) -> None:
        self.nslots = max(int(nslots), MIN_SLOTS)
        self.params = np.array([self.nslots, self.seed, 0], dtype=np.uint64)  # what find_joined takes
        # PAD usable slots past nslots, then WINDOW always empty so a window read never leaves the array
        self.words = np.zeros(self.nslots + PAD + WINDOW, dtype=np.uint32)

    def nbytes(self) -> int:
        return int(self.words.nbytes)

    def load(self) -> float:
        return (self.used + self.tombs) / self.nslots

    # -- hashing ------------------------------------------------------------------
    def _hash(self, lo: np.ndarray, hi: np.ndarray, ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start position as int64, tag word as uint32) of each key."""
        with np.errstate(over="ignore"):
            h = (lo * _M1) ^ (hi * _M2) ^ ((ns.astype(np.uint64) + self.seed) * _M3)
            h ^= h >> _S31
            h *= _M4
        pos = (((h >> _S32) * np.uint64(self.nslots)) >> _S32).astype(np.int64)
        tag = (((h >> _S28) & _TAG).astype(np.uint32)) << np.uint32(ID_BITS)
        return pos, tag

    def _hash1(self, lo: int, hi: int, ns: int) -> tuple[int, int]:
        """``_hash`` of one key in Python ints (the same bits): one key costs a few us less this way."""
        h = (
            (lo * 0x9E3779B97F4A7C15)
            ^ (hi * 0xC2B2AE3D27D4EB4F)
            ^ (((ns + int(self.seed)) & _M64) * 0x165667B19E3779F9)
        ) & _M64
        h ^= h >> 31
        h = (h * 0xD6E8FEB86659FD93) & _M64
        return ((h >> 32) * self.nslots) >> 32, ((h >> 28) & 0xF) << ID_BITS

    # -- one key (Python ints; a numpy call costs more than a whole probe here) --------
    def find1(self, lo: int, hi: int, ns: int) -> int:
        if self.used == 0:
            return -1
        if self.jit_keys is not None:
            keys, nss = self.jit_keys
            u64 = np.uint64
            return int(
                slots_jit.find_one(self.words, self.nslots, self.seed, u64(lo), u64(hi), ns, keys.base, nss.base)
            )
        pos, tag = self._hash1(lo, hi, ns)
        item = self.words.item
        while True:
            w = item(pos)
            if w == 0:
                return -1
            if w != _TOMB and (w & _HIGH) == tag:
                e = (w & _LOW) - 1
                if self.key_at(e) == (lo, hi, ns):
                    return e
            pos += 1

    def add1(self, lo: int, hi: int, ns: int, e: int) -> None:
        if self.used + 1 > MAX_ENTRIES:
            raise OverflowError(f"the slot index holds at most {MAX_ENTRIES} entries")
        if self.used + self.tombs + 1 > MAX_LOAD * self.nslots:
            self._grow(self.used + 1)
            return
        pos, tag = self._hash1(lo, hi, ns)
        item, limit = self.words.item, self.nslots + PAD
        while pos < limit:
            w = item(pos)
            if w == 0 or w == _TOMB:
                self.tombs -= w == _TOMB
                self.words[pos] = tag | (e + 1)
                self.used += 1
                return
            pos += 1
        self._grow(self.used + 1, force=True)

    def remove1(self, lo: int, hi: int, ns: int, e: int) -> None:
        pos, tag = self._hash1(lo, hi, ns)
        want, item = tag | (e + 1), self.words.item
        while True:
            w = item(pos)
            if w == want:
                self.words[pos] = TOMB
                self.used -= 1
                self.tombs += 1
                return
            if w == 0:
                raise KeyError("slot index: removing an entry that is not mapped")
            pos += 1

    # -- verbs ----------------------------------------------------------------------
    def find(self, lo: np.ndarray, hi: np.ndarray, ns: np.ndarray) -> np.ndarray:
        n = len(lo)
        if self.jit_keys is not None and n and self.used:
            found = np.empty(n, dtype=np.int64)
            keys, nss = self.jit_keys
            slots_jit.find(self.words, self.nslots, self.seed, lo, hi, ns, keys.base, nss.base, found)
            return found
        out = np.full(n, -1, dtype=np.int64)
        if n == 0 or self.used == 0:
            return out
        start, tag = self._hash(lo, hi, ns)
        rows = np.arange(n)
        words = self.words
        while True:
            win = words[start[:, None] + _STEPS]
            cand = ((win & ~ID_MASK) == tag[:, None]) & (win != 0) & (win != TOMB)
            ci, cj = np.nonzero(cand)
            if len(ci):
                ids = (win[ci, cj] & ID_MASK).astype(np.int64) - 1
                klo, khi, kns = self.keys_of(ids)
                r = rows[ci]
                ok = (klo == lo[r]) & (khi == hi[r]) & (kns == ns[r])
                out[r[ok]] = ids[ok]
                found = np.zeros(len(rows), dtype=np.bool_)
                found[ci[ok]] = True
            else:
                found = np.zeros(len(rows), dtype=np.bool_)
            more = ~found & ~(win == 0).any(axis=1)  # no empty slot yet: the key may lie further on
            if not more.any():
                return out
            rows, start, tag = rows[more], start[more] + WINDOW, tag[more]

    def find_keys(self, q: np.ndarray, ns: int) -> np.ndarray:
        """``find`` of keys given as (n, 2) uint64 words, all in namespace ``ns``."""
        if self.jit_keys is not None and self.used:
            found = np.empty(len(q), dtype=np.int64)
            keys, nss = self.jit_keys
            slots_jit.find_keys(self.words, self.nslots, self.seed, q, ns, keys.base, nss.base, found)
            return found
        return self.find(q[:, 0].copy(), q[:, 1].copy(), np.full(len(q), ns, dtype=np.uint16))

    def add_keys(self, q: np.ndarray, ns: int, ids: np.ndarray) -> None:
        """``add`` of keys given as (n, 2) uint64 words, all in namespace ``ns``."""
        n = len(q)
        if self.jit_keys is None or self.used + self.tombs + n > MAX_LOAD * self.nslots or self.used + n > MAX_ENTRIES:
            self.add(q[:, 0].copy(), q[:, 1].copy(), np.full(n, ns, dtype=np.uint16), ids)
            return
        ok, reused = slots_jit.place_keys(self.words, self.nslots, self.seed, q, ns, ids, self.nslots + PAD)
        self.tombs -= reused
        if not ok:
            self._grow(self.used + n, force=True)
            return
        self.used += n

    def add(self, lo: np.ndarray, hi: np.ndarray, ns: np.ndarray, ids: np.ndarray) -> None:
        """Map keys known to be absent (and distinct) to ``ids``; ``all_keys()`` must already list them,
        since growth rebuilds the table from it (and so places this batch too)."""
        n = len(lo)
        if n == 0:
            return
        if self.used + n > MAX_ENTRIES:
            raise OverflowError(f"the slot index holds at most {MAX_ENTRIES} entries")
        if self.used + self.tombs + n > MAX_LOAD * self.nslots:
            self._grow(self.used + n)
            return
        if not self._place(lo, hi, ns, ids):
            self._grow(self.used + n, force=True)
            return
        self.used += n

    def _place(self, lo: np.ndarray, hi: np.ndarray, ns: np.ndarray, ids: np.ndarray) -> bool:
        """Write each id into the first free (empty or tombstone) slot of its run; False if one ran off the end."""
        limit = self.nslots + PAD
        if self.jit_keys is not None:
            ok, reused = slots_jit.place(self.words, self.nslots, self.seed, lo, hi, ns, ids, limit)
            self.tombs -= reused
            return bool(ok)
        start, tag = self._hash(lo, hi, ns)
        new_words = tag | (ids.astype(np.uint32) + np.uint32(1))
        words = self.words
        pending = np.arange(len(start))
        while len(pending):
            s = start[pending]
            win = words[s[:, None] + _STEPS]
            free = (win == 0) | (win == TOMB)
            has = free.any(axis=1)
            target = s + np.argmax(free, axis=1)
            if (target[has] >= limit).any() or (s[~has] + WINDOW >= limit).any():
                return False
            # two keys of the batch may pick the same slot: the first wins, the others look again
            t_ok, r_ok = target[has], pending[has]
            _, first = np.unique(t_ok, return_index=True)
            win_rows, win_slots = r_ok[first], t_ok[first]
            self.tombs -= int(np.count_nonzero(words[win_slots] == TOMB))
            words[win_slots] = new_words[win_rows]
            start[pending[~has]] += WINDOW
            placed = np.zeros(len(start), dtype=np.bool_)
            placed[win_rows] = True
            pending = pending[~placed[pending]]
        return True

    def remove(self, lo: np.ndarray, hi: np.ndarray, ns: np.ndarray, ids: np.ndarray) -> None:
        """Tombstone the slots of (key, id) pairs; every pair must be present."""
        n = len(lo)
        if n == 0:
            return
        if self.jit_keys is not None:
            if slots_jit.remove(self.words, self.nslots, self.seed, lo, hi, ns, ids) != n:
                raise KeyError("slot index: removing an entry that is not mapped")
            self.used -= n
            self.tombs += n
            return
        start, tag = self._hash(lo, hi, ns)
        want = tag | (ids.astype(np.uint32) + np.uint32(1))
        words = self.words
        rows = np.arange(n)
        while len(rows):
            s = start[rows]
            win = words[s[:, None] + _STEPS]
            hit = win == want[rows, None]
            has = hit.any(axis=1)
            if (~has & (win == 0).any(axis=1)).any():
                raise KeyError("slot index: removing an entry that is not mapped")
            slots = s[has] + np.argmax(hit[has], axis=1)
            words[slots] = TOMB
            start[rows[~has]] += WINDOW
            rows = rows[~has]
        self.used -= n
        self.tombs += n

    # -- growth -------------------------------------------------------------------------
    all_keys: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] | None = None

    def _grow(self, live: int, force: bool = False) -> None:
        """Rebuild: larger unless purging the tombstones alone brings the load down to what growth would."""
        nslots = self.nslots
        if force or live > (MAX_LOAD / GROWTH) * nslots:
            nslots = int(max(nslots * GROWTH, live / (MAX_LOAD / GROWTH)))
        self.rebuild_all(nslots)

    def reserve(self, live: int) -> None:
        """Make room for ``live`` entries in one rebuild (to a load of ``RESERVE_LOAD``), if they do not fit."""
        if live + self.tombs > MAX_LOAD * self.nslots:
            self.rebuild_all(int(live / RESERVE_LOAD) + 1)

    def rebuild_all(self, nslots: int | None = None) -> None:
        """Place every live entry into a fresh table (``all_keys`` is set by the owner)."""
        assert self.all_keys is not None, "the owner must set all_keys before the table can grow"
        lo, hi, ns, ids = self.all_keys()
        self.rebuild(lo, hi, ns, ids, self.nslots if nslots is None else nslots)
        del lo, hi, ns, ids
        release_free_heap()

    def rebuild(self, lo: np.ndarray, hi: np.ndarray, ns: np.ndarray, ids: np.ndarray, nslots: int) -> None:
        while True:
            self._alloc(nslots)
            self.tombs = 0
            if len(lo) == 0:
                self.used = 0
                return
            if self.jit_keys is not None:  # one compiled pass in key order: no sort needed
                if self._place(lo, hi, ns, ids):
                    self.used = len(lo)
                    return
                nslots = int(nslots * 1.1) + PAD
                continue
            start, tag = self._hash(lo, hi, ns)
            new_words = tag | (ids.astype(np.uint32) + np.uint32(1))
            # linear probing in order of start position: final = i + running max of (start - i)
            order = np.argsort(start, kind="stable")
            s = start[order]
            i = np.arange(len(s), dtype=np.int64)
            final = np.maximum.accumulate(s - i) + i
            if final[-1] < self.nslots + PAD:
                self.words[final] = new_words[order]
                self.used = len(lo)
                return
            nslots = int(nslots * 1.1) + PAD
