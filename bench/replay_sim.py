"""The machinery of ``bench.replay``: a trace, two reference caches, and the store driven by it.

Hit rule everywhere (DESIGN 2.4): a request's block counts as a hit only while
every earlier block of that request hit, i.e. the hit blocks of a request are
its longest present prefix at arrival. All three caches then access every
block of the request in order (present ones are touched, missing ones put),
so they see the same accesses and differ only in what they evict.

- ``lru_hit_rate``: plain block-level LRU of ``capacity`` blocks (no leaf rule).
- ``popularity_oracle_hit_rate``: evicts the block with the fewest uses in the
  whole trace (an oracle of popularity, not of timing).
- ``lifetime_oracle_hit_rate``: knows each block's first use, last use and
  number of uses: evicts blocks that are done first, then the lowest rate of
  use over the block's lifetime (everything but the timing of each return).
- ``belady_hit_rate``: Belady's offline optimum for block caching: on a miss
  with a full cache, evict the cached block whose next use is farthest away
  (never used again = infinitely far). Every missed block is inserted (no
  bypass), as a store stores every Put.
- ``replay_store``: the real ``BlockStore`` (index, placement, leaf-first
  eviction, demotion, promotion) on byte-accounting tiers, one Lookup,
  Get (acquire, materialize, release) and chained Puts per request.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.replay_hints import future_hints
from kvstore.store.blockstore import BlockStore
from kvstore.store.leases import Lease
from kvstore.store.policies import policy_factory
from kvstore.tiers.accounting import AccountingDiskTier, AccountingLogTier, AccountingMemoryTier
from kvstore.tiers.base import DRAM, NVME, BlockMeta, Tier

NAMESPACE = "replay"
TOKENS_PER_BLOCK = 512  # the Mooncake traces' block


@dataclass(frozen=True)
class KVShape:
    """The KV bytes of one block of a model: layers x (K, V) x tokens x kv_heads x head_dim x dtype."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    def block_bytes(self, tokens: int = TOKENS_PER_BLOCK) -> int:
        return self.layers * 2 * tokens * self.kv_heads * self.head_dim * self.dtype_bytes


LLAMA3_8B_BF16 = KVShape("Llama-3-8B bf16", layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)  # 64 MiB/block


@dataclass(frozen=True)
class Trace:
    """Per request, its prefix block ids (equal ids at the same position = shared prefix)."""

    requests: tuple[tuple[int, ...], ...]
    times: tuple[float, ...] = ()  # arrival of each request, seconds (empty: unknown)

    @property
    def total_blocks(self) -> int:
        return sum(len(r) for r in self.requests)

    @property
    def distinct_blocks(self) -> int:
        return len({b for r in self.requests for b in r})

    def blocks_for(self, capacity_frac: float) -> int:
        """Capacity in blocks: ``capacity_frac`` of the distinct blocks, at least one."""
        return max(1, int(capacity_frac * self.distinct_blocks))


def load_trace(path: Path, limit: int | None = None) -> Trace:
    """Read a Mooncake FAST'25 JSONL trace (``hash_ids`` per line), optionally its first ``limit`` requests."""
    requests: list[tuple[int, ...]] = []
    times: list[float] = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                row = json.loads(line)
                requests.append(tuple(int(h) for h in row["hash_ids"]))
                times.append(float(row.get("timestamp", len(times))) / 1000.0)
    if not requests:
        raise ValueError(f"{path}: no requests")
    return Trace(tuple(requests), tuple(times))


