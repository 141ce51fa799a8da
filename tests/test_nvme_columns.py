"""A direct shm Get of raw blocks that NVMe holds, answered in columns (``ShmGets._get_read_written``): the
blocks are read, written into the client's buffers as their reads are verified, and described in one
``WrittenBlocks`` message, with no descriptor a block. Through a real server and client; the rest of what such
a Get must keep (corrupt records, killed clients, concurrent Gets) is in test_nvme_gets.py, whose direct lane
takes this path too."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kvstore.client import KVStoreError
from kvstore.lanes.server import shm_get_columns
from kvstore.lanes.server.storeops import StoreOps
from kvstore.lanes.server.written import columns_reply
from kvstore.store.leases import lease_windows
from kvstore.tiers.nvme.io import aligned_buffer
from tests.nvme_gets_support import BLOCK, PREFIX, fill, lane_client, nvme_only, quiet, start_store


@pytest.fixture
def columns_seen(monkeypatch) -> list[list[int]]:
    """The block indices of every columns reply the lane builds for a Get that read blocks from NVMe."""
    seen: list[list[int]] = []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003 (the lane's own arguments, passed on)
        reply = columns_reply(*args, **kwargs)
        seen.append(list(reply.written.index))
        return reply

    monkeypatch.setattr(shm_get_columns, "columns_reply", spy)
    return seen


@pytest.mark.parametrize("promote", [False, True], ids=["no-promote", "promote"])
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_dram_hits_and_nvme_blocks_over_several_windows_come_back_in_one_columns_message(
    make_server, tmp_path, monkeypatch, columns_seen, promote, verify
):
    # windows of 1 MiB: a 32-block Get of 64 KiB blocks is read, written and its leases ended in two
    monkeypatch.setattr(StoreOps, "windows", staticmethod(functools.partial(lease_windows, budget=1 << 20)))
    server = start_store(make_server, tmp_path, "shm-direct", promote)
    with lane_client(server, "shm-direct") as kv:
        data = fill(kv, 8)
        cold_keys, cold = data[0]
        hot_keys, hot = data[-1]
        assert nvme_only(server, cold_keys) == PREFIX and nvme_only(server, hot_keys[:8]) < 8  # DRAM hits too
        keys = cold_keys[:12] + hot_keys[:8] + cold_keys[12:24]  # NVMe, DRAM, NVMe: both kinds in each window
        want = cold[:12] + hot[:8] + cold[12:24]
        out = [aligned_buffer(BLOCK) for _ in keys]
        kv.get("t", keys, out=out, verify=verify)
        assert columns_seen == [list(range(len(keys)))]
        for g, b in zip(out, want):
            assert bytes(memoryview(g)) == b.tobytes()
    quiet(server)
    assert server.metrics.counters()["lane_shm_direct_get_bytes"] >= len(keys) * BLOCK


def test_a_buffer_too_small_for_its_nvme_block_is_refused_before_anything_is_read(make_server, tmp_path):
    server = start_store(make_server, tmp_path, "shm-direct", promote=True)
    with lane_client(server, "shm-direct") as kv:
        keys, blocks = fill(kv, 8)[0]
        assert nvme_only(server, keys) == PREFIX
        nvme = server.store.tiers[-1]
        read = nvme.stats().extra["read_bytes"]
        out = [aligned_buffer(BLOCK) for _ in keys]
        out[5] = np.zeros(BLOCK - 4096, dtype=np.uint8)
        with pytest.raises(KVStoreError) as err:
            kv.get("t", keys, out=out)
        assert "INVALID_ARGUMENT" in str(err.value.code) and "output buffer 5" in str(err.value)
        assert nvme.stats().extra["read_bytes"] == read  # nothing read
        assert nvme_only(server, keys) == PREFIX  # nothing promoted
        out[5] = aligned_buffer(BLOCK)
        kv.get("t", keys, out=out)
        for g, b in zip(out, blocks):
            assert bytes(memoryview(g)) == b.tobytes()
    quiet(server)
