"""The client's end of the shm lane's channel (``ShmChannel``): Gets and Put conversations as frames on the
socket of the direct handshake. The frames and the protocol are described with the server's end,
``kvstore/lanes/server/channel.py``.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator

import grpc
from google.protobuf.message import DecodeError

from kvstore.errors import status_code
from kvstore.lanes import framing
from kvstore.lanes.base import LaneBroken, lane_failure
from kvstore.v1 import lanes_pb2 as lpb


class ShmChannel:
    """The client's end: ``get(request)`` yields the replies of one Get; ``send_put``/``next_put_reply``/``end_put``
    carry one put conversation (``kvstore.lanes.client.shm.ChannelPut``)."""

    def __init__(self, sock: socket.socket, timeout: float | None):
        self._sock: socket.socket | None = sock
        self._busy = threading.Lock()
        self._poll: select.poll | None = None
        sock.settimeout(timeout)

    @property
    def open(self) -> bool:
        return self._sock is not None

    def claim(self) -> bool:
        """Take the channel for one Get or put conversation; False when it is closed or in use (use gRPC)."""
        return self._sock is not None and self._busy.acquire(blocking=False)

    def unclaim(self) -> None:
        self._busy.release()

    def get(self, request: lpb.LaneGetRequest) -> Iterator[lpb.LaneGetResponse]:
        """The replies of one Get, on a channel the caller has claimed (released when the replies end)."""
        in_step = False
        try:
            sock = self._usable()
            framing.send_frame(sock, framing.GET, request.SerializeToString())
            while True:
                frame = framing.recv_frame(sock)
                if frame is None:
                    raise LaneBroken("the store closed the lane's channel")
                if frame.kind == framing.STATUS:
                    in_step = True
                    status = lpb.LaneStatus.FromString(frame.meta)
                    raise self._status_error(status)
                if frame.kind != framing.GET_REPLY or frame.data_len:
                    raise framing.FrameError(f"unexpected frame kind {frame.kind} on a shm channel")
                msg = lpb.LaneGetResponse.FromString(frame.meta)
                in_step = msg.last
                yield msg
                if msg.last:
                    return
        except (OSError, framing.FrameError, DecodeError) as err:
            raise LaneBroken(f"shm lane channel: {err}") from None
        finally:
            if not in_step:
                self.close()
            self.unclaim()

    def alive(self) -> bool:
        """The store still holds its end: between requests it never sends, so anything to read (its close,
        or its process's death) means the lane is gone. One non-blocking peek."""
        sock = self._sock
        if sock is None:
            return False
        if self._poll is None:  # poll, not recv: a socket with a timeout would wait for data first
            self._poll = select.poll()
            self._poll.register(sock, select.POLLIN | select.POLLPRI)
        try:
            return not self._poll.poll(0)
        except OSError:
            return False

    def send_touch(self, touch: lpb.LaneTouch) -> bool:
        """One TOUCH frame (no reply); False when the channel is busy or closed (the caller keeps them)."""
        if not self.claim():
            return False
        try:
            framing.send_frame(self._usable(), framing.TOUCH, touch.SerializeToString())
        except OSError:
            self.close()
            return False
        finally:
            self.unclaim()
        return True

    def send_pool(self, pool: lpb.LanePool) -> str:
        """One POOL frame and its STATUS: "" when the store mapped the pool, else its reason (the channel goes on).
        Raises LaneBroken when the channel fails or is busy."""
        if not self.claim():
            raise LaneBroken("the lane's channel is closed or busy")
        try:
            sock = self._usable()
            framing.send_frame(sock, framing.POOL, pool.SerializeToString())
            frame = framing.recv_frame(sock)
            if frame is None or frame.kind != framing.STATUS or frame.data_len:
                raise framing.FrameError("no STATUS frame after a POOL frame")
            status = lpb.LaneStatus.FromString(frame.meta)
            return "" if status.code == grpc.StatusCode.OK.value[0] else status.message
        except (OSError, framing.FrameError, DecodeError) as err:
            self.close()
            raise LaneBroken(f"shm lane channel: {err}") from None
        finally:
            self.unclaim()

    # -- one LanePut conversation (``ChannelPut`` in client/shm.py drives it) ---------------------------
    def send_put(self, msg: lpb.LanePutRequest) -> None:
        sock = self._usable()
        try:
            framing.send_frame(sock, framing.PUT, msg.SerializeToString())
        except OSError as err:
            self.close()
            raise LaneBroken(f"shm lane channel: {err}") from None

    def next_put_reply(self) -> lpb.LanePutResponse:
        """The next reply of the conversation; an error STATUS raises it and ends the channel (the client may
        have sent more than the server read, so the two could not be in step again)."""
        sock = self._usable()
        try:
            frame = framing.recv_frame(sock)
            if frame is None:
                raise LaneBroken("the store closed the lane's channel")
            if frame.kind == framing.STATUS:
                self.close()
                raise self._status_error(lpb.LaneStatus.FromString(frame.meta))
            if frame.kind != framing.PUT_REPLY or frame.data_len:
                raise framing.FrameError(f"unexpected frame kind {frame.kind} in a put")
            return lpb.LanePutResponse.FromString(frame.meta)
        except (OSError, framing.FrameError, DecodeError) as err:
            self.close()
            raise LaneBroken(f"shm lane channel: {err}") from None

    def end_put(self) -> None:
        """End the conversation: replies not read yet are dropped, up to the server's STATUS(OK)."""
        if self._sock is None:
            return
        try:
            framing.send_frame(
                self._sock, framing.STATUS, lpb.LaneStatus(code=grpc.StatusCode.OK.value[0]).SerializeToString()
            )
            while True:
                frame = framing.recv_frame(self._sock)
                if frame is None or frame.kind == framing.STATUS:
                    if frame is None or lpb.LaneStatus.FromString(frame.meta).code != grpc.StatusCode.OK.value[0]:
                        self.close()
                    return
                if frame.kind != framing.PUT_REPLY:
                    raise framing.FrameError(f"unexpected frame kind {frame.kind} ending a put")
        except (OSError, framing.FrameError, DecodeError):
            self.close()

    def _usable(self) -> socket.socket:
        if self._sock is None:
            raise LaneBroken("the lane's channel is closed")
        return self._sock

    def _status_error(self, status: lpb.LaneStatus) -> Exception:
        return lane_failure(status_code(status.code), status.message)

    def drain(self, timeout: float) -> None:
        """Close the channel once the store has read every frame sent on it: its end closes after the last, so a
        TOUCH sent just before (the lane's last hits and releases) is counted before the lane's CloseLane, which
        another of the store's threads serves. Waits at most ``timeout`` for that; closed either way."""
        sock = self._sock
        if sock is None or not self._busy.acquire(timeout=timeout):
            self.close()
            return
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(timeout)
            while sock.recv(4096):  # the store sends nothing between requests: b"" is its end closing
                pass
        except OSError:
            pass
        finally:
            self._busy.release()
            self.close()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
