"""Cluster mode of one store node: membership heartbeats plus the index publisher.

``StoreServer`` starts it when ``--redis URL`` is set, after the gRPC port is
bound (the advertised address needs the real port), and stops it first on
shutdown, so clients stop routing to a draining node::

    node = ClusterNode(cfg, store, metrics, port=server.port).start()
    ...
    node.stop()          # deregister, delete this node's index keys

The node id is ``--node-id`` or the advertised address (``--advertise``, else
the listen address with the bound port; a wildcard listen host is replaced by
this host's name). Both parts run on their own threads with their own Redis
connections; nothing here is on the data path, and a node whose Redis is down
keeps serving its blocks (``redis_up`` 0 in Stats counters and /metrics).
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

from kvstore.cluster.connect import RedisConnector
from kvstore.cluster.keys import KeyLayout
from kvstore.cluster.membership import Membership, NodeInfo
from kvstore.cluster.publisher import IndexPublisher, PublisherOptions
from kvstore.config import ServeConfig
from kvstore.store import BlockStore


def advertise_address(cfg: ServeConfig, port: int) -> str:
    if cfg.advertise:
        return cfg.advertise
    host = cfg.listen.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ClusterNode:
    def __init__(
        self,
        cfg: ServeConfig,
        store: BlockStore,
        metrics: Any,
        port: int,
        *,
        lanes: Sequence[str] | None = None,
        layout: KeyLayout = KeyLayout(),
        options: PublisherOptions = PublisherOptions(),
    ):
        if not cfg.redis:
            raise ValueError("cluster mode needs --redis URL")
        if cfg.cluster_ttl <= 0:
            raise ValueError("--cluster-ttl must be positive")
        if lanes is None:  # gRPC always, plus the fast lanes the node offers (--lanes)
            lanes = ["grpc", *(x.strip() for x in str(getattr(cfg, "lanes", "")).split(",") if x.strip())]
        addr = advertise_address(cfg, port)
        self.node_id = cfg.node_id or addr
        tiers = [{"name": t.name, "capacity": t.capacity_bytes} for t in store.tiers]
        info = NodeInfo(
            id=self.node_id,
            addr=addr,
            incarnation=uuid.uuid4().hex[:12],
            shards=options.shards,
            weight=float(max(1, sum(t.capacity_bytes for t in store.tiers))),
            tiers=tiers,
            lanes=list(lanes),
            started=time.time(),
        )
        self.metrics = metrics
        metrics.set("redis_up", 0.0)
        self.membership = Membership(
            RedisConnector(cfg.redis), info, ttl=cfg.cluster_ttl, layout=layout, metrics=metrics, on_lost=self._on_lost
        )
        self.publisher = IndexPublisher(
            store,
            RedisConnector(cfg.redis),
            self.membership,
            ttl=cfg.cluster_ttl,
            layout=layout,
            metrics=metrics,
            options=options,
        )

    def _on_lost(self) -> None:
        """Membership is back after losing its entry: Redis answers, so resync the index now, not after a backoff."""
        self.publisher.connector.retry_now()
        self.publisher.request_resync()

    def start(self) -> ClusterNode:
        self.membership.start()
        self.publisher.start()
        return self

    def stop(self) -> None:
        self.membership.stop(deregister=True)
        self.publisher.stop(unlink=True)
        self.membership.connector.close()
        self.publisher.connector.close()
