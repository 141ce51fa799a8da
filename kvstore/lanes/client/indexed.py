"""Gets of hits that ask the store nothing: the client finds the blocks in the store's DRAM index
(``kvstore/arena_index.py``, ``serve --share-dram``), copies them out of the mapped arena (or, for blocks the
index names in the NVMe tier's files, ``--share-nvme``, reads them from there; a store that shares no arena
keeps an index of those alone) and checks that no entry changed meanwhile. The store hears of the hits
afterwards, in batches (TOUCH frames on the channel).

Verbs of ``IndexedGets`` (one per shm lane, thread-safe):

- ``get(namespace, hashes, out, verify, copy_from, read_disk, read_indexed) -> results | None``: every block
  copied into ``out`` and checked, or None (one is not named, or named in an arena the lane does not map:
  ``copy_from`` None, or its entry changed while it was copied, or one named on disk could not be read or failed
  its CRC32C): the caller asks the store, as before, which reads and drops a corrupt record itself. A DRAM block
  whose CRC32C does not match while its entry stayed put is corrupt: DATA_LOSS, as a named block's would be.
  ``read_indexed`` first: a prefix named whole in one segment file is probed and read in one compiled call
  (``DiskReader.read_indexed``); its probe serves the general path when the blocks are named otherwise.
- ``allow(namespace)``: the store served this lane a Get in it (its tenant may read it); only such namespaces
  are read through the index, so tenancy decides what an honest client reads, as it does over requests.
- ``take_touches(force) -> [TouchedBlocks] | None``: the hits to report, once ``TOUCH_BLOCKS`` are pending or
  the oldest has waited ``TOUCH_SECONDS`` (or ``force``), or at once after a Get that read a record from the
  files that this lane had read from there before (its marks: each entry's ``seq`` as last read): the store
  promotes a block on its second such read, so that report must not wait; at most ``MAX_PENDING`` are kept when
  none can be sent. A first read waits for the batch: sent with every such Get, its frame cost a 32 x 512 KiB Get
  0.12 ms after its reads had emptied the caches (0.03 at 64 KiB; fifty-seventh session).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.arena_index import ArenaIndexView, Found, OnDisk
from kvstore.errors import corrupt_block
from kvstore.indexed_runs import IndexedRead, read_before
from kvstore.lanes.client.outputs import copy_outs
from kvstore.v1 import lanes_pb2 as lpb

TOUCH_BLOCKS = 256
TOUCH_SECONDS = 0.05
MAX_PENDING = 1 << 16

CopyFrom = Callable[[int, int, Sequence[Any], int], tuple[Any, memoryview]]
# the blocks named on disk and the caller's buffers: True when every one was read into its buffer and checked
ReadDisk = Callable[[OnDisk, Sequence[Any]], bool]
# a Get of blocks named in one run of one segment file, probed and read in one compiled call (None: not tried)
ReadIndexed = Callable[[ArenaIndexView, str, Sequence[bytes], Sequence[Any], np.ndarray], IndexedRead | None]


class IndexedGets:
    def __init__(self, view: ArenaIndexView):
        self.view = view
        self._namespaces: set[str] = set()
        self._pending: dict[str, list[bytes]] = {}
        self._count = 0
        self._since = 0.0
        self._lock = threading.Lock()
        self.hits = 0  # blocks served through the index
        self.disk_hits = 0  # of which read from the NVMe tier's files
        self.fallbacks = 0  # Gets it could not serve (a block not named, or moved meanwhile)
        self._due = False  # a Get read a record from the files again: its hits go now (the store promotes it)
        # the seq of each entry as this lane last read its record from the files (uint32: a rewrite changes it), 2
        # MiB for the default --nvme's table (4 at most), faulted in now: left to fault as Gets first touched its
        # pages, marking a 32-block prefix took 0.15 ms (its entries lie on 32 pages)
        self._marks = np.empty(len(view.entries), dtype=np.uint32)
        self._marks[:] = 0

    def allow(self, namespace: str) -> None:
        self._namespaces.add(namespace)

    def get(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        out: Sequence[Any],
        verify: bool,
        copy_from: CopyFrom | None,
        read_disk: ReadDisk | None = None,
        read_indexed: ReadIndexed | None = None,
    ) -> list[Any] | None:
        if namespace not in self._namespaces or len(out) < len(hashes):
            return None
        found: Found | None = None
        done: IndexedRead | None = None
        if read_indexed is not None and all(len(h) == 16 for h in hashes):
            done = read_indexed(self.view, namespace, hashes, out, self._marks)
        if done is not None:
            if done.served:
                self._note(namespace, hashes, len(hashes), done.again)
                return list(out[: len(hashes)])
            if not done.rows_usable:  # not named, unreadable, corrupt or moved: ask
                self.fallbacks += 1
                return None
            found = Found(self.view, done.rows)  # named, not as one run of one file: the general path goes on
        else:
            found = self.view.find(namespace, hashes)
        if found is None:
            self.fallbacks += 1
            return None
        on_disk = found.on_disk()
        if on_disk and read_disk is None:  # this lane may not read the store's files
            self.fallbacks += 1
            return None
        in_dram: Sequence[int] = range(len(hashes))
        if len(on_disk) == len(hashes):  # a prefix demoted whole: nothing to copy out of the arena
            in_dram = ()
        elif on_disk:
            disk_positions = set(on_disk.positions.tolist())
            in_dram = [i for i in in_dram if i not in disk_positions]
        if in_dram and copy_from is None:  # named in an arena this lane does not map
            self.fallbacks += 1
            return None
        copies = (
            [(*copy_from(found.offsets[i], found.lengths[i], out, i), verify) for i in in_dram] if copy_from else []
        )
        crcs = copy_outs(copies) if copies else []
        read = not on_disk or (read_disk is not None and read_disk(on_disk, out))
        if not read or not found.unchanged():  # unreadable, or moved, evicted or rewritten meanwhile: ask instead
            self.fallbacks += 1
            return None
        if verify:
            for i, crc in zip(in_dram, crcs):
                if crc != found.crcs[i]:
                    raise corrupt_block(i, hashes[i])
        again = bool(on_disk) and read_before(self._marks, found.rows[on_disk.positions])
        self._note(namespace, hashes, len(on_disk), again)
        return list(out[: len(hashes)])

    def _note(self, namespace: str, hashes: Sequence[bytes], from_disk: int, again: bool) -> None:
        """Count a Get's hits and keep them to report; one that read a record from the files again makes them due."""
        with self._lock:
            self.hits += len(hashes)
            self.disk_hits += from_disk
            self._due |= again
            self._pend(namespace, hashes)

    def _pend(self, namespace: str, hashes: Sequence[bytes]) -> bool:
        """Keep hits to report (lock held); False when ``MAX_PENDING`` are waiting already: nothing could be sent
        for a long while, and these go uncounted."""
        if self._count + len(hashes) > MAX_PENDING:
            return False
        if not self._count:
            self._since = time.monotonic()
        self._pending.setdefault(namespace, []).extend(hashes)
        self._count += len(hashes)
        return True

    def take_touches(self, force: bool = False) -> list[lpb.TouchedBlocks] | None:
        with self._lock:
            if not self._count:
                return None
            due = force or self._due or self._count >= TOUCH_BLOCKS
            if not due and time.monotonic() - self._since < TOUCH_SECONDS:
                return None
            pending, self._pending, self._count, self._due = self._pending, {}, 0, False
        return [lpb.TouchedBlocks(namespace=ns, hashes=hs) for ns, hs in pending.items()]

    def put_back(self, touched: list[lpb.TouchedBlocks]) -> None:
        """Touches that could not be sent now (the channel was busy): kept for the next try, due as they were."""
        with self._lock:
            self._due = True
            for blocks in touched:
                if not self._pend(blocks.namespace, blocks.hashes):
                    return
