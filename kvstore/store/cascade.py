"""Placement across tiers: eviction, demotion, flush, recovery and compaction hooks.

``Cascade`` is the half of ``BlockStore`` that moves copies between tiers
(kvstore/store/blockstore.py has the per-block verbs and their bookkeeping):

- ``_make_room(tier, n)``: allocate in a memory tier, evicting synchronously;
- ``_evict(tier, want)``: the lowest-priority *leaves* of a tier leave it:
  dropped when a lower copy exists, no lower tier takes them, or the tier
  below is NVMe and they were used fewer than ``nvme_admit_uses`` times
  (admission, off by default); otherwise leased, written down in one batch
  (I/O outside the lock unless the caller holds it) and then freed. In the
  last tier, with ``nvme_eviction == "segment"``, a victim takes the other
  evictable leaves of its segment with it (``_evict_leaves_in``), so the
  segment's file goes without compaction copying what is left of it;
- ``demote_once()`` / ``start()``: the background demoter keeps every tier but
  the last under its high watermark, down to the low one;
- ``flush()``: copy every memory-only block to the durable tier (graceful stop);
- ``relocate(rank, moves)``: the NVMe tier's compaction moved records;
- ``compact_once()``: let durable tiers reclaim dead space.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.store.counters import StoreCounters
from kvstore.store.index import NO_LOC, EntryTable, dtype_id
from kvstore.store.policy import LeafLRU
from kvstore.store.published import ArenaPublisher
from kvstore.store.removals import Removals
from kvstore.tiers.base import BlockMeta, MemoryTier, Tier, TierFault, TierFull

log = logging.getLogger("kvstore.store.blockstore")


class CapacityError(Exception):
    """No room even after eviction (e.g. everything evictable is leased)."""


NVME_EVICTIONS = ("segment", "block")  # how the last tier picks victims: whole segments' leaves, or one by one


class Cascade:
    """Mixed into BlockStore; uses its table, tiers, policies, lock and counters."""

    if TYPE_CHECKING:  # provided by BlockStore
        table: EntryTable
        tiers: list[Tier]
        policies: dict[int, LeafLRU]
        counters: StoreCounters
        high: float
        low: float
        demote_batch_bytes: int
        nvme_admit_uses: int
        nvme_eviction: str
        _lock: threading.RLock
        _demoted: threading.Condition
        _inflight: int
        _wake: threading.Event
        _stop: threading.Event
        _demoter: threading.Thread | None
        _published: ArenaPublisher | None

        def _notify(self, event: str, e: int, rank: int) -> None: ...
        def _unmap(self, e: int, deferred: Removals | None = None) -> None: ...
        def _unlease(self, e: int) -> None: ...
        def _has_copy(self, e: int) -> bool: ...
        def _add_copy(self, e: int, rank: int, loc: int) -> None: ...
        def _add_new_copies(self, ids: np.ndarray, rank: int, locs: Sequence[int] | np.ndarray) -> None: ...
        def _remove_copy(self, e: int, rank: int, deferred: Removals | None = None) -> None: ...
        def _settle(self, deferred: Removals, rank: int) -> None: ...

    def _evictable(self, e: int) -> bool:
        return self.table.leases[e] == 0

    def _make_room(self, tier: MemoryTier, nbytes: int) -> int:
        """Allocate in a memory tier, evicting (synchronously, lock held) until it fits."""
        # Dropping frees exactly what is needed; a demotion batches more for sequential I/O.
        want = (
            nbytes
            if self._next_tier(tier) is None
            else max(nbytes, min(self.demote_batch_bytes // 8, tier.capacity_bytes // 50))
        )
        for _ in range(64):
            loc = tier.allocate(nbytes)
            if loc is not None:
                return loc
            if not self._evict(tier, want):
                if not self._inflight:
                    break
                self._demoted.wait(timeout=5.0)  # the demoter holds the victims: wait for its batch
        self.counters.rejected += 1
        raise CapacityError(
            f"{tier.name} tier full: {tier.used_bytes} of {tier.capacity_bytes} bytes in use and "
            f"nothing evictable (blocks are leased by readers or pinned)"
        )

    def _evict(self, tier: Tier, want: int) -> int:
        """Move or drop the lowest-priority leaves of `tier` until `want` bytes are freed.

        Victims that need a copy below are leased, written down in one batch (outside
        the lock unless the caller holds it: the synchronous path of a Put), then freed.
        """
        t, policy = self.table, self.policies[tier.rank]
        lower = self._next_tier(tier)
        demote: list[int] = []
        freed = 0
        # a memory tier's victims reach the shared index and their slots go back in one batch: nothing in
        # this loop reads a freed slot (an NVMe segment's space decides what ``freed_with`` says: freed at once)
        removed = Removals() if isinstance(tier, MemoryTier) else None
        with self._lock:
            while freed < want:
                e = policy.pop_victim(self._evictable)
                if e is None:
                    break
                freed += int(t.stored_len[e])
                has_lower = any(t.loc_of(e, x.rank) != NO_LOC for x in self.tiers if x.rank > tier.rank)
                if has_lower or lower is None or self._degraded(lower):
                    whole = lower is None and self.nvme_eviction == "segment"
                    unit = tier.freed_with(t.loc_of(e, tier.rank)) if whole else None
                    self._evict_copy(e, tier, removed)
                    if unit is not None:
                        freed += self._evict_leaves_in(tier, *unit)
                elif not self._admitted(e, tier, lower):
                    self._evict_copy(e, tier, removed)
                    self.counters.tiers[tier.rank].not_admitted += 1
                else:
                    policy.insert(e, is_leaf=True)  # stays readable until its copy below exists
                    t.leases[e] += 1
                    demote.append(e)
            if removed is not None:
                self._settle(removed, tier.rank)
            self._inflight += len(demote)
        if not demote:
            return freed
        assert lower is not None
        try:
            self._copy_down(demote, tier, lower)
        finally:
            with self._lock:
                for e in demote:
                    self._unlease(e)
                    if (
                        t.loc_of(e, tier.rank) != NO_LOC
                        and t.loc_of(e, lower.rank) != NO_LOC
                        and t.leases[e] == 0
                        and t.nchild[e, tier.rank] == 0
                    ):
                        self._evict_copy(e, tier, removed)
                        self.counters.tiers[tier.rank].demotions += 1
                if removed is not None:
                    self._settle(removed, tier.rank)
                self._inflight -= len(demote)
                self._demoted.notify_all()
        return freed

    def _evict_leaves_in(self, tier: Tier, lo: int, hi: int) -> int:
        """Evict every copy of ``tier`` at locations ``[lo, hi)`` that is an unleased leaf, or turns into one as
        its children go (lock held); the bytes freed. Why: the NVMe tier's space comes back a segment at a
        time, and victims picked one by one across segments left every segment partly live, so compaction
        copied 2-3 records for each one written under steady churn (bench.soak --nvme: docs/nvme.md). What stays
        (leased, or a parent of copies elsewhere) compaction moves later."""
        t = self.table
        freed = 0
        todo = t.entries_at(tier.rank, lo, hi)[::-1].tolist()  # children (added later: higher ids) first
        while todo:
            left = []
            for e in todo:
                if t.leases[e] == 0 and t.nchild[e, tier.rank] == 0 and t.loc_of(e, tier.rank) != NO_LOC:
                    freed += int(t.stored_len[e])
                    self._evict_copy(e, tier)
                else:
                    left.append(e)
            if len(left) == len(todo):
                break
            todo = left
        return freed

    def _admitted(self, e: int, tier: Tier, lower: Tier) -> bool:
        """Whether a victim leaving ``tier`` is worth a copy in ``lower``: always between memory tiers; into
        NVMe only once used ``nvme_admit_uses`` times (a block stored once and never read again is dropped
        instead of costing a disk write, as NVIDIA's KV block manager offloads only reused blocks)."""
        if self.nvme_admit_uses <= 1 or isinstance(lower, MemoryTier):
            return True
        return (self.policies[tier.rank].uses(e) or 0) >= self.nvme_admit_uses

    def _evict_copy(self, e: int, tier: Tier, deferred: Removals | None = None) -> None:
        assert self.table.nchild[e, tier.rank] == 0, "only leaves are evicted"
        self._remove_copy(e, tier.rank, deferred)
        self.counters.tiers[tier.rank].evictions += 1
        if not self._has_copy(e):
            self._unmap(e, deferred)

    def _next_tier(self, tier: Tier) -> Tier | None:
        i = self.tiers.index(tier)
        return self.tiers[i + 1] if i + 1 < len(self.tiers) else None

    @staticmethod
    def _degraded(tier: Tier) -> bool:
        return bool(getattr(tier, "degraded", False))

    def _copy_down(self, entries: list[int], upper: Tier, lower: Tier) -> None:
        """Copy leased entries' bytes from `upper` into `lower` (one batched write)."""
        if not entries:
            return
        with self._lock:
            metas = [self.table.meta(e) for e in entries]
            sources = [
                upper.view(self.table.loc_of(e, upper.rank), m.stored_length)  # type: ignore[attr-defined]
                for e, m in zip(entries, metas)
            ]
        try:
            locs = self._write_with_room(lower, metas, sources)
        except (TierFault, TierFull) as err:
            log.warning("copy of %d blocks to %s failed: %s", len(entries), lower.name, err)
            return
        with self._lock:
            fresh: dict[int, int] = {}
            for e, loc in zip(entries, locs):
                if e in fresh or self.table.loc_of(e, lower.rank) != NO_LOC:  # a concurrent flush/demotion first
                    lower.free([loc])
                else:
                    fresh[e] = loc
            if fresh:  # one batch: a call of the policy and index a block was 0.7 ms of a 32-block prefix's 2.5
                self._add_new_copies(np.fromiter(fresh, np.int64, len(fresh)), lower.rank, list(fresh.values()))

    def _write_with_room(self, lower: Tier, metas: list[BlockMeta], sources: list[Any]) -> list[int]:
        need = sum(m.stored_length for m in metas)
        for attempt in range(3):
            try:
                return lower.write(metas, sources)
            except TierFull:
                if attempt == 2:
                    raise
                freed = self._evict(lower, need)
                if attempt == 0 and freed and self.nvme_eviction == "segment":
                    continue  # whole segments may have gone with their victims: then no compaction copies anything
                compact = getattr(lower, "compact", None)
                if compact is not None:
                    # Callers hold the store's lock, which a running compaction's relocation takes: waiting
                    # for that compaction would deadlock, so only compact when nobody else is.
                    compact(wait=False)
                if not freed and compact is None:
                    raise
        raise TierFull(lower.name)

    def demote_once(self) -> int:
        """One pass of the background demoter: bring every tier under its low watermark."""
        moved = 0
        for tier in self.tiers[:-1]:  # the last tier drops only on demand, never ahead of time
            lower = self._next_tier(tier)
            if lower is None or self._degraded(lower):
                continue  # nowhere to demote to: ahead of time this would only drop blocks
            over = tier.used_bytes - self.low * tier.capacity_bytes
            if tier.used_bytes > self.high * tier.capacity_bytes and over > 0:
                moved += self._evict(tier, int(min(over, self.demote_batch_bytes)))
        return moved

    def start(self) -> None:
        if self._demoter is None:
            self._demoter = threading.Thread(target=self._demote_loop, name="kvstore-demoter", daemon=True)
            self._demoter.start()

    def _demote_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            try:
                while self.demote_once() and not self._stop.is_set():
                    pass
                self.compact_once()
            except Exception:  # keep the demoter alive; the fault shows in tier stats
                log.exception("demoter pass failed")
                time.sleep(0.5)

    def flush(self, batch_bytes: int = 64 << 20) -> int:
        """Copy every block that has no copy in the last (durable) tier down to it; returns blocks copied."""
        if len(self.tiers) < 2:
            return 0
        durable, copied = self.tiers[-1], 0
        while True:
            with self._lock:
                t, todo, size = self.table, [], 0
                for e in t.without_copy(durable.rank).tolist():
                    if size >= batch_bytes:
                        break
                    todo.append(e)
                    size += t.stored_len[e]
                for e in todo:
                    t.leases[e] += 1
            if not todo:
                return copied
            upper = {e: next(x for x in self.tiers if t.loc_of(e, x.rank) != NO_LOC) for e in todo}
            try:
                for tier in {id(x): x for x in upper.values()}.values():
                    self._copy_down([e for e in todo if upper[e] is tier], tier, durable)
            finally:
                with self._lock:
                    for e in todo:
                        self._unlease(e)
            done = sum(1 for e in todo if t.loc_of(e, durable.rank) != NO_LOC)
            if not done:
                log.warning("flush to %s stopped: %d blocks could not be written", durable.name, len(todo))
                return copied
            copied += done

    # -- recovery -------------------------------------------------------------------
    def _recover(self, tier: Tier, batch: int = 4096) -> None:
        """Index the blocks a durable tier found at start, a batch of one namespace at a time."""
        n = 0
        columns = getattr(tier, "recover_columns", None)  # the NVMe tier hands them over as numpy columns
        recs = columns() if columns is not None else None
        if recs is not None:
            with self._lock:
                n = self._recover_columns(tier, recs)
            if n:
                log.info("recovered %d blocks from %s", n, tier.name)
            return
        with self._lock:
            group: list[tuple[BlockMeta, int]] = []
            for meta, loc in tier.recover():
                if group and (len(group) >= batch or meta.namespace != group[0][0].namespace):
                    n += self._recover_batch(tier, group)
                    group = []
                group.append((meta, loc))
            if group:
                n += self._recover_batch(tier, group)
        if n:
            log.info("recovered %d blocks from %s", n, tier.name)

    def _recover_columns(self, tier: Tier, recs: Any, batch: int = 1 << 16) -> int:
        """``_recover`` from columns (kvstore.tiers.nvme.sidecar.RecordColumns; ``offsets`` are locations)."""
        t, n = self.table, 0
        dtypes = np.asarray([dtype_id(d) for d in recs.dtypes] or [0], dtype=np.uint8)
        held = len(t) > 0  # else no block can be in a tier above yet (the winners' keys are distinct)
        t.reserve(len(recs))  # one slot table of the final size instead of a rebuild at every growth step
        for ns_index, name in enumerate(recs.namespaces):
            rows = np.nonzero(recs.ns == ns_index)[0]
            ns = t.namespace_id(name, create=True)
            assert ns is not None  # create=True always gives an id
            for start in range(0, len(rows), batch):
                r = rows[start : start + batch]
                keys = np.ascontiguousarray(recs.keys[r], dtype=np.uint64)
                present = t.slots.find_keys(keys, ns) >= 0 if held else np.zeros(len(r), dtype=np.bool_)
                if present.any():  # already held in a tier above: this copy is not needed
                    tier.free(recs.offsets[r[present]].tolist())
                    r, keys = r[~present], keys[~present]
                fields = np.stack(
                    [recs.stored_length[r], recs.raw_length[r], recs.raw_crc[r], recs.codec[r]], axis=1
                ).astype(np.int64)
                ids = t.insert_arrays(ns, keys, fields, dtypes[recs.dtype[r]], recs.parents[r], recs.has_parent[r])
                self._add_new_copies(ids, tier.rank, recs.offsets[r])
                n += len(r)
        return n

    def _recover_batch(self, tier: Tier, group: list[tuple[BlockMeta, int]]) -> int:
        t = self.table
        ns = t.namespace_id(group[0][0].namespace, create=True)
        assert ns is not None
        present = t.find_many(ns, [m.hash for m, _ in group]).tolist()
        keep: list[tuple[BlockMeta, int]] = []
        seen: set[bytes] = set()
        for (meta, loc), e in zip(group, present):
            if e >= 0 or meta.hash in seen:
                tier.free([loc])
            else:
                seen.add(meta.hash)
                keep.append((meta, loc))
        if keep:
            ids = t.insert_many(ns, [m for m, _ in keep], [dtype_id(m.dtype) for m, _ in keep])
            self._add_new_copies(ids, tier.rank, [loc for _, loc in keep])
        return len(keep)

    def relocate(self, rank: int, moves: Sequence[tuple[int, int]]) -> None:
        """Compaction moved records of tier `rank`: (old_loc, new_loc) pairs; new_loc == NO_LOC
        means the record failed its checksum while being copied and is gone."""
        mapping = dict(moves)
        with self._lock:
            t = self.table
            ids, old = t.find_locs(rank, list(mapping))
            moved: list[int] = []
            for e, loc in zip(ids.tolist(), old.tolist()):
                new = mapping[loc]
                if new != NO_LOC:
                    t.set_loc(e, rank, new)
                    moved.append(e)
                    continue
                self.counters.corrupt += 1
                if self._published is not None:
                    self._published.removed(np.array([e], dtype=np.int64), rank)
                t.set_loc(e, rank, NO_LOC)  # the record is already gone from the tier: no free()
                self._notify("remove", e, rank)
                self.policies[rank].remove(e)
                p = t.parent_of(e)
                if p is not None and t.nchild_add(p, rank, -1) == 0:
                    self.policies[rank].set_leaf(p, True)
                if not self._has_copy(e):
                    self._unmap(e)
            if moved and self._published is not None:  # one call, before the old segment goes
                self._published.moved(np.array(moved, dtype=np.int64))

    def compact_once(self) -> None:
        """Let durable tiers reclaim dead space when they have segments worth compacting."""
        for tier in self.tiers[1:]:
            reclaimable = getattr(tier, "reclaimable", None)
            if reclaimable is not None and reclaimable().compactable_segments and not self._degraded(tier):
                tier.compact(max_segments=1)  # type: ignore[attr-defined]
