"""Blocks a client reads from NVMe itself (``serve --share-nvme``) are promoted later, by the store's promoter thread
(kvstore/store/background_promotions.py), through real in-process servers and shm clients: they come back to
DRAM whether the store named them or the DRAM index did, and are then served from there, exact (the metrics
count them); a full DRAM tier takes only the room under its high watermark and loses nothing to them; a corrupt
record met by such a promotion is dropped alone; concurrent Gets stay exact while it runs;
``promote_on_hit=False`` leaves them on NVMe; a block read once waits for a second read (a scan costs the disk no
second read), and the marks of first reads are bounded; the queue is bounded.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from prometheus_client import generate_latest

from kvstore import arena_index
from kvstore.store import background_promotions
from tests.nvme_gets_support import (
    BLOCK,
    PREFIX,
    assert_gets_exact,
    corrupt,
    fill,
    lane_client,
    nvme_only,
    nvme_store,
    quiet,
    run_concurrently,
)

pytestmark = pytest.mark.usefixtures("compiled_kernels")  # clients read the NVMe files only once compiled

LANE = "shm-disk"  # an shm lane whose client reads NVMe-only blocks from the segment files


@pytest.fixture(autouse=True)
def small_blocks_promoted(monkeypatch):
    """These tests' 64 KiB blocks are promoted through an index of NVMe-only blocks too: the size rule
    (``INDEX_PROMOTE_MIN_BYTES``) has a test of its own, which sets it back."""
    monkeypatch.setattr(background_promotions, "INDEX_PROMOTE_MIN_BYTES", 0)


def disk_store(make_server, tmp_path, **options):
    return nvme_store(make_server, tmp_path, shm_direct=True, share_nvme=True, **options)


def queued(server) -> dict[str, int]:
    return server.store.stats()["queued_promotions"]


def settled(server, timeout: float = 20.0) -> dict[str, int]:
    """The queued promotions once every one is promoted or skipped (none waiting, none in flight)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        q = queued(server)
        if q["waiting"] == 0 and q["promoted"] + q["skipped"] == q["candidates"]:
            return q
        time.sleep(0.02)
    raise AssertionError(f"queued promotions still pending: {queued(server)}")


def room_in_dram(kv, data) -> None:
    """Delete the prefixes written last (those DRAM holds): room for promotions."""
    for keys, _ in data[4:]:
        kv.delete("t", keys)


def read_by_a_client_twice(store, keys: list[bytes]) -> None:
    """What two client reads of the files leave the store: leases with no bytes, ended with a touch."""
    for _ in range(2):
        store.release(store.acquire("t", keys, touch=False), touch=True)


def dram_rank(server) -> int:
    return server.store.top.rank


x86_only = pytest.mark.skipif(not arena_index.supported(), reason="the index is built on x86-64 only")
index_modes = [  # (--share-dram, --dram-index): every Get asked; found in the index beside the shared arena, or alone
    pytest.param(False, False, id="asked"),
    pytest.param(True, True, id="index", marks=x86_only),
    pytest.param(False, True, id="nvme-index", marks=x86_only),
]


@pytest.mark.parametrize(("share_dram", "dram_index"), index_modes)
def test_blocks_a_client_reads_from_nvme_come_back_to_dram(make_server, tmp_path, share_dram, dram_index):
    """Promoted, a block is withdrawn from an index of NVMe-only blocks: its next Get asks, and DRAM serves it."""
    server = disk_store(make_server, tmp_path, share_dram=share_dram, dram_index=dram_index)
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
        keys, blocks = data[0]
        assert nvme_only(server, keys) == PREFIX
        room_in_dram(kv, data)
        deadline = time.monotonic() + 20
        while nvme_only(server, keys) and time.monotonic() < deadline:  # a Get also carries the index's hits
            assert_gets_exact(kv, LANE, keys, blocks)
            time.sleep(0.05)
        assert nvme_only(server, keys) == 0
        assert set(server.store.lookup("t", keys)[1]) == {dram_rank(server)}
        disk_bytes = server.metrics.counters().get("lane_shm_disk_get_bytes", 0)
        assert_gets_exact(kv, LANE, keys, blocks)  # from DRAM now: the client reads no file
        assert server.metrics.counters().get("lane_shm_disk_get_bytes", 0) == disk_bytes
    q = settled(server)
    assert q["promoted"] >= PREFIX and q["candidates"] >= PREFIX
    scrape = generate_latest(server.metrics.registry).decode()
    assert f"kvstore_share_nvme_promotions_promoted_total {float(q['promoted'])}" in scrape
    top = server.store.top
    assert top.used_bytes <= server.store.high * top.capacity_bytes
    quiet(server)


