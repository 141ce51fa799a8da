"""CopyPool: a batch's copies over a few threads. Whatever fails, no job still runs once a call returns."""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.lanes.copypool import CopyPool


def test_run_keeps_order_and_spreads_big_batches():
    pool = CopyPool(2)
    try:
        names: set[str] = set()

        def job(i: int) -> int:
            names.add(threading.current_thread().name)
            return i * i

        assert pool.run(job, list(range(10)), [1 << 20] * 10) == [i * i for i in range(10)]
        assert len(names) == 2  # 10 MiB: split over both threads
        names.clear()
        assert pool.run(job, [3, 4], [10, 10]) == [9, 16] and len(names) == 1  # small: stays here
    finally:
        pool.close()


def test_a_failing_run_waits_for_the_others_before_raising():
    pool = CopyPool(2)
    finished: list[int] = []
    try:

        def job(i: int) -> int:
            if i == 0:
                raise OSError("this run fails at once")
            time.sleep(0.2)  # the other run is still copying when the first fails
            finished.append(i)
            return i

        with pytest.raises(OSError):
            pool.run(job, [0, 1], [8 << 20, 8 << 20])
        assert finished == [1]  # run() returned only after it
    finally:
        pool.close()


def test_side_by_side_runs_different_jobs_at_once_and_waits_on_failure():
    pool = CopyPool(2)
    try:
        started = threading.Barrier(2, timeout=5)

        def first() -> str:
            started.wait()  # both running at the same time, or this times out
            return "here"

        def second() -> str:
            started.wait()
            return threading.current_thread().name

        here, there = pool.side_by_side([first, second])
        assert here == "here" and there.startswith("kvstore-copy")

        done: list[str] = []

        def failing() -> None:
            raise ValueError("first job fails")

        def slow() -> None:
            time.sleep(0.2)
            done.append("slow")

        with pytest.raises(ValueError):
            pool.side_by_side([failing, slow])
        assert done == ["slow"]
    finally:
        pool.close()


def test_one_thread_runs_everything_in_order():
    pool = CopyPool(1)
    assert pool.side_by_side([lambda: 1, lambda: 2]) == [1, 2]
    assert pool.run(lambda i: i + 1, [1, 2, 3], [8 << 20] * 3) == [2, 3, 4]
    pool.close()
