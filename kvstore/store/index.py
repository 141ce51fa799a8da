"""The block index: (namespace, hash) -> entry id, with per-entry state in numpy columns.

Per block the only Python objects are the 16-byte key and its dict slot; every
other field lives in a column (growing by doubling), so millions of blocks cost
a few hundred bytes each (measured by bench/transfer.py and tests/test_index.py).

An entry can hold a copy in several tiers at once (a block promoted from NVMe
to DRAM keeps its clean NVMe copy, so demoting it again is free): ``loc[e, r]``
is the location in the tier of rank r, or -1.
"""

from __future__ import annotations

import numpy as np

from kvstore.tiers.base import BlockMeta

NO_LOC = -1
N_RANKS = 4  # ranks 1..3 used (HBM, DRAM, NVME); column 0 unused so ranks index directly

DTYPES = ["", "bfloat16", "float16", "float32", "float8_e4m3fn", "uint8", "int8"]
_DTYPE_ID = {name: i for i, name in enumerate(DTYPES)}


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


class EntryTable:
    def __init__(self, initial: int = 1024):
        self._namespaces: dict[str, int] = {}
        self._ns_names: list[str] = []
        self._maps: list[dict[bytes, int]] = []
        self._free: list[int] = []
        self._size = 0
        self._alloc_columns(initial)

    def _alloc_columns(self, n: int) -> None:
        self.loc = np.full((n, N_RANKS), NO_LOC, dtype=np.int64)
        self.nchild = np.zeros((n, N_RANKS), dtype=np.int32)  # children holding a copy in each tier
        self.stored_len = np.zeros(n, dtype=np.uint32)
        self.raw_len = np.zeros(n, dtype=np.uint32)
        self.crc = np.zeros(n, dtype=np.uint32)
        self.codec = np.zeros(n, dtype=np.uint8)
        self.dtype = np.zeros(n, dtype=np.uint8)
        self.ns = np.zeros(n, dtype=np.uint16)
        self.parent = np.full(n, -1, dtype=np.int32)
        self.parent_gen = np.zeros(n, dtype=np.uint32)
        self.gen = np.zeros(n, dtype=np.uint32)
        self.depth = np.zeros(n, dtype=np.uint32)
        self.leases = np.zeros(n, dtype=np.int32)
        self.live = np.zeros(n, dtype=np.bool_)
        self.rooted = np.zeros(n, dtype=np.bool_)  # reachable by prefix match when it was stored
        self.hashes = np.zeros((n, 16), dtype=np.uint8)
        self.fp = np.zeros(n, dtype=np.uint64)  # block_fingerprint(hash, ns)

    def _grow(self) -> None:
        old = {k: v for k, v in vars(self).items() if isinstance(v, np.ndarray)}
        n = len(self.live)
        self._alloc_columns(2 * n)
        for name, column in old.items():
            getattr(self, name)[:n] = column

    # -- namespaces -------------------------------------------------------------
    def namespace_id(self, name: str, create: bool = False) -> int | None:
        ns = self._namespaces.get(name)
        if ns is None and create:
            if len(self._ns_names) >= np.iinfo(np.uint16).max:
                raise ValueError("too many namespaces on this node")
            ns = len(self._ns_names)
            self._namespaces[name] = ns
            self._ns_names.append(name)
            self._maps.append({})
        return ns

    def namespace_name(self, ns: int) -> str:
        return self._ns_names[ns]

    # -- entries ---------------------------------------------------------------
    def find(self, ns: int | None, key: bytes) -> int | None:
        return None if ns is None else self._maps[ns].get(key)

    def insert(self, ns: int, key: bytes, meta: BlockMeta, dtype: int) -> int:
        if self._free:
            e = self._free.pop()
        else:
            if self._size == len(self.live):
                self._grow()
            e = self._size
            self._size += 1
        self._maps[ns][key] = e
        self.live[e] = True
        self.ns[e] = ns
        self.hashes[e] = np.frombuffer(key, dtype=np.uint8)
        self.fp[e] = block_fingerprint(key, ns)
        self.stored_len[e], self.raw_len[e], self.crc[e] = meta.stored_length, meta.raw_length, meta.crc32c
        self.codec[e], self.dtype[e] = meta.codec, dtype
        self.loc[e] = NO_LOC
        self.nchild[e] = 0
        self.leases[e] = 0
        parent = self._maps[ns].get(meta.parent) if meta.parent else None
        self.parent[e] = -1 if parent is None else parent
        self.parent_gen[e] = 0 if parent is None else self.gen[parent]
        self.depth[e] = 0 if parent is None else self.depth[parent] + 1
        self.rooted[e] = not meta.parent or (parent is not None and bool(self.rooted[parent]))
        return e

    def parent_of(self, e: int) -> int | None:
        """The parent entry, if it is still the same block that was the parent at insert."""
        p = int(self.parent[e])
        if p < 0 or not self.live[p] or self.gen[p] != self.parent_gen[e]:
            return None
        return p

    def unmap(self, e: int) -> None:
        """Lookups miss from now on; the id stays reserved until release_id()."""
        ns_map = self._maps[int(self.ns[e])]
        key = self.key(e)
        if ns_map.get(key) == e:
            del ns_map[key]

    def release_id(self, e: int) -> None:
        self.unmap(e)
        self.live[e] = False
        self.gen[e] += 1
        self._free.append(e)

    def key(self, e: int) -> bytes:
        return self.hashes[e].tobytes()

    def meta(self, e: int) -> BlockMeta:
        p = self.parent_of(e)
        return BlockMeta(
            namespace=self._ns_names[int(self.ns[e])],
            hash=self.key(e),
            parent=self.key(p) if p is not None else b"",
            codec=int(self.codec[e]),
            dtype=DTYPES[int(self.dtype[e])],
            raw_length=int(self.raw_len[e]),
            stored_length=int(self.stored_len[e]),
            crc32c=int(self.crc[e]),
        )

    def __len__(self) -> int:
        return self._size - len(self._free)

    def nbytes(self) -> int:
        """Bytes of the index: numpy columns, the per-namespace dicts and their 16-byte keys."""
        import sys

        columns = sum(v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray))
        dicts = sum(sys.getsizeof(m) for m in self._maps)
        keys = len(self) * sys.getsizeof(bytes(16))
        return columns + dicts + keys + sys.getsizeof(self._free)
