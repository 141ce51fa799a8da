"""The index of NVMe-only blocks a store keeps without a shared DRAM arena (``--share-nvme`` on, ``--share-dram``
off: the default for a store with an NVMe tier and no tenants): which configurations make one, a --shm-dir with
no room for it (the store starts without it), and through a real in-process server and shm clients: Gets of
NVMe-only prefixes found there unasked, DRAM hits asked as before, and a client that cannot read the files
dropping the index. (``test_dram_index_disk.py`` runs its publisher and end-to-end tests in this mode too.)
"""

from __future__ import annotations

import errno
import os
import stat
import time

import pytest

from kvstore import arena_index
from kvstore.config import ServeConfig
from kvstore.lanes.client.disk import DiskReader
from kvstore.lanes.server import channel as server_channel
from kvstore.server.app import build_tiers
from kvstore.tiers.arena import ArenaTier
from tests.nvme_gets_support import (
    BLOCK,
    PREFIX,
    assert_gets_exact,
    fill,
    lane_client,
    nvme_only,
    nvme_store,
    quiet,
)

pytestmark = [
    pytest.mark.skipif(not arena_index.supported(), reason="the index is built on x86-64 only"),
    pytest.mark.usefixtures("compiled_kernels"),  # a client reads the NVMe files only once its runs are compiled
]

LANE = "shm-index"


def lane_of(kv):
    return kv._lanes.run(lambda lane: lane)  # noqa: SLF001 - the shm lane the client opened


def dram_tier(tmp_path, **options) -> ArenaTier:
    cfg = ServeConfig(
        **{
            "dram": 8 << 20,
            "nvme_dir": str(tmp_path / "nvme"),
            "nvme": 64 << 20,
            "nvme_segment": 16 << 20,
            "shm_dir": str(tmp_path),
            **options,
        }
    )
    tiers = build_tiers(cfg)
    for tier in tiers[1:]:
        tier.close()
    return tiers[0]  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("options", "alone"),
    [
        ({}, True),  # the default: --share-nvme auto (no tenants), no --share-dram
        ({"dram_index": False}, None),
        ({"share_nvme": "false"}, None),  # the store reads every NVMe block: nothing for clients to find
        ({"nvme_dir": None}, None),  # no NVMe tier
        ({"lanes": "tcp"}, None),  # no shm lane to read it
        ({"shm_direct": False}, None),  # no channel to report its hits on
        ({"share_dram": True}, False),  # the shared arena's index, naming its blocks too
    ],
)
def test_which_stores_keep_an_index_of_nvme_blocks_alone(tmp_path, options, alone):
    tier = dram_tier(tmp_path, **options)
    try:
        if alone is None:
            assert tier.index is None
            return
        assert tier.index is not None and tier.index_names_memory is not alone
        assert (tier.shared is None) is alone
        info = os.stat(tier.index.path)
        assert os.path.dirname(tier.index.path) == str(tmp_path) and stat.S_IMODE(info.st_mode) == 0o600
    finally:
        tier.close()


def test_a_shm_dir_without_room_for_it_leaves_the_store_without_one(tmp_path, monkeypatch, caplog):
    def full(directory, named_bytes):  # noqa: ANN001, ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(arena_index.ArenaIndex, "create", full)
    with caplog.at_level("WARNING", logger="kvstore.tiers.arena"):
        tier = dram_tier(tmp_path)
    try:
        assert tier.index is None
        assert "they ask the store for every Get" in caplog.text and "--shm-dir" in caplog.text
    finally:
        tier.close()


