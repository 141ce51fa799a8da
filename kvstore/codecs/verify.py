"""Does a stored block hold what its header says? The check and the words of a refusal, for every Put path.

- ``verify_crc(meta, stored, stored_crc) -> bool``
- ``crc_mismatch_reason(index, meta) -> str``: the reason in a rejected block's result (gRPC and the lanes).

A raw block (codec 0) matches when the CRC32C computed over its bytes as they landed equals the header's. An
encoded block is decoded and the CRC32C of the raw bytes is compared (the header carries the raw bytes' CRC).
Used by every server path that accepts a Put (the gRPC handler, the lanes, the coded transfer).
"""

from __future__ import annotations

from typing import Protocol

from kvstore.checksum import crc32c
from kvstore.codecs.registry import codec_name, decode


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
    @property
    def hash(self) -> bytes: ...


def verify_crc(meta: StoredMeta, stored: memoryview, stored_crc: int) -> bool:
    """``stored_crc`` is the CRC of ``stored``, as it landed."""
    if meta.codec == 0:
        return stored_crc == meta.crc32c
    try:
        raw = decode(meta.codec, stored, meta.dtype, meta.raw_length)
    except Exception:  # noqa: BLE001 - any failure to decode means the bytes are not what the header says
        return False
    return len(raw) == meta.raw_length and crc32c(raw) == meta.crc32c


def crc_mismatch_reason(index: int, meta: StoredMeta) -> str:
    """The reason of a block rejected for its checksum (the same words on every lane)."""
    what = (
        "" if meta.codec == 0 else f" (or its {meta.dtype} payload does not decode with codec {codec_name(meta.codec)})"
    )
    return (
        f"block {index} ({meta.hash.hex()}): CRC32C mismatch{what}; the bytes were corrupted in transit or "
        f"the header's checksum is wrong; this block was not stored, send it again"
    )
