"""Compile the store's kernels before the first request needs them.

The index probes (``slots_jit``), the frequency sketch (``sketch_jit``), the eviction policies' compiled
parts, the lanes' copy and CRC32C kernels (``kvstore.memops_jit``) and the NVMe tier's run reads
(``kvstore.payload_runs``) are numba functions, compiled on first
use and cached on disk beside their sources. Measured on this project's 2-core machine, against a fresh checkout (nothing cached): a ``kvstore serve``'s first 32-block
Put took 9.7 s and its first two Gets 2.0 s and 1.0 s, against 0.58 s, 14 ms and 19 ms once cached. A pod
started from an image without that cache, or a new checkout, would make its first requests wait that long.

- ``warm_up(policy_factory, index) -> seconds``: run a throwaway store (accounting tiers: DRAM over a disk rank,
  nothing allocated) through every hot path once: chained Puts in batches, lookups, Gets with their
  touches, eviction and demotion past capacity, deletes. The kernels are process-wide, so the real store
  finds them compiled (or loaded from the cache). ``kvstore serve`` runs it on a background thread at start;
  with ``index`` (a store that shares a DRAM index, or one of its NVMe-only blocks) the index's writer too, which
  otherwise ran as numpy calls until compiled (or loaded) in the background from the first block it named.
- ``python -m kvstore.store.warmup``: the same, to fill the on-disk cache (an image build runs it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstore import arena_index, memops_jit, payload_runs
from kvstore.hashing import block_hashes
from kvstore.store.blockstore import BlockStore
from kvstore.store.policies import policy_factory as make_factory
from kvstore.store.policy import LeafLRU
from kvstore.tiers.accounting import AccountingDiskTier, AccountingMemoryTier
from kvstore.tiers.base import BlockMeta

BLOCK = 4096
CHAIN = 64
WARM_NAMESPACE = "kvstore-warm-up"


def warm_up(policy_factory: Callable[[], LeafLRU] | None = None, index: bool = True) -> float:
    """Seconds spent running a throwaway store through its compiled paths (see the module docstring)."""
    t0 = time.perf_counter()
    memops_jit.warm_up()  # the lanes' copy and CRC32C kernels
    payload_runs.COMPILED.warm_up()  # the NVMe tier's compiled runs (and a --share-nvme client's reads)
    if index and arena_index.supported():
        arena_index.warm_up()  # the shared index's writer (and its clients' find)
    store = BlockStore(
        [AccountingMemoryTier(3 * CHAIN * BLOCK), AccountingDiskTier(16 * CHAIN * BLOCK)],
        policy_factory=policy_factory or make_factory(),
    )
    try:
        for c in range(6):  # past the DRAM tier's capacity: eviction demotes leaves to the disk rank
            keys = block_hashes(list(range(c * CHAIN, (c + 1) * CHAIN)), 1, WARM_NAMESPACE, "warm-up")
            tickets = []
            for i, key in enumerate(keys):
                meta = BlockMeta(WARM_NAMESPACE, key, keys[i - 1] if i else b"", 0, "uint8", BLOCK, BLOCK, 0)
                ticket = store.begin_put(WARM_NAMESPACE, meta)
                if ticket is not None:
                    tickets.append(ticket)
            store.commit_puts(tickets)
            store.lookup(WARM_NAMESPACE, keys)
            for touch in (False, True):
                leases = store.acquire(WARM_NAMESPACE, keys, allow_missing=True, touch=touch)
                store.release(leases, touch=not touch)
            if c % 2:
                store.delete(WARM_NAMESPACE, keys[CHAIN // 2 :])
    finally:
        store.close(flush=False)
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"kvstore kernels ready in {warm_up():.2f} s")
