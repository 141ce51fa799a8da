"""Store-read Gets whose NVMe reads are handed on by the lane's thread while the tier's workers read
(``kvstore.tiers.nvme.pipeline``, a read of more pieces than readers), through a real server: the tier reads in
pieces of one record, so a 32 x 64 KiB prefix is 32 pieces for 4 readers. Exact bytes, a corrupt record failing
alone, concurrent Gets sharing the readers, and nothing left held afterwards."""

from __future__ import annotations

import pytest

from kvstore.client import KVStoreError
from kvstore.tiers.nvme.io import aligned_buffer
from tests.nvme_gets_support import (
    BLOCK,
    PREFIX,
    fill,
    get_into,
    lane_client,
    nvme_only,
    nvme_prefix_with_a_corrupt_block,
    quiet,
    run_concurrently,
    start_store,
)

LANE = "shm-direct"  # the lane that copies each verified piece into its client as it lands


def small_pieces(server) -> object:
    """Make the store's NVMe tier read one record a piece (the test sets the live tier's public setting)."""
    nvme = server.store.tiers[-1]
    nvme.max_read_bytes = 2 * BLOCK
    assert nvme.read_threads < PREFIX
    return nvme


@pytest.mark.parametrize("promote", [False, True], ids=["no-promote", "promote"])
def test_blocks_handed_on_piece_by_piece_come_back_exact(make_server, tmp_path, promote):
    server = start_store(make_server, tmp_path, LANE, promote=promote)
    nvme = small_pieces(server)
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
        for keys, blocks in data[:3]:
            assert nvme_only(server, keys) == PREFIX
            before = nvme.stats().extra["read_ios"]
            got = get_into(kv, LANE, keys)
            assert nvme.stats().extra["read_ios"] - before == PREFIX  # a piece a block: more than the readers
            assert [bytes(memoryview(g)) for g in got] == [b.tobytes() for b in blocks]
    quiet(server)


def test_a_corrupt_record_handed_on_fails_alone_and_is_dropped(make_server, tmp_path):
    server = start_store(make_server, tmp_path, LANE, promote=True)
    small_pieces(server)
    with lane_client(server, LANE) as kv:
        keys, blocks = nvme_prefix_with_a_corrupt_block(server, kv, 20)
        with pytest.raises(KVStoreError) as err:
            kv.get("t", keys, out=[aligned_buffer(BLOCK) for _ in keys])
        assert "DATA_LOSS" in str(err.value.code)
        assert server.store.lookup("t", [keys[20]])[0] == 0  # dropped
        rest = keys[:20] + keys[21:]
        got = get_into(kv, LANE, rest)
        assert [bytes(memoryview(g)) for g in got] == [b.tobytes() for b in blocks[:20] + blocks[21:]]
    quiet(server)


def test_concurrent_gets_share_the_readers(make_server, tmp_path):
    # four clients at once: their reads queue on the same four workers, and a Get none of whose workers has
    # started reads its pieces on the lane's own thread
    server = start_store(make_server, tmp_path, LANE, promote=True, dram=12 << 20)
    small_pieces(server)
    with lane_client(server, LANE) as kv:
        data = fill(kv, 8)
    prefixes = [(keys, [b.tobytes() for b in blocks]) for keys, blocks in data[:2]]
    assert all(nvme_only(server, keys) == PREFIX for keys, _ in prefixes)

    def reader(seed: int) -> None:
        with lane_client(server, LANE) as c:
            for k in range(6):
                keys, want = prefixes[(seed + k) % 2]
                assert [bytes(memoryview(g)) for g in get_into(c, LANE, keys)] == want

    run_concurrently(reader)
    quiet(server)