def test_nvme_only_prefixes_are_found_unasked_and_dram_hits_are_asked(make_server, tmp_path):
    server = nvme_store(make_server, tmp_path, shm_direct=True, share_nvme="auto", promote_on_hit=False)
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
        (keys, blocks), (warm_keys, warm_blocks) = data[0], data[-1]
        assert nvme_only(server, keys) == PREFIX and nvme_only(server, warm_keys) == 0
        lane = lane_of(kv)
        assert lane.dram is None and lane.indexed is not None  # no arena mapped: the index of NVMe's blocks alone
        assert_gets_exact(kv, LANE, keys, blocks)  # asked: the store serves the namespace to this lane
        named = server.metrics.counters()["lane_shm_disk_get_bytes"]
        assert lane.indexed.disk_hits == 0
        for _ in range(3):
            assert_gets_exact(kv, LANE, keys, blocks)
        assert lane.indexed.disk_hits == 3 * PREFIX
        assert server.metrics.counters()["lane_shm_disk_get_bytes"] == named  # the store named nothing more
        fallbacks = lane.indexed.fallbacks
        assert_gets_exact(kv, LANE, warm_keys, warm_blocks)  # DRAM hits: not named, so asked (written by the store)
        assert lane.indexed.fallbacks == fallbacks + 1 and lane.indexed.hits == 3 * PREFIX
        time.sleep(0.06)  # the hits go to the store with the next Get through the index, once 50 ms have passed
        assert_gets_exact(kv, LANE, keys, blocks)
        deadline = time.monotonic() + 10
        while server.metrics.counters().get("lane_shm_index_hits", 0) < 4 * PREFIX:
            assert time.monotonic() < deadline, server.metrics.counters()
            time.sleep(0.02)
    quiet(server)


def test_a_client_that_cannot_read_the_files_drops_the_index(make_server, tmp_path, monkeypatch):
    server = nvme_store(make_server, tmp_path, shm_direct=True, share_nvme="auto", promote_on_hit=False)
    opened = DiskReader.__init__
    elsewhere = str(tmp_path / "not-mounted")
    monkeypatch.setattr(DiskReader, "__init__", lambda self, directory, *a, **k: opened(self, elsewhere, *a, **k))
    with lane_client(server, LANE) as kv:
        keys, blocks = fill(kv, 8)[0]
        assert lane_of(kv).indexed is not None
        for _ in range(3):
            assert_gets_exact(kv, LANE, keys, blocks)
        lane = lane_of(kv)
        assert lane.disk is None and lane.indexed is None  # it names nothing this lane can read
        assert server.metrics.counters().get("lane_shm_direct_get_bytes", 0) >= 2 * PREFIX * BLOCK
    quiet(server)


def test_the_hits_a_lane_reports_as_it_closes_are_counted_before_it_is_gone(make_server, tmp_path, monkeypatch):
    """A lane's last hits go in a TOUCH frame as it closes, and its CloseLane is served by another of the store's
    threads: closing waits for the store to have read the channel (its end closes), so none is lost, even when
    the store reads that frame late (here 0.2 s)."""
    touch = server_channel._touch  # noqa: SLF001 - slowed, as on a loaded store

    def late(*args):  # noqa: ANN002, ANN202
        time.sleep(0.2)
        return touch(*args)

    monkeypatch.setattr(server_channel, "_touch", late)
    server = nvme_store(make_server, tmp_path, shm_direct=True, share_nvme="auto", promote_on_hit=False)
    for round_ in range(2):
        with lane_client(server, LANE) as kv:
            if round_ == 0:
                keys, blocks = fill(kv, 8)[0]
            assert_gets_exact(kv, LANE, keys, blocks)  # asked: the namespace is this lane's to read through the index
            reported = server.metrics.counters().get("lane_shm_index_hits", 0)
            channel = lane_of(kv)._channel  # noqa: SLF001 - held back: the hits wait for the lane's close
            channel.send_touch = lambda touch: False
            assert_gets_exact(kv, LANE, keys, blocks)
            assert lane_of(kv).indexed.disk_hits == PREFIX
            del channel.send_touch
        assert server.metrics.counters().get("lane_shm_index_hits", 0) == reported + PREFIX
    quiet(server)
