"""bench.disk's baselines on a small file: the raw loop (fio's stand-in) and the file-per-block store."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import disk

MiB = 1 << 20


def test_prefix_extent_is_what_the_tier_lays_down():
    # a record is a 4 KiB header page plus the payload padded to 4 KiB; a prefix is 32 records
    assert disk.prefix_extent(64 << 10) == 32 * (4096 + 65536)
    assert disk.prefix_extent(5000) == 32 * (4096 + 8192)


def test_raw_python_measures_sequential_and_random_extent_reads(tmp_path: Path):
    extent = disk.prefix_extent(64 << 10)
    try:
        w, r, rand = disk.raw_python(tmp_path / "raw.bin", 8 * extent, (extent,))
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs)
        pytest.skip(f"O_DIRECT refused under {tmp_path}: {e}")
    assert w > 0 and r > 0 and set(rand) == {extent} and rand[extent] > 0
    assert not (tmp_path / "raw.bin").exists()


def test_tier_and_file_per_block_read_back_what_they_wrote(tmp_path: Path):
    w = disk.Workload(64 << 10, 4 * MiB)
    try:
        tier = disk.tier_once(tmp_path, w)
        fw, fr = disk.file_per_block_once(tmp_path, w)
    except OSError as e:
        pytest.skip(f"O_DIRECT refused under {tmp_path}: {e}")
    assert set(tier) == {"w", "r", "r_shuffled"} and min(tier.values()) > 0
    assert fw > 0 and fr > 0


def test_interleaved_reads_measure_all_three_and_clean_up(tmp_path: Path):
    w = disk.Workload(64 << 10, 4 * MiB)
    fw = disk.Workload(64 << 10, 2 * MiB, seed=1)
    try:
        rates = disk.interleaved_reads(tmp_path, w, fw)
    except OSError as e:
        pytest.skip(f"O_DIRECT refused under {tmp_path}: {e}")
    assert set(rates) == {"tier", "fpb", "raw"} and min(rates.values()) > 0
    assert not any(tmp_path.iterdir())


def test_nvme_get_bench_measures_gets_through_a_store_process(tmp_path: Path):
    from tqdm import tqdm

    from bench import nvme_get

    try:
        row = nvme_get.measure(64 << 10, 3, tmp_path, tqdm(disable=True))
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs)
        pytest.skip(f"O_DIRECT refused under {tmp_path}: {e}")
    assert row["block_bytes"] == 64 << 10 and row["prefixes"] == 3
    steps = ("raw", "nvme_shm", "nvme_pool", "nvme_tcp", "nvme_grpc", "dram_shm", "dram_pool", "dram_tcp", "dram_grpc")
    assert min(row[f"{s}_p50_ms"] for s in steps) > 0
    assert row["grpc_dram_vs_raw"] > 0 and row["grpc_nvme_vs_dram"] > 0 and row["pool_vs_shm_speedup"] > 0
    assert row["pool_dram_vs_shm_speedup"] > 0
    assert row["pool_bytes"] == 3 * 32 * (64 << 10) and isinstance(row["pool_huge_pages"], bool)  # none written
    assert row["nvme_hits"] + row["dram_hits"] == 4 * 3 * 32  # the four NVMe kinds' prefixes, each from one tier
    assert row["socket_gbps"] > 0 and 0 < row["tcp_ceiling_vs_raw"] <= 1
    # each store's CPU per Get it served: a store that read and checked 32 blocks spent some
    assert row["nvme_store_cpu_ms"] > 0 and row["dram_store_cpu_ms"] >= 0 and "disk_store_cpu_ms" in row
    assert row["nvme_store_cpu_vs_raw"] == row["nvme_store_cpu_ms"] / row["raw_p50_ms"]


@pytest.mark.parametrize("kind", ["disk-shm", "nvme-tcp"])
def test_nvme_get_bench_takes_only_the_kinds_asked(tmp_path: Path, kind: str):
    """``--kinds``: those Gets in turn with the raw reads, and the ratios whose steps ran."""
    from tqdm import tqdm

    from bench import nvme_get

    try:
        row = nvme_get.measure(64 << 10, 3, tmp_path, tqdm(disable=True), kinds=(kind,))
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs)
        pytest.skip(f"O_DIRECT refused under {tmp_path}: {e}")
    assert row["raw_p50_ms"] > 0 and row["raw_dst_p50_ms"] > 0 and "dram_floor_p50_ms" not in row
    if kind == "disk-shm":
        assert row["disk_nvme_vs_raw"] == row["raw_p50_ms"] / row["disk_shm_p50_ms"]
        assert row["disk_nvme_vs_raw_dst"] > 0 and row["disk_nvme_gbps"] > 0 and "nvme_store_cpu_ms" not in row
        absent = ("nvme_shm_p50_ms", "nvme_tcp_p50_ms", "tcp_nvme_vs_raw")
    else:  # the store-read TCP lane: its store's CPU per Get too, nothing of the --share-nvme store's
        assert row["tcp_nvme_vs_raw"] == row["raw_p50_ms"] / row["nvme_tcp_p50_ms"]
        assert row["nvme_store_cpu_vs_raw"] == row["nvme_store_cpu_ms"] / row["raw_p50_ms"]
        absent = ("disk_shm_p50_ms", "disk_nvme_vs_raw", "nvme_shm_p50_ms", "disk_store_cpu_ms")
    assert not any(k in row for k in (*absent, "dram_shm_p50_ms", "grpc_dram_vs_raw", "shm_dram_vs_floor"))


def test_nvme_get_bench_takes_the_floor_beside_the_stores(tmp_path: Path):
    """``--floor``: the same Gets from a process that only reads, checks and hands off, in turn with the rest."""
    from tqdm import tqdm

    from bench import nvme_get

    try:
        row = nvme_get.measure(
            64 << 10, 3, tmp_path, tqdm(disable=True), kinds=("nvme-shm", "disk-shm"), with_floor=True
        )
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs)
        pytest.skip(f"O_DIRECT refused under {tmp_path}: {e}")
    assert row["shm_floor_vs_raw"] == row["raw_p50_ms"] / row["floor_shm_p50_ms"]
    assert row["disk_nvme_vs_floor"] == row["floor_shm_p50_ms"] / row["disk_shm_p50_ms"]  # the client's own reads
    assert "pool_nvme_vs_floor" not in row
    assert row["tcp_floor_vs_raw"] == row["raw_p50_ms"] / row["floor_tcp_p50_ms"]
    assert row["shm_nvme_vs_floor"] == row["floor_shm_p50_ms"] / row["nvme_shm_p50_ms"]
    assert row["grpc_floor_vs_raw"] == row["raw_p50_ms"] / row["floor_grpc_p50_ms"]
    assert row["floor_server_cpu_ms"] > 0 and row["floor_grpc_thread_cpu_ms"] > 0
    assert "tcp_nvme_vs_floor" not in row and "grpc_nvme_vs_floor" not in row  # no such store-read Gets were asked


@pytest.mark.parametrize("piece", [4 * MiB, 256 << 10])  # a prefix in one piece; in 11, two reads in flight
def test_nvme_floor_serves_checked_prefixes_on_both_lanes(tmp_path: Path, piece: int):
    from tqdm import tqdm

    from bench import nvme_floor

    try:
        row = nvme_floor.measure(64 << 10, 3, tmp_path, tqdm(disable=True), piece, 2)
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs)
        pytest.skip(f"O_DIRECT refused under {tmp_path}: {e}")
    assert min(row[f"{s}_p50_ms"] for s in ("raw", "floor_shm", "floor_tcp", "floor_grpc")) > 0
    assert row["shm_floor_vs_raw"] == row["raw_p50_ms"] / row["floor_shm_p50_ms"] and row["floor_server_cpu_ms"] > 0


def test_nvme_floor_checks_what_it_reads(tmp_path: Path):
    """The floor is a floor of checked Gets: a flipped payload byte on disk fails its Get, it is not handed out."""
    import grpc
    import numpy as np

    from bench import nvme_floor

    floor = nvme_floor.Floor(tmp_path, 64 << 10, 1, np.random.default_rng(0))
    try:
        floor.write(0)
        floor.file.written()
        with open(floor.file.path, "r+b") as f:
            for step in ("floor-tcp", "floor-grpc"):
                f.seek(floor.file.extent * floor._extent(step, 0) + 5 * floor.file.record + 4096 + 100)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0xFF]))
        floor.start()
    except OSError as e:
        pytest.skip(f"O_DIRECT refused under {tmp_path}: {e}")
    try:
        assert floor.take("floor-shm", 0) > 0  # its prefix is intact
        with pytest.raises(grpc.RpcError):
            floor.take("floor-grpc", 0)
        with pytest.raises(ConnectionError):
            floor.take("floor-tcp", 0)
    finally:
        floor.close()


def test_nvme_floor_stops_a_server_its_start_left_halfway(tmp_path: Path, monkeypatch):
    """A start that fails after the server is up (here: its TCP connection refused) leaves no server behind."""
    import socket
    import time

    import numpy as np

    from bench import nvme_floor

    floor = nvme_floor.Floor(tmp_path, 64 << 10, 1, np.random.default_rng(0))
    try:
        floor.write(0)
    except OSError as e:
        pytest.skip(f"O_DIRECT refused under {tmp_path}: {e}")

    def refused(*args, **kwargs):
        raise ConnectionRefusedError("refused by the test")

    monkeypatch.setattr(socket, "create_connection", refused)
    with pytest.raises(ConnectionRefusedError):
        floor.start()
    server = floor.server
    assert server is not None
    t0 = time.monotonic()
    floor.close()  # at once, not after the 60 s a connected server is given to finish
    assert time.monotonic() - t0 < 10 and server.poll() is not None and floor.server is None


def test_first_gets_bench_times_fresh_clients_reading_nvme_on_every_lane(tmp_path: Path):
    from tqdm import tqdm

    from bench import first_gets

    try:
        rows = first_gets.measure(64 << 10, 4, 1, tmp_path, tqdm(disable=True))
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs)
        pytest.skip(f"O_DIRECT refused under {tmp_path}: {e}")
    assert [(r["lane"], r["start"]) for r in rows] == [
        (lane, s) for lane in first_gets.LANES for s in first_gets.STARTS
    ]
    for r in rows:
        assert r["processes"] == 1 and min(r["start_ms"], r["get1_ms"], r["later_ms"], r["warm_ms"]) > 0
        assert r["get1_vs_warm"] == r["get1_ms"] / r["warm_ms"]
        # both ways' Gets, each of 4 blocks only on NVMe
        assert r["lane_nvme_hits"] == len(first_gets.STARTS) * first_gets.GETS * 4