def test_a_full_dram_tier_takes_only_its_room_and_evicts_nothing(make_server, tmp_path):
    server = disk_store(make_server, tmp_path)
    store, top = server.store, server.store.top
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
        keys, blocks = data[0]
        time.sleep(0.5)  # the demoter brought DRAM under its low watermark
        in_dram = [k for prefix, _ in data for k in prefix if store.lookup("t", [k])[1] == [top.rank]]
        evictions = store.counters.tiers[top.rank].evictions
        room = store.high * top.capacity_bytes - top.used_bytes
        assert in_dram and room < PREFIX * BLOCK
        for _ in range(2):  # read from the files twice: queued once the lane lets the second read's blocks go
            assert_gets_exact(kv, LANE, keys, blocks)
    q = settled(server)  # (with its next request, or here as it closes)
    assert q["candidates"] == PREFIX and q["promoted"] + q["skipped"] == PREFIX and q["skipped"] > 0
    assert q["promoted"] * BLOCK <= room
    assert store.counters.tiers[top.rank].evictions == evictions
    assert all(store.lookup("t", [k])[1] == [top.rank] for k in in_dram)  # every block DRAM held, still there
    assert top.used_bytes <= store.high * top.capacity_bytes
    quiet(server)


def test_a_corrupt_record_met_by_a_queued_promotion_is_dropped_alone(make_server, tmp_path):
    server = disk_store(make_server, tmp_path)
    store = server.store
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
        keys, blocks = data[0]
        room_in_dram(kv, data)
        corrupt(server, keys[5])
        read_by_a_client_twice(store, keys)
        q = settled(server)
        assert q["candidates"] == PREFIX and q["promoted"] == 0 and q["skipped"] == PREFIX  # the batch called off
        assert store.counters.corrupt >= 1
        assert store.lookup("t", keys)[0] == 5  # the damaged record is gone; nothing after it is a prefix hit
        rest = keys[:5] + keys[6:]
        deadline = time.monotonic() + 20
        while nvme_only(server, rest) and time.monotonic() < deadline:  # read from the files again: queued again
            assert_gets_exact(kv, LANE, rest, blocks[:5] + blocks[6:])
            time.sleep(0.05)
        assert nvme_only(server, rest) == 0
        assert_gets_exact(kv, LANE, rest, blocks[:5] + blocks[6:])
    settled(server)
    quiet(server)


def test_concurrent_gets_stay_exact_while_their_blocks_are_promoted(make_server, tmp_path):
    server = disk_store(make_server, tmp_path)
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
        room_in_dram(kv, data)

    def reader(i: int) -> None:
        keys, blocks = data[i % 2]
        with lane_client(server, LANE) as own:
            for _ in range(6):
                assert_gets_exact(own, LANE, keys, blocks)

    run_concurrently(reader, threads=4)
    q = settled(server)
    assert q["promoted"] > 0
    quiet(server)


def test_promote_on_hit_false_leaves_them_on_nvme(make_server, tmp_path):
    server = disk_store(make_server, tmp_path, promote_on_hit=False)
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
        keys, blocks = data[0]
        room_in_dram(kv, data)
        for _ in range(3):
            assert_gets_exact(kv, LANE, keys, blocks)
        time.sleep(0.6)  # a demoter pass or more
        assert nvme_only(server, keys) == PREFIX
    assert queued(server)["candidates"] == 0
    quiet(server)


