"""The adaptive policy's compiled shadows and batched verbs against the Python reference, decision for decision.

The reference is ``AdaptiveLeafPolicy(jit=False)`` driven one call per block (``insert``, ``touch``): the
shadows as ``Shadow`` objects, one access at a time (kvstore/store/shadows.py). The candidate is the default
policy (the compiled bank, kvstore/store/shadow_jit.py) driven with ``insert_many`` and ``touch_many``.
Random sequences of batched inserts, Gets (touches with repeats and absent ids), evictions with leased blocks
skipped, removals and hints must give the same victims, the same P and switches, and the same shadows (keys,
clocks, classes, parent links, children, scores, the disagreement counts), also once the shadows sample.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store import shadow_jit
from kvstore.store.adaptive import AdaptiveLeafPolicy
from kvstore.store.hints import ReuseHint
from kvstore.store.index import EntryTable
from kvstore.store.shadows import PyShadows
from kvstore.tiers.base import DRAM

pytestmark = pytest.mark.skipif(not shadow_jit.AVAILABLE, reason="numba is not installed")

N = 400
CHAIN = 12  # entry i's parent is i - 1 unless i is a multiple of CHAIN


def _table() -> EntryTable:
    t = EntryTable(ranks={DRAM: 32})
    ns = t.namespace_id("ns", create=True)
    assert ns is not None
    keys = np.frombuffer(
        b"".join(hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(N)), "<u8"
    ).reshape(N, 2)
    has_parent = np.arange(N) % CHAIN != 0
    parents = np.zeros_like(keys)
    parents[1:] = keys[:-1]
    parents[~has_parent] = 0
    fields = np.tile(np.array([4096, 4096, 0, 0], dtype=np.int64), (N, 1))
    t.insert_arrays(ns, keys.copy(), fields, np.ones(N, np.uint8), parents, has_parent)
    return t


def _shadows(p: AdaptiveLeafPolicy) -> list[object]:
    return [(s.P, s.clock, s.key, s.cls, s.parent, s.nchild, s.score, s.last_hit, len(s)) for s in p._shadows] + [
        [list(map(float, row)) for row in p._disagree]
    ]


def _state(p: AdaptiveLeafPolicy) -> dict[str, object]:
    return {
        "prio": p._prio,
        "leaf": p._leaf,
        "cls": p._cls,
        "clock": p._clock,
        "P": p.P,
        "switches": p.switches,
        "sample": p._sample,
        "accesses": p._accesses,
        "shadows": _shadows(p),
    }


ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, N - 1), st.integers(1, 3 * CHAIN)),
        st.tuples(st.just("get"), st.lists(st.integers(0, N - 1), min_size=1, max_size=40)),
        st.tuples(st.just("evict"), st.integers(1, 40)),
        st.tuples(st.just("hint"), st.integers(0, N - 1), st.sampled_from(["dead", "reuse", "priority"])),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(
    ops=ops, max_shadow=st.sampled_from([64, 128, 6144]), ladder=st.sampled_from([(0.0, 4.0), (0.0, 1.0, 4.0, 16.0)])
)
def test_batched_compiled_policy_decides_as_the_python_one_block_at_a_time(ops, max_shadow, ladder) -> None:
    ref = AdaptiveLeafPolicy(max_shadow=max_shadow, ladder=ladder, jit=False)
    new = AdaptiveLeafPolicy(max_shadow=max_shadow, ladder=ladder)
    assert isinstance(ref._bank, PyShadows) and isinstance(new._bank, shadow_jit.JitShadows)
    for p in (ref, new):
        p.bind(_table(), DRAM)
    resident: set[int] = set()
    leased = {e for e in range(N) if e % 7 == 3}

    def children(e: int) -> bool:
        return any(c in resident for c in (e + 1,) if c % CHAIN)

    for op in ops:
        if op[0] == "put":  # a run of the chain, new blocks only (as commit_puts inserts them)
            start, length = op[1], op[2]
            ids = [e for e in range(start, min(start + length, N)) if e not in resident]
            if not ids:
                continue
            resident.update(ids)
            leaf = [not children(e) for e in ids]
            cold = [e % 29 == 5 for e in ids]
            for e, lf, c in zip(ids, leaf, cold):
                ref.insert(e, is_leaf=lf, cold=c)
            new.insert_many(np.asarray(ids, dtype=np.int64), np.asarray(leaf), np.asarray(cold))
            for e in ids:  # a parent held here stops being a leaf
                if e % CHAIN and e - 1 in resident:
                    for p in (ref, new):
                        p.set_leaf(e - 1, False)
        elif op[0] == "get":
            for e in op[1]:
                ref.touch(e)
            new.touch_many(op[1])
        elif op[0] == "evict":
            for _ in range(op[1]):
                a = ref.pop_victim(lambda x: x not in leased)
                b = new.pop_victim(lambda x: x not in leased)
                assert a == b
                if a is None:
                    break
                resident.discard(a)
                for p in (ref, new):
                    p.remove(a)
                    if a % CHAIN and a - 1 in resident:
                        p.set_leaf(a - 1, True)
        else:
            e, kind = op[1], op[2]
            hint = ReuseHint(reuse=False) if kind == "dead" else ReuseHint(reuse=True) if kind == "reuse" else None
            for p in (ref, new):
                p.hint(e, hint if hint is not None else ReuseHint(priority=2))
        assert _state(ref) == _state(new)
    drain = [[p.pop_victim(lambda x: True) for _ in range(N)] for p in (ref, new)]
    assert drain[0] == drain[1]


@settings(max_examples=40, deadline=None)
@given(
    seq=st.lists(st.tuples(st.integers(0, 60), st.booleans(), st.integers(1, 4)), min_size=1, max_size=400),
    capacity=st.integers(1, 40),
    shrink=st.integers(0, 30),
    P=st.sampled_from([0.0, 1.0, 4.0, 16.0]),
)
def test_a_compiled_rung_is_a_shadow(seq, capacity, shrink, P) -> None:
    """Raw accesses (parents anywhere, capacities that shrink mid-run) into both banks: the same hits."""
    py, jit = PyShadows((P, 0.0), 2), shadow_jit.JitShadows((P, 0.0), 2, 64)
    fps = np.array([f * 0x10001 for f, _, _ in seq], dtype=np.uint64)
    parents = np.array([max(f - 1, 0) * 0x10001 for f, _, _ in seq], dtype=np.uint64)
    has = np.array([h for _, h, _ in seq])
    counts = np.array([c for _, _, c in seq], dtype=np.int64)
    caps = np.array([capacity if i < len(seq) // 2 else max(capacity - shrink, 1) for i in range(len(seq))])
    i = 0
    while i < len(seq):
        a = py.run(fps[i:], parents[i:], has[i:], counts[i:], caps[i:], i)
        b = jit.run(fps[i:], parents[i:], has[i:], counts[i:], caps[i:], i)
        assert a == b
        i += a
        for s, v in zip(py.rungs, jit.rungs):
            assert (s.score, s.clock, s.key, s.cls, s.parent, s.nchild, s.last_hit) == (
                v.score, v.clock, v.key, v.cls, v.parent, v.nchild, v.last_hit,
            )  # fmt: skip
        assert py.disagree == jit.disagree.tolist()


def test_the_bank_grows_past_the_keys_it_was_sized_for() -> None:
    py, jit = PyShadows((0.0,), 2), shadow_jit.JitShadows((0.0,), 2, 8)
    fps = np.arange(1, 301, dtype=np.uint64)
    zeros, caps = np.zeros(300, np.uint64), np.full(300, 200, np.int64)
    none, counts = np.zeros(300, np.bool_), np.ones(300, np.int64)
    for bank in (py, jit):
        i = 0
        while i < 300:
            i += bank.run(fps[i:], zeros[i:], none[i:], counts[i:], caps[i:], i)
    assert jit.nodes > 200 and len(jit.rungs[0]) == 200
    assert py.rungs[0].key == jit.rungs[0].key


def test_compiled_and_python_shadows_switch_P_at_the_same_accesses() -> None:
    from tests.test_adaptive import drive, hot_set_with_scans, used_twice_then_dead

    trace = used_twice_then_dead(3000) + hot_set_with_scans(60)  # frequency misleads, then it pays
    runs = []
    for jit in (False, True):
        policy = AdaptiveLeafPolicy(jit=jit)
        rate = drive(policy, trace, 45)
        runs.append((rate, policy.P, policy.switches, [s.score for s in policy._shadows], policy._accesses))
    assert runs[0] == runs[1]
    assert runs[0][2] >= 2  # it switched both ways, so the choice was exercised
