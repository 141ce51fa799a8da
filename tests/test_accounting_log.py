"""AccountingLogTier: the NVMe tier's space rules (segments, compaction) without bytes, for bench.replay_log."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store import BlockStore
from kvstore.tiers.accounting import AccountingLogTier, AccountingMemoryTier
from kvstore.tiers.base import BlockMeta, TierFull

BLOCK = 1 << 20


def meta(i: int) -> BlockMeta:
    return BlockMeta("ns", i.to_bytes(16, "little"), b"", 0, "uint8", BLOCK, BLOCK, 0)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["write", "free", "compact"]), st.integers(1, 6)), max_size=60))
def test_live_bytes_segments_and_moves_stay_consistent(ops):
    tier = AccountingLogTier(16 * BLOCK, 4 * BLOCK)  # 4 segments of 4 blocks, one kept for compaction
    live: set[int] = set()

    def moved(moves: list[tuple[int, int]]) -> None:
        for old, new in moves:
            live.remove(old)
            live.add(new)

    tier.on_relocate = moved
    for i, (op, n) in enumerate(ops):
        if op == "write":
            try:
                live.update(tier.write([meta(i)] * n, [None] * n))
            except TierFull:
                spill = 1 + (n > 4)  # segments a batch of n needs at most
                assert len(tier._segments) + spill > tier.max_segments - 1  # noqa: SLF001 - only when out of room
        elif op == "free" and live:
            gone = sorted(live)[:: max(1, 7 - n)]
            tier.free(gone)
            live.difference_update(gone)
        elif op == "compact":
            tier.compact()
        assert tier.used_bytes == len(live) * BLOCK
        assert len(tier._segments) <= tier.max_segments  # noqa: SLF001
        tier.read(sorted(live), [BLOCK] * len(live), [None] * len(live))  # every live location reads
        for loc in live:
            unit = tier.freed_with(loc)
            assert unit is None or unit[0] <= loc < unit[1]
    with pytest.raises(KeyError):
        tier.free([max(live, default=0) + 1])


def test_segment_eviction_copies_nothing_where_block_eviction_copies(tmp_path):
    copied = {}
    for mode in ("segment", "block"):
        log = AccountingLogTier(32 * BLOCK, 4 * BLOCK)
        store = BlockStore([AccountingMemoryTier(4 * BLOCK), log], nvme_eviction=mode)
        log.on_relocate = lambda moves, store=store, log=log: store.relocate(log.rank, moves)
        for i in range(300):
            ticket = store.begin_put("ns", meta(i))
            if ticket is not None:
                store.commit_put(ticket)
            store.release(store.acquire("ns", [meta(j).hash for j in range(max(0, i - 30), i, 7)], allow_missing=True))
            while store.demote_once():
                pass
            store.compact_once()
        copied[mode] = log.counts["relocated"]
        assert log.used_bytes <= log.capacity_bytes
        store.check_invariants(quiet=True)
    assert copied["segment"] == 0 < copied["block"]
