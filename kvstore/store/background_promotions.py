"""Promotions of blocks a client read from NVMe itself (``serve --share-nvme``), made later on a thread of their own.

A Get the store serves from NVMe promotes its blocks as it reads them (``LowerReads.materialize``: the read is
the Get's own). A client that reads a block straight out of the tier's segment files (named by the store, or
by the shared DRAM index) leaves the store no bytes to keep, so without this a block such clients read stays
on NVMe however often they read it, with DRAM idle. ``BackgroundPromotions`` is the part of ``BlockStore``
that brings such blocks up:

- ``_queue_promotions(ids)`` (lock held): entries a client just read from a lower tier (the leases of a disk
  read ending, ``release(..., touch=True)`` of leases with no bytes; the index's hits reported by ``touch``)
  wait in an ordered set of at most ``QUEUE_MAX`` entries (more are skipped), from their second such read: a
  first one only marks the entry (``_read_once``, the ``READ_ONCE_MAX`` latest). A block named twice in one
  report was read twice: a lane sends its index's first reads in a batch, and that batch goes with the reread
  that made it due (``IndexedGets.take_touches``);
- ``promote_queued(batch_bytes) -> int``: the promoter's thread (``kvstore-promoter``, started with the store)
  takes queued entries, leases those still only below the top tier, reads them into top-tier slots
  (``materialize``: verified, coalesced as any Get's) and makes those the blocks' copies (``release``); how
  many it promoted.

Such a promotion costs a second read of the block, where a Get's costs none, so it waits for the block to be read
again: a prefix read once (a scan, or each prefix of ``bench.nvme_get``) costs the disk nothing more, and a prefix's
second Get no longer runs beside the promotion of its blocks (``bench.nvme_reread``, asked: that Get took 1.25-1.46x
as long as without promotions when they came from the first read, fifty-fifth session; 0.89-1.11x since). It only
takes room below the top tier's high watermark: it never evicts a block, nor pushes the tier over the mark at which
the demoter would (a scan that reads more than DRAM holds cannot turn into promotions and evictions of each other).
Blocks under ``INDEX_PROMOTE_MIN_BYTES`` that clients read through an index of NVMe-only blocks (a default store's)
are not promoted at all: promoted, they leave that index, and their next Get, asked of the store, took longer here
than the client's own read of the files. The entries that do not fit are dropped, and none is queued while the tier
has no room for the first of them (the steady state of a full store costs a Get's release its blocks' marks and one
comparison); a client that reads them again queues them again. Candidates are blocks read again: first reads are
counted only as ``read_once`` marks. ``StoreCounters`` counts the candidates, those promoted and those skipped
(``stats()["queued_promotions"]``, with those waiting and those read once). Off with ``promote_on_hit=False``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstore.store.counters import StoreCounters
from kvstore.store.index import NO_LOC, EntryTable
from kvstore.store.leases import DataLossError, Lease
from kvstore.store.published import ArenaPublisher
from kvstore.tiers.base import MemoryTier, Tier

log = logging.getLogger("kvstore.store.blockstore")

QUEUE_MAX = 1 << 16  # entries waiting (an int key each): a client reading faster than the promoter loses some
READ_ONCE_MAX = 1 << 16  # entries read once by clients, promoted if read again; the oldest are forgotten
# blocks smaller than this that clients read through an index of NVMe-only blocks (a default store's) are not
# promoted: a promoted block leaves that index, so its next Get is asked of the store, and here an asked Get of 32
# x 64 KiB DRAM hits took longer than the client's own read of them from the files (bench.nvme_reread, third Get
# promoted over not: 0.80-0.83 at 64 KiB, 1.15 at 128 KiB, 1.66 at 256 KiB, fifty-seventh session)
INDEX_PROMOTE_MIN_BYTES = 128 << 10


class BackgroundPromotions:
    """Mixed into BlockStore; uses its table, tiers, lock, watermark, counters and lease verbs."""

    if TYPE_CHECKING:  # provided by BlockStore
        table: EntryTable
        tiers: list[Tier]
        top: MemoryTier
        counters: StoreCounters
        promote_on_hit: bool
        high: float
        _lock: threading.RLock
        _stop: threading.Event
        _ranks: list[int]
        _queued: dict[int, None]
        _read_once: OrderedDict[int, None]
        _promote_wake: threading.Event
        _promoter: threading.Thread | None
        _published: ArenaPublisher | None

        def _new_leases(self, ids: np.ndarray, keys: Sequence[bytes], ranks: list[int]) -> list[Lease]: ...
        def materialize(self, leases: Sequence[Lease | None]) -> None: ...
        def release(self, leases: Sequence[Lease | None], touch: bool = False) -> None: ...

    def _start_promoter(self) -> None:
        if self._promoter is None and len(self.tiers) > 1:
            self._promoter = threading.Thread(target=self._promote_loop, name="kvstore-promoter", daemon=True)
            self._promoter.start()

    def _promote_loop(self) -> None:
        while not self._stop.is_set():
            self._promote_wake.wait(0.5)
            self._promote_wake.clear()
            try:
                self.promote_queued()
            except Exception:  # keep the promoter alive: a failed read was logged and its blocks skipped
                log.exception("queued promotions failed")

    def _room(self) -> int:
        """Bytes the top tier can take before its high watermark."""
        return int(self.high * self.top.capacity_bytes) - self.top.used_bytes

    def _index_reads(self, ids: np.ndarray) -> np.ndarray:
        """Of entries a client read from the files through the shared index, those worth promoting: all, unless
        that index names NVMe-only blocks alone, where small blocks stay (``INDEX_PROMOTE_MIN_BYTES``)."""
        if self._published is None or self._published.names_memory or not len(ids):
            return ids
        return ids[self.table.stored_len[ids] >= INDEX_PROMOTE_MIN_BYTES]

    def _queue_promotions(self, ids: Sequence[int]) -> None:
        """Queue entries a client read from a lower tier itself (lock held) and wake the promoter."""
        if not ids or not self.promote_on_hit or len(self.tiers) < 2:
            return
        queued, c = self._queued, self.counters
        ids = self._read_again(ids)  # marked whatever the room: a reread is one whenever it comes
        if not ids:
            return
        if self._room() < int(self.table.stored_len[ids[0]]):  # (a Get's blocks are alike in size)
            c.promotion_candidates += len(ids)
            c.promotions_skipped += len(ids)
            return
        fresh = [e for e in ids if e not in queued]
        kept = fresh[: max(QUEUE_MAX - len(queued), 0)]
        queued.update(dict.fromkeys(kept))
        c.promotion_candidates += len(fresh)
        c.promotions_skipped += len(fresh) - len(kept)
        if kept:
            self._promote_wake.set()

    def _read_again(self, ids: Sequence[int]) -> list[int]:
        """Those of ``ids`` read before, or twice among them (lock held); the others are marked as read once, the
        oldest forgotten."""
        seen = self._read_once
        unique = list(dict.fromkeys(ids))
        if len(unique) < len(ids):  # a report of the index's hits holds a lane's first read with its reread
            twice = {e for e, n in Counter(ids).items() if n > 1}
            seen.update(dict.fromkeys(e for e in twice if e not in seen))
        ids = unique
        again = [e for e in ids if e in seen]
        for e in again:
            del seen[e]
        if len(again) < len(ids):  # only first reads are marked (a reread marked again pushed older marks out)
            taken = set(again)
            seen.update(dict.fromkeys(e for e in ids if e not in taken))
            for _ in range(len(seen) - READ_ONCE_MAX):
                seen.popitem(last=False)
        return again

    def promote_queued(self, batch_bytes: int = 16 << 20) -> int:
        """Promote queued entries, about ``batch_bytes`` at a time, while the top tier has room under its high
        watermark; the rest of the queue is dropped once it has none. Returns how many were promoted."""
        promoted = 0
        counters = self.counters
        while not self._stop.is_set():
            leases = self._lease_queued(batch_bytes)
            if not leases:
                break
            try:
                self.materialize(leases)  # into free top-tier slots, verified; a corrupt copy is dropped
            except DataLossError as err:  # every promotion of the batch is called off; the rest keep their copies
                log.warning("a queued promotion found a corrupt copy (dropped): %s", err)
            except Exception:
                log.exception("queued promotions failed")
            done = sum(1 for lease in leases if lease.promote is not None)  # verified in their slots
            self.release(leases)  # (a Get that promoted one of them meanwhile keeps its copy: promoted too)
            counters.promoted_later += done
            counters.promotions_skipped += len(leases) - done
            promoted += done
        return promoted

    def _lease_queued(self, batch_bytes: int) -> list[Lease]:
        """Lease the next queued entries that are still only below the top tier and fit under its high mark."""
        t, top, queued = self.table, self.top, self._queued
        with self._lock:
            room = self._room()
            taken: list[int] = []
            size = skipped = 0
            while queued and size < batch_bytes:
                e = next(iter(queued))
                del queued[e]
                if not t.is_mapped(e) or t.loc_of(e, top.rank) != NO_LOC:
                    skipped += 1  # deleted, or a Get promoted it meanwhile
                    continue
                n = int(t.stored_len[e])
                if size + n > room:
                    skipped += 1 + len(queued)
                    queued.clear()  # no room: whatever waits is stale by the time there is
                    break
                taken.append(e)
                size += n
            self.counters.promotions_skipped += skipped
            if not taken:
                return []
            ids = np.array(taken, dtype=np.int64)
            t.lease_many(ids)
            ranks = t.top_ranks(ids, self._ranks).tolist()
            return self._new_leases(ids, [t.key(e) for e in taken], ranks)
