"""Batched policy inserts (``insert_many``, ``FrequencySketch.add_many``) against the one-at-a-time verbs.

Property tests: from the same state, a batch leaves a policy exactly as inserting its entries one by one
(priorities, leaves, clock, the order victims come out) and the sketch with the same counters (when no two
fingerprints of the batch share a counter, the one case ``add_many`` documents as different).
"""

from __future__ import annotations

import copy
import hashlib

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvstore.store import BlockStore
from kvstore.store.frequency import FrequencyLeafLRU, FrequencySketch
from kvstore.store.index import EntryTable
from kvstore.store.policies import policy_factory
from kvstore.store.policy import BULK_MIN, LeafLRU
from kvstore.tiers.accounting import AccountingMemoryTier
from kvstore.tiers.base import DRAM, NVME, BlockMeta

U64 = st.integers(0, (1 << 64) - 1)


def _drain(policy: LeafLRU) -> list[int]:
    out = []
    while (e := policy.pop_victim(lambda _: True)) is not None:
        out.append(e)
    return out


def _shares_a_counter(sketch: FrequencySketch, fps: list[int]) -> bool:
    distinct = sorted(set(fps))
    for i, a in enumerate(distinct):
        sa = sketch._slots(a)
        for b in distinct[i + 1 :]:
            if any(x == y for x, y in zip(sa, sketch._slots(b))):
                return True
    return False


@settings(max_examples=60, deadline=None)
@given(pool=st.lists(U64, min_size=1, max_size=40, unique=True), data=st.data())
def test_sketch_add_many_is_add_one_by_one(pool: list[int], data: st.DataObject) -> None:
    before = data.draw(st.lists(st.sampled_from(pool), max_size=60))
    batch = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=300))
    one, many = FrequencySketch(), FrequencySketch()
    assume(not _shares_a_counter(one, batch))
    for fp in before:
        one.add(fp)
        many.add(fp)
    for fp in batch:
        one.add(fp)
    many.add_many(np.asarray(batch, dtype=np.uint64))
    assert [bytes(r) for r in one._rows] == [bytes(r) for r in many._rows]
    assert one._added == many._added
    fps = np.asarray(pool, dtype=np.uint64)
    assert many.estimate_many(fps).tolist() == [one.estimate(fp) for fp in pool]


def test_sketch_add_many_saturates_and_ages() -> None:
    s = FrequencySketch()
    s.add_many(np.full(300, 7, dtype=np.uint64))
    assert s.estimate(7) == 255
    t = FrequencySketch(halve_after=0.5)  # population 1024: halves once 512 were added, at a check point
    t.add_many(np.full(1000, 9, dtype=np.uint64))
    t.add_many(np.full(100, 9, dtype=np.uint64))  # crosses 1024: halved before this batch counts
    assert t.halvings == 1 and t.estimate(9) == 255 // 2 + 100


def _ops(draw: st.DrawFn, ids: list[int]) -> list[tuple[str, int, bool, bool]]:
    return [
        (draw(st.sampled_from(["insert", "touch", "leaf"])), e, draw(st.booleans()), draw(st.booleans())) for e in ids
    ]


def _apply(policy: LeafLRU, ops: list[tuple[str, int, bool, bool]]) -> None:
    for op, e, a, b in ops:
        if op == "insert":
            if e not in policy:
                policy.insert(e, is_leaf=a, cold=b)
        elif op == "touch":
            policy.touch(e)
        else:
            policy.set_leaf(e, a)


def _same(one: LeafLRU, many: LeafLRU) -> None:
    assert one._prio == many._prio
    assert one._leaf == many._leaf
    assert one._clock == many._clock
    assert _drain(one) == _drain(many)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[tuple[str, int, bool, bool]], list[int], list[bool], list[bool]]:
    ids = draw(st.lists(st.integers(0, 199), min_size=BULK_MIN, max_size=120, unique=True))
    split = draw(st.integers(0, len(ids) - BULK_MIN))
    before = _ops(draw, ids[:split])
    batch = ids[split:]
    leaf = draw(st.lists(st.booleans(), min_size=len(batch), max_size=len(batch)))
    cold = draw(st.lists(st.booleans(), min_size=len(batch), max_size=len(batch)))
    return before, batch, leaf, cold


@settings(max_examples=60, deadline=None)
@given(case=_batches())
def test_lru_insert_many_is_insert_one_by_one(case) -> None:  # type: ignore[no-untyped-def]
    before, batch, leaf, cold = case
    one = LeafLRU()
    _apply(one, before)
    many = copy.deepcopy(one)
    for e, lf, c in zip(batch, leaf, cold):
        one.insert(e, is_leaf=lf, cold=c)
    many.insert_many(np.asarray(batch, dtype=np.int64), np.asarray(leaf), np.asarray(cold))
    _same(one, many)


