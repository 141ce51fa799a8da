"""The lane interface: what every data lane (shm, tcp, cuda_ipc) implements.

Client side, one ``Lane`` is one negotiated channel for block bytes, used by
one call at a time (``negotiate.LanePool`` hands lanes out exclusively):

- ``put(namespace, headers, payloads) -> [PutResult]``: store a batch (a payload
  is a flat byte view, or a ``Segments`` on the host lanes, moved without
  gathering it where the transport allows); one
  result per block, in order (stored, already present, or rejected with the
  reason). ``headers`` are wire BlockHeaders (hash, parent, codec, lengths,
  dtype; the lane fills in the CRC32C). Raises ``KVStoreError`` with the
  server's status code; blocks acknowledged before an error stay stored.
- ``get(namespace, hashes, out, allow_missing, verify) -> [payload | None]``:
  the blocks in order, into ``out`` buffers when given (a ``Segments`` there:
  scattered across its parts), else new buffers;
  NOT_FOUND on a missing hash unless ``allow_missing``; DATA_LOSS when a CRC32C
  does not match.
- ``close()``: give the lane back to the server (its region, its token).

A transport failure (connection reset, region gone, lane expired on the
server) raises ``LaneBroken``: the pool drops the lane and retries the call
once on a fresh one; puts and gets are idempotent.

Server side, one ``ServerLane`` (``server/lane.py``) holds what a lane owns on the node (a shared
memory region and its grants, or just a token); the registry expires it.

The cuda_ipc lane (HBM to HBM) is the shm lane's ServerLane/Lane over a
device region (``cuda_server``/``cuda_client``): the store verbs
(``storeops.StoreOps``), grants and leases (``grants``), tokens and expiry
(``registry``) are reused as they are.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc

from kvstore.errors import KVStoreError
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.lanes.shared_pool import SharedPool

TOKEN_BYTES = 32


def host_id() -> str:
    """Identity of this host as both lane ends see it: kernel boot id and host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{boot}/{socket.gethostname()}"


class LaneError(Exception):
    """A request on a lane failed with a gRPC status code (server side)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class LaneBroken(Exception):
    """The lane itself failed (transport, expired, region gone): drop it and use another."""


_BREAKING = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED)


def lane_failure(code: grpc.StatusCode, message: str) -> Exception:
    """A status a lane's server sent, as the client raises it: UNAVAILABLE, FAILED_PRECONDITION (lane or grant
    gone) and CANCELLED break the lane (``LaneBroken``: retried on a fresh one); the rest are the caller's."""
    if code in _BREAKING:
        return LaneBroken(f"{code.name}: {message}")
    return KVStoreError(code, message)


class Lane(ABC):
    """Client side of one negotiated lane."""

    kind: str = ""

    @abstractmethod
    def put(self, namespace: str, headers: Sequence[pb.BlockHeader], payloads: Sequence[Any]) -> list[Any]:
        """Store a batch; a ``kvstore.wire.PutResult`` per block, in order (payloads: flat byte views, or
        ``kvstore.payload.Segments`` on the host lanes)."""

    @abstractmethod
    def get(
        self, namespace: str, hashes: Sequence[bytes], out: Sequence[Any] | None, allow_missing: bool, verify: bool
    ) -> list[Any]:
        """Fetch a batch in order (None for a missing block with ``allow_missing``)."""

    def share(self, pools: Sequence[SharedPool]) -> None:  # noqa: B027 - only the shm lane maps client memory
        """Offer the client's shared pools to the store (once each); lanes that cannot use them ignore them."""

    def warm_up(self) -> None:  # noqa: B027 - only the shm lane has readers and kernels of its own
        """Set up now what this lane's first Gets would (``NodeClient.warm_up``)."""

    @abstractmethod
    def close(self) -> None:
        """Release the lane on the server; the object is unusable afterwards."""
