"""How block bytes leave and enter the gRPC KVStore streams (``service.py``'s Get and Put).

- ``Packer(chunk)``: whole small blocks of a packed Get (``GetRequest.packed``) gathered into messages of at most
  ``chunk`` block bytes; ``add(header, data)`` gives the messages that are full, ``take()`` the one held.
- ``chunks(lease, chunk)``: a block as its header with its first chunk, then chunks.
- Each message leaves as ``Encoded``: its bytes (``block_messages.encode_get``, the block bytes copied once) and
  how many block bytes it carries.
- ``header_of(lease)``: the header a raw block is sent with.
- ``land(slot, at, data, crc) -> crc``: a Put chunk copied into its slot, its CRC32C chained on, in one pass on
  host memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from kvstore import block_messages
from kvstore.checksum import crc32c
from kvstore.memops import copy_crc, copy_into, host_bytes, host_view
from kvstore.store import Lease
from kvstore.v1 import kvstore_pb2 as pb


def header_of(lease: Lease) -> pb.BlockHeader:
    return pb.BlockHeader(
        hash=lease.hash,
        codec=lease.codec,  # type: ignore[arg-type]
        raw_length=lease.raw_length,
        stored_length=lease.stored_length,
        crc32c=lease.crc32c,
        dtype=lease.dtype,
    )


def land(slot: Any, at: int, data: memoryview, crc: int) -> int:
    """Copy a Put chunk into its slot at ``at``; the CRC32C chained over it. Host memory in one pass (copy and
    CRC fused, ``memops.copy_crc``); a device slot (an HBM tier's tensor) through ``memops.copy_into``."""
    host = host_view(slot)
    if host is not None:
        return copy_crc(host[at : at + len(data)], data, crc)
    copy_into(slot[at : at + len(data)], data)
    return crc32c(data, crc)


Encoded = tuple[bytes, int]  # a GetResponse's bytes (block_messages.encode_get) and how many block bytes it carries


def chunks(lease: Lease, chunk: int) -> Iterator[Encoded]:
    return _chunked(header_of(lease), lease.buffer, chunk)


def _chunked(header: pb.BlockHeader, buf: Any, chunk: int) -> Iterator[Encoded]:
    """One block as its header with the first chunk, then chunks: each copied as its message is made."""
    n = header.stored_length
    view = host_bytes(buf)  # a device slot (HBM tier) downloaded once
    first = view[: min(chunk, n)]
    yield block_messages.encode_get(header, (first,)), len(first)
    for start in range(chunk, n, chunk):
        part = view[start : start + chunk]
        yield block_messages.encode_get(None, (part,)), len(part)


class Packer:
    """Whole blocks of a packed Get (``GetRequest.packed``) gathered into messages of at most ``chunk`` bytes:
    Python's gRPC moves a stream one message at a time, about 0.2-0.5 ms each here, so a 32 x 64 KiB Get sent
    a block a message took 15-18 ms from DRAM. A block larger than ``chunk`` goes as before, in chunks."""

    def __init__(self, chunk: int):
        self.chunk = chunk
        self._headers: list[pb.BlockHeader] = []
        self._parts: list[Any] = []
        self._bytes = 0

    @property
    def held(self) -> bool:
        return bool(self._headers)

    def add(self, header: pb.BlockHeader, data: Any) -> Iterator[Encoded]:
        """The messages that are full once this block is added (its bytes are copied when its message is made)."""
        n = header.stored_length
        full = [self.take()] if self._headers and self._bytes + n > self.chunk else []
        if n > self.chunk:
            return itertools.chain(full, _chunked(header, data, self.chunk))
        self._headers.append(header)
        self._parts.append(host_bytes(data)[:n])
        self._bytes += n
        return iter(full)

    def take(self) -> Encoded:
        msg = block_messages.encode_get(None, self._parts, self._headers), self._bytes
        self._headers, self._parts, self._bytes = [], [], 0
        return msg
