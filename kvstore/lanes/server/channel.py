"""The server's end of the shm lane's channel: Gets and Puts over the unix socket of its direct handshake,
instead of gRPC calls (the client's end is ``kvstore/lanes/client/channel.py``).

A LaneGet over gRPC pays a call's fixed cost: 0.6-0.9 ms on the 2-core VM for
a 4 KiB block, where the TCP lane's framed socket answers in about 0.1 ms.
Once the direct handshake has bound a client process to its shm lane
(``direct.py``: pid from SO_PEERCRED, token, a nonce read from its memory),
that socket stays open as the lane's *channel* and carries its Gets and Put
conversations as frames of ``framing``, one at a time (the lane serves one
call at a time)::

    GET(LaneGetRequest)  ->  GET_REPLY(LaneGetResponse) ... up to the one with ``last``
                             | STATUS(LaneStatus) with the error, at any point
    PUT(LanePutRequest) ...  ->  PUT_REPLY(LanePutResponse) ... (grants, results)
    STATUS(OK) (client's end)  ->  STATUS(OK), or STATUS(error) at any point; the channel then closes
    TOUCH(LaneTouch)     ->  nothing: DRAM hits the client read through the arena's index (its eviction
                             policy hears of them; a malformed one is dropped)
    POOL(LanePool)       ->  STATUS(OK), or STATUS(error) and the channel goes on: client memory to map
                             (``pools.py``), into which direct Gets' NVMe reads then land

The messages are those of LaneGet and LanePut, so the region, grants,
loans, direct writes and CRC checks are exactly those of the gRPC path. Every
request must name the lane and token the channel was bound to. The channel
closes with the lane (and the lane keeps working over gRPC without it). A
client that stops reading before the last reply closes its end: the stream
would be out of step.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvstore.lanes import framing
from kvstore.lanes.base import LaneError
from kvstore.lanes.segments import get_destinations
from kvstore.lanes.server.shm import put_conversation
from kvstore.v1 import lanes_pb2 as lpb

log = logging.getLogger(__name__)

GONE_SECONDS = 1.0  # how long a channel's end waits to learn whether its client process exited
REPLY_SECONDS = 30.0  # a client that stops reading for this long loses the channel (and the Get's leases)


def start(
    lookup: Callable[[str, bytes], Any], close: Callable[[str, bytes], None] | None = None
) -> Callable[[socket.socket, str, bytes], None]:
    """What ``DirectListener(on_bound=...)`` takes: serve each bound connection on a thread of its own. When a
    channel ends because its client process is gone (killed), ``close`` closes the lane at once: the blocks it
    named in the DRAM arena or the NVMe files and its grants end now, not at the lane's idle timeout."""

    def run(conn: socket.socket, lane_id: str, token: bytes) -> None:
        serve(conn, lane_id, token, lookup)
        if close is not None:
            try:
                lane = lookup(lane_id, token)
            except LaneError:
                return  # closed already
            peer = getattr(lane, "direct", None)
            if peer is not None and peer.exited(GONE_SECONDS):  # its sockets close a moment before it is gone
                close(lane_id, token)

    def on_bound(conn: socket.socket, lane_id: str, token: bytes) -> None:
        threading.Thread(
            target=run, args=(conn, lane_id, token), name=f"kvstore-shm-channel-{lane_id}", daemon=True
        ).start()

    return on_bound


def serve(conn: socket.socket, lane_id: str, token: bytes, lookup: Callable[[str, bytes], Any]) -> None:
    """Answer the channel's Gets and Puts until the client or the lane closes it (one thread per channel)."""
    bound = _Bound(lane_id, token, lookup)
    with conn:
        while True:
            conn.settimeout(None)  # idle between requests for as long as the lane lives
            try:
                frame = framing.recv_frame(conn)
            except (OSError, framing.FrameError):
                return
            if frame is None:
                return
            conn.settimeout(REPLY_SECONDS)
            try:
                if frame.kind == framing.PUT and not frame.data_len:
                    if not _converse(conn, frame, bound):
                        return  # after an error the client may still be sending: the channel ends
                    continue
                if frame.kind == framing.TOUCH and not frame.data_len:
                    _touch(frame.meta, bound)
                    continue
                if frame.kind == framing.POOL and not frame.data_len:
                    _pool(conn, frame.meta, bound)
                    continue
                if frame.kind != framing.GET or frame.data_len:
                    _status(
                        conn, grpc.StatusCode.INVALID_ARGUMENT, f"unexpected frame kind {frame.kind} on a shm channel"
                    )
                    return
                try:
                    request = lpb.LaneGetRequest.FromString(frame.meta)
                except DecodeError:
                    _status(conn, grpc.StatusCode.INVALID_ARGUMENT, "undecodable LaneGetRequest")
                    continue
                _answer(conn, request, bound)
            except (OSError, framing.FrameError):
                return  # the client went away mid-conversation; the generators released what they held


