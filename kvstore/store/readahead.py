"""A Get's reads from lower tiers, run in the background so the sender streams blocks as they are verified.

``ReadAhead(materialize, windows, executor)`` takes a Get's lease windows (``lease_windows``) and the
store's ``materialize(leases, on_ready)``. Verbs:

- ``wait(w, j)``: block until lease ``j`` of window ``w`` has its bytes verified in ``lease.buffer`` (a
  missing lease or a DRAM hit at once); raises what the window's read raised (``DataLossError``, ...).
- ``ready(w, j) -> bool``: the same without blocking (a sender flushes what it has before it waits).
- ``wait_new(w, seen) -> positions``: block until some lease of window ``w`` not in ``seen`` is ready, and
  return every such one (a sender that may send blocks in any order takes them as their reads complete); a
  window's read error is raised once nothing ready is left to hand out.
- ``close()``: wait for every read still in flight; call it before the leases are released, since a read
  may still be landing in a slot they hold.
- ``inline``: whether the Get is one window with at most ``INLINE_BYTES`` to read, which the consumer reads
  itself (below); a consumer that can send each piece as it is verified may instead ``materialize`` it with
  that as ``on_ready`` and never wait here (the TCP lane's unordered Gets, ``tcp._send_read``).

Window ``w + 1``'s reads start when the consumer first waits on window ``w``, so the disk reads the next
window while the sender moves the last one; at most two windows are read ahead. Windows without an
NVMe-only lease cost nothing: no thread is involved. Nor does a Get of one window with at most
``INLINE_BYTES`` to read: the consumer reads it itself at its first wait, since handing it to a reader thread
and waking the sender cost more than sending its first blocks during the rest of the read saves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

Materialize = Callable[..., None]
# A TCP lane Get of 32 x 64 KiB only on NVMe read on the lane's thread against on a reader thread, two bench
# workers in turn (/tmp/s36/drive_ab.py, 72 Gets each, both orders twice): 0.83-0.94 of the time; of 32 x 128
# KiB 0.95-1.01, of 32 x 256 KiB 1.03-1.05, of 32 x 512 KiB 1.25-1.29 (the sends no longer overlap the reads).
INLINE_BYTES = 3 << 20


class _Window:
    __slots__ = ("leases", "ready", "done", "error", "future")

    def __init__(self, leases: Sequence[Any]):
        self.leases = leases
        self.ready = {j for j, lease in enumerate(leases) if lease is None or lease.buffer is not None}
        self.done = False
        self.error: BaseException | None = None
        self.future: Future[None] | None = None


def _cold_bytes(leases: Sequence[Any]) -> int:
    return sum(lease.stored_length for lease in leases if lease is not None and lease.buffer is None)


def has_cold(leases: Sequence[Any]) -> bool:
    """Whether any lease of the batch still needs a read from a lower tier."""
    return any(lease is not None and lease.buffer is None for lease in leases)


class ReadAhead:
    def __init__(
        self,
        materialize: Materialize,
        windows: Sequence[Sequence[Any]],
        executor: Executor,
        inline_bytes: int | None = None,  # None: INLINE_BYTES
    ):
        self._materialize, self._executor = materialize, executor
        self._windows = [_Window(w) for w in windows]
        self._cond = threading.Condition()
        self._started = [False] * len(self._windows)
        limit = INLINE_BYTES if inline_bytes is None else inline_bytes
        self.inline = len(windows) == 1 and _cold_bytes(windows[0]) <= limit

    def _start(self, w: int) -> None:
        if w >= len(self._windows) or self._started[w]:
            return
        self._started[w] = True
        win = self._windows[w]
        if not has_cold(win.leases):
            win.done = True
            return
        if self.inline:
            self._read(win)  # errors are the window's, raised by the wait that follows
            return
        win.future = self._executor.submit(self._read, win)

    def _read(self, win: _Window) -> None:
        def mark(positions: list[int]) -> None:
            with self._cond:
                win.ready.update(positions)
                self._cond.notify_all()

        try:
            self._materialize(win.leases, on_ready=mark)
        except BaseException as err:
            with self._cond:
                win.error = err
        finally:
            with self._cond:
                win.done = True
                self._cond.notify_all()

    def _now(self, win: _Window, j: int) -> bool:
        if j in win.ready:
            return True
        if win.error is not None:
            raise win.error
        if win.done:
            return True  # a DRAM hit, a missing block, or a window read with no error
        return False

    def ready(self, w: int, j: int) -> bool:
        self._start(w)
        with self._cond:
            return self._now(self._windows[w], j)

    def wait(self, w: int, j: int) -> None:
        self._start(w)
        self._start(w + 1)
        win = self._windows[w]
        with self._cond:
            while not self._now(win, j):
                self._cond.wait()

    def wait_new(self, w: int, seen: set[int]) -> list[int]:
        self._start(w)
        self._start(w + 1)
        win = self._windows[w]
        with self._cond:
            while True:
                new = [j for j in win.ready if j not in seen]
                if new:
                    return sorted(new)
                if win.error is not None:
                    raise win.error
                if win.done:  # DRAM hits and missing blocks: nothing to read
                    return [j for j in range(len(win.leases)) if j not in seen]
                self._cond.wait()

    def close(self) -> None:
        for win in self._windows:
            if win.future is not None:
                try:
                    win.future.result()
                except BaseException:
                    pass  # already recorded in win.error for whoever waits on it
