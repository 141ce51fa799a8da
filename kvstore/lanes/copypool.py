"""Copies of one batch spread over a few threads: a single core copying with its CRC fused in moves about
11-14 GB/s here, two move about 17 (the memory bus, not the core, is then the limit).

``CopyPool(threads).run(fn, items, weights) -> [fn(item) ...]`` splits ``items`` into at most ``threads``
contiguous runs of about equal weight (bytes), runs the first on the calling thread and the others on the
pool, and returns the results in order (``run_batches(fn, items, weights)`` hands each thread its whole run in
one call); ``side_by_side(jobs)`` runs different jobs at once, the first here; ``start(each)`` starts every
thread now, each running ``each`` once. Batches under ``SPLIT_BYTES`` (or the caller's ``split_bytes``) stay on
the calling thread: handing work to another thread costs tens of microseconds. ``fn`` must let go of the GIL for its bulk (numpy copies,
CRC32C and process_vm_readv/writev all do). When one run fails, ``run`` still waits for the others before it
raises: none of them may touch the caller's buffers once it returns.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

SPLIT_BYTES = 4 << 20


def default_threads() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


class CopyPool:
    def __init__(self, threads: int | None = None, name: str = "kvstore-copy"):
        self.threads = threads or default_threads()
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=name) if self.threads > 1 else None

    def run(
        self, fn: Callable[[T], R], items: Sequence[T], weights: Sequence[int], split_bytes: int = SPLIT_BYTES
    ) -> list[R]:
        return self.run_batches(lambda part: [fn(item) for item in part], items, weights, split_bytes)

    def run_batches(
        self,
        fn: Callable[[Sequence[T]], list[R]],
        items: Sequence[T],
        weights: Sequence[int],
        split_bytes: int = SPLIT_BYTES,
    ) -> list[R]:
        """``run`` for a ``fn`` that takes a whole contiguous run of items (one compiled call for many blocks)
        and returns one result per item. The first run goes on the calling thread; every run is waited for,
        even when one fails."""
        if self._pool is None or len(items) < 2 or sum(weights) < split_bytes:
            return fn(items)
        runs = _split(weights, min(self.threads, len(items)))
        futures = [self._pool.submit(fn, items[r.start : r.stop]) for r in runs[1:]]
        try:
            results = fn(items[runs[0].start : runs[0].stop])
        finally:
            wait(futures)
        for f in futures:
            results.extend(f.result())
        return results

    def side_by_side(self, jobs: Sequence[Callable[[], R]]) -> list[R]:
        """Run ``jobs[0]`` on the calling thread and the others on the pool (on this thread after it where the
        pool has no thread); their results in order. Waits for all of them even when one fails."""
        if self._pool is None:
            return [job() for job in jobs]
        futures = [self._pool.submit(job) for job in jobs[1:]]
        try:
            first = jobs[0]()
        finally:
            wait(futures)
        return [first, *(f.result() for f in futures)]

    def start(self, each: Callable[[], object], timeout: float = 10.0) -> None:
        """Start every thread of the pool now (an executor starts them as jobs come), each running ``each`` once
        (a thread-local buffer faulted in, say); returns when all have, or after ``timeout``."""
        if self._pool is None:
            return
        n = self.threads - 1
        started = threading.Barrier(n, timeout=timeout)

        def job() -> None:  # held until every thread has one: no job lands on a thread that finished its own
            each()
            try:
                started.wait()
            except threading.BrokenBarrierError:
                pass

        wait([self._pool.submit(job) for _ in range(n)], timeout=timeout)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _split(weights: Sequence[int], parts: int) -> list[range]:
    """Contiguous runs of indices, about ``sum(weights) / parts`` each; every run non-empty."""
    parts = max(1, min(parts, len(weights)))
    runs: list[range] = []
    total, start, acc = sum(weights), 0, 0
    for i, w in enumerate(weights):
        acc += w
        left_items, left_runs = len(weights) - i - 1, parts - len(runs) - 1
        if left_runs > 0 and (acc >= total * (len(runs) + 1) / parts or left_items == left_runs):
            runs.append(range(start, i + 1))
            start = i + 1
    runs.append(range(start, len(weights)))
    return runs
