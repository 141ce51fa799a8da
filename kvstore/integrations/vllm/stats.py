"""Counters the connector's sides publish for tests, benchmarks and operators (extra config ``stats_path``).

- ``StatsFile(path).write(counters)``: replaces ``path`` (JSON of the dataclass's fields plus ``pid`` and
  ``time``) atomically, so a reader never sees half a file. Each side writes its own file, because in
  vLLM's multiprocessing mode the two sides live in a process the user's code cannot reach.
- ``stats_files(directory, rank=0) -> (scheduler_path, worker_path)``: a tensor/pipeline-parallel engine's
  workers write one file each (``worker.json`` for rank 0, ``worker-rank<r>.json`` for the others).
- ``read_stats(path) -> dict``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any


def stats_files(directory: str | Path, rank: int = 0) -> tuple[Path, Path]:
    d = Path(directory)
    return d / "scheduler.json", d / ("worker.json" if rank == 0 else f"worker-rank{rank}.json")


def read_stats(path: str | Path) -> dict[str, Any]:
    try:
        return dict(json.loads(Path(path).read_text(encoding="utf-8")))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


class StatsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, counters: Any, **extra: Any) -> None:
        data = {**asdict(counters), **extra, "pid": os.getpid(), "time": time.time()}
        tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            pass  # counters are for observers: a full disk must not fail a request
