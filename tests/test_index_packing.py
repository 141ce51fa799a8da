"""The index's packed fields at their limits (kvstore/store/index.py): codec and dtype share one byte, depth is
one byte and saturates, and a value that does not fit is refused without a trace, on both insert paths."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store.columns import Column, Field
from kvstore.store.index import DTYPES, MAX_CODEC, MAX_DEPTH, EntryTable
from kvstore.tiers.base import DRAM, BlockMeta


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def meta(i: int, parent: int | None = None, codec: int = 0, length: int = 4096, crc: int = 0) -> BlockMeta:
    p = key(parent) if parent is not None else b""
    return BlockMeta("ns", key(i), p, codec, "uint8", length, length, crc)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, MAX_CODEC),
            st.integers(0, len(DTYPES) - 1),
            st.integers(0, 2**32 - 1),
            st.integers(0, 2**32 - 1),
        ),
        min_size=1,
        max_size=80,
    ),
    jit=st.booleans(),
    batched=st.booleans(),
)
def test_fields_round_trip_at_their_limits(rows, jit, batched) -> None:
    t = EntryTable(ranks={DRAM: 32}, jit=jit)
    ns = t.namespace_id("ns", create=True)
    assert ns is not None
    metas = [meta(i, i - 1 if i else None, codec, length, crc) for i, (codec, _, length, crc) in enumerate(rows)]
    dtypes = [d for _, d, _, _ in rows]
    if batched:
        ids = t.insert_many(ns, metas, dtypes).tolist()
    else:
        ids = [t.insert(ns, m.hash, m, d) for m, d in zip(metas, dtypes)]
    for e, m, d in zip(ids, metas, dtypes):
        got = t.meta(e)
        assert (got.codec, got.dtype, got.stored_length, got.raw_length, got.crc32c) == (
            m.codec, DTYPES[d], m.stored_length, m.raw_length, m.crc32c,
        )  # fmt: skip
        assert t.codec[e] == m.codec and t.dtype[e] == d
    arr = np.asarray(ids)
    assert t.column("codec").take(arr).tolist() == [m.codec for m in metas]
    assert t.column("dtype").take(arr).tolist() == dtypes
    assert np.asarray(t.dtype)[arr].tolist() == dtypes and np.asarray(t.codec)[arr].tolist() == [m.codec for m in metas]


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("batched", [True, False])
def test_depth_counts_up_then_saturates(jit: bool, batched: bool) -> None:
    t = EntryTable(ranks={DRAM: 32}, jit=jit)
    ns = t.namespace_id("ns", create=True)
    assert ns is not None
    n = MAX_DEPTH + 40
    metas = [meta(i, i - 1 if i else None) for i in range(n)]
    if batched:
        ids = []
        for s in range(0, n, 64):  # prefixes of 64: each links to the last block of the one before
            ids += t.insert_many(ns, metas[s : s + 64], [1] * len(metas[s : s + 64])).tolist()
    else:
        ids = [t.insert(ns, m.hash, m, 1) for m in metas]
    depth = [t.depth[e] for e in ids]
    assert depth == [min(i, MAX_DEPTH) for i in range(n)]
    assert all(t.parent_of(ids[i]) == ids[i - 1] for i in range(1, n)) and all(t.rooted[e] for e in ids)


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("bad", ["codec", "dtype"])
def test_a_value_that_does_not_fit_is_refused_and_leaves_nothing(jit: bool, bad: str) -> None:
    t = EntryTable(ranks={DRAM: 32}, jit=jit)
    ns = t.namespace_id("ns", create=True)
    assert ns is not None
    t.insert_many(ns, [meta(i) for i in range(10)], [1] * 10)
    metas = [meta(100 + i, codec=MAX_CODEC + 1 if bad == "codec" and i == 5 else 0) for i in range(10)]
    dtypes = [16 if bad == "dtype" and i == 5 else 1 for i in range(10)]
    with pytest.raises(ValueError):
        t.insert_many(ns, metas, dtypes)
    with pytest.raises(ValueError):
        t.insert(ns, metas[5].hash, metas[5], dtypes[5])
    assert len(t) == 10 and t.slots.used == 10
    assert (t.find_many(ns, [m.hash for m in metas]) == -1).all()
    ids = t.insert_many(ns, [meta(100 + i) for i in range(10)], [1] * 10)  # the ids handed back are reused
    assert len(t) == 20 and (t.find_many(ns, [key(100 + i) for i in range(10)]) == ids).all()
    assert t._size <= 20 + 10


@settings(max_examples=100, deadline=None)
@given(a=st.integers(0, 15), b=st.integers(0, 15), c=st.integers(0, 15), d=st.integers(0, 15))
def test_two_fields_of_one_byte_never_disturb_each_other(a: int, b: int, c: int, d: int) -> None:
    col = Column(np.uint8)
    col.ensure(4)
    low, high = Field(col, 0, 4), Field(col, 4, 4)
    low.set(0, a)
    high.set(0, b)
    low.put(np.array([1, 2]), np.array([c, d]))
    high.put(np.array([1, 2]), np.array([d, c]))
    low.set(0, c)
    assert (low.get(0), high.get(0)) == (c, b)
    assert low.take(np.arange(3)).tolist() == [c, c, d] and high.take(np.arange(3)).tolist() == [b, d, c]
    with pytest.raises(ValueError):
        low.set(3, 16)
    assert col.base[3] == 0


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("many"), st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40000)), max_size=4)),
            st.tuples(st.just("one"), st.integers(0, 5), st.integers(-3, 3)),
            st.tuples(st.just("renew"), st.integers(0, 5)),
        ),
        max_size=25,
    )
)
def test_child_counts_stay_exact_past_the_16_bit_column(ops) -> None:
    """Children per tier are a uint16 column with the rare counts of 65535 or more kept aside: against a
    dict model, through add_children (repeats), nchild_add across the boundary both ways, and ids reused."""
    t = EntryTable(ranks={DRAM: 32})
    ns = t.namespace_id("ns", create=True)
    assert ns is not None
    ids = t.insert_many(ns, [meta(i) for i in range(6)], [1] * 6).tolist()
    model = dict.fromkeys(ids, 0)
    for op in ops:
        if op[0] == "many":
            parents = np.concatenate([np.full(k, ids[p], dtype=np.int64) for p, k in op[1]] + [np.zeros(0, np.int64)])
            was_leaf = t.add_children(np.concatenate([parents, np.full(3, -1)]), DRAM)  # -1: no parent
            assert sorted(was_leaf.tolist()) == sorted({ids[p] for p, _ in op[1] if model[ids[p]] == 0})
            for p, k in op[1]:
                model[ids[p]] += k
        elif op[0] == "one":
            e, delta = ids[op[1]], op[2]
            if model[e] + delta < 0:
                continue
            model[e] += delta
            assert t.nchild_add(e, DRAM, delta) == model[e]
        else:  # the entry leaves and its id comes back for a new block: it starts with no children
            i = op[1]
            t.release_id(ids[i])
            ids[i] = int(t.insert_many(ns, [meta(1000 + len(model) + i)], [1])[0])
            model.pop(ids[i], None)
            model = {e: c for e, c in model.items() if e in ids}
            model[ids[i]] = 0
        arr = np.asarray(ids)
        want = [model[e] for e in ids]
        assert [t.nchild[e, DRAM] for e in ids] == want
        assert t.nchild[arr][:, DRAM].tolist() == want and t.nchild[arr, DRAM].tolist() == want
        assert np.asarray(t.nchild)[arr, DRAM].tolist() == want and t.nchild[:, DRAM][arr].tolist() == want
    assert t.bytes_per_entry() == 53  # one tier: a 4-byte location and a 2-byte child count


def test_a_shared_prefix_with_more_children_than_16_bits_count() -> None:
    t = EntryTable(ranks={DRAM: 32})
    ns = t.namespace_id("ns", create=True)
    assert ns is not None
    root, other = t.insert_many(ns, [meta(0), meta(1)], [1, 1]).tolist()
    assert t.add_children(np.full(70_000, root), DRAM).tolist() == [root]
    assert t.nchild[root, DRAM] == 70_000 and t.column_of_loc(DRAM).base[root] == 0
    assert t.nchild_add(root, DRAM, -4_466) == 65_534 and t.nchild[root, DRAM] == 65_534  # back in the column
    assert t.nchild_add(root, DRAM, 1) == 65_535 and t.nchild[[root, other], DRAM].tolist() == [65_535, 0]
    t.nchild[root, DRAM] = 0
    assert t.nchild[root, DRAM] == 0 and not t._nchild[DRAM].big


@settings(max_examples=60, deadline=None)
@given(
    parents=st.lists(st.integers(-1, 40), min_size=2, max_size=40),  # block i's parent: p % i, none if p < 0
    batches=st.lists(st.lists(st.integers(0, 39), max_size=24), max_size=8),
    renewed=st.lists(st.integers(0, 39), max_size=3),
    near_wide=st.lists(st.integers(0, 39), max_size=2),
)
def test_new_copies_count_their_parents_children_compiled_as_with_numpy(parents, batches, renewed, near_wide):
    """``add_copies`` (one compiled call) against the numpy calls it replaces, on twin tables: a forest whose
    parents may come later in the batch, be the same entry twice over, have left and had their id reused (no
    longer the same block), or hold counts at the 16-bit column's edge (the compiled call then defers)."""
    from kvstore.store import children_jit

    tables = []
    for _ in range(2):
        t = EntryTable(ranks={DRAM: 32})
        ns = t.namespace_id("ns", create=True)
        assert ns is not None
        n = len(parents)
        ids = t.insert_many(ns, [meta(i, p % i if p >= 0 and i else None) for i, p in enumerate(parents)], [1] * n)
        for i in renewed:  # the entry leaves and its id comes back for a new block
            if i < n:
                t.release_id(int(ids[i]))
                t.insert_many(ns, [meta(1000 + i)], [1])
        for i in near_wide:
            if i < n:
                t.nchild_add(int(ids[i]), DRAM, 65_534)
        tables.append((t, ids))
    original = children_jit.AVAILABLE
    try:
        for batch in batches:
            got = []
            for (t, ids), compiled in zip(tables, (True, False)):
                children_jit.AVAILABLE = compiled and original
                picks = np.asarray(ids)[sorted({i for i in batch if i < len(ids)})]
                is_leaf, was_leaf = t.add_copies(picks, DRAM)
                assert not set(was_leaf.tolist()) & set(picks.tolist())
                got.append((is_leaf.tolist(), sorted(was_leaf.tolist())))
            assert got[0] == got[1]
            (fast, ids), (slow, _) = tables
            arr = np.asarray(ids)
            assert fast.nchild[arr, DRAM].tolist() == slow.nchild[arr, DRAM].tolist()
    finally:
        children_jit.AVAILABLE = original
