"""A shm lane's region is reserved as it is granted, not all at its opening: the first ``RESERVE_STEP`` at once,
more before any range past it is handed out, and a shm directory that cannot give more fails that grant with its
reason (never a SIGBUS later). The allocator's rule as a property; the region on real files; a real lane."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.client import Client, KVStoreError
from kvstore.lanes.server.grants import ALIGN, RangeAllocator
from kvstore.lanes.shm_region import RESERVE_STEP, ShmRegion
from tests.test_lanes_support import keys

MiB = 1 << 20


SIZE = 16 * ALIGN


def first_fit(held: list[tuple[int, int]], need: int) -> int | None:
    """Where a first-fit allocator over ``SIZE`` bytes puts ``need`` bytes beside the ``held`` ranges."""
    at = 0
    for offset, length in sorted(held):
        if offset - at >= need:
            return at
        at = offset + length
    return at if SIZE - at >= need else None


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.one_of(st.tuples(st.integers(1, 6 * ALIGN), st.booleans()), st.just(None)), max_size=60),
    limit=st.integers(0, 24).map(lambda pages: pages * ALIGN),
)
def test_no_range_is_handed_out_past_what_was_reserved(ops: list[tuple[int, bool] | None], limit: int) -> None:
    reserved = [0]

    def reserve(end: int) -> bool:
        if end > limit:  # the shm directory is full past ``limit``
            return False
        reserved[0] = max(reserved[0], end)
        return True

    alloc = RangeAllocator(SIZE, reserve=reserve)
    held: list[tuple[int, int]] = []
    for op in ops:
        if op is None:
            if held:
                alloc.free(held.pop(0)[0])
            continue
        nbytes, written = op
        need = -(-nbytes // ALIGN) * ALIGN
        expected = first_fit(held, need)
        was = reserved[0]
        offset = alloc.allocate(nbytes, written)
        if expected is None or (written and expected + need > limit):  # no room, or no pages: refused, none taken
            assert offset is None
            continue
        assert offset == expected
        if written:
            assert offset + need <= reserved[0] <= limit
        else:  # a range nobody writes (a direct Put's) reserves nothing
            assert reserved[0] == was
        held.append((offset, need))
    assert alloc.used_bytes == sum(n for _, n in held)


def _allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_a_region_reserves_in_steps_and_says_why_it_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    region = ShmRegion.create("/dev/shm", 4 * RESERVE_STEP, reserved=RESERVE_STEP)
    try:
        assert os.stat(region.path).st_size == 4 * RESERVE_STEP and _allocated(region.path) == RESERVE_STEP
        assert region.reserve(RESERVE_STEP) and _allocated(region.path) == RESERVE_STEP  # already there
        assert region.reserve(RESERVE_STEP + 1) and region.reserved == 2 * RESERVE_STEP
        assert _allocated(region.path) == 2 * RESERVE_STEP

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        with monkeypatch.context() as patched:
            patched.setattr(os, "posix_fallocate", full)
            assert not region.reserve(3 * RESERVE_STEP) and region.reserved == 2 * RESERVE_STEP
        assert "could not reserve more of it: No space left on device" in region.reserve_failure
        assert region.reserve(3 * RESERVE_STEP) and region.reserve_failure == ""  # room again: no stale reason
    finally:
        region.close()
    assert not region.reserve(4 * RESERVE_STEP)  # closed: nothing more
    whole = ShmRegion.create("/dev/shm", RESERVE_STEP)  # the default: all of it at once (the DRAM arena's way)
    try:
        assert _allocated(whole.path) == RESERVE_STEP and whole.reserve(RESERVE_STEP)
    finally:
        whole.close()


def _lane_regions() -> dict[tuple[int, int], int]:
    """Bytes reserved in each shm lane region this process (its in-process stores and clients) holds open."""
    sizes: dict[tuple[int, int], int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "kvstore-lane-" in Path(target).name:
            sizes[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sizes


def test_a_lane_reserves_what_its_grants_use(make_server) -> None:
    server = make_server(dram=256 * MiB, shm_lane_bytes=256 * MiB, shm_direct=False)  # every byte through the region
    before = _lane_regions()
    blocks = [os.urandom(4 * MiB) for _ in range(10)]
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        kv.connect()
        opened = {k: v for k, v in _lane_regions().items() if k not in before}  # other tests' may be open still
        assert list(opened.values()) == [RESERVE_STEP]  # not the 256 MiB
        assert all(r.status == "stored" for r in kv.put("ns", keys(10), blocks))  # one grant of 40 MiB
        assert [bytes(b) for b in kv.get("ns", keys(10))] == blocks
        (grown,) = (v for k, v in _lane_regions().items() if k in opened)
        assert 40 * MiB <= grown <= 48 * MiB  # what the grants reached, in steps


def test_a_direct_lane_reserves_nothing_past_its_first_step(make_server) -> None:
    """A direct Put's ranges are never written (the store reads the client's memory) and a direct Get takes none."""
    import numpy as np

    server = make_server(dram=256 * MiB, shm_lane_bytes=256 * MiB)
    blocks = [np.full(2 * MiB, i, dtype=np.uint8) for i in range(24)]  # 48 MiB in one reserve
    before = _lane_regions()
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        assert all(r.ok for r in kv.put("ns", keys(24), blocks))
        out = [np.empty(2 * MiB, dtype=np.uint8) for _ in blocks]
        kv.get("ns", keys(24), out=out)
        assert all((o == b).all() for o, b in zip(out, blocks))
        assert server.metrics.counters()["lane_shm_direct_put_bytes"] == 48 * MiB
        assert [v for k, v in _lane_regions().items() if k not in before] == [RESERVE_STEP]


def test_a_full_shm_directory_fails_only_what_does_not_fit(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the first step the shm directory is full: what fits goes by the lane, a Get or Put that cannot fit goes
    by gRPC on an auto lane and fails naming the cause on an explicit one; every byte that comes back is exact."""
    real = os.posix_fallocate

    def full_past_the_first_step(fd: int, offset: int, length: int) -> None:
        if offset >= RESERVE_STEP:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full_past_the_first_step)
    server = make_server(dram=256 * MiB, shm_lane_bytes=256 * MiB, shm_direct=False, max_block=32 * MiB)
    target = f"127.0.0.1:{server.port}"
    small = [os.urandom(6 * MiB) for _ in range(4)]
    big = os.urandom(20 * MiB)  # no grant of the first step can hold it
    with Client(target, retries=0) as kv:
        assert all(r.status == "stored" for r in kv.put("ns", keys(4)[:2], small[:2]))  # fits: by the lane
        assert kv.last_lane == "shm"
        assert all(
            r.ok for r in kv.put("ns", keys(4)[2:] + keys(1, seed=9), small[2:] + [big])
        )  # some before the lane broke
        assert [bytes(b) for b in kv.get("ns", keys(4) + keys(1, seed=9))] == small + [big]
        assert kv.last_lane == "grpc"  # by gRPC, now and for a while
    with Client(target, lane="shm", retries=0) as kv, pytest.raises(KVStoreError) as err:
        kv.get("ns", keys(1, seed=9))
    assert "could not reserve more of it: No space left on device" in str(err.value)
    server.store.check_invariants()


