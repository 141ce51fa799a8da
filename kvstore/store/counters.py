"""The store's counters: per node (``StoreCounters``) and per tier (``TierCounters``), read by Stats and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TierCounters:
    hits: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    not_admitted: int = 0  # victims dropped instead of demoted: used too few times for the tier below


@dataclass
class StoreCounters:
    lookups: int = 0
    lookup_hits: int = 0
    lookup_misses: int = 0
    puts: int = 0
    already_present: int = 0
    rejected: int = 0
    corrupt: int = 0
    # blocks a client read from NVMe itself again (kvstore/store/background_promotions.py): candidates for a promotion,
    # then promoted, or skipped (the queue full, no room under the top tier's high watermark, deleted, promoted by
    # a Get meanwhile, or a read that failed)
    promotion_candidates: int = 0
    promoted_later: int = 0
    promotions_skipped: int = 0
    tiers: dict[int, TierCounters] = field(default_factory=dict)
