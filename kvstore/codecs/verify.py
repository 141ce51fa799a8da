"""``verify_crc(meta, stored, stored_crc) -> bool``: does a stored block hold what its header says?

A raw block (codec 0) matches when the CRC32C computed over its bytes as they landed equals the header's. An
encoded block is decoded and the CRC32C of the raw bytes is compared (the header carries the raw bytes' CRC).
Used by every server path that accepts a Put (the gRPC handler, the lanes, the coded transfer).
"""

from __future__ import annotations

from typing import Protocol

from kvstore.checksum import crc32c
from kvstore.codecs.registry import decode


class StoredMeta(Protocol):
    """What a block's header says of it (a tier's BlockMeta, say)."""

    @property
    def codec(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def raw_length(self) -> int: ...
    @property
    def crc32c(self) -> int: ...


def verify_crc(meta: StoredMeta, stored: memoryview, stored_crc: int) -> bool:
    """``stored_crc`` is the CRC of ``stored``, as it landed."""
    if meta.codec == 0:
        return stored_crc == meta.crc32c
    try:
        raw = decode(meta.codec, stored, meta.dtype, meta.raw_length)
    except Exception:  # noqa: BLE001 - any failure to decode means the bytes are not what the header says
        return False
    return len(raw) == meta.raw_length and crc32c(raw) == meta.crc32c
