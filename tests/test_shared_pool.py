"""Gets into a client's shared pool (``NodeClient.shared_pool``): the store maps the client's sealed memfd and reads
NVMe blocks straight into it. Through a real server and a real NVMe tier: exact bytes with and without promotion,
a corrupt record failing alone with nothing unverified left in the pool, a pool changed before its blocks' promotion,
registrations the store must refuse, and Gets of the same blocks into two pools at once."""

from __future__ import annotations

import fcntl
import mmap
import os
import threading

import grpc
import numpy as np
import pytest

from kvstore import memops_jit, payload_runs
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.lanes import framing
from kvstore.lanes.server import pools
from kvstore.lanes.shared_pool import SharedPool
from kvstore.v1 import lanes_pb2 as lpb
from tests.nvme_gets_support import (
    BLOCK,
    PREFIX,
    lane_client,
    nvme_only,
    nvme_prefix_with_a_corrupt_block,
    prefix_on_nvme,
    quiet,
    run_concurrently,
    start_store,
)


@pytest.fixture(params=["huge", "small"])
def pool_pages(request, monkeypatch) -> str:
    """The store takes a pool as in huge pages (its NVMe reads land in place) or in 4 KiB pages (read into its
    staging, then copied in), whatever this host's shmem gives: both paths run everywhere."""
    real = pools.mapping_of

    def as_if(*args):
        why_not, _ = real(*args)
        return why_not, request.param == "huge"

    monkeypatch.setattr(pools, "mapping_of", as_if)
    return request.param


@pytest.fixture(params=["compiled", "general"])
def read_path(request, monkeypatch) -> str:
    """The NVMe tier's two ways of reading a Get's blocks: one compiled call a piece (``runs.py``: raw blocks bound for
    page-aligned memory, such as a pool in huge pages, staging or a promotion's slot) or record by record (the
    kernels still compiling, or no numba)."""
    if request.param == "compiled":
        if not memops_jit.AVAILABLE:
            pytest.skip("the compiled kernels need numba and a CPU with SSE4.2 and PCLMULQDQ")
        payload_runs.COMPILED.warm_up()
    else:
        monkeypatch.setattr(payload_runs, "ready", lambda: False)
    return str(request.param)


def took(server, read_path: str) -> None:
    """The store's NVMe reads went the way ``read_path`` chose (the tier counts its compiled pieces)."""
    compiled = int(server.store.tiers[-1].stats().extra["run_read_ios"])
    assert compiled > 0 if read_path == "compiled" else compiled == 0


def pooled_bytes(kv: Client) -> int:
    return int(kv.stats()["counters"].get("lane_shm_pool_get_bytes", 0))


def slots(pool: SharedPool, offset: int = 0) -> list[np.ndarray]:
    return [pool.array[offset + k * BLOCK : offset + (k + 1) * BLOCK] for k in range(PREFIX)]


@pytest.mark.parametrize("promote", [False, True])
def test_nvme_blocks_are_read_straight_into_a_shared_pool(make_server, tmp_path, promote, pool_pages, read_path):
    server = start_store(make_server, tmp_path, "shm-direct", promote)
    with lane_client(server, "shm-direct") as kv:
        keys, blocks = prefix_on_nvme(server, kv)
        pool = kv.shared_pool(PREFIX * BLOCK)
        pool.array[:] = 0x5A
        kv.get("t", keys, out=slots(pool))
        assert [s.tobytes() for s in slots(pool)] == [b.tobytes() for b in blocks]
        assert pooled_bytes(kv) == PREFIX * BLOCK  # every block read in place, none written by process_vm_writev
        took(server, read_path)
        quiet(server)
        left = nvme_only(server, keys)  # promoted as far as DRAM had free slots (no eviction is made for them)
        assert left < PREFIX if promote else left == PREFIX
        again = [np.zeros(BLOCK, np.uint8) for _ in keys]  # promoted or not, the store still serves them exactly
        kv.get("t", keys, out=again)
        assert [a.tobytes() for a in again] == [b.tobytes() for b in blocks]


