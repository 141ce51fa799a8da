"""How one Get's pieces are spread over threads: reads kept in flight while the verified ones are handed on.

``read_pipelined(backend, pool, buffers, pieces, dests, window, on_ready)`` reads and checks a Get's pieces
(``reader.read_one`` each) with up to ``window`` of them in flight, and returns the failed (target, reason). Two
ways of doing it:

- *Readers read, the caller hands on* (``on_caller``: an ``on_ready`` that copies, the shm lane's into its
  client's memory; ``window`` over 1 and more pieces than ``window``): up to ``window`` pool workers do nothing
  but read and check pieces, each putting a verified piece's targets in a queue; the caller takes them off it
  and calls ``on_ready``, so handing one piece on never holds up the next read. Measured (forty-fourth
  session, five runs of ``bench.nvme_get --baseline 7742533 --kinds nvme-shm,...``, docs/nvme_log.md):
  store-read shm Gets of 32-block prefixes held only on NVMe moved from 0.59-0.66 of the raw read to 0.66-0.71
  at 512 KiB blocks and from 0.65-0.80 to 0.77-0.90 at 2 MiB, against each thread reading, checking and
  handing on its own pieces: a thread copying a piece out had been a read not in flight.
- *Each thread its own pieces* (otherwise): the caller and up to ``window - 1`` workers take pieces from one
  queue, and the thread that read a piece also calls ``on_ready``. For an ``on_ready`` that only wakes another
  thread (``ReadAhead``'s, under the TCP lane's and gRPC's senders) a hop through the caller only adds a wake-up;
  and for a 32 x 64 KiB prefix (two pieces) this measured better even with copies: a hand-off costs more there
  than the overlap gains (0.30-0.37 of the raw read against 0.29-0.30).

Either way a worker starts only with a scratch buffer that is free at once, and the caller waits for at most
its own first one (holding none), so Gets sharing the pool and its buffers cannot deadlock; a Get whose workers
cannot start (the pool busy with other Gets' pieces) is read by its caller. Every preadv has returned before
``read_pipelined`` does, whatever failed; an exception from ``on_ready`` or a reader ends the read (no piece is
started after it) and propagates.

``BufferPool`` bounds the scratch memory (``count`` buffers, each as large as the largest piece read so far).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import Any

import numpy as np

from kvstore.tiers.nvme.format import align_up
from kvstore.tiers.nvme.io import IoBackend, aligned_buffer
from kvstore.tiers.nvme.reader import Piece, read_one

Failed = list[tuple[int, str]]  # (target, reason)
# How a piece is read and which of its targets passed: ``read_one`` and ``verified_targets`` for the tier's general
# pieces; ``runs.read_piece`` and ``runs.verified`` for its compiled runs (kvstore/tiers/nvme/runs.py).
ReadPiece = Callable[[IoBackend, Any, np.ndarray, Sequence[Any]], tuple[Failed, np.ndarray]]
Targets = Callable[[Any, Failed], list[int]]
STALL_S = 0.002  # a caller none of whose workers has started after this reads a piece itself


class BufferPool:
    """A fixed number of aligned bounce buffers; borrowing blocks while all are out.

    A buffer too small for a piece is replaced by one that fits (and kept), so
    memory stays at ``count x`` the largest piece read, never per-call allocations.
    """

    def __init__(self, count: int, size: int):
        self.size = size
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(aligned_buffer(size))

    def get(self, nbytes: int) -> np.ndarray:
        buf = self._free.get()
        return buf if len(buf) >= nbytes else aligned_buffer(align_up(nbytes))

    def try_get(self, nbytes: int) -> np.ndarray | None:
        """A buffer if one is free now, else None (for a caller that already holds one: never wait holding)."""
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            return None
        return buf if len(buf) >= nbytes else aligned_buffer(align_up(nbytes))

    def put(self, buf: np.ndarray) -> None:
        self._free.put(buf)


def verified_targets(piece: Piece, failed: Failed) -> list[int]:
    """The targets of ``piece`` whose records passed their checks."""
    if not failed:
        return [t for w in piece.records for t in w.targets]
    lost = {t for t, _ in failed}
    return [t for w in piece.records for t in w.targets if t not in lost]


def read_pipelined(
    backend: IoBackend,
    pool: Executor,
    buffers: BufferPool,
    pieces: Sequence[Any],
    dests: Sequence[Any],
    window: int,
    on_ready: Callable[[list[int]], None] | None = None,
    on_caller: bool = False,
    read: ReadPiece = read_one,
    targets: Targets = verified_targets,
) -> Failed:
    """Read and check ``pieces`` into ``dests`` with up to ``window`` in flight; ``on_ready(targets)`` names each
    piece's verified targets as soon as they are (failed ones left out), from the thread that read them, or
    with ``on_caller`` from the calling thread while the workers only read. Returns the failed (target, reason).
    ``read`` and ``targets``: how a piece is read and which of its targets passed (``pieces[k].nbytes`` is the
    scratch it needs)."""
    if not pieces:
        return []
    todo = deque(pieces)
    handing_on = on_caller and on_ready is not None and 1 < window < len(pieces)
    ready: queue.SimpleQueue[list[int] | BaseException] = queue.SimpleQueue()
    started = threading.Event()

    def work(buf: np.ndarray) -> tuple[Failed, np.ndarray]:
        started.set()
        failed: Failed = []
        try:
            while True:
                try:
                    piece = todo.popleft()
                except IndexError:
                    return failed, buf
                bad, buf = read(backend, piece, buf, dests)
                failed.extend(bad)
                if handing_on:
                    ready.put(targets(piece, bad))
                elif on_ready is not None and (ok := targets(piece, bad)):
                    on_ready(ok)
        except BaseException as e:
            if handing_on:
                ready.put(e)
            raise

    own = buffers.get(pieces[0].nbytes)
    jobs: list[tuple[np.ndarray, Future[tuple[Failed, np.ndarray]]]] = []
    finished = False
    try:
        for _ in range(min(window, len(pieces)) - (0 if handing_on else 1)):
            buf = buffers.try_get(pieces[0].nbytes)
            if buf is None:
                break
            jobs.append((buf, pool.submit(work, buf)))
        if handing_on:
            assert on_ready is not None
            failed, own = _hand_on(
                pieces, todo, ready, started, bool(jobs), own, on_ready, backend, dests, read, targets
            )
        else:
            failed, own = work(own)
        for i, (_buf, job) in enumerate(jobs):
            if job.cancel():  # still queued behind other Gets' pieces: every piece is done already
                continue
            more, final = job.result()
            failed.extend(more)
            jobs[i] = (final, job)
        finished = True
    finally:
        if not finished:
            todo.clear()  # no piece is started after a failure
        for _, job in jobs:
            job.cancel()
        wait([job for _, job in jobs if not job.cancelled()])  # no buffer goes back while a read may land in it
        buffers.put(own)
        for buf, _ in jobs:
            buffers.put(buf)
    return failed


def _hand_on(
    pieces: Sequence[Any],
    todo: deque[Any],
    ready: queue.SimpleQueue[list[int] | BaseException],
    started: threading.Event,
    have_workers: bool,
    own: np.ndarray,
    on_ready: Callable[[list[int]], None],
    backend: IoBackend,
    dests: Sequence[Any],
    read: ReadPiece,
    targets: Targets,
) -> tuple[Failed, np.ndarray]:
    """The caller's part of *readers read, the caller hands on*: ``on_ready`` for every piece the workers
    verified, in the order they land; a piece read here only while none of the workers has started."""
    failed: Failed = []
    left = len(pieces)
    while left:
        if started.is_set() or not todo:
            msg = ready.get()
        else:
            try:
                msg = ready.get(block=have_workers, timeout=STALL_S)
            except queue.Empty:
                try:
                    piece = todo.popleft()
                except IndexError:  # a worker started and took the last one meanwhile
                    continue
                bad, own = read(backend, piece, own, dests)
                failed.extend(bad)
                msg = targets(piece, bad)
        if isinstance(msg, BaseException):
            raise msg
        left -= 1
        if msg:
            on_ready(msg)
    return failed, own
