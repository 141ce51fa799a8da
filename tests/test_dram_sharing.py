"""Where the DRAM arena lives (``serve --share-dram``, ``kvstore/server/dram_sharing.py``).

The rule is pure logic over the host's facts, checked case by case; then real in-process stores: a default one on
this host's /dev/shm (a tmpfs) shares its arena and a shm client reads a DRAM hit from it; one whose --shm-dir is
on disk keeps it private; and an arena file that cannot be made leaves auto's store private (logged), where
``--share-dram true`` fails the start.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import os
import signal
import socket
import time

import numpy as np
import pytest

from kvstore import arena_index, shmfile
from kvstore.client import Client
from kvstore.config import ServeConfig
from kvstore.free_port import free_port
from kvstore.lanes.shm_region import sweep
from kvstore.server import dram_sharing
from kvstore.server.app import StoreServer, build_tiers
from kvstore.server.dram_sharing import DramSharing, HostFacts, decide, shared_bytes
from kvstore.server.process import shm_dir_of, store_process
from kvstore.tiers.arena import ArenaTier
from tests.test_lanes_support import keys

MiB = 1 << 20
GiB = 1 << 30

ROOMY = HostFacts(file_system="tmpfs", free_bytes=24 * GiB, available_bytes=23 * GiB, cuda=False, cross_memory=True)


def cfg(**overrides) -> ServeConfig:
    return ServeConfig(**{"dram": GiB, "shm_dir": "/dev/shm", **overrides})


def test_auto_shares_on_a_roomy_tmpfs_with_an_shm_lane_and_no_tenants() -> None:
    sharing = decide(cfg(), ROOMY)
    assert sharing.directory == "/dev/shm"
    assert not sharing.asked
    assert "shared" in sharing.reason


@pytest.mark.parametrize(
    ("overrides", "facts", "why"),
    [
        ({"tenants": "/etc/kvstore/tenants.json"}, {}, "--tenants"),
        ({"lanes": "tcp"}, {}, "shm lane"),
        ({"shm_direct": False}, {}, "shm lane"),
        ({}, {"cross_memory": False}, "shm lane"),
        ({}, {"cuda": True}, "CUDA"),
        ({}, {"file_system": "ext4"}, "not a tmpfs"),
        ({}, {"file_system": None}, "no such directory"),
        ({}, {"free_bytes": 64 * MiB}, "free"),  # a container's /dev/shm
        ({}, {"available_bytes": GiB}, "available"),
    ],
)
def test_auto_keeps_the_arena_private_and_says_why(overrides: dict, facts: dict, why: str) -> None:
    sharing = decide(cfg(**overrides), dataclasses.replace(ROOMY, **facts))
    assert sharing.directory is None
    assert why in sharing.reason


def test_auto_may_take_three_quarters_of_the_free_space_and_no_more() -> None:
    need = shared_bytes(cfg(), 0)
    assert need > GiB  # the index beside the arena counts
    at_most = need * 4 // 3 + 4
    assert decide(cfg(), dataclasses.replace(ROOMY, free_bytes=at_most)).directory == "/dev/shm"
    assert decide(cfg(), dataclasses.replace(ROOMY, free_bytes=at_most - 8)).directory is None
    # the index of NVMe-only blocks beside the arena takes room too
    assert shared_bytes(cfg(), 16 * GiB) > need
    assert shared_bytes(cfg(dram_index=False), 16 * GiB) == GiB


@pytest.mark.parametrize("facts", [{"cuda": True}, {"file_system": "ext4"}, {"free_bytes": 0}])
def test_true_and_false_are_obeyed_whatever_the_host(facts: dict) -> None:
    host = dataclasses.replace(ROOMY, **facts)
    assert decide(cfg(share_dram="true", tenants="t.json"), host) == DramSharing("/dev/shm", "--share-dram true", True)
    assert decide(cfg(share_dram=True), host).directory == "/dev/shm"  # a ServeConfig made in code holds a bool
    assert decide(cfg(share_dram="false"), ROOMY).directory is None
    assert decide(cfg(share_dram=False), ROOMY).directory is None


V1 = "4:memory:/kube/pod1\n0::/\n"
V2 = "0::/kube/pod1\n"


@pytest.mark.parametrize(
    ("proc_cgroup", "files", "room"),
    [
        (
            V1,
            {
                "/c/memory/kube/pod1/memory.limit_in_bytes": "8589934592\n",
                "/c/memory/kube/pod1/memory.usage_in_bytes": "1073741824\n",
            },
            7 * GiB,
        ),
        (
            V1,
            {
                "/c/memory/kube/pod1/memory.limit_in_bytes": "9223372036854771712",
                "/c/memory/kube/pod1/memory.usage_in_bytes": "5",
            },
            None,
        ),
        (
            V1,
            {"/c/memory/memory.limit_in_bytes": "2147483648", "/c/memory/memory.usage_in_bytes": "0"},
            2 * GiB,
        ),  # its own root
        (V2, {"/c/kube/pod1/memory.max": "4294967296\n", "/c/kube/pod1/memory.current": "5368709120\n"}, 0),  # over it
        (V2, {"/c/kube/pod1/memory.max": "max\n", "/c/kube/pod1/memory.current": "1"}, None),
        (V2, {"/c/memory.max": "1073741824", "/c/memory.current": "0"}, GiB),
        (V2, {}, None),  # nothing readable
        (V2, {"/c/kube/pod1/memory.max": "1073741824", "/c/kube/pod1/memory.current": "garbage"}, None),
        ("", {}, None),
    ],
)
def test_the_room_under_a_memory_cgroups_limit(proc_cgroup: str, files: dict, room: int | None) -> None:
    assert dram_sharing.cgroup_memory_room(proc_cgroup, files.get, root="/c") == room


def test_host_facts_name_this_hosts_file_systems(tmp_path) -> None:
    on_disk = HostFacts.read(str(tmp_path))
    assert on_disk.file_system not in (None, "tmpfs", "hugetlbfs") or tmp_path.as_posix().startswith("/dev/shm")
    assert on_disk.free_bytes > 0
    missing = HostFacts.read(str(tmp_path / "missing"))
    assert (missing.file_system, missing.free_bytes) == (None, 0)
    if os.path.isdir("/dev/shm"):
        assert HostFacts.read("/dev/shm").file_system == "tmpfs"


def _dram(server) -> ArenaTier:
    return next(t for t in server.store.tiers if isinstance(t, ArenaTier) and t.device == "cpu")


@pytest.mark.usefixtures("compiled_kernels")
def test_a_default_store_shares_its_arena_where_auto_allows_and_a_client_reads_hits_from_it(make_server) -> None:
    if decide(cfg(dram=256 * MiB), HostFacts.read("/dev/shm")).directory is None:
        pytest.skip("auto keeps the arena private on this host (no roomy tmpfs /dev/shm, or a CUDA device)")
    server = make_server()  # the tests' default store: 256 MiB of DRAM, every option at its default
    arena = _dram(server)
    assert arena.shared is not None and arena.shared.path.startswith("/dev/shm/")
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, 64 << 10, dtype=np.uint8) for _ in range(8)]
    hashes = keys(8, 58)
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        assert all(r.ok for r in kv.put("ns", hashes, data, chained=False))
        for _ in range(2):  # the second Get finds the blocks in the shared index (the first named the namespace)
            out = [np.zeros(64 << 10, dtype=np.uint8) for _ in range(8)]
            got = kv.get("ns", hashes, out=out)
            assert all(g is o for g, o in zip(got, out))
            assert all(np.array_equal(o, d) for o, d in zip(out, data))
    deadline = time.monotonic() + 5  # the client reports the hits it found itself, in a batch or as its lane closes
    while server.metrics.counters().get("lane_shm_index_hits", 0) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.metrics.counters().get("lane_shm_index_hits", 0) >= 8


def test_a_store_whose_shm_dir_is_on_disk_keeps_its_arena_private(make_server, short_dir) -> None:
    if HostFacts.read(str(short_dir)).file_system in dram_sharing.SHARED_FILE_SYSTEMS:
        pytest.skip("the temporary directory is a tmpfs here")
    server = make_server(shm_dir=str(short_dir))
    assert _dram(server).shared is None
    assert not [name for name in os.listdir(short_dir) if name.startswith("kvstore-dram-")]


def test_an_arena_file_that_cannot_be_made_leaves_auto_private_and_fails_true(monkeypatch, tmp_path, caplog) -> None:
    missing = str(tmp_path / "gone")  # shared, says the rule; the file cannot be created there
    monkeypatch.setattr(dram_sharing, "decide", lambda cfg, host, disk=0: DramSharing(missing, "auto: shared", False))
    with caplog.at_level(logging.WARNING, logger="kvstore.server"):
        tiers = build_tiers(cfg(dram=16 * MiB, shm_dir=missing))
    assert [t for t in tiers if isinstance(t, ArenaTier)][0].shared is None
    assert "it is private" in caplog.text
    monkeypatch.setattr(dram_sharing, "decide", lambda cfg, host, disk=0: DramSharing(missing, "true", True))
    with pytest.raises(OSError):
        build_tiers(cfg(dram=16 * MiB, shm_dir=missing))


def test_a_closed_shared_arena_gives_its_memory_back_while_its_tier_object_lives() -> None:
    """The file is reserved whole: a mapping that outlived its store (a tier kept by a test's traceback, a process
    that embeds stores) held all of it, and the suite ran out of memory so. Its pages go at close now."""
    if HostFacts.read("/dev/shm").file_system != "tmpfs":
        pytest.skip("no tmpfs /dev/shm here")
    tier = ArenaTier(8 * MiB, share_dir="/dev/shm", share_index=False)
    assert tier.shared is not None
    ctypes.memset(tier.shared.base, 0xAB, tier.shared.size)
    assert ctypes.string_at(tier.shared.base + 4096, 16) == b"\xab" * 16
    tier.close()
    assert not os.path.exists(tier.shared.path)
    assert ctypes.string_at(tier.shared.base, 4096) == bytes(4096)  # still mapped; its pages are gone
    assert ctypes.string_at(tier.shared.base + tier.shared.size - 4096, 4096) == bytes(4096)


def _files_of_this_process(directory: str) -> set[str]:
    return {name for name in os.listdir(directory) if name.startswith(f"kvstore-dram-{os.getpid()}-")}


def test_an_index_with_no_room_takes_its_arenas_file_with_it(monkeypatch) -> None:
    """The arena's file is made first; an index that then finds no room must not leave it holding memory (auto's
    store goes on with a private arena)."""
    if HostFacts.read("/dev/shm").file_system != "tmpfs":
        pytest.skip("no tmpfs /dev/shm here")

    def no_room(directory: str, named_bytes: int):
        raise OSError(errno.ENOSPC, "No space left on device")

    before = _files_of_this_process("/dev/shm")
    monkeypatch.setattr(arena_index.ArenaIndex, "create", staticmethod(no_room))
    with pytest.raises(OSError):
        ArenaTier(8 * MiB, share_dir="/dev/shm")
    assert _files_of_this_process("/dev/shm") == before


@pytest.mark.parametrize("stage", ["nvme", "constructor", "start", "bind"])
def test_a_store_that_fails_to_start_leaves_no_file_behind(stage: str, tmp_path) -> None:
    """Its arena and index were made before the config was refused; they held --dram of /dev/shm (1 GiB by default)
    until a later start swept them, and a process that embeds stores (the tests) kept every one."""
    if HostFacts.read("/dev/shm").file_system != "tmpfs":
        pytest.skip("no tmpfs /dev/shm here")
    (tmp_path / "empty").write_text("\n")
    taken = socket.create_server(("127.0.0.1", 0))
    (tmp_path / "a-file").write_text("not a directory")
    refused = {
        "nvme": {"nvme_dir": str(tmp_path / "a-file" / "nvme")},  # made after the arena, and it cannot be
        "constructor": {"listen": "0.0.0.0:0"},  # plaintext beyond loopback, without --insecure-plaintext
        "start": {"metrics_port": free_port(), "metrics_token_file": str(tmp_path / "empty")},
        "bind": {"listen": f"127.0.0.1:{taken.getsockname()[1]}"},
    }[stage]
    before = _files_of_this_process("/dev/shm")
    try:
        with pytest.raises((ValueError, OSError)):
            StoreServer(cfg(**{"dram": 16 * MiB, "share_dram": "true", "listen": "127.0.0.1:0", **refused})).start()
    finally:
        taken.close()
    assert _files_of_this_process("/dev/shm") == before


def test_a_sweep_takes_what_a_killed_store_of_the_same_pid_left(tmp_path) -> None:
    """A container's store is pid 1 at every restart: a file with this pid and another process's mark is a killed
    predecessor's, and goes; this process's own files stay."""
    mine = tmp_path / shmfile.name_of(shmfile.DRAM_PREFIX)
    my_mark = mine.name.rpartition("-")[2][: shmfile.MARK_HEX]
    other_mark = "0" * shmfile.MARK_HEX if my_mark != "0" * shmfile.MARK_HEX else "1" * shmfile.MARK_HEX
    predecessors = tmp_path / f"{shmfile.DRAM_PREFIX}{os.getpid()}-{other_mark}{'a' * 24}"
    for path in (mine, predecessors):
        path.write_bytes(b"")
    assert sweep(str(tmp_path)) == 1
    assert mine.exists() and not predecessors.exists()


def test_a_store_process_that_will_not_stop_is_killed_and_its_files_swept(caplog) -> None:
    """store_process (benches, demos, tests) waited for SIGTERM, then killed: the killed store's shared arena and
    index stayed in /dev/shm, holding --dram of memory, until some later store's start swept them."""
    if HostFacts.read("/dev/shm").file_system != "tmpfs":
        pytest.skip("no tmpfs /dev/shm here")
    with caplog.at_level(logging.WARNING, logger="kvstore.server.process"):
        with store_process("--dram", "64MiB", "--share-dram", "true", stop_seconds=1) as (_, proc):
            made = {n for n in os.listdir("/dev/shm") if n.startswith(f"kvstore-dram-{proc.pid}-")}
            assert made  # the arena and its index
            os.kill(proc.pid, signal.SIGSTOP)  # a SIGTERM now waits, as a store stuck in its stop would
    assert proc.returncode == -signal.SIGKILL
    assert not made & set(os.listdir("/dev/shm"))
    assert f"pid {proc.pid}) did not stop in 1 s: killed" in caplog.text


def test_the_shm_dir_a_store_process_uses(tmp_path) -> None:
    assert shm_dir_of(["--listen", "127.0.0.1:1", "--dram", "1GiB"], {}) == ServeConfig.shm_dir
    (tmp_path / "serve.yaml").write_text("shm-dir: /c\n")
    assert shm_dir_of(["--config", str(tmp_path / "serve.yaml")], {}) == "/c"
    assert shm_dir_of(["--shm-dir", "/a"], {"KVSTORE_SHM_DIR": "/b"}) == "/a"
    assert shm_dir_of(["--shm-dir=/a"], {}) == "/a"
    assert shm_dir_of([], {"KVSTORE_SHM_DIR": "/b"}) == "/b"
