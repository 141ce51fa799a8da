"""bench.replay's core: the hit rule, the reference caches, the store driver and the CLI, on tiny traces."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from bench import replay
from bench.replay_sim import (
    StoreSetup,
    Trace,
    belady_hit_rate,
    block_keys,
    lifetime_oracle_hit_rate,
    load_trace,
    lru_hit_rate,
    popularity_oracle_hit_rate,
    replay_store,
)
from kvstore.store.policies import DEFAULT_POLICY
from kvstore.tiers.base import DRAM, NVME

BLOCK = 1 << 20


def singles(*ids: int) -> list[list[int]]:
    return [[i] for i in ids]


def naive_lru(requests: list[list[int]], capacity: int) -> float:
    """A list kept in recency order, most recent last: the textbook definition."""
    order: list[int] = []
    hits = total = 0
    for request in requests:
        prefix = True
        for b in request:
            total += 1
            if b in order:
                hits += prefix
                order.remove(b)
            else:
                prefix = False
                if len(order) == capacity:
                    order.pop(0)
            order.append(b)
    return hits / total


def optimal_hits(sequence: list[int], capacity: int) -> int:
    """Most hits any demand-paging cache can get: try every eviction choice (tiny inputs only)."""
    best = 0

    def go(i: int, cache: frozenset[int], hits: int) -> None:
        nonlocal best
        if hits + len(sequence) - i <= best:
            return
        if i == len(sequence):
            best = max(best, hits)
            return
        b = sequence[i]
        if b in cache:
            go(i + 1, cache, hits + 1)
        elif len(cache) < capacity:
            go(i + 1, cache | {b}, hits)
        else:
            for victim in cache:
                go(i + 1, (cache - {victim}) | {b}, hits)

    go(0, frozenset(), 0)
    return best


def test_belady_on_a_hand_made_trace():
    # capacity 2: 1 2 | 3 evicts 2 (next used after 1) | 1 hits | 2 misses
    assert belady_hit_rate(singles(1, 2, 3, 1, 2), 2) == 1 / 5
    assert lru_hit_rate(singles(1, 2, 3, 1, 2), 2) == 0.0  # LRU evicts 1 then 2: no hit
    # a cyclic scan one larger than the cache: LRU never hits, Belady hits every other time
    scan = singles(*([1, 2, 3] * 4))
    assert lru_hit_rate(scan, 2) == 0.0
    assert belady_hit_rate(scan, 2) == 5 / 12


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=11), st.integers(1, 3))
def test_belady_is_optimal_on_single_block_requests(sequence, capacity):
    expected = optimal_hits(sequence, capacity) / len(sequence)
    assert abs(belady_hit_rate(singles(*sequence), capacity) - expected) < 1e-12


def test_popularity_oracle_keeps_the_most_used_blocks():
    # 1 is used 4 times, 2 and 3 twice each: with room for 2 blocks the oracle never lets 1 go, LRU does
    trace = singles(1, 2, 3, 1, 2, 3, 1, 1)
    assert popularity_oracle_hit_rate(trace, 2) == 3 / 8 > lru_hit_rate(trace, 2)
    assert popularity_oracle_hit_rate([[1, 2], [9, 2]], 10) == 0.0  # the prefix rule holds here too


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=14), st.integers(1, 4))
def test_popularity_oracle_stays_below_belady(sequence, capacity):
    trace = singles(*sequence)
    assert popularity_oracle_hit_rate(trace, capacity) <= belady_hit_rate(trace, capacity) + 1e-12


def test_lifetime_oracle_drops_blocks_that_are_done():
    # 1 is used four times early and never again; 2 and 3 alternate to the end. The popularity oracle keeps 1
    # (most uses) and thrashes on 2/3 in the one slot left; the lifetime oracle lets 1 go after its last use.
    trace = singles(1, 1, 1, 1, 2, 3, 2, 3, 2, 3)
    assert popularity_oracle_hit_rate(trace, 2) == 3 / 10
    assert lifetime_oracle_hit_rate(trace, 2) == 7 / 10
    assert lifetime_oracle_hit_rate([[1, 2], [9, 2]], 10) == 0.0  # the prefix rule holds here too


def test_a_block_after_a_miss_is_not_a_hit():
    # block 2 is cached, but block 9 before it misses: the prefix ends there
    assert lru_hit_rate([[1, 2], [9, 2]], 10) == 0.0
    assert belady_hit_rate([[1, 2], [9, 2]], 10) == 0.0
    assert lru_hit_rate([[1, 2], [1, 2, 3]], 10) == 2 / 5


requests = st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=5, unique=True), min_size=1, max_size=30)


@settings(max_examples=80, deadline=None)
@given(requests, st.integers(1, 8))
def test_lru_matches_the_textbook_version(trace, capacity):
    assert abs(lru_hit_rate(trace, capacity) - naive_lru(trace, capacity)) < 1e-12


def chains(seed: int, n: int) -> Trace:
    """Requests over six shared documents (skewed popularity): a prefix of 1-6 blocks plus a private tail block."""
    rng = random.Random(seed)
    rows: list[tuple[int, ...]] = []
    fresh = itertools.count(1000)
    for _ in range(n):
        doc = min(int(rng.expovariate(0.7)), 5)
        rows.append(tuple(doc * 10 + d for d in range(1 + doc)) + (next(fresh),))
    return Trace(tuple(rows))


def test_store_with_room_for_everything_hits_like_an_infinite_cache():
    trace = chains(0, 60)
    everything = trace.distinct_blocks
    infinite = lru_hit_rate(trace.requests, everything)
    for policy in ("lru", "freq"):
        result = replay_store(trace, StoreSetup(policy, everything, block_bytes=BLOCK))
        assert abs(result.hit_rate - infinite) < 1e-12
        assert result.bytes_put == everything * BLOCK  # every distinct block put exactly once
        assert result.hits_by_rank[DRAM] == result.hits


def test_small_store_stays_between_nothing_and_belady_and_counts_tiers():
    trace = chains(3, 200)
    blocks = 6
    belady = belady_hit_rate(trace.requests, blocks)
    for policy in ("lru", "freq"):
        single = replay_store(trace, StoreSetup(policy, blocks, block_bytes=BLOCK))
        assert 0 < single.hit_rate <= belady + 1e-12
        tiered = replay_store(trace, StoreSetup(policy, blocks, nvme_blocks=4 * blocks, block_bytes=BLOCK))
        assert tiered.hits == tiered.hits_by_rank[DRAM] + tiered.hits_by_rank[NVME]
        assert tiered.hit_rate >= single.hit_rate  # more room below never hurts here
        assert tiered.bytes_demoted > 0 and tiered.hits_by_rank[NVME] > 0


def test_admission_filter_stores_a_block_from_its_second_sighting():
    trace = Trace(((1, 2), (1, 2), (1, 2)))
    result = replay_store(trace, StoreSetup("lru", 10, admit_after=2, block_bytes=BLOCK), block_keys(trace))
    assert result.hits == 2  # stored at the second request, hit at the third
    assert result.bytes_put == 2 * BLOCK


def test_cli_writes_rows_json_and_plot(tmp_path: Path):
    trace_file = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": i, "input_length": 512 * len(r), "output_length": 1, "hash_ids": list(r)}
        for i, r in enumerate(chains(1, 80).requests)
    ]
    trace_file.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert len(load_trace(trace_file, limit=5).requests) == 5
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    replay.main(
        ["--trace", str(trace_file), "--capacities", "0.1,0.5", "--jobs", "1", "--out", str(out), "--plot", str(png)]
    )
    doc = json.loads(out.read_text())
    assert {(r["capacity_frac"], r["policy"]) for r in doc["rows"]} == {
        (c, p) for c in (0.1, 0.5) for p in ("kvstore", "lru", "belady")
    }
    assert all(0 <= r["hit_rate"] <= 1 for r in doc["rows"])
    assert {v["policy"] for v in doc["variants"]} == {"leaf-lru", "admit2", "popularity-oracle", "lifetime-oracle"}
    assert {(t["capacity_frac"], t["policy"]) for t in doc["tiers"]} == {
        (c, p) for c in (0.1, 0.5) for p in (DEFAULT_POLICY, "lru", f"{DEFAULT_POLICY}+nvme-admit2")
    }
    admit = {t["capacity_frac"]: t for t in doc["tiers"] if t["policy"] == f"{DEFAULT_POLICY}+nvme-admit2"}
    plain = {t["capacity_frac"]: t for t in doc["tiers"] if t["policy"] == DEFAULT_POLICY}
    assert all(admit[c]["demoted_GiB"] <= plain[c]["demoted_GiB"] for c in (0.1, 0.5))
    assert png.stat().st_size > 10_000
