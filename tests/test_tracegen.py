"""bench.tracegen: deterministic by seed, the Mooncake format, and each kind's reuse structure, measured."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path

import pytest

from bench import tracegen
from bench.replay_sim import load_trace
from bench.tracegen import KINDS, TOKENS_PER_BLOCK, generate

N = 2500


@pytest.fixture(scope="module")
def traces() -> dict[str, list[dict]]:
    return {kind: generate(kind, 3, N) for kind in KINDS}


def distinct_fraction(rows: list[dict]) -> float:
    blocks = [b for r in rows for b in r["hash_ids"]]
    return len(set(blocks)) / len(blocks)


def median_reuse_distance(rows: list[dict]) -> float:
    """Requests between two consecutive uses of a block, median over all reuses."""
    last: dict[int, int] = {}
    gaps = []
    for i, r in enumerate(rows):
        for b in set(r["hash_ids"]):
            if b in last:
                gaps.append(i - last[b])
            last[b] = i
    return statistics.median(gaps)


def continued_fraction(rows: list[dict]) -> float:
    """Requests that re-send all of an earlier request's own context: a later turn of a conversation or
    agent loop, or a document asked about again. Ids are prefix-tree nodes, so the earlier request's last
    full block appearing in this one means its whole context does; only requests whose last full block was
    new to them count as earlier ones (a shared prompt alone is not a context)."""
    seen: set[int] = set()
    ends: set[int] = set()
    hits = 0
    for r in rows:
        full = r["hash_ids"][: r["input_length"] // TOKENS_PER_BLOCK]
        hits += any(b in ends for b in full)
        if full and full[-1] not in seen:
            ends.add(full[-1])
        seen.update(full)
    return hits / len(rows)


def top_overlap(rows: list[dict], n: int = 20) -> float:
    """How many of the n most requested first blocks of the first eighth are still among them in the last."""
    part = len(rows) // 8

    def top(rs: list[dict]) -> set[int]:
        return {b for b, _ in Counter(r["hash_ids"][0] for r in rs).most_common(n)}

    first, last = top(rows[:part]), top(rows[-part:])
    return len(first & last) / max(len(first), 1)


def test_same_seed_same_trace_other_seed_other_trace():
    for kind in KINDS:
        a, b = generate(kind, 11, 300), generate(kind, 11, 300)
        assert json.dumps(a) == json.dumps(b)
        assert json.dumps(generate(kind, 12, 300)) != json.dumps(a)


def test_mooncake_format(traces, tmp_path: Path):
    for kind, rows in traces.items():
        assert len(rows) == N
        assert all(rows[i]["timestamp"] <= rows[i + 1]["timestamp"] for i in range(N - 1)), kind
        for r in rows:
            assert set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
            assert len(r["hash_ids"]) == math.ceil(r["input_length"] / TOKENS_PER_BLOCK)
            assert len(set(r["hash_ids"])) == len(r["hash_ids"]) and r["output_length"] > 0
    path = tmp_path / "t.jsonl"
    tracegen.main(["--kind", "mixture", "--seed", "3", "--requests", "200", "--out", str(path)])
    assert load_trace(path).requests == tuple(tuple(r["hash_ids"]) for r in traces["mixture"][:200])


def test_an_id_names_a_whole_prefix(traces):
    """Equal ids at a position imply the same block before it (ids are prefix-tree nodes)."""
    for kind, rows in traces.items():
        parent: dict[int, int] = {}
        for r in rows:
            ids = r["hash_ids"]
            for i, b in enumerate(ids):
                assert parent.setdefault(b, ids[i - 1] if i else -1) == (ids[i - 1] if i else -1), kind


def test_each_kind_has_its_reuse_structure(traces):
    d = {k: distinct_fraction(rows) for k, rows in traces.items()}
    reuse = {k: median_reuse_distance(rows) for k, rows in traces.items()}
    cont = {k: continued_fraction(rows) for k, rows in traces.items()}
    # one-shot documents: most blocks are used once; few requests come back to a document
    assert d["documents"] > 0.7 and cont["documents"] < 0.15
    # chats and agents: most blocks come back, in later turns of the same conversation
    assert d["sessions"] < 0.4 and cont["sessions"] > 0.5
    assert d["agents"] < 0.15 and cont["agents"] > 0.8
    # agents loop quickly: a block comes back within a few requests; chats wait for the user
    assert reuse["agents"] <= 8 < reuse["sessions"]
    # the mixture sits between its parts
    assert d["agents"] < d["mixture"] < d["documents"]
    assert 0.2 < cont["mixture"] < cont["agents"]
    # shifting popularity: the hot documents of the first eighth are mostly gone by the last; chats keep theirs
    assert top_overlap(traces["shifting"]) < 0.3 < 0.6 < top_overlap(traces["sessions"])


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown trace kind"):
        generate("nope", 0, 10)
