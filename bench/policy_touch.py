"""What a Get's touch costs each eviction policy: ``touch_many`` of 32 chained entries, microseconds per call.

    python -m bench.policy_touch [--quick] [--residents 2048,65536] [--baseline FILE.json] [--out FILE.json]

A policy bound to a real EntryTable holding ``residents`` blocks in chains of 32 (all resident in one DRAM
tier, inserted with ``insert_many``), then ``touch_many`` of a random whole chain, as a Get's release does.
Rows: ``freq`` (the baseline: one compiled sketch call), ``adaptive`` with its shadows in Python
(``jit=False``: what the default did per block before kvstore/store/shadow_jit.py) and ``adaptive`` (the
default, compiled shadows). Below 6,144 residents the shadows see every access; above, a hash-sampled share.
``vs_freq`` is each row against ``freq`` measured in the same run; with ``--baseline`` (an earlier run's
JSON, e.g. bench/results/policy_touch_before.json: the code before kvstore/store/policy_jit.py, run on the same
machine the same day) each row also shows that run's figure (``before_us``) and ``speedup`` = before / now.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import parse_args, report
from kvstore.store.adaptive import AdaptiveLeafPolicy
from kvstore.store.frequency import FrequencyLeafLRU
from kvstore.store.index import EntryTable
from kvstore.store.policy import LeafLRU
from kvstore.tiers.base import DRAM

CHAIN = 32


def _table(n: int) -> EntryTable:
    t = EntryTable(ranks={DRAM: 32})
    ns = t.namespace_id("ns", create=True)
    assert ns is not None
    keys = np.random.default_rng(1).integers(0, 2**63, (n, 2), dtype=np.uint64)
    has_parent = np.arange(n) % CHAIN != 0
    parents = np.zeros_like(keys)
    parents[1:] = keys[:-1]
    parents[~has_parent] = 0
    fields = np.tile(np.array([65536, 65536, 0, 0], dtype=np.int64), (n, 1))
    t.insert_arrays(ns, keys, fields, np.ones(n, np.uint8), parents, has_parent)
    t.column_of_loc(DRAM).put(np.arange(n), np.arange(1, n + 1))
    return t


def measure(make: Callable[[], LeafLRU], n: int, reps: int) -> float:
    """Microseconds per ``touch_many`` of one random whole chain of 32."""
    policy = make()
    policy.bind(_table(n), DRAM)
    ids = np.arange(n, dtype=np.int64)
    policy.insert_many(ids, ids % CHAIN == CHAIN - 1, np.zeros(n, dtype=np.bool_))
    starts = np.random.default_rng(2).integers(0, n // CHAIN, reps + 50) * CHAIN
    gets = [list(range(s, s + CHAIN)) for s in starts.tolist()]
    for g in gets[:50]:  # warm: compiled kernels loaded, heaps at their steady size
        policy.touch_many(g)
    t0 = time.perf_counter()
    for g in gets[50:]:
        policy.touch_many(g)
    return (time.perf_counter() - t0) / reps * 1e6


POLICIES: dict[str, Callable[[], LeafLRU]] = {
    "freq": FrequencyLeafLRU,
    "adaptive_python_shadows": lambda: AdaptiveLeafPolicy(jit=False),
    "adaptive": AdaptiveLeafPolicy,
}


def main(argv: list[str] | None = None) -> None:
    def configure(p: Any) -> None:
        p.add_argument("--residents", default="2048,65536", help="blocks held by the tier, comma-separated")
        p.add_argument("--baseline", type=Path, default=None, metavar="FILE.json", help="an earlier run to compare")

    args = parse_args("touch_many of 32 chained entries per policy, us per call", argv, configure)
    before: dict[tuple[int, str], float] = {}
    if args.baseline is not None:
        rows0 = json.loads(args.baseline.read_text())["rows"]
        before = {(r["residents"], r["policy"]): r["us_per_touch_many"] for r in rows0}
    reps = 300 if args.quick else 3000
    rows: list[dict[str, Any]] = []
    for n in (int(float(x)) for x in args.residents.split(",")):
        base = measure(POLICIES["freq"], n, reps)
        for name, make in POLICIES.items():
            us = base if name == "freq" else measure(make, n, reps)
            row = {"residents": n, "policy": name, "us_per_touch_many": round(us, 1), "vs_freq": round(us / base, 2)}
            if (n, name) in before:
                row |= {"before_us": before[n, name], "speedup": round(before[n, name] / us, 2)}
            rows.append(row)
    report(rows, args, title=f"touch_many of {CHAIN} chained ids ({reps} reps)", bench="policy_touch")


if __name__ == "__main__":
    main()
