"""Client-side lane selection and the pool of open lanes.

``LanePool(channel, target, mode, ...)``; ``mode`` is the Client's ``lane=``:

- ``"auto"``: ask for shm then tcp (tcp only on a plaintext channel: it
  carries no TLS). The server offers shm only to a client whose host id (boot
  id and host name) equals its own; if the region still cannot be mapped here
  (another /dev/shm, another uid) the lane is closed and tcp asked for. When
  the server offers nothing (lanes off, an older server without the service,
  the lane limit reached) the pool answers ``None`` and the caller uses gRPC;
  it asks again after ``RETRY_SECONDS``. When OpenLane itself fails (server
  unreachable, bad token) the gRPC path runs now and reports it, and the
  next call asks again.
- ``"shm"`` / ``"tcp"`` / ``"cuda_ipc"``: that lane or a ``KVStoreError``
  saying why not (with OpenLane's own code when that call failed, e.g.
  UNAUTHENTICATED); with ``optional=True`` (the Client's pool for device
  tensors) no lane answers ``None`` as in auto.
- ``"cuda_ipc"`` is never part of ``"auto"``: the Client asks for it on its
  own when a call carries CUDA tensors (``Client._device_lanes``).
- ``"grpc"``: never a lane.

Verbs: ``run(fn) -> result | None`` calls ``fn(lane)`` on a lane held for
that call alone (None: no lane, use gRPC). A ``LaneBroken`` drops that lane
and retries ``fn`` once on a fresh one; when that one breaks too, an optional
pool (auto) answers None (the call goes by gRPC: a store whose shm directory
cannot reserve more of a lane's region, a block larger than the region) and
opens no new lane for ``RETRY_SECONDS``; an explicit lane raises UNAVAILABLE.
At most ``max_lanes`` lanes are open; more concurrent calls wait for one.
``kind`` is the lane in use ("grpc" when none); ``close()`` closes every lane.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import grpc

from kvstore.errors import KVStoreError
from kvstore.lanes.base import Lane, LaneBroken, host_id
from kvstore.lanes.shm_region import RegionError
from kvstore.v1 import lanes_pb2 as lpb
from kvstore.v1 import lanes_pb2_grpc as lpb_grpc

if TYPE_CHECKING:
    from kvstore.lanes.shared_pool import SharedPool

log = logging.getLogger(__name__)
T = TypeVar("T")

MODES = ("auto", "grpc", "shm", "tcp", "cuda_ipc")
RETRY_SECONDS = 30.0
MAX_LANES = 4
_KINDS = {"shm": lpb.LANE_SHM, "tcp": lpb.LANE_TCP, "cuda_ipc": lpb.LANE_CUDA_IPC}
_NAMES = {v: k for k, v in _KINDS.items()}


class LanePool:
    def __init__(
        self,
        channel: grpc.Channel,
        target: str,
        mode: str,
        *,
        metadata: tuple[tuple[str, str], ...],
        timeout: float,
        tls: bool,
        max_lanes: int = MAX_LANES,
        optional: bool = False,
    ):
        if mode not in MODES:
            raise ValueError(f"lane must be one of {', '.join(MODES)}; got {mode!r}")
        self.mode, self.target, self.tls = mode, target, tls
        self.optional = optional or mode == "auto"  # no lane: None (use another path), not an error
        self._stub = lpb_grpc.KVStoreLanesStub(channel)
        self._metadata, self._timeout, self._max = metadata, timeout, max_lanes
        self._idle: list[Lane] = []
        self._open = 0
        self._cond = threading.Condition()
        self._retry_at = 0.0
        self._no_lane_for_a_while = False
        self._closed = False
        self.kind = "grpc"
        self.shared: list[SharedPool] = []  # offered to each lane before its next call (``Lane.share``)

    def run(self, fn: Callable[[Lane], T]) -> T | None:
        if self.mode == "grpc" or self._closed:
            return None
        first = self._acquire()
        if first is None:
            return None
        lane: Lane | None = first
        try:
            try:
                result = self._call(first, fn)
            except LaneBroken as err:
                log.info("%s lane broke (%s); opening a fresh one", first.kind, err)
                lane = None  # discarded: never given back, even when opening the fresh one fails
                self._discard(first)
                lane = self._acquire(fresh=True)
                if lane is None:
                    return None
                result = self._call(lane, fn)
        except LaneBroken as err:
            assert lane is not None
            self._discard(lane)
            if self.optional:  # a fresh lane failed too: this call goes by gRPC, and new lanes wait a while
                log.warning("%s lane failed twice (%s): using gRPC, new lanes in %.0f s", lane.kind, err, RETRY_SECONDS)
                with self._cond:
                    self._retry_at = time.monotonic() + RETRY_SECONDS
                return None
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"{lane.kind} lane failed twice: {err}") from None
        except BaseException:
            if lane is not None:
                self._give_back(lane)
            raise
        assert lane is not None  # the fresh one's failures returned or raised above
        self._give_back(lane)
        return result

    def _call(self, lane: Lane, fn: Callable[[Lane], T]) -> T:
        if self.shared:  # pools made since this lane last ran are offered first
            lane.share(self.shared)
        return fn(lane)

    def close(self) -> None:
        """Close the idle lanes now; lanes still in a call close when that call ends."""
        with self._cond:
            self._closed = True
            lanes, self._idle = self._idle, []
            self._open -= len(lanes)
        for lane in lanes:
            lane.close()

    # -- pool --------------------------------------------------------------------------
    def _acquire(self, fresh: bool = False) -> Lane | None:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while True:
                if self._idle and not fresh:
                    return self._idle.pop()
                if self._open < self._max:
                    if self.optional and time.monotonic() < self._retry_at:
                        return None
                    self._open += 1
                    break
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    return None
        try:
            lane = self._negotiate()
        except BaseException:
            self._forget()
            raise
        if lane is None:
            self._forget()
            if self._no_lane_for_a_while:
                self._retry_at = time.monotonic() + RETRY_SECONDS
        else:
            self.kind = lane.kind
        return lane

    def _give_back(self, lane: Lane) -> None:
        with self._cond:
            if not self._closed:
                self._idle.append(lane)
                self._cond.notify()
                return
            self._open -= 1
        lane.close()

    def _discard(self, lane: Lane) -> None:
        try:
            lane.close()
        except Exception:  # the lane is broken already; the server reaps it
            pass
        self._forget()

    def _forget(self) -> None:
        with self._cond:
            self._open -= 1
            self._cond.notify()

    # -- negotiation -----------------------------------------------------------------------
    def _negotiate(self) -> Lane | None:
        wanted = ["shm", "tcp"] if self.mode == "auto" else [self.mode]
        if self.mode == "auto" and (self.tls or self.target.startswith("unix:")):
            wanted.remove("tcp")
        if "cuda_ipc" in wanted:
            # Import torch before the server makes a region: a region not mapped within the lane lease is unlinked,
            # and a cold torch import on a loaded host takes longer than a short lease.
            try:
                import torch  # noqa: F401
            except ImportError:  # attach says so below, as a reason this lane cannot be used
                pass

        reasons: list[str] = []
        code = grpc.StatusCode.FAILED_PRECONDITION
        while wanted:
            request = lpb.OpenLaneRequest(kinds=[_KINDS[k] for k in wanted], host_id=host_id(), pid=os.getpid())
            try:
                reply = self._stub.OpenLane(request, timeout=self._timeout, metadata=self._metadata)
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
                reasons.append(f"OpenLane: {err.details() if hasattr(err, 'details') else err}")
                if code != grpc.StatusCode.UNIMPLEMENTED:  # transient or the caller's: ask again next call
                    self._retry_at = 0.0
                    self._no_lane(code, reasons, retry=False)
                    return None
                break
            if reply.kind == lpb.LANE_UNSPECIFIED:
                reasons.append(reply.reason)
                break
            kind = _NAMES.get(reply.kind, "tcp")
            try:
                return self._connect(kind, reply)
            except (RegionError, OSError, ImportError, LaneBroken, KVStoreError) as err:  # offered, unusable here
                if isinstance(err, KVStoreError):  # the lane refused us (a tcp hello reaching another node)
                    code = err.code
                reasons.append(f"{kind}: {err}")
                self._close_remote(reply)
                wanted.remove(kind)
        self._no_lane(
            code if code != grpc.StatusCode.UNIMPLEMENTED else grpc.StatusCode.FAILED_PRECONDITION, reasons, retry=True
        )
        return None

    def _no_lane(self, code: grpc.StatusCode, reasons: list[str], retry: bool) -> None:
        """No lane: the caller uses gRPC (auto), or hears why (an explicit lane)."""
        why = "; ".join(r for r in reasons if r) or "the server offers no lane"
        if not self.optional:
            raise KVStoreError(code, f"no {self.mode} lane to {self.target}: {why}")
        log.info("no fast lane to %s (%s): using gRPC", self.target, why)
        self._no_lane_for_a_while = retry

    def _connect(self, kind: str, reply: lpb.OpenLaneResponse) -> Lane:
        if kind == "cuda_ipc":
            from kvstore.lanes.client.cuda import CudaIpcClientLane

            return CudaIpcClientLane(self._stub, reply, self._metadata, self._timeout)
        if kind == "shm":
            from kvstore.lanes.client.shm import ShmClientLane

            return ShmClientLane(self._stub, reply, self._metadata, self._timeout)
        from kvstore.lanes.client.tcp import TcpClientLane

        return TcpClientLane(reply.tcp_host or _host_of(self.target), reply.tcp_port, reply, self._timeout)

    def _close_remote(self, reply: lpb.OpenLaneResponse) -> None:
        try:
            self._stub.CloseLane(
                lpb.CloseLaneRequest(lane=lpb.LaneRef(lane_id=reply.lane_id, token=reply.token)),
                timeout=5,
                metadata=self._metadata,
            )
        except grpc.RpcError:
            pass


def _host_of(target: str) -> str:
    """The host part of a gRPC target ``HOST:PORT``, ``[V6]:PORT`` or ``dns:///HOST:PORT``."""
    target = target.split("///", 1)[-1]
    host = target.rpartition(":")[0] or target
    return host.strip("[]")
