"""Where raw blocks lie in a shared DRAM arena, in a table that same-host clients map read-only and probe
themselves: a Get of DRAM hits then needs no request to the store at all (``serve --share-dram``).

The store is the only writer (``ArenaIndex``, under the BlockStore's lock); clients only read
(``ArenaIndexView``). The table is a hint, never the truth: a block it does not name, or names while it
changes, is asked of the store as before.

Layout (one file of the shm directory, named and swept as the arena is, mode 0600): a header of ``HEADER_WORDS`` uint64
(``MAGIC``, ``VERSION``, buckets, ways), then ``buckets x WAYS`` entries of ``ENTRY_WORDS`` uint64:

    seq   even: stable; odd: being written. Every change adds 1 before and 1 after it (a seqlock).
    key0, key1   the block's 16-byte hash XOR its namespace's mix (``namespace_mix``); 0, 0: a free way
    offset       of the block's bytes in the arena; with ``ON_DISK`` set, a payload in the NVMe tier's files
                 instead (segment id and file offset, ``Found.on_disk``)
    lencrc       stored length (low 32 bits) | CRC32C of the raw bytes << 32

A block in DRAM is named there; one only on NVMe is named in its segment file when the store shares those
(``serve --share-nvme``): the client reads it with O_DIRECT (``kvstore/lanes/client/disk.py``). The store
publishes a disk entry once the record is written, and withdraws it before the record can be freed, moved by
compaction or its segment deleted, so the same seqlock covers a read of the file.

A key lives in bucket ``key0 % buckets``, in any of its ``WAYS`` ways; a key whose bucket is full is not
published (its Gets go to the store). A reader takes each entry's ``seq``, then its fields, copies the bytes,
then takes ``seq`` again: equal and even means nothing changed the entry meanwhile. The store withdraws an
entry (its ``seq`` moves) before the block's slot can be freed and written again, so a copy that overlapped
a reuse of the slot always sees another ``seq``. This relies on x86-64's ordering of loads with loads and
stores with stores (numpy's separate calls, or the compiled writer's atomic stores and fence, in program
order); elsewhere ``supported()`` is False and no table is made.

A client's ``find`` and the store's writes run compiled (``kvstore/arena_index_kernels.py``, numba, compiled in
the background from the first ``ready()``) or, until then or without numba, as numpy calls.

Verbs: ``ArenaIndex.create(dir, named_bytes)`` (sized for the blocks of that many bytes: the arena's, plus
NVMe's when it names disk entries), ``publish_many(keys, offsets, lengths, crcs) -> n``,
``withdraw_many(keys)``, ``close()`` (compiled too, or numpy calls until then: the bucket's words are the
writer's only record of its keys); ``ArenaIndexView.attach(region)``, ``find(namespace, hashes) -> Found |
None`` (None unless every hash is named), ``Found.unchanged()``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import mmap
import os
import platform
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from kvstore import shmfile
from kvstore.arena_index_layout import (
    ENTRY_WORDS,
    FILE_OFFSETS,
    HEADER_WORDS,
    KEY0,
    KEY1,
    LENCRC,
    MAGIC,
    OFFSET,
    ON_DISK,
    SEGMENT_IDS,
    SEGMENT_SHIFT,
    SEQ,
    VERSION,
    WAYS,
)
from kvstore.background_compile import BackgroundCompile

MIN_BUCKETS, MAX_BUCKETS = 64, 1 << 17  # at most 1M entries (40 MiB)
BYTES_PER_ENTRY_SIZED = 32 << 10  # one entry per 32 KiB of arena: 2x a full arena of 64 KiB blocks
PREFIX = shmfile.DRAM_PREFIX  # swept like the arena after a kill; attached read-only like it


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.lru_cache(maxsize=4096)
def namespace_mix(namespace: str) -> tuple[int, int]:
    """Two uint64 XORed into a block's hash, so equal hashes of two namespaces are two keys."""
    digest = hashlib.blake2b(namespace.encode(), digest_size=16, person=b"kvstore-dramidx").digest()
    lo, hi = np.frombuffer(digest, dtype=np.uint64)
    return int(lo), int(hi)


