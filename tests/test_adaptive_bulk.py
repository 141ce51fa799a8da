"""``AdaptiveLeafPolicy.insert_many`` against ``insert`` one by one, and the adaptive policy in a BlockStore.

Property test: from the same state, a batch (chains with parents, cold entries, non-leaves, a sample that
coarsens inside the batch) leaves the policy exactly as inserting its entries one by one: clocks, classes,
leaves, the order victims come out, the shadows' keys, parents and scores, the P chosen, and the sketch's
counters (when no two fingerprints of the batch share a counter, the case ``add_many`` documents).
"""

from __future__ import annotations

import copy
import hashlib

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvstore.store.adaptive import AdaptiveLeafPolicy
from kvstore.store.frequency import FrequencySketch
from kvstore.store.index import EntryTable
from kvstore.store.policy import BULK_MIN
from kvstore.tiers.base import DRAM, NVME

CHAIN = 10  # entry i's parent is i - 1 unless i is a multiple of CHAIN


def _words(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def _table(n: int, elsewhere: list[bool]) -> EntryTable:
    t = EntryTable(ranks={DRAM: 32, NVME: 64})
    ns = t.namespace_id("ns", create=True)
    assert ns is not None
    keys = np.frombuffer(b"".join(_words(i) for i in range(n)), "<u8").reshape(n, 2).copy()
    has_parent = np.arange(n) % CHAIN != 0
    parents = np.zeros_like(keys)
    parents[1:] = keys[:-1]
    parents[~has_parent] = 0
    fields = np.tile(np.array([4096, 4096, 0, 0], dtype=np.int64), (n, 1))
    t.insert_arrays(ns, keys, fields, np.ones(n, np.uint8), parents, has_parent)
    for e, other in enumerate(elsewhere):
        if other:  # a copy in another tier: not this block's first copy, so the sketch does not count it
            t.set_loc(e, NVME, 8 * e)
    return t


def _shares_a_counter(sketch: FrequencySketch, fps: list[int]) -> bool:
    slots = [sketch._slots(fp) for fp in sorted(set(fps))]
    return any(any(x == y for x, y in zip(a, b)) for i, a in enumerate(slots) for b in slots[i + 1 :])


def _state(p: AdaptiveLeafPolicy) -> dict[str, object]:
    shadows = [(s.P, s.clock, s.key, s.cls, s.parent, s.nchild, round(s.score, 9), s.last_hit) for s in p._shadows]
    return {
        "prio": p._prio,
        "leaf": p._leaf,
        "clock": p._clock,
        "cls": p._cls,
        "P": p.P,
        "switches": p.switches,
        "sample": p._sample,
        "accesses": p._accesses,
        "shadows": shadows,
        "sketch": [bytes(r) for r in p.sketch._rows],
    }


def _drain(p: AdaptiveLeafPolicy) -> list[int]:
    out = []
    while (e := p.pop_victim(lambda _: True)) is not None:
        out.append(e)
        p.remove(e)
    return out


@settings(max_examples=50, deadline=None)
@given(
    batch=st.lists(st.integers(0, 199), min_size=BULK_MIN, max_size=150, unique=True),
    held=st.integers(0, 90),
    data=st.data(),
)
def test_insert_many_is_insert_one_by_one(batch: list[int], held: int, data: st.DataObject) -> None:
    elsewhere = data.draw(st.lists(st.booleans(), min_size=300, max_size=300))
    leaf = data.draw(st.lists(st.booleans(), min_size=len(batch), max_size=len(batch)))
    cold = data.draw(st.lists(st.booleans(), min_size=len(batch), max_size=len(batch)))
    used_before = data.draw(st.lists(st.sampled_from(batch), max_size=len(batch)))  # earlier uses: reused
    policies = []
    for _ in range(2):  # each bound to its own table (and so its own shared sketch) with the same entries
        p = AdaptiveLeafPolicy(max_shadow=64, ladder=(0.0, 4.0))  # > 64 residents: the shadows sample
        p.bind(_table(300, elsewhere), DRAM)
        for e in range(200, 200 + held):
            p.insert(e, is_leaf=e % 2 == 0)
            if e % 3 == 0:
                p.touch(e)
        for e in used_before:
            p.sketch.add(int(p.table.fp[e]))
        policies.append(p)
    one, many = policies
    assume(not _shares_a_counter(one.sketch, [int(one.table.fp[e]) for e in batch]))
    for e, lf, c in zip(batch, leaf, cold):
        one.insert(e, is_leaf=lf, cold=c)
    many.insert_many(np.asarray(batch, dtype=np.int64), np.asarray(leaf), np.asarray(cold))
    assert _state(one) == _state(many)
    assert _drain(copy.deepcopy(one)) == _drain(copy.deepcopy(many))


def test_insert_many_of_a_batch_with_a_resident_entry_takes_the_loop() -> None:
    p = AdaptiveLeafPolicy()
    p.bind(_table(40, [False] * 40), DRAM)
    p.insert(3)
    p.insert_many(np.arange(20, dtype=np.int64), np.ones(20, np.bool_), np.zeros(20, np.bool_))
    assert len(p) == 20 and p._clock == 20  # 3 kept its rank (inserted once), the other 19 came in order


@settings(max_examples=50, deadline=None)
@given(
    seq=st.lists(st.integers(0, 299), min_size=1, max_size=120),  # repeats, and entries not held, included
    held=st.integers(1, 150),
    on_nvme=st.booleans(),
    data=st.data(),
)
def test_touch_many_is_touch_one_by_one(seq: list[int], held: int, on_nvme: bool, data: st.DataObject) -> None:
    above = data.draw(st.lists(st.booleans(), min_size=300, max_size=300))  # a DRAM copy above an NVMe one
    policies = []
    for _ in range(2):
        p = AdaptiveLeafPolicy(max_shadow=64, ladder=(0.0, 4.0))
        table = _table(300, [False] * 300)
        if on_nvme:
            for e, up in enumerate(above):
                if up:
                    table.set_loc(e, DRAM, 8 * e)  # not this tier's top copy: touched without counting
        p.bind(table, NVME if on_nvme else DRAM)
        for e in range(held):
            p.insert(e, is_leaf=e % 3 != 0)
        policies.append(p)
    one, many = policies
    for e in seq:
        one.touch(e)
    many.touch_many(seq)
    assert _state(one) == _state(many)
    assert _drain(copy.deepcopy(one)) == _drain(copy.deepcopy(many))
