"""Half a minute of bench.soak against a store whose NVMe tier fills, evicts by segment and compacts, while the
clients read hits themselves from the shared arena and the segment files: nothing acknowledged is lost or
corrupt, and no request fails."""

from __future__ import annotations

import json

from bench import soak


def test_mixed_load_through_a_full_shared_nvme_tier(tmp_path):
    out = tmp_path / "soak.json"
    soak.main(
        ["--minutes", "0.5", "--window", "3", "--nvme", "32MiB", "--nvme-segment", "2MiB", "--dram", "8MiB"]
        + ["--clients", "4", "--tenants", "2", "--rate", "80"]  # light: the suite's other worker runs beside it
        + ["--share", "--hot", "1.2", "--out", str(out), "--plot", str(tmp_path / "soak.png")]
    )  # its exit status also weighs RSS growth, which half a minute measures poorly: the figures are checked here
    summary = json.loads(out.read_text())["summary"]
    assert summary["ops"] > 1800 and summary["errors"] == 0
    assert summary["corrupt_during_run"] == 0 and summary["final_corrupt"] == 0 and summary["final_nvme_corrupt"] == 0
    assert summary["final_lost"] == 0
    assert summary["final_nvme_evictions"] > 0 and summary["final_nvme_hits"] > 0  # the tier filled and served
    assert summary["final_nvme_extents_lent"] > 0  # and clients read its files themselves
    assert summary["final_nvme_write_amplification"] < 1.5  # segment eviction: compaction copies next to nothing
