"""Eviction policies (kvstore.store.policies): pure logic, the sketch, and inside a BlockStore."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store import BlockStore
from kvstore.store.policies import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    FrequencyLeafLRU,
    FrequencySketch,
    make_policy,
    policy_factory,
)
from kvstore.store.policy import LeafLRU
from kvstore.tiers.accounting import AccountingDiskTier, AccountingMemoryTier
from kvstore.tiers.base import DRAM, NVME, BlockMeta

BLOCK = 1 << 20


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def put(store: BlockStore, i: int, parent: int | None) -> None:
    meta = BlockMeta("ns", key(i), key(parent) if parent is not None else b"", 0, "uint8", BLOCK, BLOCK, 0)
    ticket = store.begin_put("ns", meta)
    if ticket is not None:
        store.commit_put(ticket)


def get(store: BlockStore, ids: list[int]) -> int:
    n, _ = store.lookup("ns", [key(i) for i in ids])
    leases = store.acquire("ns", [key(i) for i in ids[:n]])
    store.materialize(leases)
    store.release(leases)
    return n


# -- selection by name ------------------------------------------------------------------
def test_policies_by_name():
    assert DEFAULT_POLICY == "adaptive" and set(POLICY_NAMES) >= {"lru", "freq", "adaptive"}
    assert type(make_policy("lru")) is LeafLRU
    assert isinstance(make_policy("freq", protect=2.0), FrequencyLeafLRU)
    factory = policy_factory("freq")
    assert factory() is not factory()
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'.*lru"):
        make_policy("nope")
    with pytest.raises(ValueError):
        policy_factory("freq", reuse_threshold=0)


# -- the sketch ---------------------------------------------------------------------------
def test_sketch_never_underestimates_and_halves():
    sketch = FrequencySketch(width_bits=13, halve_after=1e9)  # 8x the minimum population: no growth
    truth = {fp: (fp % 7) + 1 for fp in range(1, 400)}
    for fp, n in truth.items():
        for _ in range(n):
            sketch.add(fp * 0x51ED27)
    assert all(sketch.estimate(fp * 0x51ED27) >= n for fp, n in truth.items())
    exact = sum(sketch.estimate(fp * 0x51ED27) == n for fp, n in truth.items())
    assert exact > 0.9 * len(truth)  # conservative update keeps collisions rare at this load
    before = sketch.estimate(0x51ED27 * 6)
    sketch.halve_after = 0
    for _ in range(1024):  # maintenance runs every 1024 additions
        sketch.add(123456789)
    assert sketch.halvings == 1 and sketch.estimate(0x51ED27 * 6) == before // 2


def test_sketch_grows_with_its_population():
    sketch = FrequencySketch(width_bits=10)
    policy = FrequencyLeafLRU(sketch=sketch)
    for e in range(5000):
        policy.insert(e)
    assert (1 << sketch.width_bits) >= 8 * 4096


# -- pure policy logic --------------------------------------------------------------------
def test_a_reused_block_outlives_newer_blocks_seen_once():
    policy = FrequencyLeafLRU(protect=4.0)
    policy.insert(0)
    policy.touch(0)  # seen twice: protected
    for e in range(1, 6):
        policy.insert(e)  # newer, seen once
    assert [policy.pop_victim(lambda e: True) for _ in range(5)] == [1, 2, 3, 4, 5]
    plain = LeafLRU()
    plain.insert(0)
    plain.touch(0)
    for e in range(1, 6):
        plain.insert(e)
    assert plain.pop_victim(lambda e: True) == 0  # plain LRU would drop it first


def test_protection_runs_out():
    policy = FrequencyLeafLRU(protect=1.0)
    policy.insert(0)
    policy.touch(0)
    for e in range(1, 400):  # many turnovers of a tier of about 64 blocks
        policy.insert(e)
        if e > 64:
            policy.remove(policy.pop_victim(lambda e: True))
    assert 0 not in policy  # an old reuse does not pin a block forever


def test_parent_waits_for_its_children():
    policy = FrequencyLeafLRU()
    policy.insert(0)
    policy.insert(1)
    policy.set_leaf(0, False)  # 1 is 0's child
    policy.touch(1)
    policy.touch(1)
    assert policy.pop_victim(lambda e: True) == 1
    policy.remove(1)
    policy.set_leaf(0, True)
    assert policy.pop_victim(lambda e: True) == 0


ops = st.lists(
    st.tuples(st.sampled_from(["insert", "touch", "evict", "lease"]), st.integers(0, 30)), min_size=1, max_size=120
)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from(["lru", "freq"]))
def test_victim_is_always_an_evictable_leaf(sequence, name):
    """Driven as a BlockStore drives it, over a forest where block i's parent is i // 2."""
    policy = make_policy(name)
    resident: set[int] = set()
    leased: set[int] = set()

    def children(e: int) -> list[int]:
        return [c for c in (2 * e, 2 * e + 1) if c in resident and c != e]

    for op, e in sequence:
        if op == "insert" and e not in resident and (e == 0 or e // 2 in resident):
            resident.add(e)
            policy.insert(e, is_leaf=not children(e))
            if e and len(children(e // 2)) == 1:
                policy.set_leaf(e // 2, False)
        elif op == "touch":
            policy.touch(e)
        elif op == "lease" and e in resident:
            leased ^= {e}
        elif op == "evict":
            victim = policy.pop_victim(lambda x: x not in leased)
            evictable_leaves = {x for x in resident if not children(x) and x not in leased}
            if victim is None:
                assert not evictable_leaves
                continue
            assert victim in evictable_leaves, "victim must be a resident, unleased leaf"
            resident.discard(victim)
            policy.remove(victim)
            if victim and victim // 2 in resident and not children(victim // 2):
                policy.set_leaf(victim // 2, True)
        assert len(policy) == len(resident)


# -- inside a BlockStore --------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9)), min_size=1, max_size=40))
def test_store_with_freq_keeps_leaves_first(requests):
    store = BlockStore([AccountingMemoryTier(6 * BLOCK)], policy_factory=policy_factory("freq"))
    evict_copy = store._evict_copy

    def checked(e: int, tier, deferred=None) -> None:  # noqa: ANN001 (the store's deferred removals)
        t = store.table
        assert not any(t.live[c] and t.parent_of(c) == e and t.loc[c, tier.rank] >= 0 for c in range(len(t.live)))
        evict_copy(e, tier, deferred)

    store._evict_copy = checked  # type: ignore[method-assign]
    for chain, length in requests:
        ids = [chain * 100 + d for d in range(length)]
        n = get(store, ids)
        for d in range(n, length):
            put(store, ids[d], ids[d - 1] if d else None)
        store.check_invariants()


def test_an_access_is_counted_once_across_tiers():
    store = BlockStore(
        [AccountingMemoryTier(2 * BLOCK), AccountingDiskTier(8 * BLOCK)], policy_factory=policy_factory("freq")
    )
    dram, nvme = store.policies[DRAM], store.policies[NVME]
    assert dram.sketch is nvme.sketch  # one sketch per store
    put(store, 0, None)
    for i in range(1, 4):  # pushes block 0 down to NVMe (a copy, not an access)
        put(store, i, None)
    e = store.table.find(store.table.namespace_id("ns"), key(0))
    fp = dram._fingerprint(e)
    assert store.table.loc[e, NVME] >= 0 and dram.sketch.estimate(fp) == 1
    while store.demote_once():  # what the background demoter does: room to promote
        pass
    get(store, [0])  # NVMe hit, promoted to DRAM: one access
    assert dram.sketch.estimate(fp) == 2
    assert store.table.loc[e, DRAM] >= 0 and store.table.loc[e, NVME] >= 0
    get(store, [0])  # copies in both tiers: still one access
    assert dram.sketch.estimate(fp) == 3
    store.check_invariants()