def test_a_block_changed_in_the_pool_before_its_promotion_from_there_is_not_promoted(
    make_server, tmp_path, pool_pages, read_path
):
    server = start_store(make_server, tmp_path, "shm-direct", promote=True)
    with lane_client(server, "shm-direct") as kv:
        keys, blocks = prefix_on_nvme(server, kv)
        pool = kv.shared_pool(PREFIX * BLOCK)
        store = server.store
        release = store.release

        released = threading.Event()

        def scribble_then_release(leases, touch=False):  # the client writes its pool as soon as the reply is out
            pool.array[:BLOCK] = 0xEE
            release(leases, touch)
            released.set()

        store.release = scribble_then_release
        try:
            kv.get("t", keys, out=slots(pool))
            assert released.wait(10)  # the store releases after the reply, which the client may see first
        finally:
            store.release = release
        quiet(server)
        # slots go to the Get's blocks in order while DRAM has free ones: block 0 had one, as others did
        assert nvme_only(server, keys[1:]) < PREFIX - 1
        # read in place, its slot is filled from the pool after the reply: that copy did not match its CRC32C, so
        # it is left on NVMe alone; in small pages it was read into its slot and copied out of it: promoted
        assert nvme_only(server, keys[:1]) == (1 if pool_pages == "huge" else 0)
        took(server, read_path)
        again = [np.zeros(BLOCK, np.uint8) for _ in keys]
        kv.get("t", keys, out=again)
        assert [a.tobytes() for a in again] == [b.tobytes() for b in blocks]


def test_a_corrupt_record_fails_alone_and_leaves_nothing_unverified_in_the_pool(
    make_server, tmp_path, pool_pages, read_path
):
    server = start_store(make_server, tmp_path, "shm-direct", promote=False)
    with lane_client(server, "shm-direct") as kv:
        keys, blocks = nvme_prefix_with_a_corrupt_block(server, kv, 5)
        pool = kv.shared_pool(PREFIX * BLOCK)
        pool.array[:] = 0x5A
        with pytest.raises(KVStoreError) as err:
            kv.get("t", keys, out=slots(pool))
        assert err.value.code == grpc.StatusCode.DATA_LOSS
        if pool_pages == "huge":
            assert not slots(pool)[5].any()  # read there, failed its check, zeroed: no unverified byte is left
        else:
            assert (slots(pool)[5] == 0x5A).all()  # read into staging, failed its check: never copied in
        took(server, read_path)  # compiled: block 5 failed there and was read again record by record, and dropped
        quiet(server)
        got = kv.get("t", keys, out=slots(pool), allow_missing=True)
        assert got[5] is None  # dropped; the others come back exact
        assert all(s.tobytes() == b.tobytes() for k, (s, b) in enumerate(zip(slots(pool), blocks)) if k != 5)


def test_gets_of_the_same_nvme_blocks_into_two_pools_at_once(make_server, tmp_path, pool_pages, read_path):
    server = start_store(make_server, tmp_path, "shm-direct", promote=False)
    with lane_client(server, "shm-direct") as kv:
        keys, blocks = prefix_on_nvme(server, kv)
        pools = [kv.shared_pool(PREFIX * BLOCK) for _ in range(2)]

        def reader(i: int) -> None:
            for _ in range(5):
                pools[i].array[:] = 0
                kv.get("t", keys, out=slots(pools[i]))
                assert [s.tobytes() for s in slots(pools[i])] == [b.tobytes() for b in blocks]

        run_concurrently(reader, threads=2)
        assert pooled_bytes(kv) >= 10 * PREFIX * BLOCK
        took(server, read_path)
        quiet(server)


