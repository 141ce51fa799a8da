"""Recovery's choice of the newest record per (namespace, hash) (``_newest_rows``) against one exact sort.

The reference is the sort recovery used before: every row through ``np.lexsort`` by (namespace, key, seq,
row), the last of each run wins, winners in the order of each run's first row. Property tests draw keys from
small pools (so keys repeat, across namespaces too), digests that collide on purpose, and any sequence numbers.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tiers.nvme import recovery


def _reference(keys: np.ndarray, seqs: np.ndarray, ns: np.ndarray) -> np.ndarray:
    order = np.lexsort((np.arange(len(seqs)), seqs, keys[:, 1], keys[:, 0], ns))
    k, n = keys[order], ns[order]
    last = np.ones(len(order), dtype=np.bool_)
    if len(order) > 1:
        last[:-1] = (n[1:] != n[:-1]) | (k[1:, 0] != k[:-1, 0]) | (k[1:, 1] != k[:-1, 1])
    first = np.ones(len(order), dtype=np.bool_)
    first[1:] = last[:-1]
    return order[last][np.argsort(order[first], kind="stable")]


WORD = st.integers(0, (1 << 64) - 1)


@settings(max_examples=200, deadline=None)
@given(
    pool=st.lists(st.tuples(WORD, WORD), min_size=1, max_size=12, unique=True),
    rows=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 2), st.integers(0, 20)), min_size=1, max_size=80),
)
def test_newest_rows_matches_one_exact_sort(pool: list[tuple[int, int]], rows: list[tuple[int, int, int]]) -> None:
    keys = np.array([pool[k % len(pool)] for k, _, _ in rows], dtype=np.uint64).reshape(-1, 2)
    ns = np.array([n for _, n, _ in rows], dtype=np.uint32)
    seqs = np.array([s for _, _, s in rows], dtype=np.uint64)
    assert recovery._newest_rows(keys, seqs, ns).tolist() == _reference(keys, seqs, ns).tolist()


@settings(max_examples=100, deadline=None)
@given(hi=st.lists(WORD, min_size=2, max_size=30), seqs=st.lists(st.integers(0, 5), min_size=30, max_size=30))
def test_distinct_keys_with_one_digest_all_win(hi: list[int], seqs: list[int]) -> None:
    """Keys built so that their 64-bit digests collide: only the exact comparison tells them apart."""
    n = len(hi)
    k1 = np.array(hi, dtype=np.uint64)
    with np.errstate(over="ignore"):
        k0 = np.uint64(12345) ^ (k1 * recovery._H1)  # digest = k0 ^ k1 * H1 = 12345 for every row
    keys = np.stack([k0, k1], axis=1)
    ns, s = np.zeros(n, dtype=np.uint32), np.array(seqs[:n], dtype=np.uint64)
    assert recovery._newest_rows(keys, s, ns).tolist() == _reference(keys, s, ns).tolist()


def test_unique_keys_keep_log_order() -> None:
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 1 << 64, size=(5000, 2), dtype=np.uint64, endpoint=False)
    seqs = rng.permutation(5000).astype(np.uint64)
    ns = np.zeros(5000, dtype=np.uint32)
    assert recovery._newest_rows(keys, seqs, ns).tolist() == list(range(5000))
