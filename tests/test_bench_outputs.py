"""Benchmarks write only where told: no --out means no JSON, a figure goes where --plot says or beside --out
(same stem, .png), and nothing lands in the committed bench/results by default."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
from pathlib import Path

import pytest

from bench.common import plot_path, positive
from tests.conftest import ROOT

# every module of bench/ with a main(), but the processes a bench starts (``*_worker``), which take no --out
BENCHES = sorted(
    p.stem for p in (ROOT / "bench").glob("*.py") if "\ndef main(" in p.read_text() and not p.stem.endswith("_worker")
)


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def parser_of(module_name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The bench's argument parser, caught as its main() parses (nothing of the bench runs)."""

    def catch(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    module = importlib.import_module(f"bench.{module_name}")
    with pytest.raises(_Parsed) as caught:
        module.main([])
    return caught.value.parser


def test_every_bench_is_covered():
    assert {"ttft", "replay", "soak", "transfer", "disk", "gpu_check", "codecs", "cluster"} <= set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_no_output_file_by_default(name, monkeypatch):
    defaults = {a.dest: a.default for a in parser_of(name, monkeypatch)._actions}
    assert "out" in defaults, f"bench.{name} has no --out"
    assert defaults["out"] is None, f"bench.{name} writes {defaults['out']} unless told otherwise"
    assert defaults.get("plot") is None, f"bench.{name} plots to {defaults.get('plot')} unless told otherwise"


@pytest.mark.parametrize("flags", [["--minutes", "-1"], ["--clients", "0"], ["--rate", "nan"], ["--window", "inf"]])
def test_counts_rates_and_durations_must_be_above_0(flags, capsys):
    soak = importlib.import_module("bench.soak")
    with pytest.raises(SystemExit) as exit_:  # -1 minutes ended in an IndexError after starting a store
        soak.main([*flags])
    assert exit_.value.code == 2 and f"argument {flags[0]}: must be above 0" in capsys.readouterr().err
    assert positive(int)("3") == 3 and positive(float)("0.25") == 0.25


def test_plot_path():
    assert plot_path(None, None) is None
    assert plot_path(Path("/tmp/x.json"), None) == Path("/tmp/x.png")
    assert plot_path(Path("/tmp/x.json"), Path("/elsewhere/y.png")) == Path("/elsewhere/y.png")
    assert plot_path(None, Path("y.png")) == Path("y.png")


def test_replay_plots_beside_out_and_leaves_the_committed_figure(tmp_path):
    from bench import replay

    committed = ROOT / "bench/results/replay.png"
    before = hashlib.sha256(committed.read_bytes()).hexdigest() if committed.exists() else None
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i, "input_length": 512, "output_length": 1, "hash_ids": [i % 7, 100 + i]} for i in range(40)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    replay.main(["--trace", str(trace), "--capacities", "0.5", "--jobs", "1", "--out", str(tmp_path / "x.json")])
    assert (tmp_path / "x.json").exists() and (tmp_path / "x.png").stat().st_size > 1000
    after = hashlib.sha256(committed.read_bytes()).hexdigest() if committed.exists() else None
    assert after == before
