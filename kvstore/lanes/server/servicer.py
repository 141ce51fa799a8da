"""The KVStoreLanes gRPC service: negotiates lanes and carries the shm lane's control messages.

- ``OpenLane(kinds, host_id, pid)``: the first requested kind this node can
  give: ``shm`` when the client's host id equals this node's and a region can
  be created, ``cuda_ipc`` likewise with a device region (and a client process
  other than the server's), ``tcp`` when the bulk listener runs; else
  ``LANE_UNSPECIFIED`` with the reason (the client keeps using gRPC). A kind
  whose region or set-up fails is a reason, and the next kind is tried.
- ``LanePut`` (a stream of reserves and commits) / ``LaneGet``: the shm and
  cuda_ipc lanes' verbs (``shm_server``, ``cuda_server``); the first of them
  unlinks the region's file.
  When a LanePut stream ends, whatever it reserved and did not commit is
  taken back.
- ``CloseLane``: aborts what the lane still holds and frees its region.

Every request names its lane and carries its token: an unknown lane is
FAILED_PRECONDITION (open a new one), a wrong token PERMISSION_DENIED. The
node's Gatekeeper authenticates every call (the interceptor); the tenant of
the OpenLane call is bound to the lane and every namespace on it is checked
against that tenant (``access.py``), on the TCP lane too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from kvstore.lanes.base import LaneError
from kvstore.lanes.cuda_region import DeviceRegion
from kvstore.lanes.segments import get_destinations
from kvstore.lanes.server.access import LaneAccess
from kvstore.lanes.server.cuda import CudaIpcServerLane
from kvstore.lanes.server.registry import LaneRegistry
from kvstore.lanes.server.shm import ShmServerLane, put_conversation
from kvstore.lanes.server.storeops import StoreOps
from kvstore.lanes.server.tcp import TcpLaneServer, TcpServerLane
from kvstore.lanes.shm_region import RESERVE_STEP, RegionError, ShmRegion
from kvstore.v1 import lanes_pb2 as lpb
from kvstore.v1 import lanes_pb2_grpc as lpb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R", ShmRegion, DeviceRegion)


class LaneServicer(lpb_grpc.KVStoreLanesServicer):
    def __init__(
        self,
        registry: LaneRegistry,
        ops: StoreOps,
        *,
        host_id: str,
        shm_dir: str | None,
        shm_bytes: int,
        tcp: TcpLaneServer | None,
        gate: Any = None,
        cuda_device: str | None = None,
        cuda_bytes: int = 0,
        cuda_shm_dir: str | None = None,
        direct_socket: str = "",
    ):
        self.registry, self.ops, self.host_id, self.gate = registry, ops, host_id, gate
        self.direct_socket = direct_socket  # "" when direct puts are off
        self.shm_dir, self.shm_bytes, self.tcp = shm_dir, shm_bytes, tcp
        self.cuda_device, self.cuda_bytes, self.cuda_shm_dir = cuda_device, cuda_bytes, cuda_shm_dir

    # -- negotiation ---------------------------------------------------------------------
    def OpenLane(self, request: lpb.OpenLaneRequest, context: grpc.ServicerContext) -> lpb.OpenLaneResponse:
        with self.ops.metrics.rpc("OpenLane", context):
            reasons: list[str] = []
            access = self._run(context, lambda: LaneAccess.of_current_call(self.gate))
            for kind in request.kinds:
                try:
                    reply = self._open(kind, request, reasons, access)
                except LaneError as err:
                    reasons.append(err.message)
                    continue
                if reply is not None:
                    reply.reason = "; ".join(reasons)
                    return reply
            return lpb.OpenLaneResponse(
                kind=lpb.LANE_UNSPECIFIED, host_id=self.host_id, reason="; ".join(reasons) or "no lane kind requested"
            )

    def _open(
        self, kind: lpb.LaneKind, request: lpb.OpenLaneRequest, reasons: list[str], access: LaneAccess
    ) -> lpb.OpenLaneResponse | None:
        if kind == lpb.LANE_SHM:
            if self.shm_dir is None:
                reasons.append("shm lane disabled on this node")
                return None
            if request.host_id != self.host_id:
                reasons.append("shm needs the same host")
                return None
            shm_dir = self.shm_dir
            opened = self._region_lane(
                "shm",
                lambda: ShmRegion.create(shm_dir, self.shm_bytes, reserved=RESERVE_STEP),  # the rest as it is granted
                ShmServerLane,
                reasons,
                access,
            )
            if opened is None:
                return None
            lane, region = opened
            dram = lane.pins.arena if lane.pins is not None else None
            index = self.ops.disk_index() if lane.disk is not None and dram is None else None  # NVMe blocks alone
            return lpb.OpenLaneResponse(
                kind=kind,
                lane_id=lane.lane_id,
                token=lane.token,
                shm_path=region.path,
                shm_bytes=region.size,
                direct_socket=self.direct_socket,
                direct_segments=bool(self.direct_socket),
                host_id=self.host_id,
                lease_seconds=self.registry.lease,
                dram_path=dram.path if dram is not None else "",
                dram_bytes=dram.size if dram is not None else 0,
                dram_index_path=dram.index_path if dram is not None else index.path if index is not None else "",
                dram_index_bytes=dram.index_bytes if dram is not None else index.nbytes if index is not None else 0,
                nvme_dir=(self.ops.disk_dir() or "") if lane.disk is not None else "",
            )
        if kind == lpb.LANE_CUDA_IPC:
            return self._open_cuda(request, reasons, access)
        if kind == lpb.LANE_TCP:
            if self.tcp is None:
                reasons.append("tcp lane disabled on this node")
                return None
            tlane = TcpServerLane()
            tlane.access = access
            self.registry.add(tlane)
            return lpb.OpenLaneResponse(
                kind=kind,
                lane_id=tlane.lane_id,
                token=tlane.token,
                tcp_port=self.tcp.port,
                host_id=self.host_id,
                lease_seconds=self.registry.lease,
            )
        reasons.append(f"unknown lane kind {kind}")
        return None

    def _open_cuda(
        self, request: lpb.OpenLaneRequest, reasons: list[str], access: LaneAccess
    ) -> lpb.OpenLaneResponse | None:
        if self.cuda_device is None:
            reasons.append("cuda_ipc lane disabled on this node (off, or no CUDA device)")
            return None
        if request.host_id != self.host_id:
            reasons.append("cuda_ipc needs the same host")
            return None
        if request.pid == os.getpid() and self.cuda_device != "cpu":
            reasons.append("cuda_ipc cannot map a handle in the process that made it (client inside the server)")
            return None
        device = self.cuda_device
        opened = self._region_lane(
            "cuda_ipc",
            lambda: DeviceRegion.create(device, self.cuda_bytes, self.cuda_shm_dir),
            CudaIpcServerLane,
            reasons,
            access,
        )
        if opened is None:
            return None
        lane, region = opened
        return lpb.OpenLaneResponse(
            kind=lpb.LANE_CUDA_IPC,
            lane_id=lane.lane_id,
            token=lane.token,
            shm_bytes=region.size,
            cuda_region=region.message,
            host_id=self.host_id,
            lease_seconds=self.registry.lease,
        )

    def _region_lane(
        self,
        name: str,
        make_region: Callable[[], R],
        lane_class: Callable[[R, StoreOps, float], ShmServerLane],
        reasons: list[str],
        access: LaneAccess,
    ) -> tuple[ShmServerLane, R] | None:
        """A region lane (shm or cuda_ipc) registered for ``access``, and its region; None (with the reason)
        if no region."""
        try:
            region = make_region()
        except (RegionError, OSError) as err:
            log.warning("cannot create a %s lane region: %s", name, err)
            reasons.append(f"{name} region: {err}")
            return None
        try:
            lane = lane_class(region, self.ops, self.registry.lease)
        except Exception as err:  # a bug, not the client's: the next kind may still serve it
            region.close()  # its fd, its reserved pages and its name
            log.exception("cannot set up a %s lane", name)
            reasons.append(f"{name} lane: {err}")
            return None
        lane.access = access
        try:
            self.registry.add(lane)
        except LaneError:
            lane.close()
            raise
        return lane, region

    def CloseLane(self, request: lpb.CloseLaneRequest, context: grpc.ServicerContext) -> lpb.CloseLaneResponse:
        with self.ops.metrics.rpc("CloseLane", context):
            self._run(context, lambda: self.registry.close(request.lane.lane_id, request.lane.token))
            return lpb.CloseLaneResponse()

    # -- shm verbs ------------------------------------------------------------------------
    def _shm(self, ref: lpb.LaneRef) -> ShmServerLane:
        """The shm or cuda_ipc lane a LanePut/LaneGet names (both speak the same messages)."""
        kind = "cuda_ipc" if self.registry.kind_of(ref.lane_id) == "cuda_ipc" else "shm"
        lane = self.registry.get(ref.lane_id, ref.token, kind)
        assert isinstance(lane, ShmServerLane)
        lane.attached()
        return lane

    def LanePut(
        self, request_iterator: Iterator[lpb.LanePutRequest], context: grpc.ServicerContext
    ) -> Iterator[lpb.LanePutResponse]:
        with self.ops.metrics.rpc("LanePut", context):
            try:
                yield from put_conversation(self._shm, request_iterator)
            except LaneError as err:
                context.abort(err.code, err.message)

    def LaneGet(self, request: lpb.LaneGetRequest, context: grpc.ServicerContext) -> Iterator[lpb.LaneGetResponse]:
        with self.ops.metrics.rpc("LaneGet", context):
            outs = self._run(context, lambda: get_destinations(request))
            stream = self._run(
                context,
                lambda: self._shm(request.lane).get(
                    request.request,
                    request.release,
                    request.crc_at_copy,
                    outs,
                    request.read_dram,
                    request.read_disk,
                    request.written_columns,
                    request.named_columns,
                    request.disk_columns,
                ),
            )
            while True:
                msg = self._run(context, lambda: next(stream, None))
                if msg is None:
                    return
                yield msg

    @staticmethod
    def _run(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except LaneError as err:
            context.abort(err.code, err.message)
            raise AssertionError("unreachable") from None  # context.abort raises