def _table(n: int, elsewhere: list[bool]) -> EntryTable:
    t = EntryTable(ranks={DRAM: 32, NVME: 64})
    ns = t.namespace_id("ns", create=True)
    assert ns is not None
    keys = np.frombuffer(b"".join(hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(n)), "<u8")
    keys = keys.reshape(n, 2).copy()
    fields = np.tile(np.array([4096, 4096, 0, 0], dtype=np.int64), (n, 1))
    t.insert_arrays(ns, keys, fields, np.ones(n, np.uint8), np.zeros_like(keys), np.zeros(n, np.bool_))
    for e, other in enumerate(elsewhere):
        if other:  # a copy in another tier: not this block's first copy, so the sketch does not count it
            t.set_loc(e, NVME, 8 * e)
    return t


@settings(max_examples=40, deadline=None)
@given(case=_batches(), data=st.data())
def test_freq_insert_many_is_insert_one_by_one(case, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    before, batch, leaf, cold = case
    elsewhere = data.draw(st.lists(st.booleans(), min_size=300, max_size=300))
    used_before = data.draw(st.lists(st.sampled_from(batch), max_size=len(batch)))  # earlier uses: protected
    policies = []
    for _ in range(2):  # each bound to its own table (and so its own shared sketch) with the same entries
        p = FrequencyLeafLRU(protect=3.0)
        p.bind(_table(300, elsewhere), DRAM)
        for e in range(200, 280):  # more than 64 held: the protection depends on how many
            p.insert(e, is_leaf=e % 2 == 0)
        _apply(p, before)
        for e in used_before:
            p.sketch.add(int(p.table.fp[e]))
        policies.append(p)
    one, many = policies
    assume(not _shares_a_counter(one.sketch, [int(one.table.fp[e]) for e in batch]))
    for e, lf, c in zip(batch, leaf, cold):
        one.insert(e, is_leaf=lf, cold=c)
    many.insert_many(np.asarray(batch, dtype=np.int64), np.asarray(leaf), np.asarray(cold))
    assert [bytes(r) for r in one.sketch._rows] == [bytes(r) for r in many.sketch._rows]
    _same(one, many)


def test_a_subclass_that_overrides_insert_gets_the_loop() -> None:
    seen: list[int] = []

    class Counting(LeafLRU):
        def insert(self, e: int, is_leaf: bool = True, cold: bool = False) -> None:
            seen.append(e)
            super().insert(e, is_leaf, cold)

    Counting().insert_many(np.arange(20), np.ones(20, np.bool_), np.zeros(20, np.bool_))
    assert seen == list(range(20))


def _meta(i: int, parent: int | None) -> BlockMeta:
    h = hashlib.blake2b(str(i).encode(), digest_size=16).digest()
    p = hashlib.blake2b(str(parent).encode(), digest_size=16).digest() if parent is not None else b""
    return BlockMeta("ns", h, p, 0, "uint8", 1 << 20, 1 << 20, 0)


def test_commit_puts_orders_eviction_as_commit_put_does() -> None:
    """Chains put as prefixes (one insert_many each) leave the policy as puts one block at a time."""
    stores = [
        BlockStore([AccountingMemoryTier(1 << 40, rank=DRAM)], policy_factory=policy_factory(name))
        for name in ("freq", "freq", "lru", "lru")
    ]
    # first blocks: a root, a parent later in its own chain (cold), or the leaf ending the chain before
    # (an earlier batch's leaf that stops being one)
    firsts = {0: 5, 1: None, 2: 119, 3: 205, 4: 319, 5: None}
    chains = [[(c * 100 + i, c * 100 + i - 1 if i else firsts[c]) for i in range(20)] for c in range(6)]
    for k, store in enumerate(stores):
        for chain in chains:
            tickets = [store.begin_put("ns", _meta(i, p)) for i, p in chain]
            if k % 2:
                store.commit_puts([t for t in tickets if t is not None])
            else:
                for t in tickets:
                    if t is not None:
                        store.commit_put(t)
    for one, many in ((stores[0], stores[1]), (stores[2], stores[3])):
        assert many.policies[DRAM]._leaf == {19, 59, 99, 119}  # entry ids: chains 1 and 3 end in parents
        _same(one.policies[DRAM], many.policies[DRAM])


def test_reserve_sizes_the_slot_table_once() -> None:
    t = EntryTable(ranks={DRAM: 32})
    t.reserve(50_000)
    nslots = t.slots.nslots
    assert 50_000 <= 0.85 * nslots
    ns = t.namespace_id("ns", create=True)
    assert ns is not None
    keys = np.random.default_rng(1).integers(0, 1 << 64, size=(50_000, 2), dtype=np.uint64, endpoint=False)
    fields = np.tile(np.array([1, 1, 0, 0], dtype=np.int64), (50_000, 1))
    ids = t.insert_arrays(ns, keys, fields, np.ones(50_000, np.uint8), np.zeros_like(keys), np.zeros(50_000, np.bool_))
    assert t.slots.nslots == nslots  # no growth on the way
    assert (t.slots.find_keys(keys, ns) == ids).all()
