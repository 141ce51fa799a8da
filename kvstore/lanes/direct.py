"""Direct puts on the shm lane: a client proves its pid, then the store reads its blocks out of its memory.

A shm lane put copies twice (client -> region, region -> arena slot); with
``cma.read_into`` the store copies once (client memory -> arena slot). That
is safe only if the store reads the memory of the process that holds the
lane, so the pid comes from the kernel, not from a message:

1. The server listens on one unix socket per node, ``kvstore-direct-*.sock``
   (mode 0600, in the shm directory), named in the lane's OpenLaneResponse.
2. The client connects, learns the server's pid (SO_PEERCRED), lets it read
   its memory (``cma.allow_reader``), and sends its lane id, token, and the
   address and bytes of a random 16-byte nonce in its memory.
3. The server takes the client's pid from SO_PEERCRED, checks the lane
   token, reads the nonce at that address in that pid and compares: the
   reads work and the memory is the sender's. It pins the process with a
   pidfd (so a recycled pid is never read) and binds it to the lane.

The socket then stays open as the lane's channel: its Gets and Puts travel
over it as frames instead of gRPC calls (``shm_channel``). From then on a
reserve may carry ``addresses`` (where each block is in the client's
memory) instead of the client writing the region; the server reads each
block into its arena slot with the CRC32C fused in. A Get into the
client's own buffers may carry ``out_addresses``: the server writes each
block there (process_vm_writev) and sends the CRC32C of what it wrote. A client can
only make the server read its own memory, and a bad address fails that block
with INVALID_ARGUMENT. Anything that fails in the handshake leaves the lane
as it was: copies through the region.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import select
import signal
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from kvstore import shmfile
from kvstore.lanes import cma
from kvstore.lanes.base import LaneError
from kvstore.lanes.segments import Spans

log = logging.getLogger(__name__)

HELLO = struct.Struct("!HHQ16s")  # lane id length, token length, nonce address, nonce
OK, REFUSED = b"\x00", b"\x01"
TIMEOUT = 2.0


@dataclass
class DirectPeer:
    """The client process a lane may read from, pinned by a pidfd."""

    pid: int
    pidfd: int
    _closed: bool = field(default=False, repr=False)

    def alive(self) -> bool:
        if self.exited(0):
            return False
        try:
            signal.pidfd_send_signal(self.pidfd, 0)
            return True
        except OSError:
            return False

    def exited(self, timeout: float) -> bool:
        """Whether the process has exited (a zombie too), waiting up to ``timeout`` seconds for it to."""
        if self._closed:
            return True
        try:
            return bool(select.select([self.pidfd], [], [], timeout)[0])  # a pidfd turns readable at exit
        except (OSError, ValueError):
            if self._closed:  # the lane closed on another thread meanwhile (its close sets this first)
                return True
            raise

    def read_into(self, dst: memoryview, address: int) -> int:
        """Copy a block of the client's memory into ``dst``; its CRC32C (LaneError if it cannot be read)."""
        return self._move("direct put", cma.read_into, dst, address)

    def write_from(self, address: int, src: memoryview, crc: bool = True) -> int:
        """Copy ``src`` to ``address`` in the client's memory; the CRC32C of ``src`` (0 without ``crc``)."""
        return self._move("direct get", lambda pid, buf, at: cma.write_from(pid, at, buf, crc), src, address)

    def write_many(self, pairs: list[tuple[int, Any]]) -> None:
        """Copy each ``(address, src)`` into the client's memory, as few syscalls as IOV_MAX allows."""
        self._move("direct get", _batch(cma.write_many), pairs, None)

    def write_table(self, local: np.ndarray, remote: np.ndarray) -> None:
        """``write_many`` of an int64 (address, length) table of our memory (``memops.addresses_of``) to the
        client's addresses ``remote``, row for row."""
        self._move("direct get", cma.write_table, local, remote)

    def write_scattered(self, blocks: list[tuple[Spans | np.ndarray, Any]]) -> None:
        """Copy each ``(spans, src)`` across its pieces of the client's memory, as few syscalls as IOV_MAX allows
        (no CRC32C: the caller takes them of the sources in one batch)."""
        self._move("direct get", _batch(cma.write_scattered), blocks, None)

    def read_many(self, pairs: list[tuple[int, Any]]) -> None:
        """Fill each ``(address, dst)`` from the client's memory, as few syscalls as IOV_MAX allows (no CRC32C:
        the caller takes them of the landed bytes in one batch)."""
        self._move("direct put", _batch(cma.read_many), pairs, None)

    def read_spans(self, dst: memoryview, spans: Spans) -> int:
        """Fill ``dst`` from a block in several pieces of the client's memory; its CRC32C."""
        return self._move("direct put", lambda pid, buf, at: cma.read_spans_into(pid, buf, at), dst, spans)

    def write_spans(self, spans: Spans, src: memoryview, crc: bool = True) -> int:
        """Copy ``src`` across several pieces of the client's memory; the CRC32C of ``src`` (0 without ``crc``)."""
        return self._move("direct get", lambda pid, buf, at: cma.write_spans_from(pid, at, buf, crc), src, spans)

    def take_fd(self, fd: int) -> int:
        """Our own descriptor of the client's file descriptor ``fd`` (LaneError if it cannot be had)."""
        return self._move("shared pool", lambda _pid, number, _: cma.take_fd(self.pidfd, number), fd, None)

    def _move(self, what: str, fn: Callable[[int, Any, Any], int], buf: Any, address: Any) -> int:
        if not self.alive():
            raise LaneError(grpc.StatusCode.FAILED_PRECONDITION, f"{what}: client process {self.pid} is gone")
        try:
            return fn(self.pid, buf, address)
        except cma.DirectReadError as err:
            raise _refused(what, err) from None
        except ValueError as err:  # spans that do not cover the block
            raise LaneError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {err}") from None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.pidfd)


