"""Gets into different kinds of destination memory: what a worker's KV pool costs before and after its first use.

Run by ``python -m bench.transfer --cases destination``. 64 blocks of 720 KiB (one SmolLM2-135M KV block of 16
tokens, a worker's default), held in the store's DRAM, got in one call on each lane into

- ``fresh``: a new buffer in transparent huge pages that no one has written yet (a worker's pool before its
  blocks were ever used; what ``PagedKVPool`` was until ``prefault``): each page is faulted in and zeroed
  inside the Get;
- ``populated``: the same, its pages made first with ``MADV_POPULATE_WRITE`` (``kvstore.prefault.populate``,
  what a worker's pool gets now), outside the timing;
- ``reused``: one buffer written before every repetition (a pool in steady state);
- ``shared_pool``: slices of a ``Client.shared_pool`` (what ``--shared-pool`` gives a worker's pool), whose
  DRAM hits the store copies in through its own mapping (shm lane only; plain memory on TCP). Its pages are
  what this host gives (``shared_pool_huge_pages``).

Each repetition takes every kind in turn; one row per lane with the GB/s of each (bytes / median seconds) and
the ratios ``populated_vs_fresh``, ``reused_vs_fresh`` and ``shared_pool_vs_reused``. Every Get's bytes are
checked against what was put.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np

from kvstore.client import Client
from kvstore.hugepages import huge_buffer
from kvstore.prefault import populate

BLOCK = 737_280  # SmolLM2-135M: 30 layers x K,V x 16 tokens x 3 kv heads x 64 x fp32
BATCH = 64
KINDS = ("fresh", "populated", "reused", "shared_pool")


def measure(target: str, lanes: list[str], reps: int) -> list[dict[str, Any]]:
    """One row per lane: GB/s of a Get into each kind of memory, and the ratios."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (BATCH, BLOCK), dtype=np.uint8)
    rows = []
    for lane in lanes:
        seconds: dict[str, list[float]] = {k: [] for k in KINDS}
        with Client(target, timeout=120, lane=lane) as kv:
            keys = [os.urandom(16) for _ in range(BATCH)]
            kv.put("bench", keys, list(data))
            pool = kv.shared_pool(BATCH * BLOCK, "bench-destination")
            reused = huge_buffer(BATCH * BLOCK)
            for rep in range(reps + 1):  # the first repetition warms up the lane
                for kind in KINDS:
                    if kind == "reused":
                        reused[:] = 0
                        dest = reused
                    elif kind == "shared_pool":
                        pool.array[: BATCH * BLOCK] = 0
                        dest = pool.array[: BATCH * BLOCK]  # whole pages: a hugetlb pool is longer
                    else:
                        dest = huge_buffer(BATCH * BLOCK)
                        if kind == "populated":
                            populate(dest)
                    blocks = dest.reshape(BATCH, BLOCK)
                    start = time.perf_counter()
                    kv.get("bench", keys, out=list(blocks))
                    elapsed = time.perf_counter() - start
                    if not np.array_equal(blocks, data):
                        raise AssertionError(f"a Get into {kind} memory on the {lane} lane returned other bytes")
                    if rep:
                        seconds[kind].append(elapsed)
            kv.delete("bench", keys)
            kind_of_lane, huge = kv.lane_kind, pool.huge_pages
            pool.close()
        gbps = {k: BATCH * BLOCK / statistics.median(v) / 1e9 for k, v in seconds.items()}
        rows.append(
            {
                "op": "get",
                "lane": kind_of_lane,
                "case": "destination",
                "block_bytes": BLOCK,
                "batch": BATCH,
                "reps": reps,
                **{f"{k}_gbps": round(g, 3) for k, g in gbps.items()},
                "populated_vs_fresh": round(gbps["populated"] / gbps["fresh"], 2),
                "reused_vs_fresh": round(gbps["reused"] / gbps["fresh"], 2),
                "shared_pool_vs_reused": round(gbps["shared_pool"] / gbps["reused"], 2),
                "shared_pool_huge_pages": huge,
            }
        )
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print(f"\nGets of {BATCH} x {BLOCK} B from DRAM, by destination memory (GB/s)")
    print(
        f"{'lane':5} {'fresh':>7} {'popul.':>7} {'reused':>7} {'shared':>7} {'popul/fresh':>11} {'shared/reused':>13}"
    )
    for r in rows:
        print(
            f"{r['lane']:5} {r['fresh_gbps']:>7.2f} {r['populated_gbps']:>7.2f} {r['reused_gbps']:>7.2f} "
            f"{r['shared_pool_gbps']:>7.2f} {r['populated_vs_fresh']:>11.2f} {r['shared_pool_vs_reused']:>13.2f}"
        )
