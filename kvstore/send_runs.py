"""Runs of NVMe record payloads read, checked and sent as TCP lane DATA frames by one compiled call without the
GIL (``send_run_kernels.read_check_send``): ``RunSender(sock)``, one per connection thread.

- ``send(pieces, names) -> Sent | None``: the pieces (``kvstore.tiers.nvme.runs.RunPiece``, whose ``at`` index
  ``names``, each target's u32 name in its DATA frame) read with asynchronous I/O a few at a time, each piece's
  verified blocks sent in one DATA frame as it lands. ``Sent.verified``: the targets sent (their bytes also
  stay in their destinations); ``Sent.failed``: those that were not read in full or failed their CRC32C
  (neither sent nor servable: the caller reads them again its own way, which tells a corrupt record from a short
  read); an ``OSError`` when a send failed (the connection is broken). None when the kernel's asynchronous I/O is
  not to be had (no numba, not Linux on x86-64, ``io_setup`` refused) or a piece holds more blocks than the
  kernel's ``PIECE_BLOCKS``: nothing was read.
- ``close()``: the AIO context ends (a connection's end).

Each connection's AIO context counts against the host's ``fs.aio-max-nr`` (65536 by default): Linux reserves
``max(depth, 4 x CPUs) x 2`` events a context, 16 on a 2-core host, 1024 on a 128-core one (64 connections). A
context refused is logged and that connection reads on the tier's threads; raise the sysctl for many connections.

``ready()`` says whether the kernels are compiled (the first call starts it on a daemon thread, like
``kvstore.payload_runs``); ``warm_up()`` compiles now. ``KVSTORE_COMPILED_SEND=0`` in a store's environment turns
the compiled send off (its TCP lane then reads on the tier's threads and sends in Python, as before it).
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore import memops_jit, payload_runs
from kvstore.background_compile import BackgroundCompile

log = logging.getLogger(__name__)

DEPTH = 2  # reads in flight: 1 and 4 were no faster here, and 2 keeps a drive that wants a queue busier
FRAME_MAGIC, FRAME_DATA = b"KVL1", 6  # kvstore.lanes.framing's MAGIC and DATA (the kernel writes the header)


def kernels() -> Any:
    from kvstore import send_run_kernels

    return send_run_kernels


def _compile() -> None:
    kernels().warm_up()


COMPILED = BackgroundCompile(
    "kvstore-send-runs-jit",
    memops_jit.AVAILABLE
    and sys.platform == "linux"
    and platform.machine() == "x86_64"
    and os.environ.get("KVSTORE_COMPILED_SEND", "1") != "0",
    _compile,
)


def ready() -> bool:
    return COMPILED.ready() and payload_runs.ready()


def warm_up() -> None:
    COMPILED.warm_up()


@dataclass(slots=True)
class Sent:
    nbytes: int
    verified: list[int]
    failed: list[int]


class RunSender:
    def __init__(self, sock: Any, depth: int = DEPTH):
        self._fd = sock.fileno()
        self._depth = depth
        self._ctx = np.zeros(1, dtype=np.int64)
        self._scratch: np.ndarray | None = None
        self._usable: bool | None = None  # None: no context tried yet
        self._work: Any = None  # the kernel's arrays (``send_run_kernels.workspace``), made with the context
        self._head = np.zeros(20, dtype=np.uint8)
        self._head[:4] = np.frombuffer(FRAME_MAGIC, dtype=np.uint8)
        self._head[4] = FRAME_DATA

    def _open(self) -> bool:
        if self._usable is None:
            err = kernels().setup(self._depth, self._ctx)
            self._usable = err == 0
            if err:
                log.info("io_setup refused (%s): TCP Gets from NVMe read on the tier's threads", os.strerror(-err))
            else:
                self._work = kernels().workspace(self._depth)
        return self._usable

    def send(self, pieces: Sequence[Any], names: np.ndarray, before: Callable[[], None] | None = None) -> Sent | None:
        """The module's ``send``; ``before()`` (optional) runs once the first reads are submitted and before any
        block is sent: what must precede the data on the socket (the Get's reply) goes out while the disk reads."""
        if not pieces or not ready() or max(len(p.at) for p in pieces) > kernels().PIECE_BLOCKS or not self._open():
            return None
        from kvstore.tiers.nvme.io import aligned_buffer

        scratch_bytes = max(p.nbytes for p in pieces)
        if self._scratch is None or len(self._scratch) < 2 * self._depth * scratch_bytes:
            self._scratch = aligned_buffer(2 * self._depth * scratch_bytes)
        at = np.concatenate([p.at for p in pieces])
        starts = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum([len(p.at) for p in pieces], out=starts[1:])
        failed = np.empty(len(at), dtype=np.int64)
        state = np.zeros(8, dtype=np.int64)
        k = kernels()
        args = [
            int(self._ctx[0]), self._fd, np.array([p.fd for p in pieces], dtype=np.int64), starts,
            np.concatenate([p.offsets for p in pieces]), np.concatenate([p.lengths for p in pieces]),
            np.concatenate([p.crcs for p in pieces]), np.concatenate([p.addresses for p in pieces]),
            names[at].astype(np.uint32), int(self._scratch.ctypes.data), scratch_bytes, self._depth,
            payload_runs.GATHER_BLOCK_BYTES, self._head, failed, state, self._work,
        ]  # fmt: skip
        started = k.read_check_send(*args, True)
        if started <= k.SUBMIT_FAILED // 2:
            log.info(
                "io_submit refused (%s): TCP Gets from NVMe read on the tier's threads",
                os.strerror(-started + k.SUBMIT_FAILED),
            )
            self._usable = False
            return None
        try:
            if before is not None:
                before()
        except BaseException:
            args[1] = -1  # nothing more is sent: the reads in flight land, then the call ends
            k.read_check_send(*args, False)
            raise
        result = k.read_check_send(*args, False)
        bad = at[failed[: state[k.FAILED]]]
        lost = set(bad.tolist())
        if result < 0:
            raise OSError(-result, os.strerror(-result))
        return Sent(int(result), [t for t in at.tolist() if t not in lost], bad.tolist())

    def close(self) -> None:
        if self._usable:
            kernels().destroy(int(self._ctx[0]))
        self._usable = False