# -- reference caches ----------------------------------------------------------------
def lru_hit_rate(requests: Sequence[Sequence[int]], capacity: int) -> float:
    """Prefix hit rate of a plain LRU cache of ``capacity`` blocks."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for request in requests:
        prefix = True
        for block in request:
            total += 1
            if block in cache:
                hits += prefix
                cache.move_to_end(block)
            else:
                prefix = False
                cache[block] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / max(total, 1)


def popularity_oracle_hit_rate(requests: Sequence[Sequence[int]], capacity: int) -> float:
    """Prefix hit rate of a cache that knows each block's total number of uses in the whole trace (future
    included) and evicts the least used one (ties: least recently used). It is what a perfect frequency
    estimate could do: the bound of any policy that ranks blocks by popularity rather than by *when* they
    come back, which only Belady knows."""
    uses = Counter(block for request in requests for block in request)
    return _ranked_hit_rate(requests, capacity, lambda block, i: (uses[block], i))


def lifetime_oracle_hit_rate(requests: Sequence[Sequence[int]], capacity: int) -> float:
    """Prefix hit rate of a cache that knows, for every block, when it is first and last used and how often:
    it evicts blocks that will not be used again first, then the one with the lowest rate of use over its
    lifetime (uses / (last - first)). That is more than any online estimate of popularity and liveness can
    know; what it lacks, and Belady has, is *when* each individual return comes."""
    uses: Counter[int] = Counter()
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, block in enumerate(b for request in requests for b in request):
        uses[block] += 1
        first.setdefault(block, i)
        last[block] = i

    def rank(block: int, i: int) -> tuple[float, ...]:
        if i == last[block]:
            return (0.0, i)
        return (1.0, uses[block] / (last[block] - first[block] + 1), i)

    return _ranked_hit_rate(requests, capacity, rank)


def belady_hit_rate(requests: Sequence[Sequence[int]], capacity: int) -> float:
    """Prefix hit rate of Belady's offline policy (evict the block used farthest in the future)."""
    sequence = [block for request in requests for block in request]
    never = len(sequence)
    next_use = [never] * len(sequence)
    seen: dict[int, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        next_use[i] = seen.get(sequence[i], never)
        seen[sequence[i]] = i
    return _ranked_hit_rate(requests, capacity, lambda block, i: (-next_use[i],))


def _ranked_hit_rate(
    requests: Sequence[Sequence[int]], capacity: int, rank: Callable[[int, int], tuple[float, ...]]
) -> float:
    """Prefix hit rate of a cache that, when full, evicts the block of lowest ``rank(block, i)`` (taken at its
    last access, the ``i``-th of the trace; ties: lowest block id)."""
    cached: dict[int, tuple[float, ...]] = {}  # block -> its rank
    heap: list[tuple[tuple[float, ...], int]] = []  # (rank, block); stale rows skipped
    hits = i = 0
    for request in requests:
        prefix = True
        for block in request:
            if block in cached:
                hits += prefix
            else:
                prefix = False
                while len(cached) >= capacity:
                    key, victim = heapq.heappop(heap)
                    if cached.get(victim) == key:
                        del cached[victim]
            cached[block] = key = rank(block, i)
            heapq.heappush(heap, (key, block))
            i += 1
    return hits / max(i, 1)


# -- the store ------------------------------------------------------------------------
@dataclass(frozen=True)
class StoreSetup:
    """One replay of the real store: its policy, tier sizes (in blocks) and an optional admission filter."""

    policy: str
    dram_blocks: int
    nvme_blocks: int = 0
    admit_after: int = 1  # Put a block only from its n-th sighting on (1: always)
    nvme_admit_uses: int = 1  # demote a DRAM victim to NVMe only once used this often (1: always)
    block_bytes: int = LLAMA3_8B_BF16.block_bytes()
    hints: str = ""  # engine hints derived from the future (bench/replay_hints.py): "", reuse, priority, ttl, all
    nvme_segment_blocks: int = 0  # NVMe as a log of segments of this many blocks (0: bytes only)
    nvme_eviction: str = "segment"  # with a log: the store's --nvme-eviction


@dataclass
class ReplayResult:
    """What one replay measured; rates are fractions of all blocks requested."""

    setup: StoreSetup
    total_blocks: int = 0
    hits: int = 0
    hits_by_rank: Counter[int] = field(default_factory=Counter)
    bytes_put: int = 0
    bytes_demoted: int = 0
    bytes_promoted: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    index_bytes: int = 0
    seconds: float = 0.0
    nvme_records_written: int = 0  # with a log: records the store wrote to NVMe
    nvme_relocated: int = 0  # and records compaction copied

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.total_blocks, 1)

    def tier_hit_rate(self, rank: int) -> float:
        return self.hits_by_rank[rank] / max(self.total_blocks, 1)


