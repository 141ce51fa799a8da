"""bench.compiled_send end to end, shortened: two real kvstore serve processes, the compiled one sending compiled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import compiled_send
from kvstore import send_runs


@pytest.mark.skipif(not send_runs.COMPILED.available, reason="the compiled send needs numba and Linux on x86-64")
def test_both_ways_are_timed_and_only_one_sends_compiled(tmp_path: Path) -> None:
    out = tmp_path / "send.json"
    compiled_send.main(["--sizes", "64KiB", "--prefixes", "2", "--dir", str(tmp_path / "disk"), "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["block_bytes"] == 64 << 10 and row["prefixes"] == 2
    for way in ("python", "compiled"):
        assert row[f"{way}_p50_ms"] > 0 and row[f"{way}_vs_raw"] > 0 and row[f"{way}_cpu_ms"] >= 0
    assert row["speedup"] > 0
    assert row["compiled_bytes"] >= 2 * 32 * (64 << 10)  # every NVMe block of its Gets went out compiled
    assert list((tmp_path / "disk").iterdir()) == []  # the stores' tiers and the raw extents went with them


@pytest.mark.parametrize("sizes", ["", "1000", "64KiB,x"])
def test_sizes_must_be_whole_pages(sizes: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--sizes"):
        compiled_send.main(["--sizes", sizes, "--dir", str(tmp_path)])
