"""On-disk record format of the NVMe segment log, and location encoding.

A segment file is a sequence of records, each starting on a 4 KiB boundary::

    record := header page (4096 B) | payload (stored_length B) | zero pad to 4 KiB

Header page, little-endian (offsets in bytes)::

    0    4  magic            b"KVSR"
    4    2  format version   1
    6    1  flags            bit 0: the block has a parent hash
    7    1  dtype length     (<= 16)
    8    8  seq              write sequence number (later supersedes earlier)
    16  16  hash             BLAKE2b-128 block hash
    32  16  parent           parent hash (zeros when flags bit 0 is clear)
    48   4  codec            kvstore.v1.Codec value
    52  16  dtype            ascii, NUL padded
    68   8  raw length       decoded payload bytes
    76   8  stored length    payload bytes in this record
    84   4  raw crc32c       of the decoded bytes, as given in BlockMeta
    88   4  stored crc32c    of the payload bytes in this record
    92   2  namespace length N (<= 1024)
    94   N  namespace        utf-8
    94+N 4  header crc32c    of bytes [0, 94+N)
    ...     zeros to 4096

The payload therefore starts 4 KiB aligned in the file (a direct read can land
in an aligned caller buffer, GPUDirect included). Recovery validates a record
from its header alone (magic, version, header crc) and its payload with the
stored crc, without decoding anything.

A location is one int: ``segment_id << 40 | byte offset of the record``.
"""

from __future__ import annotations

import struct
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from kvstore.checksum import crc32c as _crc32c  # hardware CRC32C of any buffer
from kvstore.tiers.base import BlockMeta

MAGIC = b"KVSR"
VERSION = 1
PAGE = 4096
HEADER_BYTES = PAGE
MAX_NAMESPACE_BYTES = 1024
MAX_DTYPE_BYTES = 16
FLAG_PARENT = 1

OFFSET_BITS = 40
OFFSET_MASK = (1 << OFFSET_BITS) - 1

_FIXED = struct.Struct("<4sHBBQ16s16sI16sQQIIH")  # 94 bytes, through the namespace length
_CRC = struct.Struct("<I")
assert _FIXED.size == 94


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C (Castagnoli) of any contiguous bytes-like object, extending ``value``."""
    if isinstance(data, np.ndarray) and data.dtype != np.uint8:
        data = data.reshape(-1).view(np.uint8)
    return _crc32c(data, value)


def align_up(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


def align_down(n: int, a: int = PAGE) -> int:
    return n // a * a


def record_bytes(stored_length: int) -> int:
    """Bytes a record with this payload occupies in a segment."""
    return HEADER_BYTES + align_up(stored_length)


def make_loc(segment_id: int, offset: int) -> int:
    return (segment_id << OFFSET_BITS) | offset


def split_loc(loc: int) -> tuple[int, int]:
    return loc >> OFFSET_BITS, loc & OFFSET_MASK


@lru_cache(maxsize=4096)
def _namespace_bytes(namespace: str) -> bytes:
    raw = namespace.encode("utf-8")
    if len(raw) > MAX_NAMESPACE_BYTES:
        raise ValueError(f"namespace is {len(raw)} bytes of utf-8; the NVMe tier stores at most {MAX_NAMESPACE_BYTES}")
    return raw


@lru_cache(maxsize=64)
def _dtype_bytes(dtype: str) -> bytes:
    raw = dtype.encode("ascii")
    if len(raw) > MAX_DTYPE_BYTES:
        raise ValueError(f"dtype name {dtype!r} is longer than {MAX_DTYPE_BYTES} bytes")
    return raw


class Header(NamedTuple):
    """A decoded, validated record header."""

    seq: int
    meta: BlockMeta
    stored_crc: int
    header_len: int  # bytes of the header proper (94 + N + 4); the rest of its page is zeros

    @property
    def record_bytes(self) -> int:
        return record_bytes(self.meta.stored_length)


@lru_cache(maxsize=4096)
def _namespace_str(raw: bytes) -> str:
    return raw.decode("utf-8")


@lru_cache(maxsize=64)
def _dtype_str(raw: bytes) -> str:
    return raw.decode("ascii")


def validate_meta(meta: BlockMeta) -> None:
    """Raise ValueError when ``meta`` cannot be encoded in a header."""
    if len(meta.hash) != 16:
        raise ValueError(f"block hash must be 16 bytes, got {len(meta.hash)}")
    if len(meta.parent) not in (0, 16):
        raise ValueError(f"parent hash must be 16 bytes or empty, got {len(meta.parent)}")
    _namespace_bytes(meta.namespace)
    _dtype_bytes(meta.dtype)


def encode_header(meta: BlockMeta, seq: int, stored_crc: int) -> bytes:
    """The header proper (without the zero fill of its page)."""
    if len(meta.hash) != 16:
        raise ValueError(f"block hash must be 16 bytes, got {len(meta.hash)}")
    if len(meta.parent) not in (0, 16):
        raise ValueError(f"parent hash must be 16 bytes or empty, got {len(meta.parent)}")
    ns = _namespace_bytes(meta.namespace)
    dt = _dtype_bytes(meta.dtype)
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        FLAG_PARENT if meta.parent else 0,
        len(dt),
        seq,
        meta.hash,
        meta.parent or bytes(16),
        meta.codec,
        dt,
        meta.raw_length,
        meta.stored_length,
        meta.crc32c & 0xFFFFFFFF,
        stored_crc,
        len(ns),
    )
    body = fixed + ns
    return body + _CRC.pack(_crc32c(body))


def check_header(buf: Any, offset: int = 0) -> tuple[int, int] | None:
    """(stored length, stored crc) of a valid header at ``buf[offset:]``, without decoding the rest."""
    try:
        fixed = _FIXED.unpack_from(buf, offset)
    except struct.error:
        return None
    nslen = fixed[13]
    if fixed[0] != MAGIC or fixed[1] != VERSION or nslen > MAX_NAMESPACE_BYTES:
        return None
    end = offset + _FIXED.size + nslen
    if end + 4 > len(buf) or _crc32c(memoryview(buf)[offset:end]) != _CRC.unpack_from(buf, end)[0]:
        return None
    return fixed[10], fixed[12]


def decode_header(buf: Any, offset: int = 0) -> Header | None:
    """Decode and validate a header at ``buf[offset:]``; None when it is not a valid header."""
    try:
        (magic, version, flags, dtlen, seq, h, parent, codec, dt, raw_len, stored_len, raw_crc, stored_crc, nslen) = (
            _FIXED.unpack_from(buf, offset)
        )
    except struct.error:
        return None
    if magic != MAGIC or version != VERSION or nslen > MAX_NAMESPACE_BYTES or dtlen > MAX_DTYPE_BYTES:
        return None
    end = offset + _FIXED.size + nslen
    if end + 4 > len(buf):
        return None
    body = bytes(buf[offset:end])
    if _crc32c(body) != _CRC.unpack_from(buf, end)[0]:
        return None
    try:
        namespace = _namespace_str(body[_FIXED.size :])
        dtype = _dtype_str(dt[:dtlen])
    except UnicodeDecodeError:
        return None
    meta = BlockMeta(namespace, h, parent if flags & FLAG_PARENT else b"", codec, dtype, raw_len, stored_len, raw_crc)
    return Header(seq, meta, stored_crc, end + 4 - offset)
