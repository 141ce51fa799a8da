"""bench.load_or_recompute end to end on the tiny model (the same code path as the SmolLM2 run, smaller)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench import load_or_recompute  # noqa: E402


def test_bench_rows_summary_and_plot(tmp_path):
    out = tmp_path / "lor.json"
    argv = ["--quick", "--model", "tiny", "--regimes", "dram_shm,nvme", "--lengths", "96,160"]
    assert load_or_recompute.main([*argv, "--plot-regimes", "dram_shm,nvme", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert {(r["regime"], r["prompt_tokens"], r["mode"]) for r in rows} == {
        (g, n, m) for g in ("dram_shm", "nvme") for n in (96, 160) for m in ("load", "recompute", "decide")
    }
    for r in rows:
        assert r["ttft_p50_s"] > 0 and r["predicted_s"] > 0 and r["same_first_token"]
        if r["mode"] == "load":
            assert r["loaded_blocks"] == (r["prompt_tokens"] - 32) // 16
        if r["mode"] == "recompute":
            assert r["loaded_blocks"] == 0
        if r["mode"] == "decide":
            assert "ttft_p50_serial_s" in r
    tiers = {g["regime"]: g["tiers"] for g in doc["regimes"]}
    assert set(tiers["nvme"]) == {"nvme"} and set(tiers["dram_shm"]) == {"dram"}
    assert {s["regime"] for s in doc["summary"]} == {"dram_shm", "nvme"}
    assert out.with_suffix(".png").stat().st_size > 0
