"""What the NVMe Get tests share (test_nvme_gets.py, test_nvme_columns.py, test_nvme_hand_on.py): a store whose
DRAM holds a few 32-block prefixes over a write-through NVMe tier, a client on a given lane, prefixes written
until the first ones are only on NVMe, a record damaged on disk, and the check that nothing is left held once
the Gets are over."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstore import send_runs
from kvstore.client import Client
from kvstore.tiers.nvme.format import HEADER_BYTES, OFFSET_MASK
from kvstore.tiers.nvme.io import aligned_buffer

BLOCK = 64 << 10
PREFIX = 32
# shm-disk: --share-nvme, every Get asked of the store, which names its NVMe blocks in their files; shm-index: the
# same found in the store's index of NVMe-only blocks, unasked (the default without --share-dram)
# tcp: NVMe blocks read, checked and sent by the compiled send where it runs (kvstore.send_runs); tcp-python: by the
# tier's threads and the lane's Python, as everywhere else
LANES = ["shm-direct", "shm-disk", "shm-index", "shm-region", "shm-loan", "tcp", "tcp-python", "grpc"]
SHARED_FILES = ("shm-disk", "shm-index")  # lanes whose client reads the NVMe files


def nvme_store(make_server, tmp_path: Path, **options):
    """A store whose 8 MiB of DRAM holds a few prefixes, over a write-through NVMe tier, which reads the NVMe blocks
    of every Get itself (``share_nvme`` false: these tests are of its reads; its DRAM arena private, as
    ``--share-dram auto`` leaves it on a host without room in /dev/shm; ``options`` override)."""
    defaults = dict(
        dram=8 << 20,
        nvme_dir=str(tmp_path / "nvme"),
        nvme=1 << 30,
        nvme_segment=64 << 20,
        share_nvme=False,
        share_dram=False,
    )
    return make_server(**{**defaults, "write_policy": "write-through", **options})


def start_store(make_server, tmp_path: Path, lane: str, promote: bool, dram: int = 8 << 20):
    server = nvme_store(
        make_server,
        tmp_path,
        dram=dram,
        promote_on_hit=promote,
        shm_direct=lane in ("shm-direct", *SHARED_FILES, "shm-pool"),
        share_nvme=lane in SHARED_FILES,
        dram_index=lane != "shm-disk",
    )
    if lane == "tcp-python":
        server.lanes.tcp.compiled_send = False
    elif lane == "tcp" and send_runs.COMPILED.available:
        send_runs.warm_up()  # compiled before the first Get: these tests take the compiled send where it runs
    return server


def lane_client(server, lane: str) -> Client:
    return Client(f"127.0.0.1:{server.port}", timeout=30, lane=lane.split("-")[0])


def fill(kv: Client, prefixes: int, seed: int = 0) -> list[tuple[list[bytes], list[np.ndarray]]]:
    """``prefixes`` unchained 32-block prefixes, more than DRAM holds: the first ones end up only on NVMe."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prefixes):
        keys = [rng.bytes(16) for _ in range(PREFIX)]
        blocks = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(PREFIX)]
        assert all(r.ok for r in kv.put("t", keys, blocks, chained=False))
        out.append((keys, blocks))
    return out


def nvme_only(server, keys: list[bytes]) -> int:
    return sum(1 for r in server.store.lookup("t", keys)[1] if r == 3)


def get_into(kv: Client, lane: str, keys: list[bytes]) -> list:
    if lane == "shm-loan":
        return [bytes(memoryview(b)) for b in kv.get("t", keys)]
    out = [aligned_buffer(BLOCK) for _ in keys]
    kv.get("t", keys, out=out)
    return out


def prefix_on_nvme(server, kv: Client) -> tuple[list[bytes], list[np.ndarray]]:
    """Fill past what DRAM holds (``fill``) and return the first prefix, checked to be only on NVMe."""
    keys, blocks = fill(kv, 8)[0]
    assert nvme_only(server, keys) == PREFIX
    return keys, blocks


def assert_gets_exact(kv: Client, lane: str, keys: list[bytes], blocks: list[np.ndarray]) -> None:
    """A Get of ``keys`` on ``lane`` (``get_into``) returns ``blocks``, byte for byte."""
    got = get_into(kv, lane, keys)
    assert [bytes(memoryview(g)) for g in got] == [b.tobytes() for b in blocks]


def corrupt(server, key: bytes) -> None:
    """Flip payload bytes of the record holding ``key`` in its segment file (what a bad disk sector does)."""
    store = server.store
    nvme = store.tiers[-1]
    e = store.table.find(store.table.namespace_id("t"), key)
    loc = int(store.table.loc[e, nvme.rank])
    seg = nvme._log.segments[loc >> 40]  # the test reaches into the tier to damage one record on disk
    with open(seg.fh.path, "r+b") as f:
        f.seek((loc & OFFSET_MASK) + HEADER_BYTES + 100)
        f.write(b"\xff" * 64)
        f.flush()
        os.fsync(f.fileno())


def nvme_prefix_with_a_corrupt_block(server, kv: Client, k: int) -> tuple[list[bytes], list[np.ndarray]]:
    """Eight prefixes written through ``kv``; the first, held only on NVMe, with its block ``k`` damaged on disk."""
    keys, blocks = fill(kv, 8)[0]
    assert nvme_only(server, keys) == PREFIX
    corrupt(server, keys[k])
    return keys, blocks


def quiet(server, timeout: float = 10.0) -> None:
    """No lease, no staging slot and no read-only DRAM slot is left once the Gets are over."""
    store = server.store
    nvme = store.tiers[-1]

    def unpinned() -> bool:  # no segment is left pinned by a read (the test reads the tier's own count)
        return all(seg.readers == 0 for seg in list(nvme._log.segments.values()))

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # a reader's pin may outlive the reply: the client has its blocks first
        if int(np.asarray(store.table.leases).sum()) == 0 and store.staging.used_bytes == 0 and unpinned():
            break
        time.sleep(0.05)
    assert unpinned()
    store.check_invariants(quiet=True)  # and every DRAM slot belongs to a block: none leaked by a promotion


def run_concurrently(reader: Callable[[int], None], threads: int = 4, timeout: float = 120.0) -> None:
    """``reader(i)`` on ``threads`` threads at once; fails on the first error any raised, or on one still running
    after ``timeout`` (a Get that hung)."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            reader(i)
        except BaseException as err:  # noqa: BLE001 (reported below, in the test's thread)
            errors.append(err)

    started = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for t in started:
        t.start()
    deadline = time.monotonic() + timeout
    for t in started:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in started), "a Get hung"
    assert not errors, errors[0]
