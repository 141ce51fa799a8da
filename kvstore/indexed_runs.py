"""The compiled Get of a prefix that the store's index names whole in one NVMe segment file
(``indexed_run_kernels.py``): ``ready()`` (the first call starts compiling, or loading numba's cache, on a daemon
thread; False until done, and always without numba or a CPU the kernels take), ``kernels()`` (the module, once
ready) and ``COMPILED``, the ``BackgroundCompile`` behind both (``warm_up()`` compiles on the calling thread: a
client's ``DiskReader.start``, tests). Imports no numba itself.

``IndexedRead(status, rows, rows_usable, again)``: what one such Get came to (``DiskReader.read_indexed``): ``served`` (every block
read, checked and still named as probed), else whether ``rows`` (the probe's, as ``ArenaIndexView.find`` makes
them) can take the Get on through the general path (``rows_usable``: the blocks are named, not as one run of one
open file), or the store is to be asked (a block not named, one that failed its read or check, or an entry that
changed meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore import arena_index, memops_jit
from kvstore.background_compile import BackgroundCompile


@dataclass(frozen=True, slots=True)
class IndexedRead:
    status: int  # ``indexed_run_kernels.find_and_read``'s
    rows: np.ndarray
    rows_usable: bool = False
    again: bool = False  # served, and this reader had read one of the records before

    @property
    def served(self) -> bool:
        return self.status == 0


def kernels() -> Any:
    from kvstore import indexed_run_kernels

    return indexed_run_kernels


def _compile() -> None:
    kernels().warm_up()


COMPILED = BackgroundCompile("kvstore-indexed-runs-jit", memops_jit.AVAILABLE and arena_index.AVAILABLE, _compile)


def ready() -> bool:
    return COMPILED.ready()


def read_before(marks: np.ndarray, rows: np.ndarray) -> bool:
    """``indexed_run_kernels.read_before`` (compiled once ready, else as numpy array operations)."""
    if ready():
        return bool(kernels().read_before(marks, rows))
    entries, seqs = rows[:, 2].astype(np.int64), rows[:, 3].astype(np.uint32)
    again = bool((marks[entries] == seqs).any())
    marks[entries] = seqs
    return again
