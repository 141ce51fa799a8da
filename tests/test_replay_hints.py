"""bench.replay's hints from the future, its suites of traces and its target check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import replay
from bench.replay_hints import future_hints
from bench.replay_report import check_target
from bench.replay_sim import StoreSetup, Trace, belady_hit_rate, replay_store
from kvstore.store.hints import ReuseHint

BLOCK = 1 << 20


def test_hints_read_the_future():
    trace = Trace(((1, 2), (1, 3), (1, 2), (4,)), times=(0.0, 1.0, 5.0, 6.0))
    reuse = future_hints(trace, "reuse")
    assert [[h.reuse for h in row] for row in reuse] == [[True, True], [True, False], [False, False], [False]]
    prio = future_hints(trace, "priority")
    assert [h.priority for h in prio[0]] == [1, 1]  # 1 is used twice more, 2 once more
    ttl = future_hints(trace, "ttl")
    assert [h.ttl_s for h in ttl[0]] == [5.0, 5.0] and [h.ttl_s for h in ttl[2]] == [0.0, 0.0]
    both = future_hints(trace, "all")[0][0]
    assert both == ReuseHint(True, 1, 5.0)
    with pytest.raises(ValueError, match="unknown hint kind"):
        future_hints(trace, "nope")


def test_reuse_hints_lift_the_adaptive_policy_towards_belady():
    # each block A_j comes back once, after four one-off blocks; with room for 2, LRU and any frequency count
    # lose it (it was seen once, like the one-offs); knowing the one-offs are done keeps it, as Belady does
    rows: list[tuple[int, ...]] = []
    for j in range(40):
        rows += [(j,), *((1000 + 4 * j + k,) for k in range(4)), (j,)]
    trace = Trace(tuple(rows), times=tuple(float(i) for i in range(len(rows))))
    plain = replay_store(trace, StoreSetup("adaptive", 2, block_bytes=BLOCK)).hit_rate
    hinted = replay_store(trace, StoreSetup("adaptive", 2, block_bytes=BLOCK, hints="reuse")).hit_rate
    ttl = replay_store(trace, StoreSetup("adaptive", 2, block_bytes=BLOCK, hints="ttl")).hit_rate
    assert hinted == pytest.approx(belady_hit_rate(trace.requests, 2)) and hinted > plain + 0.1
    assert ttl == pytest.approx(hinted)


def test_suite_of_generated_traces_writes_rows_per_trace(tmp_path: Path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "hash_ids": [i % 7, 50 + i % 3]}) + "\n" for i in range(60)))
    replay.main(
        ["--trace", str(trace), "--generated", "sessions,agents", "--gen-requests", "80", "--capacities", "0.1,0.5"]
        + ["--hint-capacities", "0.1", "--jobs", "1", "--out", str(out), "--plot", str(png)]
    )
    doc = json.loads(out.read_text())
    names = [t["name"] for t in doc["traces"]]
    assert names == ["t", "sessions-s1-n80", "agents-s1-n80"]
    assert {(r["trace"], r["capacity_frac"], r["policy"]) for r in doc["rows"]} == {
        (n, c, p) for n in names for c in (0.1, 0.5) for p in ("kvstore", "lru", "belady")
    }
    assert {(h["trace"], h["policy"]) for h in doc["hints"]} == {
        (n, f"adaptive+{k}") for n in names for k in ("reuse", "priority", "ttl", "all")
    }
    assert {t["trace"] for t in doc["tiers"]} == {"t"}  # two tiers: first trace only
    assert len(doc["policies"]) == 6 and doc["target"]["met"] in (True, False)
    assert png.stat().st_size > 10_000


def test_target_check():
    row = {"capacity_frac": 0.1, "kvstore": 0.30, "lru": 0.31, "freq": 0.29}
    ok = check_target([("a", [{**row, "vs_best": -0.004}], [])])
    bad = check_target([("a", [{**row, "vs_best": -0.004}], []), ("b", [{**row, "vs_best": -0.006}], [])])
    assert ok["met"] and not bad["met"] and bad["worst"][1]["trace"] == "b"