def test_lane_open_bench_measures_both_kinds_and_the_memory_held() -> None:
    from tqdm import tqdm

    from bench import lane_open

    shm, tcp = lane_open.measure(2, 2, tqdm(disable=True))  # each client checks the bytes it got back
    assert (shm["lane"], tcp["lane"]) == ("shm", "tcp") and shm["connect_ms"] > 0 and tcp["grpc_ms"] > 0
    assert shm["region_mib_total"] == 512 and "shm_mib_held" in shm  # /dev/shm is shared with parallel tests: the
    # figure itself is the bench's to report; test_a_lane_reserves_what_its_grants_use checks a lane's own region


def test_a_lane_that_fails_to_start_leaves_no_region_behind(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.lanes.server import servicer

    def broken(*args: object) -> None:
        raise RuntimeError("the lane's set-up failed")

    monkeypatch.setattr(servicer, "ShmServerLane", broken)
    server = make_server()
    mine = f"kvstore-lane-{os.getpid()}-"
    names, fds = {n for n in os.listdir("/dev/shm") if n.startswith(mine)}, _lane_regions()
    with Client(f"127.0.0.1:{server.port}", retries=0) as kv:
        assert kv.connect() == "tcp"  # the shm lane was refused: the next kind
        assert kv.put("ns", keys(1), [b"x" * 4096])[0].ok and bytes(kv.get("ns", keys(1))[0]) == b"x" * 4096
    assert {n for n in os.listdir("/dev/shm") if n.startswith(mine)} <= names  # no name left
    assert set(_lane_regions()) <= set(fds)  # no file held open
