"""Plumbing every ``bench/NAME.py`` shares: flags, timing, a printed table, JSON rows.

A benchmark module does::

    from bench.common import parse_args, best_seconds, report

    def main(argv=None):
        args = parse_args("what it measures", argv, configure=lambda p: p.add_argument(...))
        rows = [...]                           # one dict per measured case
        report(rows, args, title="...", columns=[...])

``--quick`` (same code path, fewer repetitions and smaller sizes; under a
minute) and ``--out FILE.json`` are always there. The JSON file holds
``{"bench", "quick", "argv", "host", "started", "seconds", "rows"}`` so a
figure can be traced back to the run that made it (``host.loadavg_at_end``
shows whether other work shared the cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]
_STARTED = time.time()


def parse_args(
    description: str,
    argv: Sequence[str] | None = None,
    configure: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """Flags common to every benchmark plus whatever ``configure`` adds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and smaller sizes (under a minute)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE.json", help="also write the rows as JSON here")
    if configure is not None:
        configure(parser)
    return parser.parse_args(argv)


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` that takes a number above 0 (and finite): a count, a rate or a duration."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def plot_path(out: Path | None, plot: Path | None) -> Path | None:
    """Where a benchmark's figure goes: ``--plot`` when given, else beside ``--out`` (same stem, ``.png``), else
    nowhere. A run writes only where it was told, never over the committed ``bench/results`` by default."""
    if plot is not None:
        return plot
    return out.with_suffix(".png") if out is not None else None


def best_seconds(
    fn: Callable[[], object], reps: int, warmup: int = 1, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The fastest of ``reps`` timed calls of ``fn`` after ``warmup`` untimed ones.

    ``clock=time.thread_time`` measures the calling thread's CPU time instead
    of wall time: the cost of single-threaded work, steady while other jobs
    share the cores (it misses time spent in other threads and in page faults
    the hypervisor absorbs, so report wall time beside it).
    """
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(max(reps, 1)):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def columns_of(rows: Iterable[Row]) -> list[str]:
    """Every key that appears in ``rows``, in first-seen order."""
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)


def format_table(rows: Sequence[Row], columns: Sequence[str] | None = None) -> str:
    """A plain-text table; missing cells are blank."""
    cols = list(columns) if columns else columns_of(rows)
    cells = [[_cell(row[c]) if c in row else "" for c in cols] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) if _numeric(v) else v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _numeric(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def write_json(path: Path, rows: Sequence[Row], args: argparse.Namespace | None = None, bench: str = "") -> None:
    """Write ``rows`` and how they were made to ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "bench": bench,
        "quick": bool(getattr(args, "quick", False)),
        "argv": sys.argv[1:],
        "host": {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(_STARTED)),
        "seconds": round(time.time() - _STARTED, 2),
        "rows": list(rows),
    }
    path.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")


def child_row(module: str, *args: str, timeout: float = 300) -> Row:
    """Run ``python -m bench.<module> --child ARGS`` in a fresh process (from the project's root) and return the
    JSON object its last line of stdout prints; RuntimeError with the tail of its stderr when it fails."""
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", "--child", *args],
        capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"bench.{module} --child {' '.join(args)} failed: {done.stderr[-2000:]}")
    row: Row = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def report(
    rows: Sequence[Row],
    args: argparse.Namespace,
    *,
    title: str = "",
    columns: Sequence[str] | None = None,
    bench: str = "",
) -> None:
    """Print the table and, with ``--out``, write the JSON."""
    if title:
        print(title)
    print(format_table(rows, columns))
    if getattr(args, "out", None):
        write_json(args.out, rows, args, bench=bench)
        print(f"wrote {len(rows)} rows to {args.out}")
