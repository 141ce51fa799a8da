"""What a ``BlockStore`` reports and checks of itself: ``stats()`` (per tier and per node, read by the Stats RPC
and the metrics) and ``check_invariants(quiet)`` (for tests: capacity, leaf structure and per-tier accounting)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.store.counters import StoreCounters
from kvstore.store.index import NO_LOC, EntryTable
from kvstore.store.policy import LeafLRU
from kvstore.store.staging import Staging
from kvstore.tiers.base import MemoryTier, Tier


class StoreInspection:
    """Mixed into BlockStore; reads its table, tiers, policies, counters and staging under its lock."""

    if TYPE_CHECKING:  # provided by BlockStore
        table: EntryTable
        tiers: list[Tier]
        policies: dict[int, LeafLRU]
        counters: StoreCounters
        staging: Staging
        _lock: threading.RLock
        _memory: dict[int, MemoryTier]
        _doomed: set[int]
        _queued: dict[int, None]
        _read_once: OrderedDict[int, None]

        def _has_copy(self, e: int) -> bool: ...

    def stats(self) -> dict[str, Any]:
        with self._lock:
            tiers = []
            for tier in self.tiers:
                s = tier.stats()
                c = self.counters.tiers[tier.rank]
                tiers.append(
                    {
                        "name": s.name,
                        "capacity_bytes": s.capacity_bytes,
                        "used_bytes": s.used_bytes,
                        "blocks": len(self.policies[tier.rank]),
                        "hits": c.hits,
                        "evictions": c.evictions,
                        "demotions": c.demotions,
                        "promotions": c.promotions,
                        "not_admitted": c.not_admitted,
                        "backend": s.backend,
                        "degraded": s.degraded,
                        "fault": s.fault,
                        **s.extra,
                    }
                )
            sc = self.counters
            return {
                "blocks": len(self.table),
                "tiers": tiers,
                "lookups": sc.lookups,
                "lookup_hits": sc.lookup_hits,
                "lookup_misses": sc.lookup_misses,
                "puts": sc.puts,
                "already_present": sc.already_present,
                "rejected": sc.rejected,
                "corrupt": sc.corrupt,
                "queued_promotions": {
                    "candidates": sc.promotion_candidates,
                    "promoted": sc.promoted_later,
                    "skipped": sc.promotions_skipped,
                    "waiting": len(self._queued),
                    "read_once": len(self._read_once),  # promoted if a client reads them again
                },
                "index_bytes": self.table.nbytes() + sum(p.nbytes() for p in self.policies.values()),
            }

    def check_invariants(self, quiet: bool = False) -> None:
        """For tests: capacity bounds, leaf structure and per-tier accounting agree. With ``quiet`` (no Get or Put
        in flight) no lease and no staging byte is held, and every slab tier's used bytes are its blocks' slots:
        none leaked by a promotion or a cold read. All under the lock, so no demotion lands midway."""
        with self._lock:
            t = self.table
            if quiet:
                assert int(np.asarray(t.leases).sum()) == 0, "a lease outlived its Get"
                assert self.staging.used_bytes == 0, "a staging slot outlived its Get"
                for memory in self._memory.values():
                    slabs = getattr(memory, "slabs", None)
                    if slabs is not None:
                        slots = [slabs.slot_size(t.loc_of(e, memory.rank)) for e in t.resident(memory.rank).tolist()]
                        assert memory.used_bytes == sum(slots), (memory.name, memory.used_bytes, sum(slots))
            for tier in self.tiers:
                assert tier.used_bytes <= tier.capacity_bytes, tier.name
                resident = t.resident(tier.rank).tolist()
                assert len(resident) == len(self.policies[tier.rank]), tier.name
                for e in resident:
                    p = t.parent_of(e)
                    if p is not None and p not in self._doomed:
                        assert t.loc_of(p, tier.rank) != NO_LOC or self._has_copy(p), "orphaned parent"
                counts: dict[int, int] = {}
                for e in resident:
                    p = t.parent_of(e)
                    if p is not None:
                        counts[p] = counts.get(p, 0) + 1
                nchild = t.nchild[:, tier.rank]
                for e in np.nonzero(t.live[:])[0].tolist():
                    assert nchild[e] == counts.get(e, 0), (tier.name, e)
