"""bench.after_pause end to end, shortened: every step runs after every pause, through a real kvstore serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import after_pause


def test_every_step_is_timed_after_every_pause_and_removes_its_file(tmp_path: Path) -> None:
    out = tmp_path / "pause.json"
    after_pause.main(["--quick", "--reps", "2", "--pauses", "0,1", "--dir", str(tmp_path / "disk"), "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == ["memcpy", "socket", "disk", "shm_get", "tcp_get", "tcp_get_64k"]
    for r in rows:
        assert r["p50_ms_0"] > 0 and r["p50_ms_1"] > 0 and r["slowdown_1"] > 0
        assert r["bytes"] == (2 << 20 if r["step"] == "tcp_get_64k" else 16 << 20)
    assert list((tmp_path / "disk").iterdir()) == []  # the extents' file went with its directory


@pytest.mark.parametrize("pauses", ["", "a,b", "0,-5"])
def test_pauses_must_be_numbers_from_0(pauses: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--pauses"):
        after_pause.main(["--pauses", pauses, "--dir", str(tmp_path)])
