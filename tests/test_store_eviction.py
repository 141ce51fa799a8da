"""BlockStore eviction properties (hypothesis): bounded capacity, exact bytes, leaves before parents."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.checksum import crc32c
from kvstore.store import BlockStore, CapacityError
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import HBM, BlockMeta

SIZES = [16 << 10, 64 << 10, 100 << 10]


def key(chain: int, depth: int) -> bytes:
    return hashlib.blake2b(f"{chain}/{depth}".encode(), digest_size=16).digest()


def payload(k: bytes, size: int) -> bytes:
    return (k * (size // 16 + 1))[:size]


def put_chain(store: BlockStore, chain: int, length: int, size: int) -> None:
    for depth in range(length):
        k = key(chain, depth)
        data = payload(k, size)
        meta = BlockMeta("ns", k, key(chain, depth - 1) if depth else b"", 0, "uint8", size, size, crc32c(data))
        ticket = store.begin_put("ns", meta)
        if ticket is not None:
            ticket.buffer[:] = data
            store.commit_put(ticket)


class Recorder(BlockStore):
    """Checks at every eviction that the victim has no child left in the tier."""

    def _evict_copy(self, e, tier, deferred=None):
        t = self.table
        children = [c for c in range(len(t.live)) if t.live[c] and t.parent_of(c) == e and t.loc[c, tier.rank] >= 0]
        assert not children, "a parent was evicted while its child stays in the tier"
        super()._evict_copy(e, tier, deferred)


ops = st.lists(
    st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 7), st.integers(1, 12), st.sampled_from(SIZES)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_random_put_get_sequences(sequence):
    store = Recorder([ArenaTier(1 << 20, page_size=256 << 10)])
    sizes: dict[int, int] = {}
    for op, chain, length, size in sequence:
        size = sizes.setdefault(chain, size)
        if op == "put":
            put_chain(store, chain, length, size)
        else:
            keys = [key(chain, d) for d in range(length)]
            n, _ = store.lookup("ns", keys)
            leases = store.acquire("ns", keys[:n])
            store.materialize(leases)
            for lease in leases:
                assert bytes(lease.buffer) == payload(lease.hash, size), "served other bytes than were put"
            store.release(leases)
        assert store.top.used_bytes <= store.top.capacity_bytes
        store.check_invariants()


def test_leaf_first_keeps_the_head_of_a_long_chain():
    store = BlockStore([ArenaTier(1 << 20, page_size=1 << 20)])
    put_chain(store, 0, 40, 64 << 10)
    keys = [key(0, d) for d in range(40)]
    n, _ = store.lookup("ns", keys)
    assert n >= 15  # the prefix head survives; only the tail beyond capacity was dropped
    assert store.stats()["tiers"][0]["evictions"] > 0


def test_lru_among_leaves():
    store = BlockStore([ArenaTier(256 << 10, page_size=256 << 10)])
    for chain in range(4):
        put_chain(store, chain, 1, 64 << 10)
    leases = store.acquire("ns", [key(0, 0)])  # chain 0 becomes most recent
    store.release(leases)
    put_chain(store, 9, 1, 64 << 10)
    assert store.lookup("ns", [key(0, 0)])[0] == 1
    assert store.lookup("ns", [key(1, 0)])[0] == 0  # the least recently used leaf went


def test_capacity_error_when_all_leased():
    store = BlockStore([ArenaTier(128 << 10, page_size=128 << 10)])
    put_chain(store, 0, 1, 64 << 10)
    put_chain(store, 1, 1, 64 << 10)
    leases = store.acquire("ns", [key(0, 0), key(1, 0)])
    try:
        put_chain(store, 2, 1, 64 << 10)
    except CapacityError as err:
        assert "leased" in str(err)
    else:
        raise AssertionError("expected CapacityError")
    store.release(leases)
    put_chain(store, 2, 1, 64 << 10)


def test_no_demotion_ahead_of_time_into_a_degraded_tier():
    """With the tier below degraded, a memory tier past its watermark keeps its blocks: the background
    demoter would only drop them (found by a timing-dependent ENOSPC test: fresh blocks vanished)."""
    upper, lower = ArenaTier(1 << 20, page_size=1 << 20), ArenaTier(4 << 20, page_size=1 << 20)
    upper.rank, upper.name = HBM, "hbm"  # two host arenas stand in for HBM above DRAM
    store = BlockStore([upper, lower], high_watermark=0.5, low_watermark=0.25)
    put_chain(store, 0, 12, 64 << 10)
    lower.degraded = True
    assert store.demote_once() == 0
    assert store.lookup("ns", [key(0, d) for d in range(12)])[0] == 12
    lower.degraded = False
    assert store.demote_once() > 0 and lower.used_bytes > 0
