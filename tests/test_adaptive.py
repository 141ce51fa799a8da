"""The adaptive policy (kvstore.store.adaptive): invariants under random use, its shadows, its adaptation, hints."""

from __future__ import annotations

import hashlib
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store import BlockStore
from kvstore.store.adaptive import AdaptiveLeafPolicy, Shadow
from kvstore.store.hints import ReuseHint
from kvstore.store.policies import make_policy, policy_factory
from kvstore.tiers.accounting import AccountingMemoryTier
from kvstore.tiers.base import BlockMeta

BLOCK = 1 << 20


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def drive(policy: AdaptiveLeafPolicy, requests: list[list[int]], capacity: int) -> float:
    """One tier of ``capacity`` blocks driven as BlockStore drives its policy; block ids are prefix nodes
    (a block's parent is the block before it). Returns the prefix hit rate."""
    resident: set[int] = set()
    nchild: defaultdict[int, int] = defaultdict(int)
    parent: dict[int, int] = {}
    policy.parent_of = parent.get
    hits = total = 0
    for request in requests:
        n = 0
        while n < len(request) and request[n] in resident:
            n += 1
        hits, total = hits + n, total + len(request)
        for i, b in enumerate(request):
            if b in resident:
                policy.touch(b)
                continue
            if len(resident) >= capacity:
                victim = policy.pop_victim(lambda e: True)
                assert victim is not None and victim in resident and not nchild[victim]
                resident.discard(victim)
                policy.remove(victim)
                p = parent.pop(victim, None)
                if p is not None and p in resident:
                    nchild[p] -= 1
                    if not nchild[p]:
                        policy.set_leaf(p, True)
            p = request[i - 1] if i else None
            rooted = p is None or p in resident
            resident.add(b)
            if p is not None and rooted:
                parent[b] = p
            policy.insert(b, is_leaf=not nchild[b], cold=not rooted)
            if p is not None and rooted:
                nchild[p] += 1
                if nchild[p] == 1:
                    policy.set_leaf(p, False)
    return hits / max(total, 1)


