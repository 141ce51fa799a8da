"""``NodeClient.warm_up``: what a fresh process's first Gets would set up, done before them. Through a real
``--share-nvme`` store on a loopback port: the reader of the store's files has its threads running before the
first Get, which then comes back exact; a client without a lane warms up harmlessly; the pieces it is built
from (``CopyPool.start``, ``BackgroundCompile.warm_up``) do what they say."""

from __future__ import annotations

import threading

from kvstore.background_compile import BackgroundCompile
from kvstore.client import Client
from kvstore.lanes.copypool import CopyPool
from tests.nvme_gets_support import PREFIX, assert_gets_exact, fill, lane_client, nvme_only, nvme_store, quiet


def _readers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvstore-disk-read") and t.is_alive()}


def test_warm_up_starts_the_nvme_reader_before_the_first_get(make_server, tmp_path):
    server = nvme_store(make_server, tmp_path, promote_on_hit=False, share_nvme=True, shm_direct=True)
    with lane_client(server, "shm-disk") as kv:
        data = fill(kv, 8)
    with lane_client(server, "shm-disk") as kv:  # a fresh client, as a worker starting
        before = _readers()
        assert kv.warm_up() == "shm"
        started = _readers() - before
        assert len(started) == 7  # DiskReader's 8 threads: the caller's and seven of the pool
        keys, blocks = data[0]
        assert nvme_only(server, keys) == PREFIX
        assert_gets_exact(kv, "shm-disk", keys, blocks)
        assert kv.warm_up() == "shm"  # again: nothing more to start
        assert _readers() - before == started
    quiet(server)


def test_kernels_that_fail_to_compile_are_logged_and_gets_still_work(make_server, tmp_path, monkeypatch, caplog):
    """A broken numba must not stop an engine's start: warm_up logs it and the uncompiled paths serve."""
    from kvstore import memops_jit, payload_runs

    def broken() -> None:
        raise RuntimeError("LLVM said no")

    server = nvme_store(make_server, tmp_path, promote_on_hit=False, share_nvme=True, shm_direct=True)
    with lane_client(server, "shm-disk") as kv:
        data = fill(kv, 8)
    monkeypatch.setattr(memops_jit, "warm_up", broken)
    monkeypatch.setattr(payload_runs.COMPILED, "warm_up", broken)
    with lane_client(server, "shm-disk") as kv, caplog.at_level("WARNING"):
        assert kv.warm_up() == "shm"
        warned = [r.getMessage() for r in caplog.records if "not warmed up (LLVM said no)" in r.getMessage()]
        assert len(warned) == 2 and "CRC32C kernels" in warned[0] and "reader of the NVMe files" in warned[1]
        keys, blocks = data[0]
        assert_gets_exact(kv, "shm-disk", keys, blocks)
    quiet(server)


def test_warm_up_without_a_lane_is_harmless(make_server, tmp_path):
    server = nvme_store(make_server, tmp_path)
    with Client(f"127.0.0.1:{server.port}", timeout=30, lane="grpc") as kv:
        assert kv.warm_up() == "grpc"
        keys, blocks = fill(kv, 1)[0]
        assert_gets_exact(kv, "grpc", keys, blocks)


def test_copy_pool_start_runs_once_on_every_thread_before_any_job():
    pool = CopyPool(4, name="kvstore-test-start")
    seen: list[int] = []
    try:
        pool.start(lambda: seen.append(threading.get_ident()))
        assert len(seen) == 3 == len(set(seen))  # the caller's thread is the fourth
        assert sum(1 for t in threading.enumerate() if t.name.startswith("kvstore-test-start")) == 3
    finally:
        pool.close()
    CopyPool(1).start(lambda: seen.append(0))  # no pool threads: nothing runs
    assert len(seen) == 3


def test_a_compile_warmed_up_twice_or_after_its_background_run_runs_once():
    runs: list[str] = []
    compiled = BackgroundCompile("kvstore-test-compile", True, lambda: runs.append(threading.current_thread().name))
    compiled.warm_up()
    compiled.warm_up()
    assert runs == [threading.current_thread().name] and compiled.ready()
    off = BackgroundCompile("kvstore-test-off", False, lambda: runs.append("off"))
    off.warm_up()
    assert not off.ready() and runs == [threading.current_thread().name]
