"""bench.nvme_native_floor: its C CRC32C agrees with the store's, and a shortened run times every step on real
O_DIRECT files over a real loopback connection, then removes them."""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

import pytest

from bench import nvme_native_floor
from kvstore.checksum import crc32c

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not (shutil.which("cc") or shutil.which("gcc")),
    reason="needs a C compiler for x86-64 (the SSE4.2 CRC32C instruction)",
)


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return nvme_native_floor.build(tmp_path_factory.mktemp("native"))


# across the three-stream path's 12 KiB strides and the 8-byte words
@pytest.mark.parametrize("length", [0, 1, 9, 8191, 12287, 12288, 12289, 65536, 3 * 12288 + 4100])
def test_its_crc32c_is_the_stores(binary: Path, tmp_path: Path, length: int) -> None:
    data = os.urandom(length)
    (tmp_path / "data").write_bytes(data)
    assert nvme_native_floor.crc_of(binary, tmp_path / "data") == crc32c(data)


def test_every_step_is_timed_and_its_file_removed(binary: Path, tmp_path: Path) -> None:
    # 3 records a piece of 12 KiB blocks: 11 pieces, the last one short, on two reading threads
    result = nvme_native_floor.run_once(binary, tmp_path, 12 << 10, rounds=3, piece=3 * (16 << 10), readers=2)
    assert result["pieces"] == 11 and result["block"] == 12 << 10
    for step in ("raw_ms", "serial_ms", "piped_ms"):
        assert len(result[step]) == 3 and all(ms > 0 for ms in result[step])
    assert result["server_cpu_ms_per_get"] > 0 and result["crc_gbps"] > 0
    assert list(tmp_path.iterdir()) == []


def test_main_reports_a_row_per_block_and_readers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvme_native_floor, "BLOCKS", (4 << 10, 64 << 10))
    out = tmp_path / "floor.json"
    nvme_native_floor.main(["--quick", "--readers", "1,2", "--dir", str(tmp_path / "disk"), "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["block"], r["readers"]) for r in rows] == [("4KiB", 1), ("4KiB", 2), ("64KiB", 1), ("64KiB", 2)]
    assert all(r["piped_vs_raw"] > 0 and r["serial_vs_raw"] > 0 for r in rows)
    assert list((tmp_path / "disk").iterdir()) == []


@pytest.mark.parametrize("readers", ["", "a", "0", "1,9"])
def test_readers_must_be_counts_from_1_to_8(readers: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--readers"):
        nvme_native_floor.main(["--readers", readers, "--dir", str(tmp_path)])


def test_a_bad_block_size_is_refused_with_its_reason(binary: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="multiple of 4096"):
        nvme_native_floor.run_once(binary, tmp_path, 1000, rounds=1, piece=1 << 20, readers=1)
