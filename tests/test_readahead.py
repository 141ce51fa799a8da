"""ReadAhead's choice of thread: a Get of one small window is read by the consumer at its first wait, anything
larger (or of several windows) on the reader threads; either way every lease is ready when waited on and a
read's error reaches the wait of that window."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from kvstore.store.readahead import INLINE_BYTES, ReadAhead


@dataclass
class FakeLease:
    stored_length: int
    buffer: Any = None  # None: only a lower tier holds it


class Recorder:
    """A materialize that fills every cold lease and notes the thread it ran on; ``fail`` raises instead."""

    def __init__(self, fail: bool = False):
        self.threads: list[str] = []
        self.fail = fail

    def __call__(self, leases, on_ready):
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise OSError("EIO")
        for lease in leases:
            if lease is not None and lease.buffer is None:
                lease.buffer = b"x"
        on_ready(list(range(len(leases))))


@pytest.fixture
def pool():
    with ThreadPoolExecutor(2, thread_name_prefix="reader") as executor:
        yield executor


def windows_of(block: int, count: int, per_window: int) -> list[list[FakeLease]]:
    leases = [FakeLease(block) for _ in range(count)]
    return [leases[i : i + per_window] for i in range(0, count, per_window)]


@pytest.mark.parametrize(
    ("block", "count", "per_window", "inline"),
    [
        (64 << 10, 32, 32, True),  # 2 MiB in one window: the consumer reads it
        (INLINE_BYTES // 4, 4, 4, True),  # exactly the limit
        (INLINE_BYTES // 4, 5, 5, False),  # past it
        (64 << 10, 32, 16, False),  # two windows: the next is read while the first is sent
    ],
)
def test_one_small_window_is_read_by_the_consumer_and_anything_else_by_the_readers(
    pool, block, count, per_window, inline
):  # fmt: skip
    materialize = Recorder()
    windows = windows_of(block, count, per_window)
    reads = ReadAhead(materialize, windows, pool)
    for w, window in enumerate(windows):
        for j in range(len(window)):
            reads.wait(w, j)
            assert window[j].buffer is not None
    reads.close()
    me = threading.current_thread().name
    assert (materialize.threads == [me] * len(windows)) == inline
    assert inline or all(t.startswith("reader") for t in materialize.threads)


@pytest.mark.parametrize("block", [64 << 10, 1 << 20])
def test_a_read_error_reaches_the_wait_on_either_thread(pool, block):
    windows = windows_of(block, 32, 32)
    reads = ReadAhead(Recorder(fail=True), windows, pool)
    with pytest.raises(OSError, match="EIO"):
        reads.wait(0, 0)
    with pytest.raises(OSError, match="EIO"):
        reads.ready(0, 1)
    reads.close()


def test_a_window_held_in_memory_needs_no_read_at_all(pool):
    materialize = Recorder()
    windows = [[FakeLease(64 << 10, buffer=b"hot") for _ in range(4)]]
    reads = ReadAhead(materialize, windows, pool)
    assert all(reads.ready(0, j) for j in range(4))
    reads.close()
    assert materialize.threads == []
