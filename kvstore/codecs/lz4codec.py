"""LZ4 block (``lz4``, wire id 5): very fast, useful only on sparse blocks.

On dense KV lz4 finds nothing (ratio 1.00; DESIGN 5). It earns its place on
zero-padded blocks (partially filled pages, padded head dims), where it keeps
most of zstd-1's ratio at several times the speed; bench/codecs.py measures
both cases on real KV so the controller's prior and this claim stay honest.
Payload: an lz4 block with its 4-byte little-endian raw length in front
(``lz4.block`` ``store_size=True``). The python-lz4 binding only returns new
buffers, so ``decode_into`` copies once.
"""

from __future__ import annotations

import lz4.block
import numpy as np

from .base import DEFAULT_OPTIONS, Codec, CodecError, EncodeOptions, check_out


class Lz4Codec(Codec):
    name = "lz4"
    id = 5

    def encode(self, src: np.ndarray, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> bytes:
        encoded: bytes = lz4.block.compress(src, mode="fast", store_size=True)
        return encoded

    def decode_into(self, encoded: memoryview, dtype: str, raw_len: int, out: np.ndarray) -> None:
        check_out(self.name, out, raw_len)
        if len(encoded) < 4 or int.from_bytes(encoded[:4], "little") != raw_len:
            raise CodecError(f"lz4: payload does not declare raw_len {raw_len}")
        try:
            raw = lz4.block.decompress(encoded)
        except lz4.block.LZ4BlockError as exc:
            raise CodecError(f"lz4: corrupt block ({exc})") from None
        out[:raw_len] = np.frombuffer(raw, dtype=np.uint8)

    def max_encoded_len(self, raw_len: int, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> int:
        # LZ4_COMPRESSBOUND plus the 4-byte size prefix.
        return raw_len + raw_len // 255 + 16 + 4
