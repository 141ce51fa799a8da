"""Request validation shared by every lane: one place decides what is malformed.

Each check raises ``InvalidRequest`` (mapped to INVALID_ARGUMENT) with a message
that tells the caller what to fix. A block header's ``dtype`` must be one of
``WIRE_DTYPES`` (an empty one is refused, not taken as bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvstore.codecs import codec_name, get_codec
from kvstore.codecs.base import FLOAT_DTYPES
from kvstore.codecs.policy import LossyPolicy, is_lossy
from kvstore.hashing import HASH_BYTES
from kvstore.store.index import DTYPES
from kvstore.tiers.base import BlockMeta
from kvstore.v1 import kvstore_pb2 as pb

MAX_NAMESPACE_BYTES = 256
KNOWN_CODECS = frozenset(range(6))  # kvstore.v1.Codec values
# BlockHeader.dtype names a Put may carry (the index's table minus its "" slot); kvstore.proto lists them too.
WIRE_DTYPES = tuple(sorted(d for d in DTYPES if d))


class InvalidRequest(ValueError):
    pass


@dataclass(frozen=True)
class Limits:
    max_block_bytes: int = 8 << 20
    max_chunk_bytes: int = 1 << 20
    max_message_bytes: int = 4 << 20  # gRPC's limit on one message (serve --max-message)
    max_hashes: int = 65536
    max_stream_bytes: int = 16 << 30
    lossy: LossyPolicy = LossyPolicy()  # namespaces whose blocks may arrive under a lossy codec

    @property
    def send_chunk_bytes(self) -> int:
        """Block bytes in one message this store sends, or takes packed: a chunk, and at most half of gRPC's
        message limit (headers ride along)."""
        return min(self.max_chunk_bytes, self.max_message_bytes // 2)


def namespace(ns: str) -> str:
    raw = ns.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_NAMESPACE_BYTES:
        raise InvalidRequest(f"namespace is {len(raw)} bytes; the limit is {MAX_NAMESPACE_BYTES}")
    if "\0" in ns or any(ord(c) < 0x20 for c in ns):
        raise InvalidRequest("namespace must not contain NUL or control characters")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("namespace is not valid UTF-8") from None
    return ns


def hashes(keys: list[bytes] | tuple[bytes, ...], limits: Limits) -> list[bytes]:
    if len(keys) > limits.max_hashes:
        raise InvalidRequest(f"{len(keys)} hashes in one request; the limit is {limits.max_hashes}")
    for i, key in enumerate(keys):
        if len(key) != HASH_BYTES:
            raise InvalidRequest(f"hash {i} is {len(key)} bytes; block hashes are {HASH_BYTES} bytes")
    return list(keys)


def header(ns: str, hdr: pb.BlockHeader, index: int, limits: Limits) -> BlockMeta:
    """A BlockMeta from a wire BlockHeader, or InvalidRequest naming block `index`."""
    where = f"block {index}"
    if len(hdr.hash) != HASH_BYTES:
        raise InvalidRequest(f"{where}: hash is {len(hdr.hash)} bytes; block hashes are {HASH_BYTES} bytes")
    if hdr.parent and len(hdr.parent) != HASH_BYTES:
        raise InvalidRequest(f"{where}: parent hash is {len(hdr.parent)} bytes; expected {HASH_BYTES} or none")
    if hdr.codec not in KNOWN_CODECS:
        raise InvalidRequest(f"{where}: unknown codec {hdr.codec}")
    if hdr.stored_length == 0 or hdr.raw_length == 0:
        raise InvalidRequest(f"{where}: empty block (raw_length and stored_length must be > 0)")
    if hdr.stored_length > limits.max_block_bytes or hdr.raw_length > limits.max_block_bytes:
        raise InvalidRequest(
            f"{where}: {max(hdr.stored_length, hdr.raw_length)} bytes exceeds the block size limit "
            f"of {limits.max_block_bytes} bytes"
        )
    if is_lossy(hdr.codec) and not limits.lossy.allows(ns):
        raise InvalidRequest(
            f"{where}: codec {codec_name(hdr.codec)} is lossy and namespace {ns!r} keeps lossless KV only; "
            f"send it uncoded or losslessly coded (the server's --lossy-namespaces lists where "
            f"lossy KV may go)"
        )
    if hdr.codec == 0 and hdr.stored_length != hdr.raw_length:
        raise InvalidRequest(
            f"{where}: codec none needs stored_length == raw_length ({hdr.stored_length} != {hdr.raw_length})"
        )
    dtype = hdr.dtype
    if dtype not in WIRE_DTYPES:
        said = "is empty" if not dtype else f"{dtype!r} is unknown"
        raise InvalidRequest(
            f"{where}: dtype {said}; set it to the element type of the raw bytes, one of "
            f"{', '.join(WIRE_DTYPES)} (uint8 for plain bytes)"
        )
    if get_codec(hdr.codec).float_only and dtype not in FLOAT_DTYPES:
        raise InvalidRequest(
            f"{where}: codec {codec_name(hdr.codec)} codes float KV; dtype {dtype!r} is not one of "
            f"{', '.join(FLOAT_DTYPES)} (send it uncoded, zstd or lz4)"
        )
    return BlockMeta(
        namespace=ns,
        hash=bytes(hdr.hash),
        parent=bytes(hdr.parent),
        codec=hdr.codec,
        dtype=dtype,
        raw_length=hdr.raw_length,
        stored_length=hdr.stored_length,
        crc32c=hdr.crc32c,
    )


def over_capacity(block_hash: bytes, reason: str) -> pb.BlockResult:
    """A block refused for capacity or quota (RESOURCE_EXHAUSTED in its result): the same on gRPC and every lane."""
    return pb.BlockResult(
        hash=block_hash, status=pb.PUT_REJECTED, code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], reason=reason
    )
