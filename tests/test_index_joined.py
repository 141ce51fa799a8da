"""``EntryTable.find_many`` on its compiled path (slots_jit.find_joined: keys read out of two joins).

Against ``find`` of each key: keys of every length (only 16 bytes can match; the joins' check must tell
lengths that sum right apart from 16s), one namespace (no namespace compare) and several, and tables
big enough that 4-bit tags collide often (false tag matches must probe on).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store import index as index_mod
from kvstore.store import slots_jit
from kvstore.store.index import EntryTable
from kvstore.tiers.base import DRAM

pytestmark = pytest.mark.skipif(not slots_jit.AVAILABLE, reason="numba is not installed")


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def filled(n: int, namespaces: int) -> EntryTable:
    t = EntryTable(ranks={DRAM: 32})
    for k in range(namespaces):
        ns = t.namespace_id(f"ns{k}", create=True)
        assert ns is not None
        keys = np.frombuffer(b"".join(key(i) for i in range(k, n, namespaces)), dtype="<u8").reshape(-1, 2).copy()
        m = len(keys)
        fields = np.tile(np.array([1, 1, 0, 0], dtype=np.int64), (m, 1))
        t.insert_arrays(ns, keys, fields, np.ones(m, np.uint8), np.zeros_like(keys), np.zeros(m, np.bool_))
    return t


TABLES = {(n, k): filled(n, k) for n in (40, 3000) for k in (1, 3)}


@settings(max_examples=150, deadline=None)
@given(
    shape=st.sampled_from(sorted(TABLES)),
    ns=st.integers(0, 3),
    picks=st.lists(
        st.one_of(
            st.integers(0, 3500).map(key), st.binary(max_size=20), st.integers(0, 3500).map(lambda i: key(i)[:15])
        ),
        min_size=1,
        max_size=70,
    ),
)
def test_find_many_is_find_of_each(shape: tuple[int, int], ns: int, picks: list[bytes]) -> None:
    t = TABLES[shape]
    want = [-1 if (e := t.find(ns, k)) is None else e for k in picks]
    assert t.find_many(ns, picks).tolist() == want


def test_lengths_that_sum_to_16s_are_not_16s() -> None:
    """A 15-byte and a 17-byte key: one join with a zero between keys would look right here."""
    t = TABLES[(3000, 1)]
    k = key(7)
    for bad in ([k[:15], b"\x00" + k], [k[:15], b"\x00" * 17], [k + b"\x00", k[1:]], [b"", k + bytes(16)]):
        assert t.find_many(0, bad).tolist() == [-1, -1]
        assert t.find_many(0, [key(1), *bad, key(2)]).tolist() == [t.find(0, key(1)), -1, -1, t.find(0, key(2))]


def test_the_compiled_path_answers_without_the_numpy_one(monkeypatch: pytest.MonkeyPatch) -> None:
    t = TABLES[(3000, 3)]
    monkeypatch.setattr(index_mod, "_key_words", lambda keys: pytest.fail("took the numpy path"))
    got = t.find_many(1, [key(i) for i in range(64)])
    assert got.tolist() == [-1 if (e := t.find(1, key(i))) is None else e for i in range(64)]
    assert (got >= 0).sum() == len(range(1, 64, 3))


def test_one_namespace_never_answers_for_another_id() -> None:
    t = TABLES[(3000, 1)]
    assert (t.find_many(0, [key(i) for i in range(64)]) >= 0).all()
    assert (t.find_many(1, [key(i) for i in range(64)]) == -1).all()  # an id no namespace has
