"""``freq`` and ``adaptive`` evict what they evicted before ``touch_many`` became one compiled pass.

tests/data/policy_victims.json holds, for seeded random operation sequences (``run``), every victim in order,
P and the switches every 50 operations, and the end state, as the code at commit b57aec3 (before
kvstore/store/policy_jit.py) produced them, recorded again when hinted blocks became ranked by their uses
(``kept_once``, 2026-12-02: the adaptive sequences, which carry hints, changed; the freq ones did not). This test replays the same sequences on
today's code and compares everything. To record again (only where a change of decisions is intended):

    PYTHONPATH=CHECKOUT python tests/test_policy_recorded.py tests/data/policy_victims.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.store.adaptive import AdaptiveLeafPolicy
from kvstore.store.frequency import FrequencyLeafLRU
from kvstore.store.hints import ReuseHint
from kvstore.tiers.base import DRAM, HBM
from tests.policy_tables import chained_table

DATA = Path(__file__).parent / "data" / "policy_victims.json"
CASES = [("freq", 0, 900, 700, 6144), ("freq", 1, 900, 700, 6144), ("adaptive", 0, 900, 700, 64),
         ("adaptive", 1, 500, 900, 6144), ("jumpy", 0, 500, 900, 6144), ("jumpy", 1, 900, 700, 64)]  # fmt: skip


def run(kind: str, seed: int, n: int, steps: int, max_shadow: int) -> list[Any]:
    """The record of one sequence: victims (ints), ``["P", P, switches]`` every 50 steps, the end state."""
    rng = np.random.default_rng(seed)
    chain = int(rng.integers(4, 40))
    t, now = chained_table(n, chain), [0.0]
    p: Any
    if kind == "adaptive":
        p = AdaptiveLeafPolicy(max_shadow=max_shadow, now=lambda: now[0])
    elif kind == "jumpy":  # switches P often
        p = AdaptiveLeafPolicy(max_shadow=max_shadow, now=lambda: now[0], margin=0.0, confidence=0.0, window=0.05)
    else:
        p = FrequencyLeafLRU()
    p.bind(t, DRAM)
    hbm, rec, held = t.column_of_loc(HBM), [], set()

    def evicted(v: int) -> None:
        p.remove(v)
        held.discard(v)
        if v % chain and v - 1 in held:
            p.set_leaf(v - 1, True)

    for step in range(steps):
        op = rng.integers(0, 100)
        if op < 20:  # a put of a run of a chain
            s, k = int(rng.integers(0, n)), int(rng.integers(1, 3 * chain))
            ids = [e for e in range(s, min(n, s + k)) if e not in held]
            if ids:
                a = np.array(ids, dtype=np.int64)
                leaf = np.zeros(len(a), bool)
                leaf[-1] = True
                p.insert_many(a, leaf, rng.random(len(a)) < 0.05)
                held.update(ids)
                if ids[0] % chain and ids[0] - 1 in held:
                    p.set_leaf(ids[0] - 1, False)
        elif op < 25:
            e = int(rng.integers(0, n))
            p.insert(e, bool(rng.random() < 0.5), bool(rng.random() < 0.05))
            held.add(e)
        elif op < 60:  # a Get: a run of a chain, sometimes with repeats and absent ids
            s, k = int(rng.integers(0, n)), int(rng.integers(1, 70))
            ids = list(range(s, min(n, s + k)))
            if rng.random() < 0.2:
                ids += [int(x) for x in rng.integers(0, n, 5)]
            if rng.random() < 0.5:
                p.touch_many(ids)
            else:
                for e in ids:
                    p.touch(e)
        elif op < 75:
            k, salt = int(rng.integers(1, 20)), int(rng.integers(0, 7))
            for _ in range(k):
                v = p.pop_victim(lambda e: (e * 7 + salt) % 5 != 0)
                rec.append(v)
                if v is None:
                    break
                evicted(v)
        elif op < 80:
            e = int(rng.integers(0, n))
            p.remove(e)
            held.discard(e)
        elif op < 85:
            p.set_leaf(int(rng.integers(0, n)), bool(rng.random() < 0.6))
        elif op < 90:
            e, h = int(rng.integers(0, n)), int(rng.integers(0, 5))
            hints = [ReuseHint(reuse=False), ReuseHint(reuse=True), ReuseHint(priority=int(rng.integers(1, 4))),
                     ReuseHint(ttl_s=float(rng.integers(1, 5))), ReuseHint(reuse=True, priority=2)]  # fmt: skip
            p.hint(e, hints[h])
        elif op < 95:  # copies in the tier above come and go
            ids_a = rng.integers(0, n, 10)
            hbm.put(ids_a, np.where(rng.random(10) < 0.5, 0, ids_a + 1).astype(np.uint32))
        else:
            now[0] += float(rng.integers(0, 3))
        if step % 50 == 0:
            rec.append(["P", getattr(p, "P", None), getattr(p, "switches", None)])
    while (v := p.pop_victim(lambda e: True)) is not None:  # the whole order that is left
        rec.append(v)
        evicted(v)
    stats = json.dumps(p.stats() if hasattr(p, "stats") else {}, sort_keys=True, default=str)
    rec.append(["end", getattr(p, "P", None), getattr(p, "switches", None), p.sketch.halvings, stats])
    return rec


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_same_victims_as_before(case: int) -> None:
    recorded = json.loads(DATA.read_text())[case]
    assert recorded["case"] == list(CASES[case])
    got = json.loads(json.dumps(run(*CASES[case])))
    assert sum(isinstance(x, int) for x in got) > 500  # victims enough to mean something
    for i, (a, b) in enumerate(zip(got, recorded["record"])):
        assert a == b, (i, a, b)
    assert len(got) == len(recorded["record"])


if __name__ == "__main__":
    out = [{"case": list(c), "record": run(*c)} for c in CASES]
    Path(sys.argv[1]).write_text(json.dumps(out, separators=(",", ":")) + "\n")
