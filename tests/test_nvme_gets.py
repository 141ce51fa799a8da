"""Gets of blocks that only NVMe holds, through a real server on every lane (issue 19): the reads land straight
where the bytes go and are handed on as they are verified, so these check what that must not break: exact
bytes, CRC checks before anything is served, a corrupt record failing alone, no lease or slot left behind by a
Get that ends early (a client killed mid-Get included), and concurrent Gets of the same blocks.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import KVStoreError
from kvstore.hugepages import files_get_huge_pages
from kvstore.lanes import framing
from kvstore.lanes.client.disk import DiskReader
from kvstore.tiers.nvme.io import aligned_buffer
from tests.conftest import ROOT
from tests.nvme_gets_support import (
    BLOCK,
    LANES,
    PREFIX,
    assert_gets_exact,
    corrupt,
    fill,
    get_into,
    lane_client,
    nvme_only,
    nvme_prefix_with_a_corrupt_block,
    nvme_store,
    prefix_on_nvme,
    quiet,
    run_concurrently,
    start_store,
)

pytestmark = pytest.mark.usefixtures("compiled_kernels")  # clients read the NVMe files only once compiled


@pytest.mark.parametrize("promote", [False, True], ids=["no-promote", "promote"])
@pytest.mark.parametrize("lane", LANES)
def test_nvme_only_blocks_come_back_exact_on_every_lane(make_server, tmp_path, lane, promote):
    server = start_store(make_server, tmp_path, lane, promote)
    with lane_client(server, lane) as kv:
        data = fill(kv, 8)
        keys, blocks = data[0]
        assert nvme_only(server, keys) == PREFIX
        for _ in range(2):  # the second Get: from DRAM when promoted, from NVMe again otherwise
            got = get_into(kv, lane, keys)
            for g, b in zip(got, blocks):
                assert bytes(memoryview(g)) == b.tobytes()
        # a Get mixing DRAM hits, NVMe blocks and a missing block, in one request
        mixed = data[1][0][:8] + [b"\x01" * 16] + data[-1][0][:8]
        want = data[1][1][:8] + [None] + data[-1][1][:8]
        out = kv.get("t", mixed, allow_missing=True)
        for g, b in zip(out, want):
            assert (g is None) if b is None else bytes(memoryview(g)) == b.tobytes()
        indexed = kv._lanes.run(lambda lane: getattr(lane, "indexed", None))  # noqa: SLF001 - the shm lane's
    quiet(server)
    tiers = {t["name"]: t for t in server.store.stats()["tiers"]}
    assert tiers["nvme"]["hits"] >= PREFIX
    counters = server.metrics.counters()
    if lane == "shm-disk":  # read by the client from the segment files: the store read none of them
        assert counters["lane_shm_disk_get_bytes"] >= 2 * PREFIX * BLOCK
        assert server.store.tiers[-1].stats().extra["extents_lent"] >= 2 * PREFIX
    elif lane == "shm-index":  # the first Get named by the store, the second found in its index
        assert counters["lane_shm_disk_get_bytes"] >= PREFIX * BLOCK
        assert indexed is not None and indexed.disk_hits >= PREFIX
    elif promote:
        assert tiers["dram"]["promotions"] > 0
    if lane == "tcp" and server.lanes.tcp.compiled_send:  # sent by the compiled send, as a store here sends them
        assert counters["lane_tcp_compiled_get_bytes"] >= PREFIX * BLOCK
    elif lane == "tcp-python":
        assert "lane_tcp_compiled_get_bytes" not in counters


def test_a_client_whose_runs_are_not_compiled_yet_has_the_store_read_them(make_server, tmp_path, monkeypatch):
    """Until the client's compiled runs are ready (a fresh process, compiling or loading them in the background) an
    shm lane whose store shares its NVMe files lets the store read them: the uncompiled reads were slower."""
    server = start_store(make_server, tmp_path, "shm-disk", promote=False)
    with lane_client(server, "shm-disk") as kv:
        keys, blocks = prefix_on_nvme(server, kv)
        monkeypatch.setattr(DiskReader, "ready", property(lambda self: False))
        assert_gets_exact(kv, "shm-disk", keys, blocks)
        assert server.metrics.counters().get("lane_shm_disk_get_bytes", 0) == 0
        monkeypatch.undo()  # compiled: the client reads them from the files
        assert_gets_exact(kv, "shm-disk", keys, blocks)
        deadline = time.monotonic() + 10  # (the server counts after the reply)
        while server.metrics.counters().get("lane_shm_disk_get_bytes", 0) < PREFIX * BLOCK:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    quiet(server)


def test_a_client_that_cannot_see_the_store_s_files_has_the_store_read_them(make_server, tmp_path, monkeypatch):
    """A store with the default ``--share-nvme auto`` and a client in another mount namespace (a pod without the
    store's volume: here its DiskReader is pointed at a directory that is not there): every Get is exact, the
    first by asking again for what it could not read, the rest by the store alone."""
    server = nvme_store(make_server, tmp_path, share_nvme="auto", shm_direct=True, promote_on_hit=False)
    opened = DiskReader.__init__
    elsewhere = str(tmp_path / "not-mounted")
    monkeypatch.setattr(DiskReader, "__init__", lambda self, directory, *a, **k: opened(self, elsewhere, *a, **k))
    with lane_client(server, "shm-disk") as kv:
        keys, blocks = prefix_on_nvme(server, kv)
        for _ in range(3):
            assert_gets_exact(kv, "shm-disk", keys, blocks)
        assert server.metrics.counters().get("lane_shm_disk_get_bytes", 0) <= PREFIX * BLOCK  # named once at most
        deadline = time.monotonic() + 10  # (the server counts after the reply)
        while server.metrics.counters().get("lane_shm_direct_get_bytes", 0) < 3 * PREFIX * BLOCK:
            assert time.monotonic() < deadline, server.metrics.counters()
            time.sleep(0.02)
    quiet(server)


@pytest.mark.parametrize("lane", LANES)
def test_a_corrupt_record_fails_alone_and_is_dropped(make_server, tmp_path, lane):
    server = start_store(make_server, tmp_path, lane, promote=True)
    with lane_client(server, lane) as kv:
        keys, blocks = nvme_prefix_with_a_corrupt_block(server, kv, 5)
        out = [aligned_buffer(BLOCK) for _ in keys]
        with pytest.raises(KVStoreError) as err:
            if lane == "shm-loan":
                kv.get("t", keys)
            else:
                kv.get("t", keys, out=out)
        assert "DATA_LOSS" in str(err.value.code) or "checksum" in str(err.value).lower()
        assert server.store.lookup("t", [keys[5]])[0] == 0  # dropped
        rest = keys[:5] + keys[6:]
        got = get_into(kv, lane, rest)
        for g, b in zip(got, blocks[:5] + blocks[6:]):
            assert bytes(memoryview(g)) == b.tobytes()
        assert server.store.counters.corrupt == 1
    quiet(server)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A --shm-dir whose files get 4 KiB pages (not a tmpfs), with a path short enough for the direct lane's
    unix socket in it (a test's tmp_path can pass the 107 bytes such a path may hold)."""
    with tempfile.TemporaryDirectory(prefix="kvshm-", dir="/tmp" if os.path.isdir("/tmp") else None) as d:
        if files_get_huge_pages(d) is not False:
            pytest.skip(f"{d} may give huge pages here")
        yield Path(d)


@pytest.mark.parametrize("lane", ["shm-direct", "tcp"])
def test_promotions_into_a_small_page_arena_are_read_apart_and_copied_at_release(make_server, tmp_path, lane, shm):
    # a shared arena on a file system without huge pages (a directory of /tmp): reads into it ran at half speed,
    # so a promotion's read lands in staging and release copies it into the slot reserved for it
    server = nvme_store(
        make_server,
        tmp_path,
        share_dram=True,
        dram_index=False,
        shm_dir=str(shm),
        shm_direct=lane == "shm-direct",
    )
    store = server.store
    assert store.top.small_pages
    with lane_client(server, lane) as kv:
        data = fill(kv, 8)
        keys, blocks = data[0]
        assert nvme_only(server, keys) == PREFIX
        staged = store.staging.taken
        for g, b in zip(get_into(kv, lane, keys), blocks):
            assert bytes(memoryview(g)) == b.tobytes()
        quiet(server)
        promoted = store.stats()["tiers"][0]["promotions"]
        assert promoted > 0 and store.staging.taken - staged == PREFIX  # every read, promotions too, into staging
        ranks = store.lookup("t", keys)[1]
        in_dram = [k for k, r in zip(keys, ranks) if r == 2]
        assert len(in_dram) == promoted
        want = {k: b for k, b in zip(keys, blocks)}
        for g, k in zip(get_into(kv, lane, in_dram), in_dram):  # DRAM hits now: the copy made at release
            assert bytes(memoryview(g)) == want[k].tobytes()
        # a corrupt record: the Get fails, and the slots reserved for its promotions all come back
        keys, blocks = data[1]
        assert nvme_only(server, keys) == PREFIX
        corrupt(server, keys[7])
        with pytest.raises(KVStoreError) as err:
            kv.get("t", keys, out=[aligned_buffer(BLOCK) for _ in keys])
        assert "DATA_LOSS" in str(err.value.code) or "checksum" in str(err.value).lower()
    quiet(server)  # no lease, staging slot or DRAM slot left behind


def test_a_small_page_region_takes_nvme_blocks_by_copy_from_staging(make_server, tmp_path, shm):
    # the lane's region on a file system without huge pages: the blocks are read into staging, then copied in
    server = nvme_store(
        make_server,
        tmp_path,
        promote_on_hit=False,
        shm_dir=str(shm),
        shm_direct=False,
    )
    with lane_client(server, "shm-region") as kv:
        data = fill(kv, 8)
        keys, blocks = data[0]
        assert nvme_only(server, keys) == PREFIX
        staged = server.store.staging.taken
        for g, b in zip(get_into(kv, "shm-region", keys), blocks):
            assert bytes(memoryview(g)) == b.tobytes()
        assert server.store.staging.taken - staged == PREFIX
    quiet(server)


@pytest.mark.parametrize("lane", ["shm-direct", "shm-region", "tcp"])
def test_a_store_bug_mid_get_is_internal_and_the_lane_lives_on(make_server, tmp_path, lane, monkeypatch):
    # an exception no lane expects (a bug) used to end the shm channel or the tcp connection: the client took the
    # lane for broken, ran the Get again on a new one, and reported UNAVAILABLE; now every lane answers as gRPC
    server = start_store(make_server, tmp_path, lane, promote=False)
    with lane_client(server, lane) as kv:
        keys, blocks = fill(kv, 8)[0]
        assert nvme_only(server, keys) == PREFIX
        calls = []

        def broken(*args, **kwargs):  # noqa: ANN002, ANN003 (stands in for any store method that raises)
            calls.append(1)
            raise RuntimeError("a bug")

        monkeypatch.setattr(server.store, "materialize", broken)
        with pytest.raises(KVStoreError) as err:
            kv.get("t", keys, out=[aligned_buffer(BLOCK) for _ in keys])
        assert "UNKNOWN" in str(err.value.code) and "a bug" in str(err.value)  # as gRPC answers (the region lane)
        assert len(calls) == 1  # answered, not retried on another lane
        monkeypatch.undo()
        for g, b in zip(get_into(kv, lane, keys), blocks):
            assert bytes(memoryview(g)) == b.tobytes()
    quiet(server)


@pytest.mark.parametrize("lane", ["shm-direct", "shm-disk", "shm-index", "tcp", "tcp-python", "grpc"])
def test_concurrent_gets_of_the_same_nvme_blocks(make_server, tmp_path, lane):
    server = start_store(make_server, tmp_path, lane, promote=True, dram=12 << 20)
    with lane_client(server, lane) as kv:
        data = fill(kv, 8)
    keys, blocks = data[0]
    assert nvme_only(server, keys) == PREFIX
    want = [b.tobytes() for b in blocks]

    def reader(seed: int) -> None:
        with lane_client(server, lane) as c:
            for k in range(4):
                sel = keys if (seed + k) % 2 else keys[::-1]
                got = get_into(c, lane, sel)
                ref = want if sel is keys else want[::-1]
                for g, b in zip(got, ref):
                    assert bytes(memoryview(g)) == b

    run_concurrently(reader)
    quiet(server)


CHILD = r"""
import sys, numpy as np
from kvstore.client import Client
from kvstore.tiers.nvme.io import aligned_buffer

target, lane, keys = sys.argv[1], sys.argv[2], [bytes.fromhex(k) for k in sys.argv[3].split(",")]
with Client(target, timeout=30, lane=lane.split("-")[0]) as kv:
    if lane == "shm-pool":  # into a pool the store maps (its NVMe reads land there)
        pool = kv.shared_pool(len(keys) << 16, name="kvstore-killed-pool").array
        out = [pool[k << 16 : (k + 1) << 16] for k in range(len(keys))]
    else:
        out = [aligned_buffer(64 << 10) for _ in keys]
    print("ready", flush=True)
    while True:
        kv.get("t", keys, out=out)
"""


@pytest.mark.parametrize("lane", ["shm-direct", "shm-disk", "shm-index", "shm-pool", "tcp", "tcp-python"])
def test_a_client_killed_mid_get_leaks_no_lease_and_no_slot(make_server, tmp_path, lane):
    server = start_store(make_server, tmp_path, lane, promote=False)
    with lane_client(server, lane) as kv:
        data = fill(kv, 8)
    keys = [k for prefix in data[:4] for k in prefix[0]]  # 128 blocks, all only on NVMe
    assert nvme_only(server, keys) == len(keys)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, f"127.0.0.1:{server.port}", lane, ",".join(k.hex() for k in keys)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20
        while server.store.stats()["tiers"][-1]["hits"] < 3 * len(keys) and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(200):  # kill it while the server is inside a Get
            if int(np.asarray(server.store.table.leases).sum()) > 0:
                break
            time.sleep(0.002)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    quiet(server, timeout=20)
    if lane == "shm-pool":  # its lane closed with the client, and the store's mapping of its pool went with it
        deadline = time.monotonic() + 20
        while "kvstore-killed-pool" in Path("/proc/self/maps").read_text() and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
        assert "kvstore-killed-pool" not in Path("/proc/self/maps").read_text()
    with lane_client(server, lane) as kv:  # the store still serves those blocks
        assert lane != "shm-pool" or kv.stats()["counters"]["lane_shm_pool_get_bytes"] > 0
        got = get_into(kv, lane, keys[:PREFIX])
        assert [bytes(memoryview(g)) for g in got] == [b.tobytes() for b in data[0][1]]


@pytest.mark.parametrize("sender", ["python", "compiled"])
def test_a_tcp_send_failing_mid_read_ends_the_connection_and_leaks_nothing(make_server, tmp_path, monkeypatch, sender):
    """A TCP Get's pieces are sent as they are verified: by the threads that verified them (``_send_read``), or
    read, checked and sent by one compiled call (``send_runs.RunSender``). When a send fails (the client gone),
    the read ends, the connection closes as for any failed send (not a DATA_LOSS or UNAVAILABLE status for a disk
    that did nothing wrong), and no lease, staging slot or segment pin is left. The client retries the broken
    lane and gets every byte."""
    import types

    import kvstore.lanes.server.tcp as tcp_server
    from kvstore import send_runs

    failed: list[object] = []  # the connection whose send failed
    after: list[int] = []  # the kinds of frames the server sent on it afterwards: no STATUS (it would be a lie)

    def failing_once(conn, kind, meta=b"", payload=()):
        if failed and failed[0] in (conn, conn.fileno()):
            after.append(kind)
        if kind == framing.DATA and not failed and sender == "python":
            failed.append(conn)
            raise BrokenPipeError("the client went away")
        return framing.send_frame(conn, kind, meta, payload)

    monkeypatch.setattr(tcp_server, "framing", types.SimpleNamespace(**{**vars(framing), "send_frame": failing_once}))
    compiled_send = send_runs.RunSender.send
    if sender == "python":
        monkeypatch.setattr(send_runs.RunSender, "send", lambda self, pieces, names, before=None: None)
    else:
        if not send_runs.COMPILED.available:
            pytest.skip("no compiled send here (numba, SSE4.2 and PCLMULQDQ, Linux on x86-64)")
        send_runs.warm_up()
        bad_fd = os.open(tmp_path / "read-only", os.O_RDONLY | os.O_CREAT, 0o644)

        def send_failing_once(self, pieces, names, before=None):  # the kernel's writev fails: a descriptor it
            if failed:  # cannot write
                return compiled_send(self, pieces, names, before)
            failed.append(self._fd)  # the connection's
            fd, self._fd = self._fd, bad_fd
            try:
                return compiled_send(self, pieces, names, before)
            finally:
                self._fd = fd

        monkeypatch.setattr(send_runs.RunSender, "send", send_failing_once)
    server = start_store(make_server, tmp_path, "tcp", promote=False)
    with lane_client(server, "tcp") as kv:
        assert_gets_exact(kv, "tcp", *prefix_on_nvme(server, kv))
    assert failed and framing.STATUS not in after  # another piece's DATA may have been on its way
    quiet(server)
    if sender == "compiled":
        os.close(bad_fd)


def test_a_corrupt_record_on_tcp_is_data_loss_even_when_the_read_ends_first(make_server, tmp_path, monkeypatch):
    """The TCP sender checks whether the next block is ready before it flushes what it holds; when the window's
    read has already failed by then, that check raises the read's error, which must reach the client as a
    DATA_LOSS status and not as a dropped connection (the client retries a broken lane, and the retry finds the
    dropped block gone: NOT_FOUND). A slow sender makes the read end first every time."""
    import kvstore.lanes.server.tcp as tcp_server

    slow = tcp_server.host_bytes  # the test slows the server's sender down where it takes each block's bytes

    def lagging(buf):
        time.sleep(0.05)
        return slow(buf)

    monkeypatch.setattr(tcp_server, "host_bytes", lagging)
    server = start_store(make_server, tmp_path, "tcp", promote=False)
    with lane_client(server, "tcp") as kv:
        keys, blocks = nvme_prefix_with_a_corrupt_block(server, kv, 5)
        with pytest.raises(KVStoreError) as err:
            kv.get("t", keys, out=[aligned_buffer(BLOCK) for _ in keys])
        assert "DATA_LOSS" in str(err.value.code), err.value
        got = get_into(kv, "tcp", keys[:5])
        assert [bytes(memoryview(g)) for g in got] == [b.tobytes() for b in blocks[:5]]
    quiet(server)


@pytest.mark.parametrize("aligned", [True, False], ids=["page-aligned", "unaligned"])
def test_share_nvme_fills_segments_as_a_vllm_block_is_laid_out(make_server, tmp_path, aligned):
    """A block as one slice per layer (Segments), as the vLLM connector loads it: the client's own reads of the
    NVMe files land straight in page-aligned slices, or through scratch when the slices are not aligned."""
    from kvstore.payload import Segments

    server = start_store(make_server, tmp_path, "shm-disk", promote=False)
    with lane_client(server, "shm-disk") as kv:
        data = fill(kv, 8)
        keys, blocks = data[0]
        assert nvme_only(server, keys) == PREFIX
        layers, part = 4, BLOCK // 4
        pool = aligned_buffer(PREFIX * BLOCK + 4096)
        base = 0 if aligned else 64  # torch's allocations are 64-byte aligned, not page aligned
        rows = [[pool[base + (k * PREFIX + b) * part :][:part] for k in range(layers)] for b in range(PREFIX)]
        kv.get("t", keys, out=[Segments(r) for r in rows])
        for r, b in zip(rows, blocks):
            assert np.concatenate(r).tobytes() == b.tobytes()
    assert server.metrics.counters()["lane_shm_disk_get_bytes"] == PREFIX * BLOCK
    quiet(server)


@pytest.mark.parametrize("segment", [64 << 20, 1 << 20], ids=["one-file", "across-files"])
def test_share_nvme_reads_an_asked_prefix_into_aligned_buffers_as_compiled_runs(make_server, tmp_path, segment):
    """An asked Get's NVMe blocks, each bound for a page-aligned buffer, are read per file in one compiled call
    (``DiskReader.read_run``, ``read_runs`` when segments' ends cut the prefix), never block by block; a corrupt
    record among them is not served: the store reads it again, drops it and says DATA_LOSS."""
    server = nvme_store(
        make_server, tmp_path, promote_on_hit=False, share_nvme=True, shm_direct=True, nvme_segment=segment
    )
    with lane_client(server, "shm-disk") as kv:
        keys, blocks = prefix_on_nvme(server, kv)
        disk = kv._lanes.run(lambda lane: lane).disk  # noqa: SLF001 - the shm lane's reader of the store's files
        runs: list[tuple[str, list[int] | None]] = []
        for name in ("read_run", "read_runs"):
            real = getattr(disk, name)
            setattr(disk, name, lambda *a, real=real, name=name: runs.append((name, real(*a))) or runs[-1][1])
        disk.read = lambda blocks: pytest.fail(f"{len(blocks)} blocks read one by one")
        assert_gets_exact(kv, "shm-disk", keys, blocks)
        assert runs == [("read_run" if segment > PREFIX * BLOCK else "read_runs", [])]
        corrupt(server, keys[20])
        with pytest.raises(KVStoreError) as err:
            get_into(kv, "shm-disk", keys)
        assert "DATA_LOSS" in str(err.value.code) and runs[-1][1] == [20]
        assert server.store.lookup("t", [keys[20]])[0] == 0  # dropped
    quiet(server)


def test_share_nvme_names_at_most_the_lanes_budget_and_the_store_reads_the_rest(make_server, tmp_path):
    """A lane names at most its region's size of NVMe blocks at once (what one client can keep pinned): past it
    the store reads the blocks itself, in the same Get."""
    server = nvme_store(
        make_server,
        tmp_path,
        promote_on_hit=False,
        share_nvme=True,
        shm_lane_bytes=1 << 20,
        max_block=BLOCK,
    )
    with lane_client(server, "shm-disk") as kv:
        assert_gets_exact(kv, "shm-disk", *prefix_on_nvme(server, kv))
    named = server.metrics.counters()["lane_shm_disk_get_bytes"]
    assert 0 < named < PREFIX * BLOCK and named % BLOCK == 0
    quiet(server)


class _FirstReadLate:
    """The NVMe tier's backend with the next ``preadv`` that starts at or before ``at_most`` (the read of a Get's
    first block) held back ``seconds``: a disk that serves that request late. Not simply the next ``preadv``: a
    small Get's two pieces are read at once, and under load the second one's read could start first."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds, self.armed, self.at_most = inner, seconds, False, 0
        self._lock = threading.Lock()

    def preadv(self, fh, bufs, offset):
        with self._lock:
            late = self.armed and offset <= self.at_most
            self.armed = self.armed and not late
        if late:
            time.sleep(self.seconds)
        return self.inner.preadv(fh, bufs, offset)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("small", [False, True], ids=["read-ahead", "small-get"])
@pytest.mark.parametrize("asks", [True, False], ids=["named-frames", "old-client"])
def test_tcp_sends_blocks_as_their_reads_complete(make_server, tmp_path, monkeypatch, asks, small):
    """On the TCP lane a read the disk serves late no longer holds back the verified blocks behind it: with the
    first read held back, the client (whose hello asks for DATA frames that name their blocks) gets the later
    blocks first, every byte right. A client whose hello does not ask gets every block in the reply's order.
    Both ways a Get is read: on reader threads a window ahead (``ReadAhead``, a Get of more than
    ``readahead.INLINE_BYTES``, here made 0), and a small Get's two pieces read by the lane's thread and a
    reader, each sent by the thread that verified it (``_send_read``)."""
    from kvstore.lanes.client import tcp as client_tcp
    from kvstore.store import readahead
    from kvstore.v1 import lanes_pb2

    if not small:
        monkeypatch.setattr(readahead, "INLINE_BYTES", 0)

    if not asks:  # an older client: its hello has no unordered_data
        old = type(client_tcp)("lanes_pb2_without_unordered")
        old.__dict__.update(vars(lanes_pb2))
        old.TcpHello = lambda **kw: lanes_pb2.TcpHello(**{**kw, "unordered_data": False})
        monkeypatch.setattr(client_tcp, "lpb", old)
    frames: list[list[int]] = []
    named = client_tcp._named
    monkeypatch.setattr(client_tcp, "_named", lambda *a: frames.append(named(*a)) or frames[-1])
    server = start_store(make_server, tmp_path, "tcp", promote=False)
    nvme = server.store.tiers[-1]
    nvme.backend = late = _FirstReadLate(nvme.backend, 0.3)
    with lane_client(server, "tcp") as kv:
        keys, blocks = prefix_on_nvme(server, kv)
        t = server.store.table
        _, first = nvme.payload_places(np.array([t.loc_of(t.find(t.namespace_id("t"), keys[0]), nvme.rank)]))
        late.at_most, late.armed = int(first[0]), True
        got = get_into(kv, "tcp", keys)
        assert all(bytes(memoryview(g)) == b.tobytes() for g, b in zip(got, blocks))
        assert not late.armed
    quiet(server)
    order = [k for ks in frames for k in ks]
    if asks:
        assert sorted(order) == list(range(PREFIX)) and order != sorted(order)  # some came before a block ahead of them
    else:
        assert frames == []  # no frame named its blocks: all came in order


def test_promotions_copied_at_release_are_checked_and_the_unfit_are_not_promoted():
    """``_fill_promotions`` (the copy of blocks read into a client's pool or staging into the DRAM slots reserved
    for them, in one compiled call): a raw block whose bytes no longer match its CRC32C, or whose buffer is shorter
    than the block, is not promoted and its slot comes back; a coded block is copied unchecked; every lease's
    ``promote_copy`` is cleared, whether it had a slot or not."""
    from kvstore.checksum import crc32c
    from kvstore.store.blockstore import BlockStore
    from kvstore.store.leases import Lease
    from kvstore.tiers.arena import ArenaTier

    store = BlockStore([ArenaTier(8 << 20, page_size=1 << 20)])
    rng = np.random.default_rng(7)
    sources = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(5)]

    def lease(k: int, codec: int = 0, crc: int | None = None, buffer=None, slot: bool = True) -> Lease:
        return Lease(
            entry=k, hash=bytes([k]) * 16, codec=codec, dtype="uint8", raw_length=BLOCK, stored_length=BLOCK,
            crc32c=crc32c(sources[k].tobytes()) if crc is None else crc, rank=0,
            buffer=sources[k] if buffer is None else buffer, promote=store.top.allocate(BLOCK) if slot else None,
            promote_copy=True,
        )  # fmt: skip

    good, changed, short, coded = lease(0), lease(1, crc=1), lease(2, buffer=sources[2][: BLOCK // 2]), lease(3, 2, 5)
    none = lease(4, slot=False)
    slots = [x.promote for x in (good, changed, short, coded)]
    back = store._fill_promotions([good, changed, short, coded, none])
    assert sorted(back) == sorted([slots[1], slots[2]])
    assert (good.promote, changed.promote, short.promote, coded.promote) == (slots[0], None, None, slots[3])
    assert not any(x.promote_copy for x in (good, changed, short, coded, none))
    for x, k in ((good, 0), (coded, 3)):
        assert bytes(store.top.view(x.promote, BLOCK)) == sources[k].tobytes()
