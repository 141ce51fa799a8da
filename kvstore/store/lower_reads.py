"""Reads from lower tiers (issue 19): straight into where the bytes go, handed on piece by piece.

``LowerReads`` is the part of ``BlockStore`` that serves leased blocks no memory tier holds
(kvstore/store/blockstore.py has the lease verbs themselves):

- ``materialize(leases, on_ready, dest_for, on_caller, final_dests)``: read the NVMe-only blocks of a batch into
  a free top-tier slot (a promotion, made the block's copy at ``release``), the caller's buffer (with
  ``final_dests`` even when promoted: a client's shared pool), the staging arena or a fresh buffer, each verified
  before ``on_ready`` names it; a corrupt copy is dropped and ``DataLossError`` raised;
- ``disk_dir()`` / ``disk_extents(leases)`` / ``release_extents(handles)``: where NVMe-only raw blocks lie in
  the tier's files, for a reader that reads them itself, with their segments pinned until released;
- ``_fill_promotions(leases)`` (before the lock), ``_promote(leases)`` and ``_let_go(lease)`` (lock held): what
  ``release`` does with the slots a read took.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvstore.memops import addresses_of, run_rows
from kvstore.store.counters import StoreCounters
from kvstore.store.index import NO_LOC, EntryTable
from kvstore.store.leases import DataLossError, Lease
from kvstore.store.staging import Staging
from kvstore.tiers.base import DRAM, CorruptBlock, MemoryTier, Tier
from kvstore.tiers.nvme.io import aligned_buffer

log = logging.getLogger("kvstore.store.blockstore")

CODEC_NONE = 0  # kvstore.v1.Codec: stored bytes are the raw bytes, so both CRC32Cs are the same


class LowerReads:
    """Mixed into BlockStore; uses its table, tiers, lock, staging arena and counters."""

    if TYPE_CHECKING:  # provided by BlockStore
        table: EntryTable
        tiers: list[Tier]
        top: MemoryTier
        counters: StoreCounters
        promote_on_hit: bool
        staging: Staging
        _lock: threading.RLock

        def _tier(self, rank: int) -> Tier: ...
        def _add_new_copies(self, ids: np.ndarray, rank: int, locs: Sequence[int] | np.ndarray) -> None: ...
        def _remove_copy(self, e: int, rank: int) -> None: ...
        def _has_copy(self, e: int) -> bool: ...
        def _unmap(self, e: int) -> None: ...

    def materialize(
        self,
        leases: Sequence[Lease | None],
        on_ready: Callable[[list[int]], None] | None = None,
        dest_for: Callable[[int], Any] | None = None,
        on_caller: bool = False,
        final_dests: bool = False,
        run_reader: Callable[[list[Any], np.ndarray], tuple[list[int], list[int]] | None] | None = None,
    ) -> None:
        """Read the batch's NVMe-only blocks (coalesced by the tier) straight into where they go.

        Each lands, in this order of preference, in a free slot of the top tier (a promotion, when
        ``promote_on_hit``; no eviction is done for it), in ``dest_for(i)`` (a caller's buffer for
        ``leases[i]``, such as a lane's region range; None: no such buffer), or in a slot of the store's
        staging arena (so a full DRAM tier serves from NVMe without allocating), else in a fresh buffer.
        A promoted block becomes the top tier's copy at ``release`` (after the Get's reply, off its path). On a
        top tier in small pages (``small_pages``: a shared arena on a tmpfs without huge pages, into which this
        VM's O_DIRECT reads ran at half speed) a promotion's slot is reserved but its read lands in staging, and
        ``release`` copies the verified bytes into the slot.
        Every payload is verified (CRC32C) before ``lease.buffer`` is usable; a raw (codec none) block's
        record must also carry the CRC32C of the index, so its bytes' CRC32C is ``lease.crc32c``.
        ``on_ready(positions)`` (called from reading threads, or with ``on_caller`` from this one while the tier's
        readers only read: for an ``on_ready`` that copies, ``pipeline.read_pipelined``) names the leases whose
        bytes are verified as each read completes, so the caller moves them on while later ones are still read.
        A slot held only for this read is freed by ``release``. A corrupt copy is dropped and ``DataLossError``
        raised (the other blocks stay).
        With ``final_dests`` a block that ``dest_for`` gives a buffer (a client's shared pool) is read there even
        when it is promoted: its slot is filled at ``release`` by a copy checked against its CRC32C, since the
        client may change its memory once the reply is out (a copy that fails is not promoted).
        ``run_reader(pieces, positions)``: ``NvmeTier.read``'s, with each target's position in ``leases``.
        """
        cold = [i for i, lease in enumerate(leases) if lease is not None and lease.buffer is None]
        if not cold:
            return
        promoted: list[tuple[Lease, int]] = []
        read_apart = self.top.small_pages  # promotions read into staging, copied into their slot at release
        with self._lock:
            for i in cold:
                lease = leases[i]
                assert lease is not None
                n = lease.stored_length
                dest = dest_for(i) if dest_for is not None else None
                final = final_dests and dest is not None
                # a final destination's promotion is a host copy at release: none into HBM
                loc = self.top.allocate(n) if self.promote_on_hit and not (final and self.top.rank != DRAM) else None
                if loc is not None:
                    promoted.append((lease, loc))
                    if final:
                        lease.buffer, lease.promote_copy = dest, True
                        continue
                    staged = self.staging.take(n) if read_apart else None
                    if staged is not None:
                        lease.hold, lease.buffer, lease.promote_copy = (None, staged[0]), staged[1], True
                    else:
                        lease.buffer = self.top.view(loc, n)
                    continue
                if dest is None:
                    staged = self.staging.take(n)
                    if staged is None:
                        dest = aligned_buffer(n)
                    else:
                        lease.hold = (None, staged[0])
                        dest = staged[1]
                lease.buffer = dest
            by_rank: dict[int, list[int]] = {}
            for i in cold:
                by_rank.setdefault(leases[i].rank, []).append(i)  # type: ignore[union-attr]
            plans = [
                (self._tier(r), pos, [self.table.loc_of(leases[i].entry, r) for i in pos])  # type: ignore[union-attr]
                for r, pos in by_rank.items()
            ]
        verified: set[int] = set()  # positions handed on: their bytes stay readable until release, whatever fails

        promoting = {id(lease): loc for lease, loc in promoted}

        def done(positions: list[int]) -> None:
            verified.update(positions)
            for i in positions:  # verified in its top-tier slot: the block's copy there from its release on
                lease = leases[i]
                assert lease is not None
                loc = promoting.get(id(lease))
                if loc is not None:
                    lease.promote = loc
            if on_ready is not None:
                on_ready(positions)

        try:
            for tier, pos, locs in plans:
                group = [leases[i] for i in pos]
                lengths = [x.stored_length for x in group]  # type: ignore[union-attr]
                bufs = [x.buffer for x in group]  # type: ignore[union-attr]
                try:
                    if getattr(tier, "streams_reads", False):  # raw blocks: the record's CRC must be the index's
                        crcs = [x.crc32c if x.codec == CODEC_NONE else None for x in group]  # type: ignore[union-attr]
                        runs = None if run_reader is None else lambda p, at=np.asarray(pos): run_reader(p, at)
                        cast(Any, tier).read(
                            locs, lengths, bufs, lambda idx, pos=pos: done([pos[k] for k in idx]), crcs, on_caller, runs
                        )  # NvmeTier.read
                    else:
                        tier.read(locs, lengths, bufs)
                        done(pos)
                except CorruptBlock as err:
                    bad = set(err.locs)
                    self._drop_corrupt(tier, [(x, loc) for x, loc in zip(group, locs) if loc in bad])  # type: ignore[misc]
                    raise DataLossError(str(err)) from err
        except BaseException:
            with self._lock:  # every slot taken for this read is freed at release: a sender may still hold one
                for lease, loc in promoted:
                    if lease.promote_copy:  # never lent to anyone: free now (the staging slot goes at release)
                        lease.promote, lease.promote_copy = None, False
                        self.top.free([loc])
                    else:
                        lease.promote, lease.hold = None, (self.top, loc)
                for i in cold:
                    if i not in verified:
                        leases[i].buffer = None  # type: ignore[union-attr]
            raise

    def disk_dir(self) -> str | None:
        """The directory of the tier whose records ``disk_extents`` names (the NVMe tier), or None."""
        for tier in self.tiers:
            if hasattr(tier, "extents"):
                return str(cast(Any, tier).data_dir)
        return None

    def disk_extents(self, leases: Sequence[Lease | None]) -> tuple[list[tuple[str, int] | None], list[Any]]:
        """Where the disk-resident raw blocks of ``leases`` (no buffer yet, codec none) lie in the NVMe tier's
        files, for a reader that reads them itself: (file name, payload offset), None for every other lease.
        The record's CRC32C is the index's (``lease.crc32c``), which the reader must check. The files stay
        as they are (no segment retired) until ``release_extents`` of the handles; the leases keep the blocks."""
        where: list[tuple[str, int] | None] = [None] * len(leases)
        handles: list[Any] = []
        by_rank: dict[int, list[int]] = {}
        for i, lease in enumerate(leases):
            if lease is not None and lease.buffer is None and lease.codec == CODEC_NONE:
                by_rank.setdefault(lease.rank, []).append(i)
        for rank, pos in by_rank.items():
            tier = self._tier(rank)
            if not hasattr(tier, "extents"):
                continue
            entries = np.fromiter((cast(Lease, leases[i]).entry for i in pos), dtype=np.int64, count=len(pos))
            with self._lock:
                locs = self.table.locs(entries, rank).tolist()
            found, pins = cast(Any, tier).extents(locs)
            handles.append((tier, pins))
            for i, x in zip(pos, found):
                where[i] = x
        return where, handles

    @staticmethod
    def release_extents(handles: Sequence[Any]) -> None:
        for tier, pins in handles:
            tier.release_extents(pins)

    def _fill_promotions(self, leases: Sequence[Lease]) -> list[int]:
        """Copy each verified block read elsewhere (a staging slot, a client's shared pool) into the top-tier slot
        reserved for it (``promote_copy``), before ``_promote`` makes that slot the block's copy: one memcpy at
        release, after the bytes went out, every block's in one compiled call with its CRC32C (``memops.run_rows``:
        0.21 against 0.25 ms a MiB with a call a block at 64 KiB, 0.20 against 0.24 at 512 KiB, 2 MiB even; in one
        store, calls alternated, fiftieth session). A raw block's copy is checked against its CRC32C (a client may
        have written its pool since the reply): one that fails is not promoted, and its slot is returned for the
        caller to free with the lock held. Lock not held here: both slots belong to the lease alone."""
        filled = [lease for lease in leases if lease.promote is not None]  # None: its read failed, slot went back
        for lease in leases:
            lease.promote_copy = False
        if not filled:
            return []
        if self.top.rank != DRAM:  # never so (materialize reserves such copies in host memory): none promoted
            return [self._unpromoted(lease, "its slot is not host memory") for lease in filled]
        sizes = np.fromiter((lease.stored_length for lease in filled), dtype=np.int64, count=len(filled))
        slots = self.top.views([cast(int, lease.promote) for lease in filled], sizes.tolist())
        sources, targets = addresses_of([lease.buffer for lease in filled]), addresses_of(slots)
        fits = (sources[:, 1] >= sizes) & (targets[:, 1] >= sizes)  # (always, as materialize gave them out)
        rows = np.stack([sources[:, 0], targets[:, 0], sizes, np.arange(len(filled))], axis=1)[fits]
        values = run_rows(rows, len(filled))  # a block not raw is only copied: its CRC32C is not the index's
        return [
            self._unpromoted(lease, "changed in its Get's buffer" if fit else "a buffer shorter than the block")
            for lease, crc, fit in zip(filled, values, fits.tolist())
            if not fit or (lease.codec == CODEC_NONE and crc != lease.crc32c)
        ]

    @staticmethod
    def _unpromoted(lease: Lease, why: str) -> int:
        log.info("block %s %s before its promotion: not promoted", lease.hash.hex(), why)
        loc, lease.promote = lease.promote, None
        return cast(int, loc)

    def _promote(self, leases: list[Lease]) -> bool:
        """Make each lease's ``promote`` slot (verified bytes read from below) the block's top-tier copy, unless
        it was deleted (an entry stays live until its leases end) or a concurrent Get promoted it first: then the
        slot is freed (lock held). The copies are added in one batch: one at a time, the eviction policy's
        bookkeeping of a 32-block Get's promotions took a quarter of a TCP lane thread's busy time."""
        t, top = self.table, self.top
        ids: list[int] = []
        locs: list[int] = []
        taken: set[int] = set()
        for lease in leases:
            loc, lease.promote = lease.promote, None
            assert loc is not None
            e = lease.entry
            if t.is_mapped(e) and t.loc_of(e, top.rank) == NO_LOC and e not in taken:
                taken.add(e)
                ids.append(e)
                locs.append(loc)
            else:
                top.free([loc])
        if ids:
            self._add_new_copies(np.array(ids, dtype=np.int64), top.rank, locs)
            self.counters.tiers[top.rank].promotions += len(ids)
        return bool(leases)

    def _let_go(self, lease: Lease) -> None:
        """Free the slot a lease held only for its read (lock held)."""
        if lease.hold is None:
            return
        tier, loc = lease.hold
        lease.hold = None
        if tier is None:
            self.staging.give(loc)
        else:
            tier.free([loc])

    def _drop_corrupt(self, tier: Tier, bad: list[tuple[Lease, int]]) -> None:
        with self._lock:
            for lease, _ in bad:
                log.error("block %s failed its checksum in %s: dropped", lease.hash.hex(), tier.name)
                self.counters.corrupt += 1
                self._remove_copy(lease.entry, tier.rank)
                if not self._has_copy(lease.entry):
                    self._unmap(lease.entry)