def test_a_buffer_outside_any_pool_is_written_as_before(make_server, tmp_path, pool_pages):
    server = start_store(make_server, tmp_path, "shm-direct", promote=False)
    with lane_client(server, "shm-direct") as kv:
        keys, blocks = prefix_on_nvme(server, kv)
        pool = kv.shared_pool(PREFIX // 2 * BLOCK)  # holds half the prefix: the rest goes to plain buffers
        out = slots(pool)[: PREFIX // 2] + [np.zeros(BLOCK, np.uint8) for _ in range(PREFIX // 2)]
        kv.get("t", keys, out=out)
        assert [o.tobytes() for o in out] == [b.tobytes() for b in blocks]
        assert pooled_bytes(kv) == PREFIX // 2 * BLOCK


# -- registrations the store refuses (a POOL frame sent by hand on a lane's channel) ------------------------


def channel_of(kv: Client):
    """The shm lane's channel and ref of ``kv`` (its first lane, opened now)."""
    kv.connect()
    lane = kv._lanes._idle[0]  # the test drives the lane's channel by hand
    return lane._channel, lane.ref


def offer(kv: Client, fd: int, address: int, length: int) -> str:
    channel, ref = channel_of(kv)
    return channel.send_pool(lpb.LanePool(lane=ref, fd=fd, address=address, length=length))


def test_the_store_refuses_memory_it_could_not_map_safely(make_server, tmp_path):
    server = make_server(shm_direct=True)
    with Client(f"127.0.0.1:{server.port}", timeout=30, lane="shm") as kv:
        pool = SharedPool(1 << 20)
        assert offer(kv, pool.fd, pool.address, pool.nbytes) == ""
        assert "overlaps" in offer(kv, pool.fd, pool.address, pool.nbytes)

        unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)  # could shrink under the store's mapping
        os.ftruncate(unsealed, 1 << 20)
        mapping = mmap.mmap(unsealed, 1 << 20)
        address = int(np.frombuffer(mapping, np.uint8).ctypes.data)
        assert "sealed" in offer(kv, unsealed, address, 1 << 20)

        os.close(unsealed)
    # on a lane of its own, where no pool is mapped yet: ``pool`` may lie right past ``other`` (mmap places them
    # side by side), and a range that reached it would be refused as an overlap before anything else was checked
    with Client(f"127.0.0.1:{server.port}", timeout=30, lane="shm") as kv:
        other = SharedPool(1 << 20, hugetlb=False)  # 1 MiB, not a huge page of 2; sealed, named at another address
        elsewhere = mmap.mmap(-1, 1 << 20)  # an address this process maps, with another file
        assert "does not map" in offer(kv, other.fd, int(np.frombuffer(elsewhere, np.uint8).ctypes.data), 1 << 20)
        assert "fewer than" in offer(kv, other.fd, other.address, 2 << 20)
        assert "whole pages" in offer(kv, other.fd, other.address + 1, 4096)
        assert "fd" in offer(kv, 999_999, other.address, 1 << 20)
        assert offer(kv, other.fd, other.address, other.nbytes) == ""  # the channel went on after each refusal
        for p in (pool, other):
            p.close()
        elsewhere.close()


def test_a_pool_frame_without_a_direct_lane_is_refused(make_server, tmp_path):
    server = make_server(shm_direct=True)
    with Client(f"127.0.0.1:{server.port}", timeout=30, lane="shm") as kv:
        channel, ref = channel_of(kv)
        bad = lpb.LanePool(
            lane=lpb.LaneRef(lane_id=ref.lane_id, token=b"x" * len(ref.token)), fd=1, address=0, length=0
        )
        assert channel.send_pool(bad)  # a wrong token: refused, and the channel goes on
        assert framing.POOL == 9
        pool = SharedPool(4096)
        assert channel.send_pool(lpb.LanePool(lane=ref, fd=pool.fd, address=pool.address, length=pool.nbytes)) == ""
        seals = fcntl.fcntl(pool.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL


def test_a_pool_is_sealed_whole_pages_and_says_what_pages_it_got():
    with SharedPool(5000) as pool:
        assert pool.nbytes % mmap.PAGESIZE == 0 and pool.nbytes >= 5000 and pool.array.nbytes == pool.nbytes
        seals = fcntl.fcntl(pool.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(OSError):
            os.ftruncate(pool.fd, 4096)  # what would fault the store's mapping
        assert isinstance(pool.huge_pages, bool)
    assert pool.fd == -1
    with pytest.raises(ValueError):
        SharedPool(0)


def free_hugetlb_bytes() -> int:
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    return int(info["HugePages_Free"]) * (int(info["Hugepagesize"].split()[0]) << 10)


@pytest.mark.skipif(free_hugetlb_bytes() < 4 << 20, reason="no free hugetlb pages (vm.nr_hugepages)")
def test_a_pool_in_hugetlb_pages_takes_the_reads_in_place(make_server, tmp_path, monkeypatch):
    seen: list[tuple[str, bool]] = []  # what the store found of the pool's mapping
    real = pools.mapping_of
    monkeypatch.setattr(pools, "mapping_of", lambda *args: seen.append(real(*args)) or seen[-1])
    server = start_store(make_server, tmp_path, "shm-direct", promote=False)
    with lane_client(server, "shm-direct") as kv:
        keys, blocks = prefix_on_nvme(server, kv)
        pool = kv.shared_pool(PREFIX * BLOCK)
        assert pool.huge_pages and pool.nbytes % (2 << 20) == 0
        kv.get("t", keys, out=slots(pool))
        assert [s.tobytes() for s in slots(pool)] == [b.tobytes() for b in blocks]
        assert pooled_bytes(kv) == PREFIX * BLOCK
        assert seen == [("", True)]  # in huge pages: read in place


def test_dram_hits_are_copied_into_a_shared_pool_with_their_checksums(make_server):
    """A direct Get's DRAM hits bound for a pool are copied through the store's mapping (CRC32C in the same pass),
    the rest written as before: a prefix the store holds in DRAM, half of it into a pool (its DRAM arena private:
    a shared one's hits the client copies itself)."""
    server = make_server(shm_direct=True, share_dram=False)
    with lane_client(server, "shm-direct") as kv:
        rng = np.random.default_rng(7)
        keys = [rng.bytes(16) for _ in range(PREFIX)]
        blocks = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(PREFIX)]
        assert all(r.ok for r in kv.put("t", keys, blocks, chained=False))
        pool = kv.shared_pool(PREFIX // 2 * BLOCK)
        for verify, alternate in ((True, False), (False, False), (True, True)):
            pool.array[:] = 0
            inside, plain = slots(pool)[: PREFIX // 2], [np.zeros(BLOCK, np.uint8) for _ in range(PREFIX // 2)]
            if alternate:  # pool slots and plain buffers in turn, the pool's in reverse order
                out = [b for pair in zip(inside[::-1], plain) for b in pair]
            else:
                out = inside + plain
            kv.get("t", keys, out=out, verify=verify)
            assert [o.tobytes() for o in out] == [b.tobytes() for b in blocks]
        assert pooled_bytes(kv) == 3 * (PREFIX // 2) * BLOCK
        other = kv.shared_pool(PREFIX // 2 * BLOCK)  # two pools in one Get, in turn
        out = [b for pair in zip(slots(pool)[: PREFIX // 2], slots(other)[: PREFIX // 2]) for b in pair]
        for o in out:
            o[:] = 0
        kv.get("t", keys, out=out)
        assert [o.tobytes() for o in out] == [b.tobytes() for b in blocks]
        assert pooled_bytes(kv) == 3 * (PREFIX // 2) * BLOCK + PREFIX * BLOCK


def test_huge_pages_likely_reads_shmem_enabled(monkeypatch):
    from kvstore.lanes import shared_pool

    monkeypatch.setattr(shared_pool, "_free_hugetlb_bytes", lambda: 0)
    assert not shared_pool.huge_pages_likely(1 << 30, "always within_size advise [never] deny force")
    assert not shared_pool.huge_pages_likely(1 << 30, "always within_size advise never [deny] force")
    for mode in ("always", "within_size", "advise", "force"):
        text = " ".join(f"[{m}]" if m == mode else m for m in "always within_size advise never deny force".split())
        assert shared_pool.huge_pages_likely(1 << 30, text)
    monkeypatch.setattr(shared_pool, "_free_hugetlb_bytes", lambda: 1 << 30)
    assert shared_pool.huge_pages_likely(1 << 30, "[never]")
    assert not shared_pool.huge_pages_likely((1 << 30) + 1, "[never]")  # a page short