# -- invariants, under random use --------------------------------------------------------------
hints = st.builds(ReuseHint, st.sampled_from([None, True, False]), st.integers(0, 3), st.none() | st.floats(0, 5))
OPS = ["insert"] * 4 + ["touch", "evict", "evict", "lease", "tick", "hint"]
ops = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 14), hints), min_size=20, max_size=150)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([(0.0,), (4.0,), (0.0, 1.0, 4.0, 16.0)]))
def test_victim_is_always_an_unleased_leaf_and_memory_stays_bounded(sequence, ladder):
    """Over a forest where block i's parent is i // 2: every victim is a resident leaf no lease holds,
    whatever the hints and the clock; what the policy holds stays within a constant of its residents."""
    now = [0.0]
    policy = AdaptiveLeafPolicy(ladder=ladder, now=lambda: now[0])
    resident: set[int] = set()
    leased: set[int] = set()
    peak = 0

    def children(e: int) -> list[int]:
        return [c for c in (2 * e, 2 * e + 1) if c in resident and c != e]

    for op, e, hint in sequence:
        if op == "insert" and e not in resident and (e == 0 or e // 2 in resident):
            resident.add(e)
            policy.insert(e, is_leaf=not children(e))
            if e and len(children(e // 2)) == 1:
                policy.set_leaf(e // 2, False)
        elif op == "touch":
            policy.touch(e)
        elif op == "hint":
            policy.hint(e, hint)
        elif op == "tick":
            now[0] += e / 10
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
            leased.discard(victim)
            policy.remove(victim)
            if victim and victim // 2 in resident and not children(victim // 2):
                policy.set_leaf(victim // 2, True)
        assert len(policy) == len(resident)
        peak = max(peak, len(resident))
        size = policy.footprint()
        assert size["heap_rows"] <= 5 * (4 * len(resident) + 64)
        assert size["hinted"] <= 2 * len(resident)
        assert size["shadow_keys"] <= max(peak, 1)
        assert size["shadow_heap_rows"] <= 2 * (4 * size["shadow_keys"] + 64) + 1


def test_memory_is_bounded_over_a_long_run():
    policy = AdaptiveLeafPolicy(max_shadow=256)
    requests = [[(r * 7919 + d) % 5000 * 10 + d for d in range(3)] for r in range(4000)]  # fresh chains
    drive(policy, [[b + 100000 * (r % 2) for b in req] for r, req in enumerate(requests)], capacity=600)
    size = policy.footprint()
    assert size["resident"] == 600
    assert size["shadow_keys"] <= 256 and policy.stats()["shadow_sample"] == 4  # 600 blocks > 2 x 256: sampled
    assert size["heap_rows"] <= 4 * (4 * 600 + 64)
    assert policy.nbytes() < 600 * 2000


# -- the shadows ---------------------------------------------------------------------------------
request_lists = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=1), min_size=1, max_size=300)


@settings(max_examples=60, deadline=None)
@given(request_lists, st.integers(1, 12), st.sampled_from([0.0, 1.0, 4.0]))
def test_a_shadow_counts_the_hits_of_the_policy_it_models(requests, capacity, P):
    """With one rung, the tier runs exactly the order its shadow simulates: same hits (no decay)."""
    policy = AdaptiveLeafPolicy(ladder=(P,), window=1e15)
    rate = drive(policy, requests, capacity)
    (shadow,) = policy._shadows
    assert shadow.score == pytest.approx(rate * len(requests), abs=1e-6)


def test_shadow_keeps_leaves_first():
    s = Shadow(0.0, 2)
    for fp, parent in ((1, None), (2, 1), (3, 2)):
        s.access(fp, parent, 1, capacity=3)
    s.access(9, None, 1, capacity=3)  # full: the only leaf, 3, goes although 1 is older
    assert set(s.key) == {1, 2, 9}


# -- the adaptation ------------------------------------------------------------------------------
def hot_set_with_scans(rounds: int) -> list[list[int]]:
    """A hot set of 30 blocks reused every round, between scans of 40 blocks never seen again: LFU-friendly."""
    out: list[list[int]] = []
    fresh = 10_000
    for _ in range(rounds):
        out += [[b] for b in range(30)]
        for _ in range(40):
            out.append([fresh])
            fresh += 1
    return out


def used_twice_then_dead(n: int) -> list[list[int]]:
    """Every block is used twice, 30 accesses apart, then never again: frequency is a false signal."""
    out: list[list[int]] = []
    for i in range(n):
        out.append([i])
        if i >= 15:
            out.append([i - 15])
    return out


def test_it_chooses_protection_where_frequency_pays_and_lru_where_it_does_not():
    lfu_friendly = hot_set_with_scans(60)
    lru_friendly = used_twice_then_dead(6000)
    for trace, capacity, better in ((lfu_friendly, 50, "freq"), (lru_friendly, 40, "lru")):
        policy = AdaptiveLeafPolicy()
        rate = drive(policy, trace, capacity)
        rates = {name: drive(make_policy(name), trace, capacity) for name in ("lru", "freq")}  # type: ignore[arg-type]
        assert rates[better] > min(rates.values()) + 0.05, rates
        assert rate >= max(rates.values()) - 0.02, (rate, rates)
        assert (policy.P > 0) == (better == "freq"), policy.stats()


# -- hints ---------------------------------------------------------------------------------------
def test_hints_order_victims():
    now = [0.0]
    policy = AdaptiveLeafPolicy(ladder=(0.0,), now=lambda: now[0])
    for e in range(6):
        policy.insert(e)
    policy.hint(5, ReuseHint(reuse=False))  # newest, but done: first out
    policy.hint(0, ReuseHint(reuse=True))  # oldest, but continues: last out
    policy.hint(1, ReuseHint(ttl_s=10.0))  # kept for 10 s
    assert policy.pop_victim(lambda e: True) == 5
    policy.remove(5)
    assert policy.pop_victim(lambda e: True) == 2
    policy.remove(2)
    now[0] = 11.0  # 1's TTL ran out: it goes before every unhinted block
    assert policy.pop_victim(lambda e: True) == 1
    policy.remove(1)
    assert [policy.pop_victim(lambda e: True) for _ in range(1)] == [3]
    policy.touch(0)  # a hint lasts until the next access
    assert policy.stats()["classes"]["kept"] == policy.stats()["classes"]["kept_once"] == 0
    with pytest.raises(ValueError):
        ReuseHint(priority=9)


def test_hinted_blocks_are_still_ranked_by_their_uses():
    """Where every block carries a "reuse" hint, a hinted block used again outlives hinted blocks seen once
    by P turnovers, as unhinted ones do (one class for all hinted blocks made that plain LRU: 0 went first)."""
    policy = AdaptiveLeafPolicy(ladder=(4.0,))
    policy.insert(0)
    policy.touch(0)  # used twice, and then the oldest of all
    for e in range(1, 8):
        policy.insert(e)
    for e in range(8):
        policy.hint(e, ReuseHint(reuse=True))
    assert policy.stats()["classes"] == {"dead": 0, "once": 0, "reused": 0, "kept": 1, "kept_once": 7}
    order = [policy.pop_victim(lambda e: True) for _ in range(7)]
    assert order == [1, 2, 3, 4, 5, 6, 7]
    for e in order:
        policy.remove(e)
    assert policy.pop_victim(lambda e: True) == 0


def test_store_hint_reaches_the_policy():
    store = BlockStore([AccountingMemoryTier(3 * BLOCK)], policy_factory=policy_factory("adaptive"))
    for i in range(3):
        ticket = store.begin_put("ns", BlockMeta("ns", key(i), b"", 0, "uint8", BLOCK, BLOCK, 0))
        assert ticket is not None
        store.commit_put(ticket)
    assert store.hint("ns", [key(0), key(99)], ReuseHint(reuse=True)) == 1
    assert store.hint("other", [key(0)], ReuseHint(reuse=True)) == 0
    ticket = store.begin_put("ns", BlockMeta("ns", key(3), b"", 0, "uint8", BLOCK, BLOCK, 0))  # evicts 1, not 0
    assert ticket is not None
    store.commit_put(ticket)
    assert store.lookup("ns", [key(0)])[0] == 1 and store.lookup("ns", [key(1)])[0] == 0
    assert BlockStore([AccountingMemoryTier(BLOCK)]).hint("ns", [key(0)], ReuseHint(reuse=False)) == 0
    store.check_invariants()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9), st.sampled_from([None, True, False])), max_size=40),
    st.booleans(),
)
def test_store_with_adaptive_keeps_leaves_first(requests, two_tiers):
    """Inside a BlockStore (one tier, or DRAM over NVMe), with hints: no block is evicted while a child holds
    a copy in that tier, and the store's invariants hold after every request."""
    from kvstore.tiers.accounting import AccountingDiskTier

    tiers = [AccountingMemoryTier(6 * BLOCK)] + ([AccountingDiskTier(12 * BLOCK)] if two_tiers else [])
    store = BlockStore(tiers, policy_factory=policy_factory("adaptive"))
    evict_copy = store._evict_copy

    def checked(e: int, tier, deferred=None) -> None:  # noqa: ANN001 (the store's deferred removals)
        t = store.table
        assert not any(t.live[c] and t.parent_of(c) == e and t.loc[c, tier.rank] >= 0 for c in range(len(t.live)))
        evict_copy(e, tier, deferred)

    store._evict_copy = checked  # type: ignore[method-assign]
    for chain, length, reuse in requests:
        ids = [chain * 100 + d for d in range(length)]
        n, _ = store.lookup("ns", [key(i) for i in ids])
        leases = store.acquire("ns", [key(i) for i in ids[:n]])
        store.materialize(leases)
        store.release(leases)
        for d in range(n, length):
            parent = key(ids[d - 1]) if d else b""
            ticket = store.begin_put("ns", BlockMeta("ns", key(ids[d]), parent, 0, "uint8", BLOCK, BLOCK, 0))
            if ticket is not None:
                store.commit_put(ticket)
        store.hint("ns", [key(i) for i in ids], ReuseHint(reuse=reuse))
        while store.demote_once():
            pass
        store.check_invariants()