def test_a_block_read_once_waits_for_a_second_read_and_the_oldest_marks_are_forgotten(
    make_server, tmp_path, monkeypatch
):
    """A promotion costs a second disk read: a prefix a client read once (a scan) costs none, one read again is
    promoted; only the latest ``READ_ONCE_MAX`` first reads are remembered."""
    server = disk_store(make_server, tmp_path, dram_index=False)  # every Get asked
    store = server.store
    monkeypatch.setattr(background_promotions, "READ_ONCE_MAX", 40)
    # the marks are under test, not the room: none is counted as skipped for want of it, however full DRAM is
    monkeypatch.setattr(background_promotions.BackgroundPromotions, "_room", lambda self: 1 << 40)
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
        room_in_dram(kv, data)
        (first, first_blocks), (second, second_blocks) = data[:2]
        assert_gets_exact(kv, LANE, first, first_blocks)  # their leases end as the Get returns (a TOUCH frame)
        assert_gets_exact(kv, LANE, second, second_blocks)  # 32 more marks: the first prefix's 24 oldest go
        deadline = time.monotonic() + 10
        while queued(server)["read_once"] != 40:
            assert time.monotonic() < deadline, queued(server)
            time.sleep(0.02)
        time.sleep(0.6)  # a promoter pass or more
        assert nvme_only(server, first) == PREFIX and queued(server)["candidates"] == 0
        read_by_a_client_twice(store, first)  # the 8 still marked are queued at once, the 24 forgotten next time
        q = settled(server)
        assert q["candidates"] == PREFIX and q["promoted"] + q["skipped"] == PREFIX and q["promoted"] > 0
    quiet(server)


def test_a_first_read_is_marked_even_without_room_and_its_reread_counted_as_skipped(make_server, tmp_path, monkeypatch):
    """Marks do not wait for room: a block read once while DRAM is full is a reread the next time, whenever that
    comes; with no room then, that reread is a candidate, skipped."""
    server = disk_store(make_server, tmp_path)
    store = server.store
    monkeypatch.setattr(background_promotions.BackgroundPromotions, "_room", lambda self: 0)
    with lane_client(server, LANE) as kv:
        keys, _ = fill(kv, 8)[0]
        store.release(store.acquire("t", keys, touch=False), touch=True)
        assert queued(server)["read_once"] == PREFIX and queued(server)["candidates"] == 0
        store.release(store.acquire("t", keys, touch=False), touch=True)
        q = queued(server)
        assert q["read_once"] == 0 and q["candidates"] == PREFIX and q["skipped"] == PREFIX and q["waiting"] == 0
    quiet(server)


def test_a_report_of_rereads_and_first_reads_marks_only_the_first_reads(make_server, tmp_path, monkeypatch):
    """Blocks read again are candidates and their marks go; the report's first reads are marked. (Marking the rereads
    again pushed older marks out, and made a third read of them a second candidate once the promoter had taken
    them off the queue: a test of the marks failed so, now and then.)"""
    server = disk_store(make_server, tmp_path)
    store = server.store
    monkeypatch.setattr(background_promotions.BackgroundPromotions, "_room", lambda self: 1 << 40)
    with lane_client(server, LANE) as kv:
        keys, _ = fill(kv, 8)[0]
        half = PREFIX // 2
        store.release(store.acquire("t", keys[:half], touch=False), touch=True)
        store.release(store.acquire("t", keys, touch=False), touch=True)
        q = settled(server)
        assert q["candidates"] == half and q["read_once"] == PREFIX - half
    quiet(server)


def test_a_block_named_twice_in_one_report_was_read_twice(make_server, tmp_path, monkeypatch):
    """A lane's report of its index's hits holds a first read with the reread that made it due: a candidate."""
    server = disk_store(make_server, tmp_path)
    store = server.store
    monkeypatch.setattr(background_promotions.BackgroundPromotions, "_room", lambda self: 1 << 40)
    with lane_client(server, LANE) as kv:
        first, second = [keys for keys, _ in fill(kv, 8)[:2]]
        store.touch("t", first)
        assert queued(server)["read_once"] == PREFIX and queued(server)["candidates"] == 0
        store.touch("t", second + second)
        q = settled(server)
        assert q["candidates"] == PREFIX and q["read_once"] == PREFIX  # the first prefix's marks still wait
    quiet(server)


