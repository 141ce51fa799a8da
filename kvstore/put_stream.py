"""The sending end of a raw gRPC Put stream (``NodeClient``'s Puts that no lane took).

``put_call(channel)``: KVStore.Put taking requests already encoded (``kvstore/block_messages.py``: each chunk
joined into its message once). ``put_requests(namespace, headers, payloads, chunk, packed=0)``: the stream's
messages, the namespace in the first. A block is its header with its first chunk, then chunks; with ``packed``
(the server's last ``PutResponse.packed_bytes``) consecutive blocks go whole, several to a message of at most
that many bytes, headers included (``PutRequest.blocks``, their bytes one after another in ``data``), as a packed
Get sends them: Python's gRPC costs about 0.25 ms a message here, and a 32 x 16 KiB Put sent a block a message.
``PutShape``: how one client cuts its Puts to one store, from what the store said (``learn``) or refused
(``refused``: an older store refuses packed messages, a store with a small ``--max-message`` a message over it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from kvstore.block_messages import encode_put, serialize
from kvstore.errors import KVStoreError
from kvstore.payload import Segments
from kvstore.v1 import kvstore_pb2 as pb

PUT_METHOD = "/" + pb.DESCRIPTOR.services_by_name["KVStore"].full_name + "/Put"
HEADER_OVERHEAD = 16  # a packed block's header field: tag and length, with room for the message's own fields


# gRPC core's words for a message over a limit, either end: "Received message larger than max (524337 vs. 262144)"
_OVER_LIMIT = re.compile(r"larger than max \((\d+) vs\. (\d+)\)")


@dataclass
class PutShape:
    """How a client cuts its raw Puts to one store: ``packed`` is the store's last ``PutResponse.packed_bytes`` (0
    for an older store, and before the first reply), ``limit`` the message size a refusal showed it takes (0: none
    seen). Chunks stay within both, and within the client's own ``ceiling``."""

    packed: int = 0
    limit: int = 0

    def chunk(self, ceiling: int) -> int:
        return min(n for n in (ceiling, self.packed, self.limit // 2) if n > 0)

    def learn(self, reply: pb.PutResponse, ceiling: int) -> None:
        self.packed = min(reply.packed_bytes, ceiling)

    def refused(self, err: KVStoreError, packed: int, chunk: int) -> bool:
        """Whether a Put sent with ``packed`` and ``chunk`` was refused for its shape, which is then changed so
        that sending it again can pass (blocks the store handled before the refusal are stored again as equal
        bytes: a Put of a stored hash is idempotent). An older store, replaced under a live client, reads a
        packed message as a data chunk with no header (INVALID_ARGUMENT); a store whose ``--max-message`` is under
        the client's chunk refuses the message (RESOURCE_EXHAUSTED) before any reply has said its limit. A real
        fault of the Put fails again the same way, unpacked, and is raised then."""
        if err.code == grpc.StatusCode.INVALID_ARGUMENT and packed:
            self.packed = 0
            return True
        over = _OVER_LIMIT.search(err.message) if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
        if over is not None and 0 < int(over.group(2)) // 2 < chunk:
            self.limit = int(over.group(2))
            self.packed = min(self.packed, self.limit // 2)
            return True
        return False


def put_call(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable[bytes, pb.PutResponse]:
    return channel.stream_unary(PUT_METHOD, serialize, pb.PutResponse.FromString)


def put_requests(
    namespace: str,
    headers: Sequence[pb.BlockHeader],
    payloads: Sequence[memoryview | Segments],
    chunk: int,
    packed: int = 0,
) -> Iterator[bytes]:
    first = [namespace]  # the namespace goes in the stream's first message only

    def ns() -> str:
        return first.pop() if first else ""

    held: list[pb.BlockHeader] = []
    held_parts: list[memoryview] = []
    held_bytes = 0
    for header, payload in zip(headers, payloads):
        n = header.stored_length
        cost = n + header.ByteSize() + HEADER_OVERHEAD  # what it adds to a packed message
        if cost <= packed:
            if held and held_bytes + cost > packed:
                yield encode_put(ns(), None, held_parts, held)
                held, held_parts, held_bytes = [], [], 0
            held.append(header)
            held_parts.extend(payload.views if isinstance(payload, Segments) else (payload,))
            held_bytes += cost
            continue
        if held:
            yield encode_put(ns(), None, held_parts, held)
            held, held_parts, held_bytes = [], [], 0
        chunks = chunk_parts(payload, chunk)
        yield encode_put(ns(), header, next(chunks, ()))
        for parts in chunks:
            yield encode_put("", None, parts)
    if held:
        yield encode_put(ns(), None, held_parts, held)


def chunk_parts(payload: memoryview | Segments, chunk: int) -> Iterator[Sequence[memoryview]]:
    """A payload as the views that make each gRPC chunk of at most ``chunk`` bytes (joined into its message)."""
    if isinstance(payload, Segments):
        yield from payload.chunk_parts(chunk)
        return
    for start in range(0, len(payload), chunk):
        yield (payload[start : start + chunk],)
