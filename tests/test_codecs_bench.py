"""bench.codecs runs end to end (synthetic KV, tiny) and writes the rows it promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from bench import codecs as bench_codecs  # noqa: E402
from bench.common import format_table  # noqa: E402


def test_bench_codecs_synthetic(tmp_path: Path) -> None:
    out = tmp_path / "codecs.json"
    argv = ["--synthetic", "--tokens", "32", "--reps", "1", "--dtypes", "bfloat16", "--out", str(out)]
    rows = bench_codecs.main(argv)
    doc = json.loads(out.read_text())
    assert doc["bench"] == "codecs" and len(doc["rows"]) == len(rows) == 3 * 6
    coded = [r for r in doc["rows"] if r["variant"] in ("dense", "half-zero")]
    assert len(coded) == 2 * 6
    for row in coded:
        assert {"codec", "dtype", "ratio", "encode_gbps", "decode_gbps", "source"} <= set(row)
        assert row["source"] == "synthetic" and row["ratio"] > 0.9
    links = [r for r in doc["rows"] if r["variant"].startswith("link")]
    assert all(r["sequential_gbps"] > 0 and r["pipelined_gbps"] > 0 for r in links)
    fp8 = next(r for r in doc["rows"] if r["codec"] == "fp8" and r["variant"] == "dense")
    assert fp8["max_err_per_vecmax"] <= 0.0668 and 0.9 < fp8["attn_cosine"] <= 1.0 + 1e-6
    lz4 = next(r for r in doc["rows"] if r["codec"] == "lz4" and r["variant"] == "half-zero")
    assert lz4["ratio"] > 1.8


def test_format_table_aligns_and_leaves_blanks() -> None:
    text = format_table([{"a": "x", "b": 1.5}, {"a": "yy", "c": 2}])
    header, rule, first, second = text.splitlines()
    assert header.split() == ["a", "b", "c"] and set(rule) == {"-", " "}
    assert first.split() == ["x", "1.5"] and second.split() == ["yy", "2"]
    assert second.index("2") == header.index("c")  # blank cell under b keeps the columns aligned
