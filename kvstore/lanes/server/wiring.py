"""Wiring of the lanes into a store node: ``LaneServer(store_server).register(grpc_server)``.

Reads the lane options of ``ServeConfig`` (``lanes``, ``tcp_lane_listen``,
``shm_dir``, ``shm_lane_bytes``, ``shm_direct``, ``cuda_lane_bytes``, ``cuda_lane_device``,
``lane_lease``, ``lane_max``), builds the
registry (with its reaper), the bulk TCP listener, the direct-put handshake socket and the KVStoreLanes
servicer, and registers the servicer on the gRPC server. ``close(grace)``
stops the listener after in-flight frames and closes every lane (aborting
outstanding grants, unlinking regions).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import grpc

from kvstore.lanes import cma
from kvstore.lanes.base import host_id
from kvstore.lanes.direct import DirectListener
from kvstore.lanes.server import channel as shm_channel
from kvstore.lanes.server.lane import ServerLane
from kvstore.lanes.server.registry import LaneRegistry
from kvstore.lanes.server.servicer import LaneServicer
from kvstore.lanes.server.storeops import StoreOps
from kvstore.lanes.server.tcp import TcpLaneServer
from kvstore.lanes.shm_region import sweep
from kvstore.v1 import lanes_pb2, lanes_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = lanes_pb2.DESCRIPTOR.services_by_name["KVStoreLanes"].full_name
IDLE_LEASES = 10  # a lane unused for this many leases is closed


def lane_kinds(spec: str) -> set[str]:
    kinds = {k.strip() for k in spec.split(",") if k.strip()}
    unknown = kinds - {"shm", "tcp", "cuda_ipc"}
    if unknown:
        raise ValueError(f"option --lanes: unknown lane kinds {sorted(unknown)} (shm, tcp, cuda_ipc)")
    return kinds


class LaneServer:
    def __init__(self, node: Any):
        cfg = node.cfg
        kinds = lane_kinds(cfg.lanes)
        if "shm" in kinds and cfg.shm_lane_bytes < cfg.max_block:
            raise ValueError(f"--shm-lane-bytes ({cfg.shm_lane_bytes}) must hold the largest block ({cfg.max_block})")
        self.ops = StoreOps(node.store, node.limits, node.metrics, share_nvme=cfg.nvme_shared)
        self.registry = LaneRegistry(
            node.metrics,
            lease_seconds=cfg.lane_lease,
            idle_seconds=IDLE_LEASES * cfg.lane_lease,
            max_lanes=cfg.lane_max,
        )
        self.tcp: TcpLaneServer | None = None
        if "tcp" in kinds and cfg.tls_cert:
            log.warning("tcp lane off: gRPC uses TLS and the tcp lane is plaintext (shm and gRPC remain)")
            kinds.discard("tcp")
        if "tcp" in kinds:
            host, port = _listen_address(cfg.tcp_lane_listen or "", cfg.host_port[0])
            self.tcp = TcpLaneServer(host, port, self.registry, self.ops, frame_seconds=cfg.lane_lease)
        shm_dir = cfg.shm_dir if "shm" in kinds and os.path.isdir(cfg.shm_dir) else None
        if "shm" in kinds and shm_dir is None:
            log.warning("shm lane off: %s is not a directory", cfg.shm_dir)
        if shm_dir is not None and (stale := sweep(shm_dir)):
            log.info("removed %d lane region files left by servers that were killed", stale)
        self.direct: DirectListener | None = None
        if shm_dir is not None and cfg.shm_direct and cma.available():
            registry = self.registry

            def lookup(lane_id: str, token: bytes) -> ServerLane:
                return registry.get(lane_id, token, "shm")

            self.direct = DirectListener(shm_dir, lookup, on_bound=shm_channel.start(lookup, registry.close))
        cuda_device = _cuda_lane_device(cfg) if "cuda_ipc" in kinds else None
        if cuda_device is not None and cfg.cuda_lane_bytes < cfg.max_block:
            raise ValueError(f"--cuda-lane-bytes ({cfg.cuda_lane_bytes}) must hold the largest block ({cfg.max_block})")
        self.servicer = LaneServicer(
            self.registry,
            self.ops,
            host_id=host_id(),
            shm_dir=shm_dir,
            shm_bytes=cfg.shm_lane_bytes,
            tcp=self.tcp,
            gate=getattr(node, "gate", None),
            cuda_device=cuda_device,
            cuda_bytes=cfg.cuda_lane_bytes,
            cuda_shm_dir=cfg.shm_dir if os.path.isdir(cfg.shm_dir) else None,
            direct_socket=self.direct.path if self.direct is not None else "",
        )

    def register(self, server: grpc.Server) -> LaneServer:
        lanes_pb2_grpc.add_KVStoreLanesServicer_to_server(self.servicer, server)
        self.registry.start()
        if self.direct is not None:
            self.direct.start()
        if self.tcp is not None:
            self.tcp.start()
            log.info("tcp lane listening on port %d", self.tcp.port)
        return self

    def close(self, grace: float = 5.0) -> None:
        if self.tcp is not None:
            self.tcp.close(grace)
        if self.direct is not None:
            self.direct.close()
        self.registry.stop()


def _cuda_lane_device(cfg: Any) -> str | None:
    """Where cuda_ipc regions live: None (lane off) unless CUDA works here or the cpu stand-in is asked for."""
    device: str | None = cfg.cuda_lane_device or cfg.hbm_device
    if device == "cpu":
        return device
    from kvstore.tiers.arena import cuda_available

    return device if cuda_available() else None


def _listen_address(spec: str, default_host: str) -> tuple[str, int]:
    if not spec:
        return default_host, 0
    host, _, port = spec.rpartition(":")
    return host.strip("[]") or default_host, int(port or 0)