@pytest.mark.parametrize(("share_dram", "dram_index"), index_modes[1:])
def test_an_index_lane_reports_a_first_read_with_its_batch_and_a_reread_at_once(
    make_server, tmp_path, share_dram, dram_index
):
    """A first read of a record from the files costs no frame of its own; the lane's second read of it goes at
    once, with the first, and the store promotes the prefix on it."""
    server = disk_store(make_server, tmp_path, share_dram=share_dram, dram_index=dram_index)
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
        (keys, blocks), (other, other_blocks) = data[0], data[1]
        room_in_dram(kv, data)
        assert_gets_exact(kv, LANE, other, other_blocks)  # asked: the store serves the namespace to this lane
        deadline = time.monotonic() + 10
        while queued(server)["read_once"] < PREFIX:  # that Get's own first read, marked once its frame is read
            assert time.monotonic() < deadline, queued(server)
            time.sleep(0.02)
        marks = queued(server)["read_once"]
        lane = kv._lanes.run(lambda lane: lane)  # noqa: SLF001 - the shm lane the client opened
        assert_gets_exact(kv, LANE, keys, blocks)
        assert lane.indexed.disk_hits == PREFIX
        time.sleep(0.2)
        assert queued(server)["read_once"] == marks and queued(server)["candidates"] == 0  # still in the batch
        assert_gets_exact(kv, LANE, keys, blocks)  # read again: due now
        deadline = time.monotonic() + 10
        while queued(server)["candidates"] < PREFIX:  # the frame went as the Get returned; the store reads it soon
            assert time.monotonic() < deadline, queued(server)
            time.sleep(0.02)
        q = settled(server)
        assert lane.indexed.disk_hits == 2 * PREFIX and q["candidates"] == PREFIX and q["promoted"] == PREFIX
        assert nvme_only(server, keys) == 0
    quiet(server)


@pytest.mark.parametrize(
    ("share_dram", "min_bytes", "promoted"), [(False, BLOCK + 1, 0), (False, BLOCK, PREFIX), (True, BLOCK + 1, PREFIX)]
)
def test_small_blocks_read_through_an_index_of_nvme_blocks_alone_stay_on_nvme(
    make_server, tmp_path, monkeypatch, share_dram, min_bytes, promoted
):
    """Promoted, a block leaves an index of NVMe-only blocks and its next Get is asked: blocks under
    ``INDEX_PROMOTE_MIN_BYTES`` read through such an index are not promoted; through ``--share-dram``'s index
    (which names DRAM copies too) they are."""
    monkeypatch.setattr(background_promotions, "INDEX_PROMOTE_MIN_BYTES", min_bytes)
    server = disk_store(make_server, tmp_path, share_dram=share_dram)
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
        keys = data[0][0]
        room_in_dram(kv, data)
        server.store.touch("t", keys + keys)  # what a lane's reread reports
        deadline = time.monotonic() + 10
        while queued(server)["promoted"] < promoted:
            assert time.monotonic() < deadline, queued(server)
            time.sleep(0.02)
        q = settled(server)
        assert q["candidates"] == promoted and nvme_only(server, keys) == PREFIX - promoted
    quiet(server)


def test_the_queue_is_bounded(make_server, tmp_path, monkeypatch):
    server = disk_store(make_server, tmp_path)
    store = server.store
    monkeypatch.setattr(background_promotions, "QUEUE_MAX", 8)
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
        keys, _ = data[0]
        room_in_dram(kv, data)
        read_by_a_client_twice(store, keys)  # 32 at once into a queue of 8
        q = settled(server)
    assert q["candidates"] == PREFIX and q["promoted"] == 8 and q["skipped"] == PREFIX - 8
    assert nvme_only(server, keys) == PREFIX - 8
    assert np.count_nonzero(np.asarray(store.table.leases)) == 0
    quiet(server)
