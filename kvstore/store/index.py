"""The block index: (namespace, hash) -> entry id, with every per-entry field in packed columns.

No Python object per block: fields live in numpy columns that grow without
copying (kvstore/store/columns.py: zeroed reservations whose untouched pages
cost nothing) and keys are found through an open-addressing table of uint32
slots (kvstore/store/slots.py, probed by compiled loops when numba is there,
kvstore/store/slots_jit.py, else by numpy). An entry of a store with one memory
tier costs 53 bytes of columns plus 4.7-6.8 bytes of slots (``python -m
bench.index_scale``; figures in README.md):

    key 16 (two uint64)  ns 2  per tier: loc 4 or 8 (+1, 0 = none), nchild 2
    (uint16; the rare counts of 65535 or more in a dict beside it: a shared prefix may have any number)
    stored_len 4  raw_len 4  crc 4  form 1 (codec id 4 bits, dtype id 4 bits)
    parent 4 (+1)  gen 4  parent_gen 4  depth 1 (saturating at 255: a hint for
    policies, nothing reads it as an address)  leases 2  flags 1 (live, rooted, mapped)

A codec id above 15 or a dtype id above 15 does not fit and is refused (ValueError, nothing inserted).

Only the ranks of the store's tiers get loc/nchild columns, each as wide as the
tier's ``loc_bits`` (64 unless the tier says less). Entry ids are stable for
an entry's life, then reused (``gen`` tells a parent link to a reused id apart).

Verbs, single (one compiled or Python-int probe) and batched (one call for a
whole prefix):

- ``namespace_id(name, create)`` / ``namespace_name(ns)``;
- ``find(ns, key) -> e | None``, ``find_many(ns, keys) -> ids`` (-1: absent; with numba, one compiled
  call that reads the keys out of two joins, slots_jit.find_joined);
- ``insert(ns, key, meta, dtype) -> e``, ``insert_many(ns, metas, dtypes) -> ids``,
  ``insert_arrays(ns, keys, fields, dtypes, parents, has_parent) -> ids``
  (keys absent and distinct; a parent may come earlier in the same batch);
- ``reserve(n)``: size the slot table for ``n`` more entries at once;
- ``parent_of(e)``, ``parents_of(ids)``, ``add_children(parents, rank)``, ``add_copies(ids, rank)`` (both, for
  entries just given a copy: compiled, kvstore/store/children_jit.py), ``meta(e)``, ``key(e)``;
- ``unmap(e)``: lookups miss from now on; ``release_id(e)``: the id is free;
- ``loc_of`` / ``set_loc`` / ``locs`` / ``top_ranks`` / ``resident`` /
  ``without_copy`` / ``find_locs``: which tiers hold copies, and where.

Callers outside the store read the columns under their old names: ``loc[e,
rank]``, ``loc[ids]`` (rows of ``N_RANKS`` ints), ``live``, ``ns``,
``stored_len``, ``hashes[ids]``, ``leases``, ``fp[e]``, ... (kvstore/store/index_views.py:
ints and numpy arrays out; a slice is a read-only copy).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from kvstore.store import children_jit, slots_jit
from kvstore.store.columns import Column, CountColumn, Field
from kvstore.store.index_views import (
    CountView,
    FieldView,
    FingerprintView,
    FlagView,
    HashView,
    RankedView,
    ScalarView,
)
from kvstore.store.slots import SlotIndex
from kvstore.tiers.base import BlockMeta

NO_LOC = -1
N_RANKS = 4  # ranks 1..3 used (HBM, DRAM, NVME); column 0 unused so ranks index directly

DTYPES = ["", "bfloat16", "float16", "float32", "float8_e4m3fn", "uint8", "int8"]
_DTYPE_ID = {name: i for i, name in enumerate(DTYPES)}

LIVE, ROOTED, MAPPED = 1, 2, 4
MAX_DEPTH = slots_jit.MAX_DEPTH  # depth saturates here (it is a hint for policies, not an address)
MAX_LEASES = 0xFFFF
CODEC_BITS = DTYPE_BITS = 4  # codec wire id and dtype id share one byte ("form"): codec low, dtype high
MAX_CODEC = (1 << CODEC_BITS) - 1
assert len(DTYPES) <= 1 << DTYPE_BITS

_M64 = (1 << 64) - 1
_FP_MIX = 0x9E3779B97F4A7C15


def block_fingerprint(key: bytes, ns: int) -> int:
    """A 64-bit digest of (namespace, 16-byte block hash): what the eviction policies count uses by."""
    k = int.from_bytes(key, "little")
    return ((k ^ (k >> 64)) + ns * _FP_MIX) & _M64


def dtype_id(name: str) -> int:
    try:
        return _DTYPE_ID[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(d for d in DTYPES if d)}") from None


def _key_words(keys: Sequence[bytes]) -> np.ndarray | None:
    """(n, 2) uint64 words of 16-byte keys, None when any key is not 16 bytes."""
    buf = b"".join(keys)
    if len(buf) != 16 * len(keys) or set(map(len, keys)) != {16}:
        return None
    return np.frombuffer(buf, dtype=np.uint64).reshape(-1, 2)


class EntryTable:
    if TYPE_CHECKING:  # the columns' views (leases, stored_len, ns, dtype, ...) are set per name in __init__

        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, initial: int = 1024, ranks: Mapping[int, int] | Sequence[int] | None = None, jit: bool = True):
        """``ranks``: the tier ranks entries may hold copies in, each with its location width in bits
        (a sequence means 64 bits each); all ranks at 64 bits by default. ``jit=False`` keeps the slot
        index on its numpy path even where the compiled kernels are available (kvstore/store/slots_jit.py)."""
        if ranks is None:
            ranks = {r: 64 for r in range(1, N_RANKS)}
        elif not isinstance(ranks, Mapping):
            ranks = {r: 64 for r in ranks}
        self.ranks = tuple(sorted(ranks))
        self._namespaces: dict[str, int] = {}
        self._ns_names: list[str] = []
        self._size = 0  # ids 0.._size-1 were handed out at least once
        self._live = 0
        self._free = np.zeros(64, dtype=np.int64)
        self._nfree = 0
        c = self._c = {
            "key": Column(np.uint64, (2,)),
            "ns": Column(np.uint16),
            "stored_len": Column(np.uint32),
            "raw_len": Column(np.uint32),
            "crc": Column(np.uint32),
            "form": Column(np.uint8),  # codec | dtype << CODEC_BITS
            "parent": Column(np.uint32),  # parent id + 1; 0: none
            "parent_gen": Column(np.uint32),
            "gen": Column(np.uint32),
            "depth": Column(np.uint8),
            "leases": Column(np.uint16),
            "flags": Column(np.uint8),
        }
        self._loc = {r: Column(np.uint32 if bits <= 32 else np.uint64) for r, bits in ranks.items()}  # loc + 1
        self._nchild = {r: CountColumn() for r in ranks}  # children holding a copy in each tier (uint16 + wide)
        self._cols = list(c.values()) + list(self._loc.values()) + list(self._nchild.values())
        self._keys, self._ns, self._flags = c["key"], c["ns"], c["flags"]
        self._fields = {"codec": Field(c["form"], 0, CODEC_BITS), "dtype": Field(c["form"], CODEC_BITS, DTYPE_BITS)}
        self._rows = 0  # every column has room for this many entries
        self._row_bases: tuple[np.ndarray, ...] = ()
        self.slots = SlotIndex(self._keys_of, self._key_at, jit_keys=(self._keys, self._ns) if jit else None)
        self.slots.all_keys = self._all_keys
        self._ensure(max(initial, 1))
        size = self._count
        self.loc = RankedView(self._loc, size, offset=1)
        self.nchild = CountView(self._nchild, size)
        for name in ("stored_len", "raw_len", "crc", "ns", "parent_gen", "gen", "depth", "leases"):
            setattr(self, name, ScalarView(c[name], size))
        self.codec = FieldView(self._fields["codec"], size)
        self.dtype = FieldView(self._fields["dtype"], size)
        self.parent = ScalarView(c["parent"], size, offset=1)
        self.live = FlagView(self._flags, LIVE, size)
        self.mapped = FlagView(self._flags, MAPPED, size)  # live and not deleted: lookups find it
        self.rooted = FlagView(self._flags, ROOTED, size)
        self.hashes = HashView(self._keys, size)
        self.fp = FingerprintView(self._keys, self._ns, size)

    def _count(self) -> int:
        return self._size

    def _ensure(self, n: int) -> None:
        if n > self._rows:
            for col in self._cols:
                col.ensure(n)
            self._rows = self._keys.rows
            self._row_bases = tuple(self._c[name].base for name in self._ROW_COLUMNS)

    # -- callbacks of the slot index ------------------------------------------------
    def _key_at(self, e: int) -> tuple[int, int, int]:
        keys = self._keys.base
        return keys.item(e, 0), keys.item(e, 1), self._ns.base.item(e)

    def _keys_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = self._keys.take(ids)
        return k[:, 0], k[:, 1], self._ns.take(ids)

    def _all_keys(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        ids = np.nonzero(self._flags.head(self._size) & MAPPED)[0]
        lo, hi, ns = self._keys_of(ids) if len(ids) else (np.zeros(0, np.uint64),) * 2 + (np.zeros(0, np.uint16),)
        return lo, hi, ns, ids

    # -- namespaces -------------------------------------------------------------
    def namespace_id(self, name: str, create: bool = False) -> int | None:
        ns = self._namespaces.get(name)
        if ns is None and create:
            if len(self._ns_names) >= np.iinfo(np.uint16).max:
                raise ValueError("too many namespaces on this node")
            ns = len(self._ns_names)
            self._namespaces[name] = ns
            self._ns_names.append(name)
        return ns

    def namespace_name(self, ns: int) -> str:
        return self._ns_names[ns]

    # -- lookups ---------------------------------------------------------------
    def find(self, ns: int | None, key: bytes) -> int | None:
        if ns is None or len(key) != 16:
            return None
        e = self.slots.find1(int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little"), ns)
        return None if e < 0 else e

    def find_many(self, ns: int | None, keys: Sequence[bytes]) -> np.ndarray:
        """Entry id of each key, -1 where absent (one vectorized probe for the batch)."""
        if ns is None or not keys:
            return np.full(len(keys), -1, dtype=np.int64)
        sl = self.slots
        if sl.jit_keys is not None and sl.used:
            # the compiled path reads the keys out of two joins (which also prove every key is 16 bytes);
            # with one namespace on the node, every entry is in it and namespaces need not be compared
            out = np.empty(len(keys), dtype=np.int64)
            nsq = ns if ns == 0 and len(self._ns_names) == 1 else ns | 1 << 16
            j0, j1 = b"\x00".join(keys), b"\x01".join(keys)
            if slots_jit.find_joined(sl.words, sl.params, j0, j1, nsq, self._keys.base, self._ns.base, out):
                return out
        words = _key_words(keys)
        if words is None or (len(keys) < 8 and self.slots.jit_keys is None):
            # a few keys: the Python-int probe is cheaper than the numpy calls of a vectorized one
            return np.array([-1 if (e := self.find(ns, k)) is None else e for k in keys], dtype=np.int64)
        return self.slots.find_keys(words, ns)

    # -- inserts ---------------------------------------------------------------
    def _new_ids(self, n: int) -> np.ndarray:
        if not self._nfree:
            ids = np.arange(self._size, self._size + n, dtype=np.int64)
            self._size += n
            self._ensure(self._size)
            return ids
        take = min(n, self._nfree)
        ids = self._free[self._nfree - take : self._nfree][::-1].copy()
        self._nfree -= take
        if take < n:
            fresh = np.arange(self._size, self._size + n - take, dtype=np.int64)
            self._size += n - take
            self._ensure(self._size)
            ids = np.concatenate([ids, fresh])
        return ids

    def insert(self, ns: int, key: bytes, meta: BlockMeta, dtype: int) -> int:
        if len(key) != 16:
            raise ValueError(f"block hash must be 16 bytes, got {len(key)}")
        if not (0 <= meta.codec <= MAX_CODEC and 0 <= dtype < len(DTYPES)):
            raise ValueError(f"codec id {meta.codec} or dtype id {dtype} does not fit the index")
        if self._nfree:
            self._nfree -= 1
            e = int(self._free[self._nfree])
        else:
            e = self._size
            self._size += 1
            self._ensure(self._size)
        c = self._c
        lo, hi = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
        krow = c["key"].base[e]
        krow[0], krow[1] = lo, hi
        c["ns"].base[e] = ns
        c["stored_len"].base[e] = meta.stored_length
        c["raw_len"].base[e] = meta.raw_length
        c["crc"].base[e] = meta.crc32c
        c["form"].base[e] = meta.codec | dtype << CODEC_BITS
        c["leases"].base[e] = 0
        for col in self._loc.values():
            col.base[e] = 0
        for count in self._nchild.values():
            count.set(e, 0)
        parent = self.find(ns, meta.parent) if meta.parent else None
        if parent is None:
            c["parent"].base[e] = 0
            c["parent_gen"].base[e] = 0
            c["depth"].base[e] = 0
            rooted = not meta.parent
        else:
            c["parent"].base[e] = parent + 1
            c["parent_gen"].base[e] = c["gen"].get(parent)
            c["depth"].base[e] = min(c["depth"].get(parent) + 1, MAX_DEPTH)
            rooted = bool(self._flags.get(parent) & ROOTED)
        self._flags.base[e] = LIVE | MAPPED | (ROOTED if rooted else 0)
        self._live += 1
        self.slots.add1(lo, hi, ns, e)
        return e

    def insert_many(self, ns: int, metas: Sequence[BlockMeta], dtypes: Sequence[int]) -> np.ndarray:
        """Insert blocks whose keys are absent and distinct, in order (a block's parent may be an earlier one)."""
        n = len(metas)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        words = _key_words([m.hash for m in metas])
        if words is None:
            raise ValueError("block hashes must be 16 bytes")
        fields = np.array([(m.stored_length, m.raw_length, m.crc32c, m.codec) for m in metas], dtype=np.int64)
        has_parent = np.fromiter((bool(m.parent) for m in metas), dtype=np.bool_, count=n)
        parents = np.zeros((n, 2), dtype=np.uint64)
        if has_parent.any():
            pw = _key_words([m.parent for m in metas if m.parent])
            if pw is not None:
                parents[has_parent] = pw
            else:  # a parent hash that is not 16 bytes can never be found: such a block is unreachable
                for i, m in enumerate(metas):
                    if m.parent and len(m.parent) == 16:
                        parents[i] = np.frombuffer(m.parent, dtype=np.uint64)
                    elif m.parent:
                        parents[i] = (0, 0)
        return self.insert_arrays(ns, words, fields, np.asarray(dtypes, dtype=np.uint8), parents, has_parent)

    def insert_arrays(
        self,
        ns: int,
        keys: np.ndarray,
        fields: np.ndarray,
        dtypes: np.ndarray,
        parents: np.ndarray,
        has_parent: np.ndarray,
    ) -> np.ndarray:
        """``insert_many`` from arrays: keys and parent keys as (n, 2) uint64 words, ``fields`` as
        (n, 4) ints (stored_len, raw_len, crc, codec), ``has_parent`` as bools."""
        n = len(keys)
        if self.slots.jit_keys is not None:
            return self._insert_compiled(ns, self._new_ids(n), keys, fields, dtypes, parents, has_parent)
        self._fields["codec"].check(fields[:, 3])
        self._fields["dtype"].check(dtypes)
        ids = self._new_ids(n)
        c = self._c
        c["key"].put(ids, keys)
        c["ns"].put(ids, ns)
        c["stored_len"].put(ids, fields[:, 0])
        c["raw_len"].put(ids, fields[:, 1])
        c["crc"].put(ids, fields[:, 2])
        c["form"].put(ids, np.asarray(fields[:, 3], dtype=np.uint8) | np.asarray(dtypes, dtype=np.uint8) << CODEC_BITS)
        for col in (c["leases"], *self._loc.values(), *self._nchild.values()):
            col.put(ids, 0)
        # parents: most often the block just before (a chain), else in the index, rarely elsewhere in the batch
        prev = np.zeros(n, dtype=np.bool_)
        if n > 1:
            prev[1:] = has_parent[1:] & (parents[1:] == keys[:-1]).all(axis=1)
        outside = has_parent & ~prev
        pid = np.full(n, -1, dtype=np.int64)
        if outside.any():
            q = parents[outside]
            pid[outside] = self.slots.find(q[:, 0].copy(), q[:, 1].copy(), np.full(len(q), ns, dtype=np.uint16))
        pid[prev] = ids[np.nonzero(prev)[0] - 1]
        inbatch = outside & (pid < 0)
        if inbatch.any():  # a parent earlier in the batch but not just before: look it up by key
            pos = {keys[i].tobytes(): i for i in range(n)}
            for i in np.nonzero(inbatch)[0].tolist():
                j = pos.get(parents[i].tobytes(), n)
                if j < i:
                    pid[i] = ids[j]
        known = outside & (pid >= 0)
        depth = np.zeros(n, dtype=np.int64)
        rooted = ~has_parent
        if known.any():
            q = pid[known]
            depth[known] = c["depth"].take(q).astype(np.int64) + 1
            rooted[known] = (self._flags.take(q) & ROOTED) != 0
        if prev.any():  # along a run of links to the block before: depth counts up, rootedness is the run's
            idx = np.arange(n)
            head = np.maximum.accumulate(np.where(prev, 0, idx))
            depth = depth[head] + (idx - head)
            rooted = rooted[head]
        if (inbatch & (pid >= 0)).any():  # the rare links elsewhere in the batch, in order
            d, rt, pl, il = depth.tolist(), rooted.tolist(), pid.tolist(), ids.tolist()
            where = {e: i for i, e in enumerate(il)}
            for i in range(n):
                j = where.get(pl[i], n) if pl[i] >= 0 else n
                if j < i:
                    d[i], rt[i] = d[j] + 1, rt[j]
            depth, rooted = np.asarray(d), np.asarray(rt, dtype=np.bool_)
        found = pid >= 0
        c["parent"].put(ids, pid + 1)
        c["parent_gen"].put(ids, np.where(found, c["gen"].take(np.maximum(pid, 0)), 0))
        c["depth"].put(ids, np.minimum(depth, MAX_DEPTH))
        self._flags.put(ids, np.where(rooted, LIVE | MAPPED | ROOTED, LIVE | MAPPED))
        self._live += n
        self.slots.add(keys[:, 0].copy(), keys[:, 1].copy(), np.full(n, ns, dtype=np.uint16), ids)
        return ids

    _ROW_COLUMNS = (
        "key", "ns", "stored_len", "raw_len", "crc", "form", "leases", "parent", "parent_gen", "gen", "depth",
        "flags",
    )  # fmt: skip

    def reserve(self, n: int) -> None:
        """Room for ``n`` more entries in the slot table now (one rebuild at most), e.g. before recovery."""
        self.slots.reserve(self.slots.used + n)

    def _insert_compiled(self, ns: int, ids: np.ndarray, keys: np.ndarray, fields: np.ndarray,
                         dtypes: np.ndarray, parents: np.ndarray, has_parent: np.ndarray) -> np.ndarray:  # fmt: skip
        """``insert_arrays`` in one compiled pass over the rows (kvstore/store/slots_jit.py)."""
        for col in (*self._loc.values(), *self._nchild.values()):
            col.put(ids, 0)
        sl = self.slots
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        fits = slots_jit.insert_rows(
            sl.words, sl.nslots, sl.seed, ids, keys, np.ascontiguousarray(fields, dtype=np.int64),
            np.ascontiguousarray(dtypes, dtype=np.int64), np.ascontiguousarray(parents, dtype=np.uint64),
            np.ascontiguousarray(has_parent, dtype=np.bool_), ns, self._row_bases,
        )  # fmt: skip
        if not fits:  # nothing was written: the ids go back
            for e in ids.tolist():
                self.release_id(e)
            raise ValueError(f"a codec id above {MAX_CODEC} or a dtype id above {len(DTYPES) - 1}: does not fit")
        self._live += len(ids)
        sl.add_keys(keys, ns, ids)
        return ids

    # -- entries -----------------------------------------------------------------
    def parent_of(self, e: int) -> int | None:
        """The parent entry, if it is still the same block that was the parent at insert."""
        p = self._c["parent"].base.item(e) - 1
        if p < 0 or not self._flags.get(p) & LIVE or self._c["gen"].get(p) != self._c["parent_gen"].base.item(e):
            return None
        return p

    def parents_of(self, ids: np.ndarray) -> np.ndarray:
        """``parent_of`` of many entries: the parent id, -1 where none (or no longer the same block)."""
        c = self._c
        p = c["parent"].take(ids).astype(np.int64) - 1
        q = np.maximum(p, 0)
        ok = (p >= 0) & ((self._flags.take(q) & LIVE) != 0) & (c["gen"].take(q) == c["parent_gen"].take(ids))
        return np.where(ok, p, -1)

    def add_children(self, parents: np.ndarray, rank: int) -> np.ndarray:
        """Count one more child with a copy in ``rank`` for each parent id >= 0 (repeats allowed); returns the
        parents whose count went up from 0 (they stopped being leaves of that tier)."""
        parents = parents[parents >= 0]
        if not len(parents):
            return parents
        col = self._nchild[rank]
        uniq, times = np.unique(parents, return_counts=True)
        count = col.take(uniq)
        col.put(uniq, count + times)
        return uniq[count == 0]

    def add_copies(self, ids: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Count distinct entries just given a copy in ``rank`` as their parents' children there: (whether each
        has no child with a copy in ``rank``, the parents outside ``ids`` that stopped being leaves of it). One
        compiled call where numba is there (kvstore/store/children_jit.py)."""
        if children_jit.AVAILABLE and len(ids):
            c, counts = self._c, self._nchild[rank]
            is_leaf = np.empty(len(ids), dtype=np.bool_)
            was_leaf = np.empty(len(ids), dtype=np.int64)
            k = children_jit.add_copies(
                c["parent"].base, c["parent_gen"].base, c["gen"].base, self._flags.base, counts.base,
                np.asarray(ids, dtype=np.int64), is_leaf, was_leaf,
            )  # fmt: skip
            if k >= 0:
                return is_leaf, was_leaf[:k]
        was_leaf = self.add_children(self.parents_of(ids), rank)
        return self._nchild[rank].take(ids) == 0, was_leaf[~np.isin(was_leaf, ids)]

    def is_mapped(self, e: int) -> bool:
        return bool(self._flags.get(e) & MAPPED)

    def unmap(self, e: int) -> None:
        """Lookups miss from now on; the id stays reserved until release_id()."""
        flags = self._flags.get(e)
        if flags & MAPPED:
            lo, hi, ns = self._key_at(e)
            self.slots.remove1(lo, hi, ns, e)
            self._flags.set(e, flags & ~MAPPED)

    def release_id(self, e: int) -> None:
        self.unmap(e)
        if self._flags.get(e) & LIVE:
            self._live -= 1
        self._flags.set(e, 0)
        gen = self._c["gen"]
        gen.set(e, (gen.get(e) + 1) & 0xFFFFFFFF)
        if self._nfree == len(self._free):
            self._free = np.concatenate([self._free, np.zeros(len(self._free), dtype=np.int64)])
        self._free[self._nfree] = e
        self._nfree += 1

    def key(self, e: int) -> bytes:
        return self._keys.row(e).tobytes()

    def meta(self, e: int) -> BlockMeta:
        p = self.parent_of(e)
        c = self._c
        return BlockMeta(
            namespace=self._ns_names[self._ns.get(e)],
            hash=self.key(e),
            parent=self.key(p) if p is not None else b"",
            codec=self._fields["codec"].get(e),
            dtype=DTYPES[self._fields["dtype"].get(e)],
            raw_length=c["raw_len"].get(e),
            stored_length=c["stored_len"].get(e),
            crc32c=c["crc"].get(e),
        )

    # -- copies ---------------------------------------------------------------------
    def loc_of(self, e: int, rank: int) -> int:
        col = self._loc.get(rank)
        return NO_LOC if col is None else col.base.item(e) - 1

    def set_loc(self, e: int, rank: int, loc: int) -> None:
        self._loc[rank].base[e] = loc + 1

    def nchild_add(self, e: int, rank: int, delta: int) -> int:
        """Add ``delta`` to e's count of children with a copy in ``rank``; returns the new count."""
        col = self._nchild[rank]
        v = col.get(e) + delta
        col.set(e, v)
        return v

    def locs(self, ids: np.ndarray, rank: int) -> np.ndarray:
        """Locations (int64, NO_LOC where none) of entries ``ids`` in tier ``rank``."""
        col = self._loc.get(rank)
        if col is None:
            return np.full(len(ids), NO_LOC, dtype=np.int64)
        return col.take(ids).astype(np.int64) - 1

    def top_ranks(self, ids: np.ndarray, ranks: Sequence[int]) -> np.ndarray:
        """The first rank of ``ranks`` (top tier first) holding a copy of each entry, 0 when none."""
        out = np.zeros(len(ids), dtype=np.int64)
        for rank in reversed(ranks):
            if rank in self._loc:
                out = np.where(self._loc[rank].take(ids) != 0, rank, out)
        return out

    def resident(self, rank: int) -> np.ndarray:
        """Ids of live entries holding a copy in ``rank``."""
        col = self._loc.get(rank)
        if col is None:
            return np.zeros(0, dtype=np.int64)
        n = self._size
        return np.nonzero((col.head(n) != 0) & ((self._flags.head(n) & LIVE) != 0))[0]

    def without_copy(self, rank: int) -> np.ndarray:
        """Ids of live entries with no copy in ``rank``."""
        n = self._size
        live = (self._flags.head(n) & LIVE) != 0
        col = self._loc.get(rank)
        return np.nonzero(live if col is None else live & (col.head(n) == 0))[0]

    def find_locs(self, rank: int, locs: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Entries whose copy in ``rank`` is at one of ``locs``: (ids, their locations)."""
        col = self._loc.get(rank)
        if col is None or not len(locs):
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        stored = col.head(self._size).astype(np.int64) - 1
        ids = np.nonzero(np.isin(stored, np.asarray(list(locs), dtype=np.int64)))[0]
        return ids, stored[ids]

    def entries_at(self, rank: int, lo: int, hi: int) -> np.ndarray:
        """Ids of the entries whose copy in ``rank`` lies at a location in ``[lo, hi)``: one scan of its column."""
        col = self._loc.get(rank)
        if col is None:
            return np.zeros(0, dtype=np.int64)
        raw = col.head(self._size)  # location + 1 (0: no copy, never in range for lo >= 0)
        return np.nonzero((raw > lo) & (raw <= hi))[0]

    def lease_many(self, ids: np.ndarray) -> None:
        leases = self._c["leases"]
        if len(ids) and int(leases.take(ids).max()) + len(ids) > MAX_LEASES:
            raise OverflowError(f"more than {MAX_LEASES} concurrent leases of one block")
        leases.add(ids, 1)

    @overload
    def column(self, name: Literal["codec", "dtype"]) -> Field: ...  # type: ignore[overload-overlap]
    @overload
    def column(self, name: str) -> Column: ...
    def column(self, name: str) -> Column | Field:
        """A column by name; ``codec`` and ``dtype`` are bit fields of the ``form`` column."""
        return self._fields[name] if name in self._fields else self._c[name]

    def column_of_loc(self, rank: int) -> Column:
        """The raw location column of ``rank`` (it stores location + 1; 0: no copy)."""
        return self._loc[rank]

    def __len__(self) -> int:
        return self._live

    def nbytes(self) -> int:
        """Bytes of the index: its columns (rows up to the high-water mark), the slot table and the free list."""
        return sum(col.nbytes() for col in self._cols) + self.slots.nbytes() + self._free.nbytes + sys.getsizeof(self)

    def bytes_per_entry(self) -> int:
        """Column bytes of one entry (without slots): what the packed layout costs per block."""
        return sum(col.dtype.itemsize * int(np.prod(col.inner or (1,))) for col in self._cols)
