"""``touch_many`` (one call per Get) must leave every policy exactly as the same touches one by one would:
the priorities, the eviction order and (for ``freq``) the sketch's counters, duplicates and agings included."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.client import Client
from kvstore.store import BlockStore
from kvstore.store.policies import POLICY_NAMES, FrequencySketch, policy_factory
from kvstore.tiers.accounting import AccountingDiskTier, AccountingMemoryTier
from kvstore.tiers.base import BlockMeta

BLOCK = 1 << 20


def _key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def _store(policy: str) -> BlockStore:
    return BlockStore(
        [AccountingMemoryTier(24 * BLOCK), AccountingDiskTier(1 << 40)],
        policy_factory=policy_factory(policy),
        demote_batch_bytes=4 * BLOCK,
        write_through=True,  # copies in both tiers: the lower one's touches estimate, never count
    )


def _fill(store: BlockStore, n: int) -> None:
    for i in range(n):
        meta = BlockMeta("ns", _key(i), _key(i - 1) if i % 5 else b"", 0, "uint8", BLOCK, BLOCK, 0)
        ticket = store.begin_put("ns", meta)
        if ticket is not None:
            store.persist([store.commit_put(ticket)[1]])


def _state(store: BlockStore) -> list:
    out = []
    for rank, policy in sorted(store.policies.items()):
        live = sorted((p, e) for e, p in policy._prio.items() if e in policy._leaf)
        sketch = getattr(policy, "sketch", None)
        rows = [bytes(r) for r in sketch._rows] if sketch is not None else None
        out.append((rank, dict(policy._prio), live, rows, getattr(sketch, "_added", None)))
    return out


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICY_NAMES)),
    gets=st.lists(st.lists(st.integers(0, 59), min_size=1, max_size=40), min_size=1, max_size=12),
)
def test_batched_touches_equal_sequential_ones(policy, gets):
    one, many = _store(policy), _store(policy)
    for s in (one, many):
        _fill(s, 60)
    for ids in gets:
        for store, batched in ((one, False), (many, True)):
            ns = store.table.namespace_id("ns")
            found = store.table.find_many(ns, [_key(i) for i in ids])
            found = found[found >= 0]
            with store._lock:
                if batched:
                    store._touch_many(found)
                else:
                    for e in found.tolist():
                        store._touch(e)
        assert _state(one) == _state(many)
    for rank in one.policies:  # and the eviction order that follows from it
        a = [one.policies[rank].pop_victim(lambda e: True) for _ in range(5)]
        b = [many.policies[rank].pop_victim(lambda e: True) for _ in range(5)]
        assert a == b


def test_sketch_count_many_matches_add_across_collisions_and_aging():
    rng = np.random.default_rng(3)
    a, b = FrequencySketch(width_bits=6), FrequencySketch(width_bits=6)  # tiny: counters are shared a lot
    for _ in range(200):
        fps = rng.integers(0, 1 << 63, int(rng.integers(1, 40)), dtype=np.uint64)
        fps[rng.random(len(fps)) < 0.2] = fps[0]  # repeats inside one batch
        counted = rng.random(len(fps)) < 0.8
        want = [a.add(int(f)) if c else a.estimate(int(f)) for f, c in zip(fps.tolist(), counted.tolist())]
        assert b.count_many(fps, counted) == want
        assert [bytes(r) for r in a._rows] == [bytes(r) for r in b._rows]
        assert (a._added, a.halvings, a.width_bits) == (b._added, b.halvings, b.width_bits)
    assert a.halvings > 0 or a.width_bits > 6  # aging happened inside batches


def test_sketch_count_many_vectorized_path_is_taken_and_exact():
    a, b = FrequencySketch(width_bits=20), FrequencySketch(width_bits=20)
    fps = np.arange(1, 33, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15 >> 3)
    counted = np.ones(32, dtype=bool)
    counted[::3] = False
    for _ in range(5):
        want = [a.add(int(f)) if c else a.estimate(int(f)) for f, c in zip(fps.tolist(), counted.tolist())]
        assert b.count_many(fps, counted) == want
    assert [bytes(r) for r in a._rows] == [bytes(r) for r in b._rows]


@pytest.mark.parametrize("lane", ["shm", "tcp"])
def test_a_lane_get_counts_as_an_access_once_its_reply_is_out(make_server, lane):
    server = make_server(
        eviction_policy="freq", shm_direct=True, share_dram=False
    )  # asked: a shared index reports later
    keys = [_key(1000 + i) for i in range(8)]
    with Client(f"127.0.0.1:{server.port}", timeout=30, lane=lane) as kv:
        assert all(r.ok for r in kv.put("ns", keys, [np.full(4096, i, np.uint8) for i in range(8)], chained=False))
        store = server.store
        ids = store.table.find_many(store.table.namespace_id("ns"), keys).tolist()
        policy = store.policies[store.top.rank]
        before = [policy.uses(e) for e in ids]
        got = kv.get("ns", keys, out=[np.zeros(4096, np.uint8) for _ in keys])
        assert [int(g[0]) for g in got] == list(range(8))
        deadline = time.monotonic() + 10
        while int(np.asarray(store.table.leases).sum()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [policy.uses(e) for e in ids] == [u + 1 for u in before]
