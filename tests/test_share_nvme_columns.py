"""A ``--share-nvme`` Get whose blocks are all only on NVMe comes back as one message of columns (``DiskBlocks``),
not a descriptor a block: through a real store on a loopback port, with the client reading the segment files.
Checked here: which form each kind of Get gets, that an older client (no ``disk_columns``) still gets
descriptors, that a buffer too short fails before anything is read and gives its grant back, and that columns
that do not add up are refused."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from kvstore.client import KVStoreError
from kvstore.lanes.client import disk_gets, shm_get
from kvstore.lanes.client.disk_gets import DiskColumns
from kvstore.tiers.nvme.io import aligned_buffer
from kvstore.v1 import lanes_pb2 as lpb
from tests.nvme_gets_support import BLOCK, PREFIX, assert_gets_exact, fill, lane_client, nvme_only, nvme_store, quiet

pytestmark = pytest.mark.usefixtures("compiled_kernels")  # clients read the NVMe files only once compiled


@pytest.fixture
def server(make_server, tmp_path):
    return nvme_store(make_server, tmp_path, promote_on_hit=False, share_nvme=True, shm_direct=True)


@pytest.fixture
def forms(monkeypatch) -> list[str]:
    """How the client took each message's disk blocks: "columns" or "descriptors"."""
    seen: list[str] = []
    of_message, of_descriptors = DiskColumns.of_message, DiskColumns.of_descriptors
    monkeypatch.setattr(DiskColumns, "of_message", lambda *a: seen.append("columns") or of_message(*a))
    monkeypatch.setattr(DiskColumns, "of_descriptors", lambda *a: seen.append("descriptors") or of_descriptors(*a))
    return seen


def test_a_get_of_blocks_all_on_nvme_is_named_in_one_message_of_columns(server, forms):
    with lane_client(server, "shm-disk") as kv:
        data = fill(kv, 8)
        keys, blocks = data[0]
        assert nvme_only(server, keys) == PREFIX
        assert_gets_exact(kv, "shm-disk", keys, blocks)
        assert forms == ["columns"]
        dram_keys, dram_blocks = data[-1]  # a prefix DRAM still holds, half of it beside half of the first
        mixed = keys[:16] + dram_keys[:16]
        assert_gets_exact(kv, "shm-disk", mixed, blocks[:16] + dram_blocks[:16])
        assert forms == ["columns", "descriptors"]  # DRAM hits beside them: a descriptor a block, as before
    assert server.metrics.counters()["lane_shm_disk_get_bytes"] == (PREFIX + 16) * BLOCK
    quiet(server)


def test_an_older_client_without_disk_columns_still_gets_descriptors(server, forms, monkeypatch):
    replies = shm_get.ShmGets._replies

    def older(self, request: lpb.LaneGetRequest):  # a client from before the field: it never sets it
        request.disk_columns = False
        return replies(self, request)

    monkeypatch.setattr(shm_get.ShmGets, "_replies", older)
    with lane_client(server, "shm-disk") as kv:
        keys, blocks = fill(kv, 8)[0]
        assert_gets_exact(kv, "shm-disk", keys, blocks)
    assert forms == ["descriptors"]
    quiet(server)


def test_a_lane_past_its_budget_gets_descriptors_and_the_store_reads_the_rest(make_server, tmp_path, forms):
    server = nvme_store(
        make_server, tmp_path, promote_on_hit=False, share_nvme=True, shm_direct=True, shm_lane_bytes=1 << 20,
        max_block=BLOCK,
    )  # fmt: skip
    with lane_client(server, "shm-disk") as kv:
        keys, blocks = fill(kv, 8)[0]
        assert_gets_exact(kv, "shm-disk", keys, blocks)
    assert "columns" not in forms
    assert 0 < server.metrics.counters()["lane_shm_disk_get_bytes"] < PREFIX * BLOCK
    quiet(server)


def test_a_buffer_too_short_fails_before_any_read_and_gives_its_grant_back(server, forms, monkeypatch):
    reads: list[int] = []
    read_runs = disk_gets._read_runs
    monkeypatch.setattr(disk_gets, "_read_runs", lambda *a: reads.append(1) or read_runs(*a))
    with lane_client(server, "shm-disk") as kv:
        data = fill(kv, 8)
        keys, blocks = data[0]
        out = [aligned_buffer(BLOCK) for _ in keys]
        out[7] = out[7][: BLOCK - 4096]
        with pytest.raises(KVStoreError) as err:
            kv.get("t", keys, out=out)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "7" in str(err.value)
        assert forms == ["columns"] and not reads
        dram_keys, dram_blocks = data[-1]
        assert_gets_exact(kv, "shm-disk", dram_keys, dram_blocks)  # carries the release of the failed Get's grant
        deadline = time.monotonic() + 10
        while int(np.asarray(server.store.table.leases).sum()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert int(np.asarray(server.store.table.leases).sum()) == 0  # no lease left with the client still there
        assert_gets_exact(kv, "shm-disk", keys, blocks)
    quiet(server)


def test_columns_that_do_not_add_up_are_refused():
    good = lpb.DiskBlocks(index=[0, 1], files=["seg-0000000001.log"], file=[0, 0], offset=[4096, 73728],
                          length=[BLOCK, BLOCK], crc32c=[1, 2])  # fmt: skip
    columns = DiskColumns.of_message(good, 3)
    assert columns.positions.tolist() == [3, 4] and columns.files == ["seg-0000000001.log"]
    for bad in (
        lpb.DiskBlocks(index=[0, 1], files=["seg-0000000001.log"], file=[0, 1], offset=[0, 0], length=[1, 1],
                       crc32c=[0, 0]),  # a file index past the names
        lpb.DiskBlocks(index=[0, 1], files=["seg-0000000001.log"], file=[0], offset=[0, 0], length=[1, 1],
                       crc32c=[0, 0]),  # a column short
    ):  # fmt: skip
        with pytest.raises(KVStoreError) as err:
            DiskColumns.of_message(bad, 0)
        assert err.value.code == grpc.StatusCode.INTERNAL


def test_a_store_failing_to_name_the_blocks_fails_the_get_and_keeps_no_lease(server, monkeypatch):
    from kvstore.lanes.server.disk_names import DiskNames

    def broken(self, window):
        raise RuntimeError("a segment could not be pinned")

    with lane_client(server, "shm-disk") as kv:
        keys, blocks = fill(kv, 8)[0]
        with monkeypatch.context() as patch:
            patch.setattr(DiskNames, "name", broken)
            with pytest.raises(KVStoreError) as err:
                kv.get("t", keys, out=[aligned_buffer(BLOCK) for _ in keys])
            assert "segment could not be pinned" in str(err.value)
        assert int(np.asarray(server.store.table.leases).sum()) == 0  # with the client still there
        assert_gets_exact(kv, "shm-disk", keys, blocks)  # the lane lives on
    quiet(server)
