"""Bounded memory: a 2 GiB DRAM tier full of 64 KiB blocks keeps the server under 2.3 GiB RSS."""

from __future__ import annotations

import os

from kvstore.client import Client


def test_rss_with_full_2gib_tier(spawn_server):
    proc = spawn_server("--dram", "2GiB")
    block = os.urandom(64 << 10)
    n_blocks = (2 << 30) // len(block)
    with Client(proc.target, timeout=120) as kv:
        for start in range(0, n_blocks + 512, 512):  # a little more than fits: eviction runs too
            keys = [i.to_bytes(16, "little") for i in range(start, start + 512)]
            assert all(r.ok for r in kv.put("fill", keys, [block] * len(keys)))
        stats = kv.stats()
    rss = proc.rss_bytes()
    dram = stats["tiers"][0]
    per_block = stats["counters"]["index_bytes"] / stats["blocks"]
    print(
        f"\nRSS {rss / 2**30:.3f} GiB with {stats['blocks']} blocks, DRAM used {dram['used_bytes'] / 2**30:.3f} GiB; "
        f"index {per_block:.0f} bytes/block"
    )
    assert dram["used_bytes"] <= dram["capacity_bytes"] == 2 << 30
    assert stats["blocks"] >= n_blocks - 64
    assert rss <= 2.3 * 2**30
    assert per_block < 600