def _batch(fn: Callable[[int, Any], None]) -> Callable[[int, Any, Any], int]:
    """A batch move (``cma.write_many``, ``read_many``, ``write_scattered``) in the shape ``DirectPeer._move`` runs."""

    def move(pid: int, pairs: Any, _: Any) -> int:
        fn(pid, pairs)
        return 0

    return move


def _refused(what: str, err: OSError) -> LaneError:
    """A bad address is the caller's error; lost permission or a gone process breaks the lane (the client then
    opens another, whose handshake decides again whether it may be direct)."""
    if err.errno in (errno.EPERM, errno.ESRCH):
        return LaneError(grpc.StatusCode.FAILED_PRECONDITION, f"{what}: {err}; open a new lane")
    return LaneError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {err}")


UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, the last a NUL


class DirectListener:
    """The node's handshake socket; ``lookup(lane_id, token)`` returns the shm lane (or raises LaneError).

    ``on_bound(conn, lane_id, token)``, when given, takes over each connection whose handshake bound its lane
    (it runs on the listener's thread, so it must hand the connection to a thread of its own); without it
    the connection is closed once the handshake is answered.
    """

    def __init__(self, directory: str, lookup: Any, on_bound: Any = None):
        self.path = os.path.join(directory, shmfile.name_of(shmfile.DIRECT_PREFIX, ".sock", random_hex=8))
        if len(os.fsencode(self.path)) > UNIX_PATH_MAX:
            raise ValueError(
                f"--shm-dir {directory}: too long for the shm lane's socket in it ({len(os.fsencode(self.path))} "
                f"bytes with its name, a unix socket's path holds {UNIX_PATH_MAX}); pick a shorter directory"
            )
        self._lookup = lookup
        self._on_bound = on_bound
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600 (a chmod after bind would leave a window); this runs at
        # node start, and a file another thread makes meanwhile could only come out more private, never less
        try:
            self._sock.bind(self.path)
        except OSError as err:
            self._sock.close()
            raise ValueError(
                f"--shm-dir {directory}: cannot make the shm lane's socket there ({err.strerror})"
            ) from None
        finally:
            os.umask(old)
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._serve, name="kvstore-direct", daemon=True)
        self._closed = threading.Event()

    def start(self) -> DirectListener:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            bound = None
            try:
                conn.settimeout(TIMEOUT)
                reply, bound = self._handshake(conn)
                conn.sendall(reply)
            except (OSError, ValueError) as err:
                log.info("direct handshake failed: %s", err)
                bound = None
            if bound is None or self._on_bound is None:
                conn.close()
                continue
            lane, lane_id, token = bound
            lane.bind_channel(conn)  # it closes with the lane
            self._on_bound(conn, lane_id, token)

    def _handshake(self, conn: socket.socket) -> tuple[bytes, tuple[Any, str, bytes] | None]:
        """The reply, and (lane, lane id, token) once the lane is bound to the connecting process."""
        pid = cma.peer_pid(conn)
        head = _recv_exactly(conn, HELLO.size)
        id_len, token_len, address, nonce = HELLO.unpack(head)
        lane_id = _recv_exactly(conn, id_len).decode()
        token = _recv_exactly(conn, token_len)
        try:
            lane = self._lookup(lane_id, token)
        except LaneError as err:
            return REFUSED + err.message.encode(), None
        landed = bytearray(len(nonce))
        try:
            cma.read_into(pid, memoryview(landed), address)
        except cma.DirectReadError as err:
            return REFUSED + f"cannot read the client's memory: {err}".encode(), None
        if bytes(landed) != nonce:
            return REFUSED + b"the nonce is not in the connecting process", None
        lane.bind_direct(DirectPeer(pid, os.pidfd_open(pid)))
        return OK, (lane, lane_id, token)


def handshake(path: str, lane_id: str, token: bytes) -> tuple[str | None, socket.socket | None]:
    """Client side: (None, the connected socket) once the server may read this process's memory for the lane
    (the socket then carries the lane's Gets and Puts: ``shm_channel``), else (why not, None)."""
    if not path or not cma.available():
        return "no direct puts offered", None
    nonce = bytearray(secrets.token_bytes(16))
    address, _ = cma.address_of(nonce)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    why: str | None
    try:
        sock.settimeout(TIMEOUT)
        sock.connect(path)
        server_pid = cma.peer_pid(sock)
        if server_pid <= 0:  # another pid namespace that this one cannot see
            why = "the store's process is not visible from here"
        elif not cma.allow_reader(server_pid):
            why = "this process lets another store read its memory"
        else:
            lane = lane_id.encode()
            sock.sendall(HELLO.pack(len(lane), len(token), address, bytes(nonce)) + lane + token)
            reply = sock.recv(4096)
            why = None if reply[:1] == OK else (reply[1:].decode(errors="replace") or "refused")
    except OSError as err:
        why = f"direct handshake: {err}"
    if why is not None:
        sock.close()
        return why, None
    return None, sock


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ValueError("the client hung up mid-handshake")
        buf += chunk
    return bytes(buf)
