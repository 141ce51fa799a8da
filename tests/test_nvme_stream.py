"""The tier's streamed read (issue 19): ``on_ready`` hands on each piece's blocks as soon as they are verified,
never a block that failed; a record whose CRC32C differs from the caller's index fails; a callback that raises
ends the read after every preadv returned. And the store's materialize into staging slots (DRAM full)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.checksum import crc32c
from kvstore.store import BlockStore, DataLossError
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import BlockMeta, CorruptBlock
from kvstore.tiers.nvme import NvmeTier, PosixBackend
from kvstore.tiers.nvme.faults import InstrumentedBackend
from kvstore.tiers.nvme.format import PAGE, split_loc
from kvstore.tiers.nvme.io import aligned_buffer
from tests.test_nvme_tier import flip_byte, segment_files, write_blocks

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 64 * KiB
PIECED = 128 * KiB  # 32 of them are read in four pieces (64 KiB blocks: two)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def test_on_ready_hands_on_every_good_block_once_and_never_a_bad_one(tmp_path: Path, rng) -> None:
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=16 * MiB, backend=backend)
    blocks = write_blocks(tier, [PIECED] * 32, rng)
    locs = list(blocks)
    bad = locs[20]
    flip_byte(segment_files(tmp_path)[0], split_loc(bad)[1] + PAGE + 99)
    dests = [aligned_buffer(PIECED) for _ in locs]
    seen: list[int] = []
    lock = threading.Lock()

    def ready(idx: list[int]) -> None:
        for i in idx:  # a block handed on holds its verified bytes already
            assert dests[i].tobytes() == blocks[locs[i]]
        with lock:
            seen.extend(idx)

    backend.reset_counts()
    with pytest.raises(CorruptBlock) as err:
        tier.read(locs, [PIECED] * 32, dests, ready)
    assert err.value.locs == [bad]
    assert sorted(seen) == [i for i in range(32) if locs[i] != bad]
    assert backend.preads == 4  # handed on in four pieces, as they were read


def test_a_record_whose_crc_differs_from_the_index_fails(tmp_path: Path, rng) -> None:
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=16 * MiB)
    blocks = write_blocks(tier, [BLOCK] * 4, rng)
    locs = list(blocks)
    crcs = [crc32c(np.frombuffer(blocks[loc], np.uint8)) for loc in locs]
    crcs[2] ^= 1  # what a block corrupted in DRAM before it was written to NVMe looks like
    dests = [aligned_buffer(BLOCK) for _ in locs]
    with pytest.raises(CorruptBlock, match="differs from the index") as err:
        tier.read(locs, [BLOCK] * 4, dests, None, crcs)
    assert err.value.locs == [locs[2]]
    assert dests[2].tobytes() == bytes(BLOCK)  # wiped
    assert dests[1].tobytes() == blocks[locs[1]]


def test_a_callback_that_raises_ends_the_read(tmp_path: Path, rng) -> None:
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=16 * MiB)
    blocks = write_blocks(tier, [BLOCK] * 32, rng)

    def boom(idx: list[int]) -> None:
        raise RuntimeError("the client went away")

    with pytest.raises(RuntimeError, match="went away"):
        tier.read(list(blocks), [BLOCK] * 32, [aligned_buffer(BLOCK) for _ in blocks], boom)
    dests = [aligned_buffer(BLOCK) for _ in blocks]
    tier.read(list(blocks), [BLOCK] * 32, dests)  # the tier is fine afterwards (buffers back in the pool)
    assert [d.tobytes() for d in dests] == list(blocks.values())
    tier.close()


def _store(tmp_path: Path, dram: int, promote: bool = True) -> BlockStore:
    return BlockStore(
        [ArenaTier(dram, page_size=1 * MiB), NvmeTier(tmp_path / "nvme", 64 * MiB, segment_bytes=16 * MiB)],
        write_through=True,
        promote_on_hit=promote,
        staging_bytes=4 * MiB,
    )


def _put(store: BlockStore, n: int, rng) -> list[tuple[bytes, bytes]]:
    out = []
    for _ in range(n):
        key, data = rng.bytes(16), rng.integers(0, 256, BLOCK, dtype=np.uint8)
        meta = BlockMeta("t", key, b"", 0, "uint8", BLOCK, BLOCK, crc32c(data))
        ticket = store.begin_put("t", meta)
        assert ticket is not None
        np.frombuffer(ticket.buffer, np.uint8)[:] = data
        _, e = store.commit_put(ticket)
        store.persist([e])
        out.append((key, data.tobytes()))
    return out


def test_a_full_dram_tier_serves_nvme_blocks_from_staging_slots(tmp_path: Path, rng) -> None:
    store = _store(tmp_path, 2 * MiB)
    blocks = _put(store, 64, rng)  # 4 MiB through a 2 MiB DRAM tier: the first ones only on NVMe
    cold = [k for k, _ in blocks if store.lookup("t", [k])[1] == [3]]
    assert len(cold) >= 16
    while store.top.allocate(BLOCK) is not None:  # DRAM full: no promotion possible
        pass
    leases = store.acquire("t", cold[:16])
    ready: list[int] = []
    store.materialize(leases, on_ready=ready.extend)
    assert sorted(ready) == list(range(16))
    want = dict(blocks)
    for lease in leases:
        assert bytes(memoryview(lease.buffer)[:BLOCK]) == want[lease.hash]
    assert store.staging.used_bytes == 16 * BLOCK
    store.release(leases)
    assert store.staging.used_bytes == 0
    store.close(flush=False)


def test_a_corrupt_copy_is_dropped_and_the_slots_come_back(tmp_path: Path, rng) -> None:
    store = _store(tmp_path, 2 * MiB)
    blocks = _put(store, 64, rng)
    cold = [k for k, _ in blocks if store.lookup("t", [k])[1] == [3]][:8]
    nvme = store.tiers[-1]
    ns = store.table.namespace_id("t")
    loc = int(store.table.loc[store.table.find(ns, cold[3]), nvme.rank])
    flip_byte(segment_files(tmp_path / "nvme")[0], split_loc(loc)[1] + PAGE + 5)
    used = store.top.used_bytes
    leases = store.acquire("t", cold)
    with pytest.raises(DataLossError):
        store.materialize(leases)
    store.release(leases)
    assert store.lookup("t", [cold[3]])[0] == 0  # dropped
    assert store.top.used_bytes == used and store.staging.used_bytes == 0  # no slot kept by the failed read
    leases = store.acquire("t", cold[:3] + cold[4:])
    store.materialize(leases)
    want = dict(blocks)
    assert all(bytes(memoryview(x.buffer)[:BLOCK]) == want[x.hash] for x in leases)
    store.release(leases)
    store.check_invariants()
    store.close(flush=False)
