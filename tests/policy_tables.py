"""Helpers for the policy tests (no tests here): an EntryTable of chained entries in three ranks."""

from __future__ import annotations

import hashlib

import numpy as np

from kvstore.store.index import EntryTable
from kvstore.tiers.base import DRAM, HBM, NVME


def chained_table(n: int, chain: int) -> EntryTable:
    """``n`` entries of 4 KiB in namespace "ns", in chains of ``chain`` (entry i's parent is i - 1 inside one),
    keyed by blake2b of their index; ranks HBM, DRAM and NVMe exist, no entry has a copy yet."""
    t = EntryTable(ranks={HBM: 32, DRAM: 32, NVME: 40})
    ns = t.namespace_id("ns", create=True)
    assert ns is not None
    digest = b"".join(hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(n))
    keys = np.frombuffer(digest, "<u8").reshape(n, 2).copy()
    has_parent = np.arange(n) % chain != 0
    parents = np.zeros_like(keys)
    parents[1:] = keys[:-1]
    parents[~has_parent] = 0
    fields = np.tile(np.array([4096, 4096, 0, 0], dtype=np.int64), (n, 1))
    t.insert_arrays(ns, keys, fields, np.ones(n, np.uint8), parents, has_parent)
    return t