class _Bound:
    """The lane a channel was bound to at its handshake: every request must name it (and it must be open)."""

    def __init__(self, lane_id: str, token: bytes, lookup: Callable[[str, bytes], Any]):
        self.lane_id, self.token, self._lookup = lane_id, token, lookup

    def lane(self, ref: lpb.LaneRef) -> Any:
        if ref.lane_id != self.lane_id or ref.token != self.token:
            self._lookup(ref.lane_id, ref.token)  # the errors LaneGet/LanePut give: unknown lane, wrong token
            raise LaneError(grpc.StatusCode.PERMISSION_DENIED, "a channel serves only the lane it was bound to")
        lane = self._lookup(self.lane_id, self.token)
        lane.attached()
        return lane


def _converse(conn: socket.socket, first: framing.Frame, bound: _Bound) -> bool:
    """One LanePut conversation: PUT frames in, PUT_REPLY frames out, until the client's STATUS(OK); then a
    STATUS(OK) back. False when it ended in an error (sent as STATUS)."""

    def requests() -> Iterator[lpb.LanePutRequest]:
        frame: framing.Frame | None = first
        while True:
            if frame is None:
                raise framing.FrameError("the client closed the channel mid-put")
            if frame.kind == framing.STATUS:
                return  # the client's end of the conversation
            if frame.kind != framing.PUT or frame.data_len:
                raise LaneError(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected frame kind {frame.kind} in a put")
            try:
                yield lpb.LanePutRequest.FromString(frame.meta)
            except DecodeError:
                raise LaneError(grpc.StatusCode.INVALID_ARGUMENT, "undecodable LanePutRequest") from None
            frame = framing.recv_frame(conn)

    replies = None
    try:
        lane = bound.lane(lpb.LaneRef(lane_id=bound.lane_id, token=bound.token))
        with lane.ops.metrics.rpc("LanePut"):
            replies = put_conversation(bound.lane, requests())
            for msg in replies:
                framing.send_frame(conn, framing.PUT_REPLY, msg.SerializeToString())
    except LaneError as err:
        _status(conn, err.code, err.message)
        return False
    finally:
        if replies is not None:
            replies.close()
    _status(conn, grpc.StatusCode.OK, "")
    return True


def _answer(conn: socket.socket, request: lpb.LaneGetRequest, bound: _Bound) -> None:
    try:
        lane = bound.lane(request.lane)
    except LaneError as err:
        _status(conn, err.code, err.message)
        return
    with lane.ops.metrics.rpc("LaneGet"):
        replies = None
        try:
            replies = lane.get(
                request.request,
                request.release,
                request.crc_at_copy,
                get_destinations(request),
                request.read_dram,
                request.read_disk,
                request.written_columns,
                request.named_columns,
                request.disk_columns,
            )
            for msg in replies:
                framing.send_frame(conn, framing.GET_REPLY, msg.SerializeToString())
        except LaneError as err:
            _status(conn, err.code, err.message)
        except (OSError, framing.FrameError):
            raise  # the client went away: the channel ends
        except Exception as err:  # a bug of ours: this Get fails as gRPC would fail it (UNKNOWN), the lane lives on
            log.exception("a LaneGet failed")
            _status(conn, grpc.StatusCode.UNKNOWN, f"the store failed serving this Get: {err!r} (see its log)")
        finally:
            if replies is not None:
                replies.close()  # now, not at garbage collection: its leases and current grant go back


def _touch(meta: bytes, bound: _Bound) -> None:
    """A TOUCH frame: hits the client read through the DRAM index. It has no reply, so nothing in it can fail
    the channel: a malformed one, or one for another lane, is dropped."""
    try:
        touch = lpb.LaneTouch.FromString(meta)
        bound.lane(touch.lane).touched(touch)
    except Exception as err:  # noqa: BLE001 - no reply to carry an error, and the channel must live on
        log.debug("dropped a TOUCH frame: %s", err)


def _pool(conn: socket.socket, meta: bytes, bound: _Bound) -> None:
    """A POOL frame: map the client's shared pool; STATUS(OK), or the error (the channel goes on)."""
    try:
        pool = lpb.LanePool.FromString(meta)
    except DecodeError:
        _status(conn, grpc.StatusCode.INVALID_ARGUMENT, "undecodable LanePool")
        return
    try:
        bound.lane(pool.lane).add_pool(pool)
    except LaneError as err:
        _status(conn, err.code, err.message)
        return
    _status(conn, grpc.StatusCode.OK, "")


def _status(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
    framing.send_frame(conn, framing.STATUS, lpb.LaneStatus(code=code.value[0], message=message).SerializeToString())
