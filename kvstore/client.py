"""The public client (DESIGN 2.4): ``Client(target)`` for one node (``HOST:PORT``) or a cluster (``redis://...``).

    from kvstore.client import Client
    with Client("127.0.0.1:7070") as kv:             # a NodeClient (kvstore/node_client.py)
        n = kv.lookup("ns", hashes)
    with Client("redis://127.0.0.1:6379") as kv:     # a ClusterClient (kvstore/cluster/client.py)
        blocks = kv.get("ns", hashes)

The verbs, their promises and the options are in ``kvstore/node_client.py``; the cluster client has the same
verbs. This module sits at the top of the client side: it imports both clients, and neither imports it.
``KVStoreError``, ``PutResult``, ``Segments``, ``SegmentRows`` and ``as_bytes_view`` are re-exported from their leaf modules for users.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.cluster.urls import is_redis_url
from kvstore.errors import KVStoreError
from kvstore.node_client import NodeClient
from kvstore.payload import SegmentRows, Segments, as_bytes_view
from kvstore.wire import CHUNK_BYTES, TIER_NAMES, PutResult

if TYPE_CHECKING:
    from kvstore.cluster.client import ClusterClient

__all__ = [
    "CHUNK_BYTES",
    "TIER_NAMES",
    "Client",
    "KVStoreError",
    "PutResult",
    "SegmentRows",
    "Segments",
    "as_bytes_view",
    "connect",
]


class Client(NodeClient):
    """A NodeClient; ``Client("redis://HOST:PORT")`` (or rediss://, redis+cluster://) is a ClusterClient instead."""

    def __new__(cls, target: str, *args: Any, **kwargs: Any) -> Any:
        if cls is Client and is_redis_url(target):
            return _cluster_client(target, *args, **kwargs)
        return super().__new__(cls)


def connect(target: str, **options: Any) -> NodeClient | ClusterClient:
    """The client for ``target``: a ClusterClient for redis:// targets, else a NodeClient."""
    return _cluster_client(target, **options) if is_redis_url(target) else NodeClient(target, **options)


def _cluster_client(target: str, *args: Any, **kwargs: Any) -> ClusterClient:
    """Imported here: the cluster client needs redis (the ``cluster`` extra), a single node does not."""
    try:
        from kvstore.cluster.client import ClusterClient
    except ImportError as err:
        raise ImportError(f"{target}: a cluster target needs redis-py: pip install 'kvstore[cluster]' ({err})") from err
    return ClusterClient(target, *args, **kwargs)
