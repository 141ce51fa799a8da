"""``touch_many`` of ``freq`` and ``adaptive`` decides exactly as ``touch`` one by one, on the compiled path and
on the numpy one (kvstore/store/policy_jit.py, kvstore/store/frequency.py, kvstore/store/adaptive.py).

Three copies of a policy, each bound to its own identical index (a policy shares the sketch of its index), see
the same random operations: puts (``insert_many``, ``insert``), Gets (runs of a chain, with repeats and ids
the tier does not hold) given as one ``touch_many`` (compiled), one ``touch_many`` on the numpy path, or a
``touch`` per block; evictions with leased blocks skipped, removals, leaf changes, hints with TTLs that run
out, copies coming and going in the tiers above (which decide whether a touch counts). After every operation
the victims, P and the switches must be the same, and at the end the whole eviction order, the shadows'
accesses and the stats. The sketch is made to age (halve) at every check, and checks are brought near, so that
aging lands inside batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store import policy_jit
from kvstore.store.adaptive import AdaptiveLeafPolicy
from kvstore.store.frequency import FrequencyLeafLRU
from kvstore.store.hints import ReuseHint
from kvstore.tiers.base import DRAM, HBM, NVME
from tests.policy_tables import chained_table

pytestmark = pytest.mark.skipif(not policy_jit.AVAILABLE, reason="numba is not installed")

N = 300


class Copy:
    """One policy on its own index; ``mode``: how a Get reaches it ("fused", "numpy" or "each")."""

    def __init__(self, kind: str, rank: int, chain: int, mode: str, now: list[float], max_shadow: int):
        self.table, self.mode = chained_table(N, chain), mode
        if kind == "freq":
            self.p: Any = FrequencyLeafLRU()
        else:  # eager switching; with max_shadow 64 the shadows sample once more than 64 blocks are held
            self.p = AdaptiveLeafPolicy(max_shadow=max_shadow, margin=0.0, confidence=0.0, window=0.1,
                                        now=lambda: now[0])  # fmt: skip
        self.p.bind(self.table, rank)
        self.p.sketch.halve_after = 0.02  # age at every check (every 1024 additions)
        if mode == "numpy":
            self.p._fused = (self.table, None)  # what _fused_columns gives where it does not apply

    def get(self, ids: list[int]) -> None:
        if self.mode == "each":
            for e in ids:
                self.p.touch(e)
        else:
            self.p.touch_many(ids)

    def decisions(self) -> tuple[Any, ...]:
        return getattr(self.p, "P", None), getattr(self.p, "switches", None)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, N - 1), st.integers(1, 40), st.booleans()),
        st.tuples(
            st.just("get"), st.integers(0, N - 1), st.integers(1, 70), st.lists(st.integers(0, N - 1), max_size=6)
        ),
        st.tuples(st.just("evict"), st.integers(1, 30), st.integers(0, 6)),
        st.tuples(st.just("remove"), st.integers(0, N - 1)),
        st.tuples(st.just("leaf"), st.integers(0, N - 1), st.booleans()),
        st.tuples(st.just("hint"), st.integers(0, N - 1), st.integers(0, 4)),
        st.tuples(st.just("above"), st.lists(st.integers(0, N - 1), min_size=1, max_size=12), st.integers(1, 3)),
        st.tuples(st.just("time"), st.integers(0, 3)),
        st.tuples(st.just("age"), st.integers(0, 40)),
    ),
    min_size=1,
    max_size=60,
)
HINTS = (ReuseHint(reuse=False), ReuseHint(reuse=True), ReuseHint(priority=2), ReuseHint(ttl_s=2.0),
         ReuseHint(reuse=True, priority=1))  # fmt: skip


def _drive(
    kind: str, rank: int, chain: int, steps: list[tuple[Any, ...]], warm: int, max_shadow: int = 64
) -> tuple[int, int]:
    """The operations on three copies, checked as the module doc says: how often P switched, the sketch aged."""
    now = [0.0]
    copies = [Copy(kind, rank, chain, mode, now, max_shadow) for mode in ("fused", "numpy", "each")]
    held: set[int] = set()

    def all_(f: Any) -> list[Any]:
        return [f(c) for c in copies]

    def put(ids: list[int]) -> None:
        a = np.array(ids, dtype=np.int64)
        leaf = np.zeros(len(a), dtype=np.bool_)
        leaf[-1] = True
        cold = (a % 17) == 0
        for c in copies:
            c.p.insert_many(a, leaf, cold)
            if ids[0] % chain and ids[0] - 1 in held:
                c.p.set_leaf(ids[0] - 1, False)
        held.update(ids)

    def evict(k: int, salt: int) -> None:
        for _ in range(k):
            got = all_(lambda c: c.p.pop_victim(lambda e: (e * 7 + salt) % 5 != 0 or salt == 6))
            assert got.count(got[0]) == 3, got
            v = got[0]
            if v is None:
                return
            held.discard(v)
            for c in copies:
                c.p.remove(v)
                if v % chain and v - 1 in held:
                    c.p.set_leaf(v - 1, True)

    for s in range(0, min(warm, N), 30):  # enough held for the shadows to sample (adaptive, max_shadow 64)
        put(list(range(s, min(N, s + 30))))
    for op in steps:
        if op[0] == "put":
            ids = [e for e in range(op[1], min(N, op[1] + op[2])) if e not in held]
            if ids and op[3]:
                put(ids)
            elif ids:
                for c in copies:
                    c.p.insert(ids[0], True, False)
                held.add(ids[0])
        elif op[0] == "get":
            ids = list(range(op[1], min(N, op[1] + op[2]))) + op[3]
            for c in copies:
                c.get(ids)
        elif op[0] == "evict":
            evict(op[1], op[2])
        elif op[0] == "remove":
            held.discard(op[1])
            for c in copies:
                c.p.remove(op[1])
        elif op[0] == "leaf":
            for c in copies:
                c.p.set_leaf(op[1], op[2])
        elif op[0] == "hint":
            for c in copies:
                c.p.hint(op[1], HINTS[op[2]])
        elif op[0] == "above":  # copies in the tiers above appear (odd) or go (even)
            where = np.array(op[1], dtype=np.int64)
            locs = np.where(where % 2 == 1, where + 1, 0).astype(np.uint32)
            for c in copies:
                for r in (HBM, DRAM, NVME):
                    if r < rank and (op[2] >> (r - 1)) & 1:
                        c.table.column_of_loc(r).put(where, locs)
        elif op[0] == "age":  # the sketch's next aging check comes within that many additions
            for c in copies:
                c.p.sketch._added = (c.p.sketch._added | 1023) - op[1]
        else:
            now[0] += op[1]
        d = all_(Copy.decisions)
        assert d.count(d[0]) == 3, (op, d)
    evict(N, 6)  # the whole order that is left
    if kind == "adaptive":
        ends = all_(lambda c: (c.p._accesses, c.p.stats(), c.p.footprint()))
        assert ends.count(ends[0]) == 3, ends
    sketches = all_(lambda c: (c.p.sketch.halvings, [bytes(r) for r in c.p.sketch._rows]))
    assert sketches.count(sketches[0]) == 3
    return int(getattr(copies[0].p, "switches", 0)), copies[0].p.sketch.halvings


@pytest.mark.parametrize("kind", ["freq", "adaptive"])
@pytest.mark.parametrize("rank", [DRAM, NVME])  # one rank above (HBM), two (HBM, DRAM)
@settings(max_examples=25, deadline=None)
@given(steps=ops, chain=st.integers(3, 40), warm=st.sampled_from([0, 120, 300]))
def test_touch_many_decides_as_touch_one_by_one(kind: str, rank: int, chain: int, steps: list[Any], warm: int) -> None:
    _drive(kind, rank, chain, steps, warm)


def _random_steps(rng: np.random.Generator, n: int) -> list[tuple[Any, ...]]:
    steps: list[tuple[Any, ...]] = []
    for _ in range(n):
        x, e = int(rng.integers(0, 100)), int(rng.integers(0, N))
        if x < 25:
            steps.append(("put", e, int(rng.integers(1, 40)), bool(x < 22)))
        elif x < 60:
            steps.append(
                ("get", e, int(rng.integers(1, 70)), [int(v) for v in rng.integers(0, N, int(rng.integers(0, 4)))])
            )
        elif x < 80:
            steps.append(("evict", int(rng.integers(1, 30)), int(rng.integers(0, 7))))
        elif x < 84:
            steps.append(("remove", e))
        elif x < 88:
            steps.append(("leaf", e, bool(x % 2)))
        elif x < 92:
            steps.append(("hint", e, int(rng.integers(0, 5))))
        elif x < 95:
            steps.append(("above", [int(v) for v in rng.integers(0, N, 10)], int(rng.integers(1, 4))))
        elif x < 98:
            steps.append(("age", int(rng.integers(0, 40))))
        else:
            steps.append(("time", int(rng.integers(0, 3))))
    return steps


@pytest.mark.parametrize("seed", range(4))
def test_long_random_runs_decide_alike_and_switch(seed: int) -> None:
    rng = np.random.default_rng(seed)
    steps = _random_steps(rng, 600)
    _, aged = _drive("freq", [DRAM, NVME][seed % 2], int(rng.integers(3, 40)), steps, 300)
    switched, aged_too = _drive("adaptive", [DRAM, NVME][seed % 2], int(rng.integers(3, 40)), steps, 300, 6144)
    sampled = _drive("adaptive", [NVME, DRAM][seed % 2], int(rng.integers(3, 40)), steps, 300)
    assert switched > 0 and aged > 0 and aged_too > 0, (switched, aged, aged_too, sampled)  # every path ran


def test_a_long_get_grows_the_buffers_and_the_queue() -> None:
    kind_steps: list[tuple[Any, ...]] = [("get", 0, 70, list(range(200, 300)) * 3), ("evict", 20, 6)] * 3
    _drive("adaptive", DRAM, 10, kind_steps, 300)
    _drive("freq", DRAM, 10, kind_steps, 300)
