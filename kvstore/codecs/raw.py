"""The identity codec (``none``, wire id 0): the payload is the raw bytes."""

from __future__ import annotations

import numpy as np

from .base import DEFAULT_OPTIONS, Codec, CodecError, EncodeOptions, check_out


class NoneCodec(Codec):
    name = "none"
    id = 0

    def encode(self, src: np.ndarray, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> bytes:
        return src.tobytes()

    def encode_into(self, src: np.ndarray, dtype: str, opts: EncodeOptions, out: np.ndarray) -> int:
        if out.nbytes < src.nbytes:
            raise CodecError(f"none: output buffer of {out.nbytes} bytes is smaller than {src.nbytes}")
        out[: src.nbytes] = src
        return src.nbytes

    def decode_into(self, encoded: memoryview, dtype: str, raw_len: int, out: np.ndarray) -> None:
        if len(encoded) != raw_len:
            raise CodecError(f"none: payload of {len(encoded)} bytes, expected raw_len {raw_len}")
        check_out(self.name, out, raw_len)
        out[:raw_len] = np.frombuffer(encoded, dtype=np.uint8)

    def max_encoded_len(self, raw_len: int, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> int:
        return raw_len