def buckets_for(named_bytes: int) -> int:
    entries = max(1, named_bytes // BYTES_PER_ENTRY_SIZED)
    buckets = 1 << max(0, (entries // WAYS - 1).bit_length())
    return min(MAX_BUCKETS, max(MIN_BUCKETS, buckets))


def table_bytes(buckets: int) -> int:
    return (HEADER_WORDS + buckets * WAYS * ENTRY_WORDS) * 8


def keys_of(namespace: str, hashes: Sequence[bytes] | np.ndarray) -> np.ndarray | None:
    """(n, 2) uint64 keys of ``hashes`` (16 bytes each) in ``namespace``; None when one is not 16 bytes."""
    if isinstance(hashes, np.ndarray):
        raw = np.ascontiguousarray(hashes, dtype=np.uint8).reshape(-1, 16).view(np.uint64)
    else:
        if any(len(h) != 16 for h in hashes):
            return None
        raw = np.frombuffer(b"".join(hashes), dtype=np.uint64).reshape(-1, 2)
    lo, hi = namespace_mix(namespace)
    keys = raw ^ np.array([lo, hi], dtype=np.uint64)
    keys[(keys[:, 0] == 0) & (keys[:, 1] == 0), 1] = 1  # 0, 0 marks a free way (a 2^-128 chance)
    return keys


class ArenaIndex:
    """The store's side: publishes and withdraws entries. Not thread-safe: the BlockStore's lock serialises it."""

    def __init__(self, path: str, region: mmap.mmap, buckets: int):
        self.path, self._region, self.buckets = path, region, buckets
        words = np.frombuffer(region, dtype=np.uint64, count=table_bytes(buckets) // 8)
        words[:4] = (MAGIC, VERSION, buckets, WAYS)
        self._entries = words[HEADER_WORDS:].reshape(buckets * WAYS, ENTRY_WORDS)
        self.published = 0
        self.full = 0  # keys not published: their bucket had no free way
        ready()  # start compiling the writes

    @classmethod
    def create(cls, directory: str, named_bytes: int) -> ArenaIndex:
        buckets = buckets_for(named_bytes)
        path, region = shmfile.create(directory, PREFIX, table_bytes(buckets))
        return cls(path, region, buckets)

    @property
    def nbytes(self) -> int:
        return table_bytes(self.buckets)

    def publish_many(self, keys: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, crcs: np.ndarray) -> int:
        """Name these blocks (their bytes are in place and checked), each in the way that names its key already,
        else in its bucket's first free way; the number named (a key whose bucket is full is not). One compiled
        call (``arena_index_kernels.publish``): 10.5 us per 32 keys here, where the loop over the keys in Python
        (with a dict of every named key beside the file) took 66-72 us."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)  # (what keys_of gives: no copy)
        lencrcs = np.asarray(lengths, dtype=np.uint64) | (np.asarray(crcs, dtype=np.uint64) << np.uint64(32))
        offsets = np.asarray(offsets, dtype=np.uint64)
        if ready():
            taken = np.zeros(1, dtype=np.int64)
            mask = np.uint64(self.buckets - 1)
            written = int(_kernels().publish(self._entries, mask, keys, offsets, lencrcs, taken))
            new = int(taken[0])
        else:
            written, new = self._publish_numpy(keys, offsets, lencrcs)
        self.published += new
        self.full += len(keys) - written
        return written

    def _publish_numpy(self, keys: np.ndarray, offsets: np.ndarray, lencrcs: np.ndarray) -> tuple[int, int]:
        """``publish`` key by key, each entry under its seqlock in separate numpy calls: (named, in a free way)."""
        entries, mask = self._entries, self.buckets - 1
        written = new = 0
        for k, (k0, k1) in enumerate(keys.tolist()):
            first = (k0 & mask) * WAYS
            ways = entries[first : first + WAYS, KEY0 : KEY1 + 1].tolist()
            if [k0, k1] in ways:
                e = first + ways.index([k0, k1])
            elif [0, 0] in ways:
                e = first + ways.index([0, 0])
                new += 1
            else:
                continue  # the bucket is full
            seq = int(entries[e, SEQ])
            entries[e, SEQ] = seq + 1
            entries[e, KEY0:] = (k0, k1, int(offsets[k]), int(lencrcs[k]))
            entries[e, SEQ] = seq + 2
            written += 1
        return written, new

    def withdraw_many(self, keys: np.ndarray) -> None:
        """Stop naming these blocks: called before their slots may be freed or written again."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        if ready():
            n = int(_kernels().withdraw(self._entries, np.uint64(self.buckets - 1), keys))
        else:
            n = self._withdraw_numpy(keys)
        self.published -= n

    def _withdraw_numpy(self, keys: np.ndarray) -> int:
        """Clear the entries naming these keys, each under its seqlock (a few numpy calls for all)."""
        if not len(keys):
            return 0
        entries = self._entries
        first = (keys[:, 0] & np.uint64(self.buckets - 1)).astype(np.int64) * WAYS
        ways = first[:, None] + np.arange(WAYS)
        fields = entries[ways]
        named = (fields[:, :, KEY0] == keys[:, 0:1]) & (fields[:, :, KEY1] == keys[:, 1:2])
        slots = np.unique(ways[named])
        seq = entries[slots, SEQ]
        entries[slots, SEQ] = seq + np.uint64(1)
        entries[slots, KEY0:] = 0
        entries[slots, SEQ] = seq + np.uint64(2)
        return len(slots)

    def __len__(self) -> int:
        return self.published

    def close(self) -> None:
        """Remove the file (the mappings keep the memory until they go)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class OnDisk:
    """The blocks of a ``find`` that lie in the NVMe tier's files: int64 arrays of one entry per block."""

    positions: np.ndarray  # the blocks' places in the ``find``
    segments: np.ndarray  # segment ids (file names: ``arena_index_layout.segment_name``)
    offsets: np.ndarray  # of the payloads in those files
    lengths: np.ndarray
    crcs: np.ndarray
    segment: int = -1  # the one segment file every block of the ``find`` lies in (positions 0..n-1), else -1

    def __len__(self) -> int:
        return len(self.positions)


_NONE = np.zeros(0, dtype=np.int64)
NOT_ON_DISK = OnDisk(_NONE, _NONE, _NONE, _NONE, _NONE)


class Found:
    """Where every block of one ``find`` lies, and the ``seq`` each entry had when it was read. ``offsets``,
    ``lengths`` and ``crcs`` are lists made when first asked: a Get read whole from disk never needs them."""

    def __init__(self, view: ArenaIndexView, rows: np.ndarray):
        self._view = view
        self._rows = rows  # (n, 4) uint64: offset, lencrc, entry, seq

    @property
    def rows(self) -> np.ndarray:
        """(n, 4) uint64, a row per block: offset word, length and CRC32C, entry, its ``seq`` when probed."""
        return self._rows

    @functools.cached_property
    def offsets(self) -> list[int]:
        offsets: list[int] = self._rows[:, 0].tolist()
        return offsets

    @functools.cached_property
    def lengths(self) -> list[int]:
        lengths: list[int] = (self._rows[:, 1] & np.uint64(0xFFFFFFFF)).tolist()
        return lengths

    @functools.cached_property
    def crcs(self) -> list[int]:
        crcs: list[int] = (self._rows[:, 1] >> np.uint64(32)).tolist()
        return crcs

    def on_disk(self) -> OnDisk:
        """The blocks named in the NVMe tier's files, as arrays (a Get's worth at once, not a tuple per block)."""
        rows = self._rows
        if ready() and int(rows[0, 0]) & ON_DISK:  # as a rule a prefix demoted whole: one compiled call
            n = len(rows)
            offsets, lengths, crcs = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
            segment = int(_kernels().one_file(rows, offsets, lengths, crcs))
            if segment >= 0:
                return OnDisk(np.arange(n), np.full(n, segment, np.int64), offsets, lengths, crcs, segment)
        words = rows[:, 0]
        positions = np.flatnonzero(words & np.uint64(ON_DISK))
        if not len(positions):
            return NOT_ON_DISK
        named, lencrc = words[positions], rows[positions, 1]
        return OnDisk(
            positions=positions,
            segments=((named >> np.uint64(SEGMENT_SHIFT)) & np.uint64(SEGMENT_IDS)).astype(np.int64),
            offsets=(named & np.uint64(FILE_OFFSETS)).astype(np.int64),
            lengths=(lencrc & np.uint64(0xFFFFFFFF)).astype(np.int64),
            crcs=(lencrc >> np.uint64(32)).astype(np.int64),
        )

    def unchanged(self) -> bool:
        """True when no entry changed since ``find``: the bytes copied meanwhile are the named blocks'."""
        entries, rows = self._view.entries, self._rows
        if ready():
            return bool(_kernels().unchanged(entries, rows, len(rows)))
        return bool(np.array_equal(entries[rows[:, 2].astype(np.int64), SEQ], rows[:, 3]))


class ArenaIndexView:
    """A client's read-only view of the store's table (``attach`` checks its header)."""

    def __init__(self, words: np.ndarray):
        if len(words) < HEADER_WORDS or int(words[0]) != MAGIC or int(words[1]) != VERSION:
            raise ValueError("not a kvstore DRAM index of this version")
        buckets, ways = int(words[2]), int(words[3])
        if ways != WAYS or buckets & (buckets - 1) or len(words) < table_bytes(buckets) // 8:
            raise ValueError(f"DRAM index of {buckets} buckets x {ways} ways does not fit its {len(words) * 8} bytes")
        self.buckets = buckets
        self.entries = words[HEADER_WORDS : HEADER_WORDS + buckets * WAYS * ENTRY_WORDS].reshape(-1, ENTRY_WORDS)
        ready()

    @classmethod
    def attach(cls, buffer: memoryview) -> ArenaIndexView:
        return cls(np.frombuffer(buffer, dtype=np.uint64))

    def find(self, namespace: str, hashes: Sequence[bytes]) -> Found | None:
        """Where each block lies, when the table names every one of them stable now; else None."""
        if not hashes or any(len(h) != 16 for h in hashes):
            return None
        rows = self._find_compiled(namespace, hashes) if ready() else self._find_numpy(namespace, hashes)
        if rows is None:
            return None
        return Found(self, rows)

    def _find_compiled(self, namespace: str, hashes: Sequence[bytes]) -> np.ndarray | None:
        mix0, mix1 = namespace_mix(namespace)
        rows = np.empty((len(hashes), 4), dtype=np.uint64)
        joined = b"".join(hashes)
        n = _kernels().find(self.entries, np.uint64(self.buckets - 1), joined, np.uint64(mix0), np.uint64(mix1), rows)
        return rows if n == len(hashes) else None

    def _find_numpy(self, namespace: str, hashes: Sequence[bytes]) -> np.ndarray | None:
        keys = keys_of(namespace, hashes)
        assert keys is not None
        base = (keys[:, 0] & np.uint64(self.buckets - 1)).astype(np.int64) * WAYS
        slots = base[:, None] + np.arange(WAYS)  # (n, WAYS) entry numbers
        seqs = self.entries[slots, SEQ]  # a call of its own, before the fields: the seqlock's first read
        fields = self.entries[slots]
        match = (fields[:, :, KEY0] == keys[:, 0:1]) & (fields[:, :, KEY1] == keys[:, 1:2])
        match &= seqs & np.uint64(1) == 0
        if not match.any(axis=1).all():
            return None
        way = match.argmax(axis=1)
        pick = np.arange(len(keys))
        chosen = fields[pick, way]
        rows = np.empty((len(keys), 4), dtype=np.uint64)
        rows[:, 0], rows[:, 1] = chosen[:, OFFSET], chosen[:, LENCRC]
        rows[:, 2], rows[:, 3] = slots[pick, way], seqs[pick, way]
        return rows


AVAILABLE = not os.environ.get("KVSTORE_NO_JIT") and importlib.util.find_spec("numba") is not None and supported()
_kernels_module: ModuleType | None = None
_lock = threading.Lock()


def _kernels() -> ModuleType:
    global _kernels_module
    if _kernels_module is None:
        with _lock:
            if _kernels_module is None:
                from kvstore import arena_index_kernels

                _kernels_module = arena_index_kernels
    return _kernels_module


def _compile() -> None:
    entries = np.zeros((WAYS * 2, ENTRY_WORDS), dtype=np.uint64)
    entries.flags.writeable = False  # as a client maps the table: numba compiles for that type
    rows = np.zeros((1, 4), dtype=np.uint64)
    k = _kernels()
    k.find(entries, np.uint64(1), bytes(16), np.uint64(0), np.uint64(0), rows)
    k.unchanged(entries, rows, 0)
    column = np.zeros(1, dtype=np.int64)
    k.one_file(rows, column, column, column)
    table = np.zeros((WAYS * 2, ENTRY_WORDS), dtype=np.uint64)  # the store's, writable
    keys, words = np.ones((1, 2), dtype=np.uint64), np.zeros(1, dtype=np.uint64)
    k.publish(table, np.uint64(1), keys, words, words, column)
    k.withdraw(table, np.uint64(1), keys)


_compiled = BackgroundCompile("kvstore-arena-index-jit", AVAILABLE, _compile)


def ready() -> bool:
    """The compiled ``find`` is there; the first call starts compiling it in the background."""
    return _compiled.ready()


def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache) now, not on a caller's first Get."""
    _compiled.warm_up()
