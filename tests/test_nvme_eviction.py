"""How a full NVMe tier drops blocks (``--nvme-eviction``): a victim's whole segment, or victims one by one."""

from __future__ import annotations

import pytest

from kvstore import config
from kvstore.arena_index_layout import segment_name
from kvstore.checksum import crc32c
from kvstore.hashing import block_hashes
from kvstore.store import BlockStore
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme import NvmeTier

SIZE = 256 << 10  # a record is 260 KiB: 7 to a 2 MiB segment


def payload(key: bytes) -> bytes:
    return (key * (SIZE // 16 + 1))[:SIZE]


def put(store: BlockStore, keys: list[bytes], chained: bool = False) -> None:
    for parent, k in zip([b""] + keys[:-1], keys):
        data = payload(k)
        meta = BlockMeta("ns", k, parent if chained else b"", 0, "uint8", SIZE, SIZE, crc32c(data))
        ticket = store.begin_put("ns", meta)
        assert ticket is not None
        ticket.buffer[:] = data
        store.commit_put(ticket)


def on_nvme(store: BlockStore, keys: list[bytes], chained: bool = False) -> NvmeTier:
    """``keys`` put, then all demoted: written to NVMe in order, 7 records to a segment."""
    put(store, keys, chained)
    for _ in keys if chained else [None]:  # leaf first: a chain leaves DRAM one block a round
        store._evict(store.top, store.top.used_bytes)  # noqa: SLF001 - as the demoter does
    nvme = store.tiers[1]
    assert isinstance(nvme, NvmeTier)
    return nvme


def open_store(tmp_path, mode: str) -> BlockStore:
    nvme = NvmeTier(tmp_path / mode, 64 << 20, segment_bytes=2 << 20)
    store = BlockStore([ArenaTier(16 << 20, page_size=1 << 20), nvme], nvme_eviction=mode)
    nvme.on_relocate = lambda moves: store.relocate(nvme.rank, moves)
    return store


def segment_of(store: BlockStore, key: bytes) -> int:
    e = store.table.find(store.table.namespace_id("ns"), key)
    assert e is not None
    return store.table.loc_of(e, store.tiers[1].rank) >> 40


def present(store: BlockStore, keys: list[bytes]) -> list[bool]:
    return [store.lookup("ns", [k])[0] == 1 for k in keys]


def test_a_victim_takes_the_unleased_leaves_of_its_segment_and_the_file_goes(tmp_path):
    store = open_store(tmp_path, "segment")
    keys = block_hashes(list(range(16 * 21)), 16, "ns", "flat")  # 21 unchained blocks: 3 segments of 7
    nvme = on_nvme(store, keys)
    first = [k for k in keys if segment_of(store, k) == segment_of(store, keys[0])]
    assert len(first) == 7
    held = store.acquire("ns", [first[3]])  # a reader holds one of them
    freed = store._evict(nvme, 1)  # noqa: SLF001 - what a write into a full tier does
    assert freed == 6 * SIZE  # the victim (the oldest) and five of its neighbours; the leased one stays
    assert present(store, first) == [False, False, False, True, False, False, False]
    assert all(present(store, [k for k in keys if k not in first]))
    store.release(held)  # a use: now the most recently used block
    second = segment_of(store, keys[7])
    assert (tmp_path / "segment" / segment_name(second)).exists()
    assert store._evict(nvme, 1) == 7 * SIZE  # noqa: SLF001 - the next victim's segment, whole
    assert not any(present(store, keys[7:14]))
    assert nvme.compact().records_moved == 1  # only the block read meanwhile is copied
    assert not (tmp_path / "segment" / segment_name(second)).exists()  # nothing to copy: its file went
    assert all(present(store, [first[3], *keys[14:]]))
    leases = store.acquire("ns", [first[3], *keys[14:]])
    store.materialize(leases)
    assert all(bytes(x.buffer[:SIZE]) == payload(k) for x, k in zip(leases, [first[3], *keys[14:]]))
    store.release(leases)
    store.check_invariants(quiet=True)
    store.close()


def test_a_chain_inside_the_segment_goes_leaf_first_and_a_parent_of_copies_elsewhere_stays(tmp_path):
    store = open_store(tmp_path, "segment")
    keys = block_hashes(list(range(16 * 10)), 16, "ns", "chain")  # one chain of 10: 7 + 3 records
    nvme = on_nvme(store, keys, chained=True)
    by_segment: dict[int, list[bytes]] = {}
    for k in keys:
        by_segment.setdefault(segment_of(store, k), []).append(k)
    assert sorted(len(v) for v in by_segment.values()) == [3, 7]
    tail = next(v for v in by_segment.values() if keys[-1] in v)
    store._evict(nvme, 1)  # noqa: SLF001 - the only leaf is the chain's last block
    assert not any(present(store, tail))  # its segment-mates became leaves as it went, and went too
    assert all(present(store, [k for k in keys if k not in tail]))  # the head, in the other segment, stays
    store.check_invariants(quiet=True)
    store.close()


def test_a_victim_in_the_segment_being_written_goes_alone(tmp_path):
    store = open_store(tmp_path, "segment")
    keys = block_hashes(list(range(16 * 11)), 16, "ns", "flat")  # 7 in a sealed segment, 4 in the active one
    nvme = on_nvme(store, keys)
    store.release(store.acquire("ns", keys[:7]))  # the sealed segment's blocks used since: the victim is newer
    assert store._evict(nvme, 1) == SIZE  # noqa: SLF001 - its segment's space would not come back
    assert present(store, keys).count(False) == 1 and not present(store, keys[7:])[0]
    store.check_invariants(quiet=True)
    store.close()


def test_block_eviction_drops_victims_one_by_one(tmp_path):
    store = open_store(tmp_path, "block")
    keys = block_hashes(list(range(16 * 14)), 16, "ns", "flat")
    nvme = on_nvme(store, keys)
    assert store._evict(nvme, 1) == SIZE  # noqa: SLF001
    assert present(store, keys).count(False) == 1
    store.check_invariants(quiet=True)
    store.close()


def test_the_option_is_checked():
    assert config.load(env={}).nvme_eviction == "segment"
    assert config.load(env={"KVSTORE_NVME_EVICTION": "block", "KVSTORE_NVME_DIR": "/nvme"}).nvme_eviction == "block"
    with pytest.raises(ValueError, match="--nvme-eviction: one of segment, block"):
        config.load(env={"KVSTORE_NVME_EVICTION": "fifo"})
    with pytest.raises(ValueError, match="nvme_eviction must be one of"):
        BlockStore([ArenaTier(1 << 20, page_size=1 << 20)], nvme_eviction="fifo")


def test_churn_through_a_full_tier_copies_nothing(tmp_path):
    """Puts far beyond DRAM and NVMe, demoted as DRAM fills: every write into the full tier makes its room by
    dropping whole segments, so compaction never copies a record (``block`` copied some under this churn)."""
    copied = {}
    for mode in ("segment", "block"):
        nvme = NvmeTier(tmp_path / mode, 16 << 20, segment_bytes=2 << 20)  # 7 segments of 7 records usable
        store = BlockStore([ArenaTier(4 << 20, page_size=1 << 20), nvme], nvme_eviction=mode)
        nvme.on_relocate = lambda moves, store=store, nvme=nvme: store.relocate(nvme.rank, moves)
        keys = block_hashes(list(range(16 * 300)), 16, "ns", mode)
        for k in range(0, len(keys), 3):
            put(store, keys[k : k + 3])
            store.release(store.acquire("ns", keys[max(0, k - 40) : k : 7]))  # reads of recent blocks
        copied[mode] = int(nvme.stats().extra["relocated"])
        assert nvme.used_bytes <= nvme.capacity_bytes
        assert all(present(store, keys[-3:]))
        store.check_invariants(quiet=True)
        store.close()
    assert copied["segment"] == 0
    assert copied["block"] > 0
