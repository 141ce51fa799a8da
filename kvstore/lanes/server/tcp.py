"""Server side of the bulk TCP lane: a listener, one thread per connection, many blocks per frame.

Verbs (frames in ``framing.py``):

- HELLO: the first frame of a connection names a TCP lane opened over gRPC and
  proves it with the lane's token; anything else, or nothing within
  ``HELLO_SECONDS``, closes the connection.
- PUT: all headers are validated before any byte is stored (INVALID_ARGUMENT
  names the block; the payload is read and dropped). Then, block by block,
  ``begin_put`` and ``recv_into`` straight into the arena slot (no copy in
  user space) with the CRC32C computed piece by piece as the bytes arrive,
  verified against the CRC32C that follows the block, committed. A block that is already present or rejected has its
  bytes read and dropped. A connection that dies mid-block aborts that slot:
  nothing partial ever becomes visible and no slot leaks.
- GET: lease the blocks, send every header, then DATA frames of whole blocks
  gathered straight from the arena slots with ``sendmsg``. NVMe blocks are read
  in the background (``ReadAhead``, a window ahead) straight into their slots
  and sent as each read is verified, so the disk and the socket work at once;
  the leases are dropped when the Get ends. A small Get (one window, at most
  ``readahead.INLINE_BYTES`` to read) from a client that takes DATA frames in
  any order is read on this thread and the tier's readers, each piece sent by
  the thread that verified it (``_send_read``), so no thread hop starts the
  read and no piece waits for the others. Where the compiled send runs
  (``kvstore.send_runs``: numba, Linux on x86-64), such a client's every
  window is read on this thread: its raw NVMe blocks read with the kernel's
  asynchronous I/O, checked and ``writev``d as DATA frames by one call
  without the GIL, two reads in flight while the last piece is checked and
  sent.

Socket reads and writes inside a frame time out after ``frame_seconds``
(kernel SO_RCVTIMEO/SO_SNDTIMEO), so a stalled peer cannot hold slots or
leases longer than that.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kvstore import send_runs
from kvstore.lanes import framing
from kvstore.lanes.base import LaneError
from kvstore.lanes.server.access import LaneAccess
from kvstore.lanes.server.lane import ServerLane
from kvstore.lanes.server.registry import LaneRegistry
from kvstore.lanes.server.storeops import Reservation, StoreOps, accepted_codecs
from kvstore.memops import copy_into, host_bytes, host_view
from kvstore.send_runs import RunSender
from kvstore.store import Lease
from kvstore.store.readahead import ReadAhead
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb

log = logging.getLogger(__name__)

HELLO_SECONDS = 10.0
POLL_SECONDS = 0.5
COMMIT_BATCH = 64  # a Put frame's blocks are committed this many at a time (StoreOps.finish_many), as they arrive


class TcpServerLane(ServerLane):
    """A TCP lane is a token for exactly one connection; the lane closes when the connection does."""

    kind = "tcp"
    connected = False
    unordered_data = False  # the client takes DATA frames that name their blocks (TcpHello.unordered_data)

    def expire(self, now: float) -> int:
        return 0

    def close(self) -> None:
        self.closed.set()


class TcpLaneServer:
    def __init__(self, host: str, port: int, registry: LaneRegistry, ops: StoreOps, frame_seconds: float):
        self.registry, self.ops, self.frame_seconds = registry, ops, frame_seconds
        self.compiled_send = send_runs.COMPILED.available  # Gets of NVMe blocks by send_runs (False: tests, Python)
        self._listener = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128
        )
        self.port = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._conns: dict[socket.socket, bool] = {}  # connection -> busy
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def start(self) -> TcpLaneServer:
        self._thread = threading.Thread(target=self._accept_loop, name="kvstore-tcp-lane", daemon=True)
        self._thread.start()
        return self

    def close(self, grace: float = 5.0) -> None:
        """Stop accepting, let frames in progress finish for ``grace`` seconds, then cut the rest."""
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            self._idle.wait_for(lambda: not any(self._conns.values()), timeout=grace)
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- connections ----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            framing.tune(conn)
            with self._lock:
                self._conns[conn] = False
            threading.Thread(target=self._serve, args=(conn,), name="kvstore-tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        lane: ServerLane | None = None
        runs: RunSender | None = None
        try:
            lane = self._hello(conn)
            if lane is not None:
                framing.set_timeouts(conn, self.frame_seconds)
                if getattr(lane, "unordered_data", False) and self.compiled_send:
                    runs = RunSender(conn)
                self._frames(conn, lane, runs)
        except OSError as err:
            log.debug("tcp lane connection ended: %s", err)
        except Exception:
            log.exception("tcp lane connection failed")
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                self._idle.notify_all()
            conn.close()
            if runs is not None:
                runs.close()
            if lane is not None:
                self.registry.close(lane.lane_id, lane.token)

    def _hello(self, conn: socket.socket) -> ServerLane | None:
        if not select.select([conn], [], [], HELLO_SECONDS)[0]:
            return None
        framing.set_timeouts(conn, HELLO_SECONDS)
        frame = framing.recv_frame(conn)
        if frame is None or frame.kind != framing.HELLO or frame.data_len:
            return None
        try:
            hello = _parse(lpb.TcpHello, frame.meta, "hello")
            ref = hello.lane
            lane = self.registry.get(ref.lane_id, ref.token, "tcp")
            assert isinstance(lane, TcpServerLane)
            with self._lock:
                if lane.connected:
                    raise LaneError(
                        grpc.StatusCode.PERMISSION_DENIED, f"tcp lane {ref.lane_id!r} already has its connection"
                    )
                lane.connected = True
                lane.unordered_data = hello.unordered_data
        except LaneError as err:
            self._status(conn, err.code, err.message)
            return None
        self._status(conn, grpc.StatusCode.OK, "")
        return lane

    def _frames(self, conn: socket.socket, lane: ServerLane, runs: RunSender | None = None) -> None:
        while not self._stopping.is_set():
            if not select.select([conn], [], [], POLL_SECONDS)[0]:
                if lane.closed.is_set():
                    return
                continue
            frame = framing.recv_frame(conn)
            if frame is None:
                return
            self._busy(conn, True)
            try:
                if lane.closed.is_set():
                    framing.drain(conn, frame.data_len)
                    self._status(
                        conn, grpc.StatusCode.FAILED_PRECONDITION, f"lane {lane.lane_id!r} was closed; open a new lane"
                    )
                    return
                lane.touch()
                if frame.kind == framing.PUT:
                    with self.ops.metrics.rpc("TcpLanePut"):
                        self._put(conn, frame, lane.access)
                elif frame.kind == framing.GET and not frame.data_len:
                    with self.ops.metrics.rpc("TcpLaneGet"):
                        try:
                            self._get(conn, frame, lane.access, getattr(lane, "unordered_data", False), runs)
                        except (OSError, framing.FrameError):
                            raise  # the client went away: the connection ends
                        except Exception as err:  # a bug of ours: this Get fails as gRPC would fail it (UNKNOWN),
                            log.exception("a tcp lane Get failed")  # and the connection lives on
                            self._status(
                                conn,
                                grpc.StatusCode.UNKNOWN,
                                f"the store failed serving this Get: {err!r} (see its log)",
                            )
                else:
                    self._status(conn, grpc.StatusCode.INVALID_ARGUMENT, f"unexpected frame kind {frame.kind}")
                    return
            finally:
                self._busy(conn, False)

    def _busy(self, conn: socket.socket, busy: bool) -> None:
        with self._lock:
            self._conns[conn] = busy
            if not busy:
                self._idle.notify_all()

    def _status(self, conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
        meta = lpb.LaneStatus(code=code.value[0], message=message).SerializeToString()
        framing.send_frame(conn, framing.STATUS, meta)

    # -- put ------------------------------------------------------------------------------------
    def _put(self, conn: socket.socket, frame: framing.Frame, access: LaneAccess) -> None:
        ops = self.ops
        try:
            request = _parse(lpb.TcpPut, frame.meta, "put")
            ns = ops.namespace(request.namespace, access)
            metas = ops.headers(ns, request.headers)
            expected = sum(m.stored_length + framing.CRC.size for m in metas)
            if expected != frame.data_len:
                raise LaneError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the headers announce {expected} payload bytes but the frame carries {frame.data_len}",
                )
        except LaneError as err:
            framing.drain(conn, frame.data_len)
            self._status(conn, err.code, err.message)
            return
        reply = pb.PutResponse()
        committed: list[int] = []
        error: LaneError | None = None
        stored = 0
        res = None
        received: list[tuple[Reservation, int, int]] = []  # (reservation, claimed CRC32C, as landed), in order
        landed = 0
        crc_bytes = memoryview(bytearray(framing.CRC.size))
        left = frame.data_len  # payload bytes of the frame not read yet
        try:
            for i, meta in enumerate(metas):
                left -= meta.stored_length + framing.CRC.size
                n = meta.stored_length
                if error is not None:  # the rest of the frame is read and dropped; the Put ends in the error
                    framing.drain(conn, n + framing.CRC.size)
                    continue
                res = ops.reserve(ns, meta, i, access)
                if res.full and any(r.ticket is not None for r, _, _ in received):
                    # memory is held by this frame's uncommitted blocks: committed, they can be evicted
                    error = self._finish(ops, received, reply, committed, access)
                    stored, received = landed, []
                    if error is None:
                        res = ops.reserve(ns, meta, i, access)
                if res.ticket is None:
                    framing.drain(conn, n + framing.CRC.size)
                    received.append((res, 0, 0))  # its result is final: already present, or refused
                    res = None
                    continue
                computed = self._recv_block(conn, res.ticket.buffer, n, left + framing.CRC.size)
                framing.recv_into(conn, crc_bytes)
                received.append((res, framing.CRC.unpack(crc_bytes)[0], computed))
                landed += n
                res = None
                if len(received) >= COMMIT_BATCH:
                    error = self._finish(ops, received, reply, committed, access)
                    stored, received = landed, []
            if error is None:
                error = self._finish(ops, received, reply, committed, access)
                stored, received = landed, []
        finally:
            if res is not None:
                ops.abort([res])  # the connection died in the middle of this block
            ops.abort([r for r, _, _ in received])  # those still holding a ticket: received, never committed
            ops.metrics.add("lane_tcp_put_bytes", stored)
            ops.metrics.bytes_in(stored)
        ops.persist(committed)
        if error is not None:
            self._status(conn, error.code, error.message)
        else:
            framing.send_frame(conn, framing.PUT_REPLY, reply.SerializeToString())

    @staticmethod
    def _finish(
        ops: StoreOps,
        received: list[tuple[Reservation, int, int]],
        reply: pb.PutResponse,
        committed: list[int],
        access: LaneAccess,
    ) -> LaneError | None:
        """Verify every received block alone and commit the good ones at once (``StoreOps.finish_many``)."""
        try:
            reply.results.extend(ops.finish_many(received, committed, access))
        except LaneError as err:
            return err
        return None

    @staticmethod
    def _recv_block(conn: socket.socket, buffer: Any, n: int, after: int) -> int:
        """Receive a block of ``n`` bytes into its slot; ``after``: bytes of the frame that follow it."""
        dst = host_view(buffer)
        if dst is not None:
            return framing.recv_into_crc(conn, dst[:n], after=after)
        staging = memoryview(bytearray(n))  # device slot (HBM tier): land on host, then upload
        crc = framing.recv_into_crc(conn, staging, after=after)
        copy_into(buffer, staging)
        return crc

    # -- get ------------------------------------------------------------------------------------
    def _get(
        self,
        conn: socket.socket,
        frame: framing.Frame,
        access: LaneAccess,
        unordered: bool = False,
        runs: RunSender | None = None,
    ) -> None:
        """With ``unordered`` (the client's hello asked for it), each DATA frame names its blocks and holds those
        whose reads completed, in any order: a read the disk serves late (this VM's disk starved one 2 MiB read
        for 39 ms while 25 later ones completed) no longer holds back the verified blocks behind it. With ``runs``
        too, every window is read on this thread, its raw NVMe blocks read, checked and sent by one compiled call
        (``_send_read``)."""
        ops = self.ops
        try:
            request = _parse(pb.GetRequest, frame.meta, "get")
            _, leases = ops.acquire(request, access, touch=False)  # the policies' touch waits for each window's send
        except LaneError as err:
            self._status(conn, err.code, err.message)
            return
        accepted = accepted_codecs(request)
        windows, reads = ops.read_ahead(leases)
        released = 0
        sent = 0
        try:
            reply = lpb.TcpGetReply(headers=[ops.header_of(lease, accepted) for lease in leases]).SerializeToString()
            replied = [False]

            def send_reply() -> None:
                if not replied[0]:
                    framing.send_frame(conn, framing.GET_REPLY, reply)
                    replied[0] = True

            if not (unordered and runs is not None):  # else sent once the first reads are submitted (_send_read)
                send_reply()
            first = 0  # header index of the window's first lease
            for w, window in enumerate(windows):
                if unordered:
                    counted = [0]
                    try:
                        if reads.inline or runs is not None:  # read here, each piece sent as it is verified
                            self._send_read(conn, ops, accepted, window, counted, first, runs, send_reply)
                        else:
                            self._send_unordered(conn, ops, accepted, reads, w, window, first, counted)
                    except LaneError as err:
                        self._status(conn, err.code, err.message)
                        return
                    except _SendFailed as err:
                        raise err.error from None  # the client went away: the connection ends, as below
                    finally:
                        sent += counted[0]
                    ops.release(window, touch=True)
                    released += len(window)
                    first += len(window)
                    continue
                payload: list[memoryview] = []
                for j, lease in enumerate(window):
                    try:  # ready() raises the window's error too: a status, never a dropped connection (which
                        # the client would take for a broken lane and retry, to find the corrupt block gone)
                        if payload and not reads.ready(w, j):  # send what is verified while the rest is read
                            framing.send_frame(conn, framing.DATA, b"", payload)
                            sent += sum(len(p) for p in payload)
                            payload = []
                        reads.wait(w, j)
                    except LaneError as err:
                        self._status(conn, err.code, err.message)
                        return
                    if lease is not None:
                        payload.append(host_bytes(ops.servable(lease, accepted)))
                if payload:
                    framing.send_frame(conn, framing.DATA, b"", payload)
                    sent += sum(len(p) for p in payload)
                ops.release(window, touch=True)  # sent: the kernel holds the bytes now
                released += len(window)
                first += len(window)
        finally:
            reads.close()
            ops.release(leases[released:], touch=True)
            ops.metrics.add("lane_tcp_get_bytes", sent)
            ops.metrics.bytes_out(sent)

    @staticmethod
    def _send_read(
        conn: socket.socket,
        ops: StoreOps,
        accepted: Any,
        window: list[Lease | None],
        counted: list[int],
        first: int = 0,
        runs: RunSender | None = None,
        before: Callable[[], None] | None = None,
    ) -> None:
        """Send a window's blocks as DATA frames that name them (``first``: the window's first header index): its
        DRAM hits at once, then each piece of its NVMe reads as soon as it is verified
        (``materialize`` with ``on_caller``: sent by the thread that read it, this one or a reader, or with more
        pieces than readers by this thread while the readers read), a lock keeping frames whole; ``counted[0]``
        adds the bytes sent. A corrupt or unreadable block raises the read's LaneError after the pieces verified
        before it were sent; a failed send raises ``_SendFailed`` (a store-side OSError would read as a failed
        disk read).
        Measured (forty-fifth session, ``/tmp/s45/ab.py``: 150 TCP Gets of 32 x 64 KiB only on NVMe, each in turn
        with a raw read; eight runs each way, which goes first alternating): 0.271-0.318 of the raw read (median
        0.297, Get p50 3.98 ms) against 0.265-0.279 (0.272, 4.22 ms) with ``ReadAhead``'s inline read, which sent
        nothing until both pieces were read. Larger Gets keep ``ReadAhead``: sent this way, with this way's runs
        always second (a place that favoured them by up to 0.03), they measured even at 512 KiB and slower at 2 MiB
        (0.768-0.791 against 0.802-0.815).
        With ``runs`` (a connection's ``RunSender``) the tier hands its compiled runs to ``read_and_send`` instead:
        read, checked and sent by one call without the GIL, on this thread; what that call could not verify is
        read again by the tier and sent as above. ``before()`` (the Get's reply, sent once) goes out before the
        first block: with ``runs``, once the first reads are submitted, so the disk reads while it is built and sent
        (``materialize`` plans the read before that)."""
        lock = threading.Lock()
        sent_here: set[int] = set()  # positions ``runs`` sent: the tier names them verified afterwards

        def send(positions: list[int]) -> None:
            with lock:
                try:
                    if before is not None:
                        before()
                    todo = [j for j in positions if j not in sent_here] if sent_here else positions
                    counted[0] += _send_named(conn, ops, accepted, window, todo, first)
                except OSError as err:
                    raise _SendFailed(err) from err

        def read_and_send(pieces: list[Any], at: np.ndarray) -> tuple[list[int], list[int]] | None:
            """``NvmeTier.read``'s run reader: the runs read, checked and sent by one compiled call."""
            assert runs is not None
            with lock:
                try:
                    done = runs.send(pieces, first + at, before)
                except OSError as err:
                    raise _SendFailed(err) from err
                if done is None:
                    return None
                counted[0] += done.nbytes
                ops.metrics.add("lane_tcp_compiled_get_bytes", done.nbytes)
                sent_here.update(at[done.verified].tolist())
                return done.verified, done.failed

        hits = [j for j, lease in enumerate(window) if lease is not None and lease.buffer is not None]
        if hits or runs is None:  # DRAM hits first (after the reply, if it has yet to go)
            send(hits)
        ops.materialize(window, send, on_caller=True, run_reader=read_and_send if runs is not None else None)
        send([])  # the reply, where no block was sent

    @staticmethod
    def _send_unordered(
        conn: socket.socket,
        ops: StoreOps,
        accepted: Any,
        reads: ReadAhead,
        w: int,
        window: list[Lease | None],
        first: int,
        counted: list[int],
    ) -> None:
        """Send window ``w``'s blocks as their reads complete, each DATA frame naming its blocks' header indices
        (``first``: the window's first); ``counted[0]`` adds the bytes sent. Raises the window's LaneError once
        every block read before it failed has been sent."""
        seen: set[int] = set()
        while len(seen) < len(window):
            ready = reads.wait_new(w, seen)
            seen.update(ready)
            counted[0] += _send_named(conn, ops, accepted, window, ready, first)


def _send_named(
    conn: socket.socket, ops: StoreOps, accepted: Any, window: Sequence[Lease | None], positions: list[int], first: int
) -> int:
    """One DATA frame of the present blocks of ``window`` at ``positions``, named by their header indices
    (``first``: the window's first); the bytes sent (none, and no frame, when every one is missing)."""
    payload: list[memoryview] = []
    names: list[int] = []
    for j in positions:
        lease = window[j]
        if lease is not None:
            payload.append(host_bytes(ops.servable(lease, accepted)))
            names.append(first + j)
    if payload:
        framing.send_frame(conn, framing.DATA, struct.pack(f"<{len(names)}I", *names), payload)
    return sum(len(p) for p in payload)


class _SendFailed(Exception):
    """A DATA frame could not be sent (the client went away), raised through ``materialize`` unchanged."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def _parse(message: Any, data: bytes, what: str) -> Any:
    """A frame's metadata message; malformed bytes are the client's error, not the server's."""
    try:
        return message.FromString(data)
    except DecodeError:
        raise LaneError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {what} frame metadata") from None
