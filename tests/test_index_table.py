"""The compact block index (kvstore.store.index, slots, columns): property tests against a dict model."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store.columns import CHUNK
from kvstore.store.index import NO_LOC, EntryTable, block_fingerprint
from kvstore.store.slots import MAX_LOAD, WINDOW, SlotIndex
from kvstore.tiers.base import DRAM, NVME, BlockMeta


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def meta(ns: str, i: int, parent: int | None = None, size: int = 100) -> BlockMeta:
    return BlockMeta(ns, key(i), key(parent) if parent is not None else b"", 1, "bfloat16", 2 * size, size, i & 0xFFFF)


def table(jit: bool = True) -> EntryTable:
    return EntryTable(ranks={DRAM: 32, NVME: 64}, jit=jit)


# -- a dict model --------------------------------------------------------------------------
op = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 300), st.integers(0, 2)),
    st.tuples(st.just("insert_many"), st.lists(st.integers(0, 300), min_size=1, max_size=80), st.integers(0, 2)),
    st.tuples(st.just("delete"), st.integers(0, 300), st.integers(0, 2)),
    st.tuples(st.just("unmap"), st.integers(0, 300), st.integers(0, 2)),
    st.tuples(st.just("find_many"), st.lists(st.integers(0, 300), max_size=80), st.integers(0, 2)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=120), st.booleans())
def test_random_operations_agree_with_a_dict(ops, jit):
    t = table(jit)
    names = ["a", "b", "c"]
    model: dict[tuple[int, int], int] = {}  # (ns, i) -> entry
    unmapped: set[int] = set()
    for kind, arg, n in ops:
        ns = t.namespace_id(names[n], create=True)
        if kind == "insert" and (ns, arg) not in model:
            model[(ns, arg)] = t.insert(ns, key(arg), meta(names[n], arg), 2)
        elif kind == "insert_many":
            fresh = list(dict.fromkeys(i for i in arg if (ns, i) not in model))
            ids = t.insert_many(ns, [meta(names[n], i) for i in fresh], [2] * len(fresh))
            model.update({(ns, i): e for i, e in zip(fresh, ids.tolist())})
        elif kind == "delete" and (ns, arg) in model:
            t.release_id(model.pop((ns, arg)))
        elif kind == "unmap" and (ns, arg) in model:
            e = model.pop((ns, arg))
            t.unmap(e)  # still live (a leased block being deleted) but never found
            unmapped.add(e)
        elif kind == "find_many":
            got = t.find_many(ns, [key(i) for i in arg]).tolist()
            assert got == [model.get((ns, i), -1) for i in arg]
    for (ns, i), e in model.items():
        assert t.find(ns, key(i)) == e
        assert t.key(e) == key(i) and t.ns[e] == ns and t.live[e]
    assert len(set(model.values()) | unmapped) == len(model) + len(unmapped)  # ids are never shared
    assert len(t) == len(model) + len(unmapped)
    assert t.slots.used == len(model)


@pytest.mark.parametrize("jit", [True, False])
def test_growth_under_load_loses_nothing(jit):
    t = table(jit)
    ns = t.namespace_id("ns", create=True)
    n = 3 * CHUNK + 123  # several column chunks and many slot-table rebuilds
    start_slots = t.slots.nslots
    for base in range(0, n, 64):
        batch = [meta("ns", i, i - 1 if i % 64 else None) for i in range(base, min(base + 64, n))]
        t.insert_many(ns, batch, [2] * len(batch))
    assert len(t) == n and t.slots.nslots > 100 * start_slots
    assert t.slots.load() <= MAX_LOAD
    ids = t.find_many(ns, [key(i) for i in range(n)])
    assert (ids >= 0).all() and len(set(ids.tolist())) == n
    assert (t.find_many(ns, [key(i) for i in range(n, n + 500)]) == -1).all()
    t.slots.rebuild_all()
    assert (t.find_many(ns, [key(i) for i in range(n)]) == ids).all()
    assert t.bytes_per_entry() == 53 + 8 + 2  # a second tier adds its 8-byte location and a child count
    assert EntryTable(ranks={DRAM: 32}).bytes_per_entry() == 53


@pytest.mark.parametrize("jit", [True, False])
def test_dense_table_probes_past_a_window(jit):
    """A table filled to its maximum load: many keys sit more than WINDOW slots from home."""
    t = table(jit)
    ns = t.namespace_id("ns", create=True)
    n = int(MAX_LOAD * t.slots.nslots)
    t.insert_many(ns, [meta("ns", i) for i in range(n)], [2] * n)
    assert t.slots.nslots == 1024  # filled without growing
    words = t.slots.words
    runs = np.diff(np.nonzero(np.diff(np.concatenate([[0], (words != 0).astype(np.int8), [0]])))[0])[::2]
    assert runs.max() > 2 * WINDOW
    assert (t.find_many(ns, [key(i) for i in range(n)]) == np.arange(n)).all()
    assert [t.find(ns, key(i)) for i in range(n)] == list(range(n))


@pytest.mark.parametrize("jit", [True, False])
def test_tombstones_are_reused_without_growth(jit):
    t = table(jit)
    ns = t.namespace_id("ns", create=True)
    live = list(range(500))
    t.insert_many(ns, [meta("ns", i) for i in live], [2] * 500)
    nslots = t.slots.nslots
    next_key = 500
    for _ in range(20):  # churn: the table's size stays put, tombstones are reused or purged by a rebuild
        for i in live[:250]:
            t.release_id(t.find(ns, key(i)))
        live = live[250:] + list(range(next_key, next_key + 250))
        t.insert_many(ns, [meta("ns", i) for i in live[-250:]], [2] * 250)
        next_key += 250
    assert t.slots.nslots == nslots and len(t) == 500
    assert t.slots.used + t.slots.tombs <= MAX_LOAD * nslots
    assert (t.find_many(ns, [key(i) for i in live]) >= 0).all()
    assert (t.find_many(ns, [key(i) for i in range(next_key - 500)]) == -1).all()
    assert t._size <= 750  # entry ids were reused


def test_namespaces_keep_the_same_hash_apart():
    t = table()
    a, b = t.namespace_id("a", create=True), t.namespace_id("b", create=True)
    ea, eb = t.insert(a, key(1), meta("a", 1), 2), t.insert(b, key(1), meta("b", 1), 2)
    assert ea != eb and t.find(a, key(1)) == ea and t.find(b, key(1)) == eb
    t.release_id(ea)
    assert t.find(a, key(1)) is None and t.find(b, key(1)) == eb
    assert t.find(t.namespace_id("never"), key(1)) is None and t.namespace_id("never") is None
    assert t.find(b, b"short") is None
    with pytest.raises(ValueError):
        t.insert(b, b"short", meta("b", 2), 2)


def test_batch_insert_links_chains_like_single_inserts():
    one, many = table(), table()
    for t in (one, many):
        t.namespace_id("ns", create=True)
    metas = [meta("ns", 0)] + [meta("ns", i, i - 1) for i in range(1, 70)] + [meta("ns", 100, 999)]
    singles = [one.insert(0, m.hash, m, 1) for m in metas]
    batch = many.insert_many(0, metas, [1] * len(metas)).tolist()
    for t, ids in ((one, singles), (many, batch)):
        assert t.parent_of(ids[0]) is None and t.rooted[ids[0]] and t.depth[ids[0]] == 0
        assert [t.parent_of(e) for e in ids[1:70]] == ids[:69]
        assert t.depth[ids[69]] == 69 and t.rooted[ids[69]]
        assert t.parent_of(ids[70]) is None and not t.rooted[ids[70]]  # parent never stored: unreachable
        assert t.meta(ids[5]) == metas[5]
    # a reused id is not its old children's parent any more
    many.release_id(batch[3])
    e = many.insert(0, key(5000), meta("ns", 5000), 2)
    assert e == batch[3] and many.parent_of(batch[4]) is None


def test_views_read_like_the_old_numpy_columns():
    t = table()
    ns = t.namespace_id("ns", create=True)
    ids = t.insert_many(ns, [meta("ns", i) for i in range(10)], [2] * 10)
    t.loc[3, DRAM] = 77
    t.set_loc(4, NVME, (5 << 40) | 4096)
    assert t.loc[3, DRAM] == 77 and t.loc[3, NVME] == NO_LOC and t.loc[3, 1] == NO_LOC
    assert t.loc.shape == (10, 4) and t.loc[ids].shape == (10, 4)
    assert t.loc[[3, 4]].tolist() == [[-1, -1, 77, -1], [-1, -1, -1, (5 << 40) | 4096]]
    col = t.loc[:, DRAM]
    assert col[3] == 77 and not col.flags.writeable
    assert np.asarray(t.live).all() and t.live[:].shape == (10,)
    assert t.hashes[ids[2:4]].tobytes() == key(2) + key(3) and t.hashes[2].tobytes() == key(2)
    assert t.fp[7] == block_fingerprint(key(7), ns) and int(t.fp[ids][7]) == block_fingerprint(key(7), ns)
    t.leases[2] += 3
    assert t.leases.sum() == 3 and t.stored_len[ids].tolist() == [100] * 10
    t.release_id(5)
    assert not t.live[5] and int(np.asarray(t.live).sum()) == 9
    assert t.resident(DRAM).tolist() == [3] and t.find_locs(NVME, [(5 << 40) | 4096])[0].tolist() == [4]


@given(st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=50, unique=True), st.integers(0, 65535))
def test_one_key_probe_hashes_like_the_batch(keys, ns):
    slots = SlotIndex(lambda ids: (ids, ids, ids), lambda e: (0, 0, 0), nslots=5000)
    w = np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(-1, 2)
    pos, tag = slots._hash(w[:, 0], w[:, 1], np.full(len(keys), ns, dtype=np.uint16))
    for k, p, g in zip(keys, pos.tolist(), tag.tolist()):
        assert slots._hash1(int.from_bytes(k[:8], "little"), int.from_bytes(k[8:], "little"), ns) == (p, g)