def build_store(setup: StoreSetup, now: Callable[[], float] | None = None) -> BlockStore:
    """A BlockStore over accounting tiers: DRAM, and NVMe below it when ``nvme_blocks`` > 0; ``now`` is
    the policy's clock for TTL hints (the trace's time), where the policy takes one."""
    tiers: list[Tier] = [AccountingMemoryTier(setup.dram_blocks * setup.block_bytes, rank=DRAM)]
    log: AccountingLogTier | None = None
    if setup.nvme_blocks and setup.nvme_segment_blocks:
        size = setup.block_bytes
        log = AccountingLogTier(setup.nvme_blocks * size, setup.nvme_segment_blocks * size, rank=NVME)
        tiers.append(log)
    elif setup.nvme_blocks:
        tiers.append(AccountingDiskTier(setup.nvme_blocks * setup.block_bytes, rank=NVME))
    params = {"now": now} if now is not None and setup.policy == "adaptive" else {}
    factory = policy_factory(setup.policy, **params)
    store = BlockStore(
        tiers, policy_factory=factory, nvme_admit_uses=setup.nvme_admit_uses, nvme_eviction=setup.nvme_eviction
    )
    if log is not None:
        log.on_relocate = lambda moves: store.relocate(NVME, moves)
    return store


def block_keys(trace: Trace) -> dict[int, bytes]:
    """16-byte keys for the trace's block ids (BLAKE2b, like real block hashes)."""
    ids = {b for r in trace.requests for b in r}
    return {b: hashlib.blake2b(b.to_bytes(8, "little"), digest_size=16).digest() for b in ids}


def _promotable(store: BlockStore, leases: list[Lease | None], size: int) -> list[Lease]:
    """The leases ``materialize`` would promote: lower-tier hits while the top tier has free room.

    The rest it would read into a fresh temporary buffer without promoting; an
    accounting tier has no bytes to read, so they are left out (same store state,
    no 64 MiB allocation per block).
    """
    room = (store.top.capacity_bytes - store.top.used_bytes) // size
    cold = [lease for lease in leases if lease is not None and lease.buffer is None]
    return cold[: max(room, 0)]


def replay_store(
    trace: Trace, setup: StoreSetup, keys: dict[int, bytes] | None = None, progress: Callable[[int], None] | None = None
) -> ReplayResult:
    """Drive a fresh store with the trace: per request Lookup, Get the hit prefix, Put the rest."""
    keys = keys if keys is not None else block_keys(trace)
    clock = [0.0]
    store = build_store(setup, lambda: clock[0])
    hints = future_hints(trace, setup.hints) if setup.hints else None
    result = ReplayResult(setup)
    sightings: Counter[int] = Counter()
    size = setup.block_bytes
    started = time.perf_counter()
    for done, request in enumerate(trace.requests, 1):
        if trace.times:
            clock[0] = trace.times[done - 1]
        hashes = [keys[b] for b in request]
        n, ranks = store.lookup(NAMESPACE, hashes)
        result.total_blocks += len(hashes)
        result.hits += n
        result.hits_by_rank.update(ranks)
        if n:
            leases = store.acquire(NAMESPACE, hashes[:n])
            try:
                store.materialize(_promotable(store, leases, size))
            finally:
                store.release(leases)
        for b in request:
            sightings[b] += 1
        parent = hashes[n - 1] if n else b""
        for i in range(n, len(hashes)):
            if sightings[request[i]] < setup.admit_after:
                break  # not admitted: the blocks after it would be unreachable by prefix anyway
            ticket = store.begin_put(NAMESPACE, BlockMeta(NAMESPACE, hashes[i], parent, 0, "bfloat16", size, size, 0))
            if ticket is not None:
                store.commit_put(ticket)
                result.bytes_put += size
            parent = hashes[i]
        if hints is not None:  # the Put carries, for each block of the request, what the future holds
            for h, hint in zip(hashes, hints[done - 1]):
                if not hint.empty:
                    store.hint(NAMESPACE, [h], hint)
        if setup.nvme_blocks:
            while store.demote_once():  # what the background demoter does between requests
                pass
            if setup.nvme_segment_blocks:
                store.compact_once()  # and then, as it does, compaction of segments under half live
        if progress is not None and (done % 64 == 0 or done == len(trace.requests)):
            progress(done)
    result.seconds = time.perf_counter() - started
    stats = store.stats()
    by_name = {t["name"]: t for t in stats["tiers"]}
    dram = by_name["dram"]
    result.bytes_demoted = dram["demotions"] * size
    result.bytes_promoted = dram["promotions"] * size
    result.evictions = {name: t["evictions"] for name, t in by_name.items()}
    result.index_bytes = stats["index_bytes"]
    if setup.nvme_segment_blocks:
        result.nvme_records_written = int(by_name["nvme"]["records_written"])
        result.nvme_relocated = int(by_name["nvme"]["relocated"])
    store.close(flush=False)
    return result
