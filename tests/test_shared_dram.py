"""The shared DRAM arena (``serve --share-dram``): shm Gets name DRAM hits where they lie, the client copies them.

Real in-process servers and clients on loopback. Checked: the bytes (plain buffers and Segments), that the
server named them in the arena rather than copying them, that their leases last until the client releases
the message's grant (its next request) and end when the client goes, the pin budget (past it blocks are
copied through the region as before), a corrupt DRAM block caught by the client's own CRC32C, NVMe blocks
beside DRAM ones in one Get, and the arena file removed when the store stops.
"""

from __future__ import annotations

import os
import time

import grpc
import numpy as np
import pytest

from kvstore.client import Client, KVStoreError, Segments
from kvstore.lanes.server.shm import ShmServerLane
from kvstore.lanes.server.shm_get import ShmGets
from kvstore.tiers.arena import SHARED_PREFIX, ArenaTier
from tests.test_lanes_support import keys

pytestmark = pytest.mark.usefixtures("compiled_kernels")  # clients read the NVMe files only once compiled

MiB = 1 << 20


def blocks(n: int, size: int = MiB, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def shm_lanes(server) -> list[ShmServerLane]:
    return [lane for lane in server.lanes.registry._lanes.values() if isinstance(lane, ShmServerLane)]  # noqa: SLF001


def counter(server, name: str, settle: float = 5.0) -> float:
    """A server counter once the Get that adds it has ended (the server counts after its last reply)."""
    deadline = time.monotonic() + settle
    while name not in server.metrics.counters() and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.metrics.counters().get(name, 0)


def leased(server, expect: int | None = None, settle: float = 5.0) -> int:
    """Leases held in the store; with ``expect``, once they reach it (leases a Get's request released end
    after that Get's reply, so a moment after the client has it)."""
    deadline = time.monotonic() + settle
    while expect is not None and int(server.store.table.leases.sum()) != expect and time.monotonic() < deadline:
        time.sleep(0.01)
    return int(server.store.table.leases.sum())


def dram_arena(server) -> ArenaTier:
    return next(t for t in server.store.tiers if isinstance(t, ArenaTier) and t.shared is not None)


@pytest.fixture
def shared(make_server):
    return make_server(
        share_dram=True, dram_index=False
    )  # every Get asked of the store (tests/test_dram_index.py: the index)


def test_dram_hits_are_named_in_the_arena_and_copied_once_by_the_client(shared):
    data = blocks(8)
    with Client(f"127.0.0.1:{shared.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", keys(8), data)
        out = [np.zeros(MiB, np.uint8) for _ in data]
        got = kv.get("ns", keys(8), out=out)
        assert all(g is o for g, o in zip(got, out))
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        assert counter(shared, "lane_shm_dram_get_bytes") == 8 * MiB  # none copied by the server
        assert "lane_shm_direct_get_bytes" not in shared.metrics.counters()
        assert leased(shared) == 8  # held until the client releases the grant with its next request
        kv.get("ns", keys(1), out=out[:1])
        assert leased(shared, 1) == 1
    assert leased(shared, 0) == 0  # the client closed its lane: nothing stays pinned


def named_gets(monkeypatch) -> list[int]:
    """Counts the Gets the store answers with one message of ``NamedBlocks`` columns (their block counts)."""
    seen: list[int] = []
    original = ShmGets._get_named  # noqa: SLF001

    def counted(self, leases, offsets, ended):
        seen.append(len(leases))
        return original(self, leases, offsets, ended)

    monkeypatch.setattr(ShmGets, "_get_named", counted)
    return seen


def test_an_all_dram_get_is_named_as_columns_and_a_partial_one_by_descriptors(shared, monkeypatch):
    seen = named_gets(monkeypatch)
    data = blocks(6, 64 << 10)
    with Client(f"127.0.0.1:{shared.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", keys(6), data)
        out = [np.zeros(64 << 10, np.uint8) for _ in data]
        kv.get("ns", keys(6), out=out)
        assert seen == [6] and all(np.array_equal(a, b) for a, b in zip(out, data))
        wanted = keys(6)[:3] + [b"\x07" * 16]  # one never stored: the general path names the rest
        got = kv.get("ns", wanted, out=out[:4], allow_missing=True)
        assert seen == [6] and got[3] is None and all(np.array_equal(a, b) for a, b in zip(out[:3], data))
        kv.get("ns", keys(1), out=out[:1])
        assert leased(shared, 1) == 1  # both earlier Gets' pins ended with the requests after them


def test_a_refused_get_still_ends_the_leases_it_releases(shared):
    data = blocks(4)
    with Client(f"127.0.0.1:{shared.port}", lane="shm", timeout=30, retries=0) as kv:
        kv.put("ns", keys(4), data)
        out = [np.zeros(MiB, np.uint8) for _ in data]
        kv.get("ns", keys(4), out=out)
        assert leased(shared) == 4
        with pytest.raises(KVStoreError) as err:
            kv.get("ns", [b"short"], out=out[:1])  # refused: a hash is 16 bytes
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert leased(shared, 0) == 0  # the refused request carried the release of the first Get's grant


def test_segments_are_filled_from_the_arena(shared):
    data = blocks(3, 3 * 49152)
    with Client(f"127.0.0.1:{shared.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", keys(3), data)
        outs = [Segments([np.zeros(49152, np.uint8) for _ in range(3)]) for _ in data]
        kv.get("ns", keys(3), out=outs)
        assert [bytes(o.join()) for o in outs] == [d.tobytes() for d in data]
        assert counter(shared, "lane_shm_dram_get_bytes") == 3 * 3 * 49152


def test_a_get_without_out_buffers_copies_through_the_region(shared):
    data = blocks(2)
    with Client(f"127.0.0.1:{shared.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", keys(2), data)
        assert [bytes(b) for b in kv.get("ns", keys(2))] == [d.tobytes() for d in data]
        assert counter(shared, "lane_shm_get_bytes") == 2 * MiB
        assert "lane_shm_dram_get_bytes" not in shared.metrics.counters()


def test_past_the_pin_budget_blocks_go_through_the_region(make_server):
    server = make_server(share_dram=True, dram_index=False, shm_lane_bytes=4 * MiB, max_block=2 * MiB)
    data = blocks(10)
    with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", keys(10), data)
        out = [np.zeros(MiB, np.uint8) for _ in data]
        kv.get("ns", keys(10), out=out)
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        named = counter(server, "lane_shm_dram_get_bytes")
        # at most the budget (the lane's region size) pinned at once: the rest copied into the region, and
        # the second round (after the region filled) names more once the first round's grants are released
        assert 4 * MiB <= named < 10 * MiB
        assert counter(server, "lane_shm_get_bytes") == 10 * MiB
        assert all(lane.pins is not None and lane.pins.pinned_bytes <= 4 * MiB for lane in shm_lanes(server))


def test_a_corrupt_dram_block_fails_the_clients_check(shared):
    data = blocks(3)
    with Client(f"127.0.0.1:{shared.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", keys(3), data)
        arena = dram_arena(shared)
        view = np.frombuffer(arena.view(0, arena.capacity_bytes), dtype=np.uint8)
        at = np.flatnonzero(view[: 4 * MiB] != 0)[0]  # a byte of a stored block
        view[at] ^= 0xFF
        out = [np.zeros(MiB, np.uint8) for _ in data]
        with pytest.raises(KVStoreError) as err:
            kv.get("ns", keys(3), out=out)
        assert err.value.code == grpc.StatusCode.DATA_LOSS
        view[at] ^= 0xFF
        kv.get("ns", keys(3), out=out)
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        assert leased(shared, 3) == 3  # the failed Get's pins ended with the next request, not at the lane's close


@pytest.mark.parametrize("share_nvme", ["false", "auto"])
def test_nvme_and_dram_blocks_in_one_get(make_server, tmp_path, share_nvme):
    server = make_server(
        share_dram=True,
        dram=8 * MiB,
        nvme_dir=str(tmp_path),
        nvme=256 * MiB,
        nvme_segment=16 * MiB,
        max_block=MiB,
        share_nvme=share_nvme,
    )
    data = blocks(24, 512 << 10)
    with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", keys(24), data)
        _, tiers = kv.lookup_tiers("ns", keys(24))
        assert "nvme" in tiers and "dram" in tiers  # leaf-first demotion left the tail on NVMe
        out = [np.zeros(512 << 10, np.uint8) for _ in data]
        kv.get("ns", keys(24), out=out)
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        assert counter(server, "lane_shm_dram_get_bytes") > 0  # DRAM hits named in the arena
        if share_nvme == "false":
            assert counter(server, "lane_shm_direct_get_bytes") > 0  # NVMe reads written into our buffers by the store
        else:  # the default, with no --tenants: the client read the NVMe blocks from the segment files itself
            assert counter(server, "lane_shm_disk_get_bytes") > 0
            assert server.metrics.counters().get("lane_shm_direct_get_bytes", 0) == 0
    assert leased(server, 0) == 0


def test_the_arena_file_goes_with_the_store(make_server):
    server = make_server(share_dram=True)
    path = dram_arena(server).shared.path  # type: ignore[union-attr]
    assert os.path.basename(path).startswith(SHARED_PREFIX) and os.stat(path).st_mode & 0o777 == 0o600
    server.stop(0)
    server.store.close()
    assert not os.path.exists(path)
