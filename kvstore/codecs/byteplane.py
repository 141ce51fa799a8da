"""Byte-plane split plus zstd-1 (``byteplane``, wire id 2), lossless.

The bytes of a float differ in entropy: the high byte of a bf16/fp16 word
(sign and exponent) is highly skewed, the low byte (mantissa) is close to
uniform. Coding them as separate planes lets zstd's entropy stage see the
skew instead of an interleaved mix. For an element of ``w`` bytes (2 for
bfloat16/float16, 4 for float32) plane ``k`` holds byte ``k`` of every
little-endian element; each plane is stored zstd-1 coded or raw, whichever is
smaller (for 16-bit KV that is coded high plane, raw low plane; for float32
the two high planes code and the two low ones usually stay raw). zstd stops
early on incompressible input, so trying every plane costs little. Planes use
zstd level 1 with a 7-byte minimum match (``zstd.plane_compressor``).

Payload (little-endian)::

    header   2s magic b"BP" | u8 version=1 | u8 itemsize w | u8 tail t | u8 planes (= w)
    w times  u8 mode (0 raw, 1 zstd) | u64 stored length
    planes   plane 0 .. plane w-1, as the modes say
    tail     t raw bytes (raw_len mod w), so any byte length round-trips
"""
from __future__ import annotations

import struct

import numpy as np

from . import zstd
from .base import Codec, CodecError, EncodeOptions, DEFAULT_OPTIONS, check_out, itemsize_of

_MAGIC = b"BP"
_VERSION = 1
_HEADER = struct.Struct("<2sBBBB")
_PLANE = struct.Struct("<BQ")
_RAW, _ZSTD = 0, 1
_WORD = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def split_planes(body: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """Planes of ``body`` (uint8, length a multiple of ``itemsize``), low byte first."""
    words = body.view(_WORD[itemsize])
    planes = [words.astype(np.uint8)]
    for k in range(1, itemsize):
        planes.append((words >> np.uint8(8 * k)).astype(np.uint8))
    return planes


def join_planes(planes: list[np.ndarray], out: np.ndarray) -> None:
    """Interleave ``planes`` back into ``out`` (uint8 of len(planes) * plane length)."""
    itemsize = len(planes)
    word = _WORD[itemsize]
    words = out.view(word)
    np.left_shift(planes[-1], 8 * (itemsize - 1), out=words, dtype=word)
    for k in range(itemsize - 2, 0, -1):
        np.bitwise_or(words, np.left_shift(planes[k], 8 * k, dtype=word), out=words)
    np.bitwise_or(words, planes[0], out=words, dtype=word)


class BytePlaneCodec(Codec):
    """Byte planes, each zstd-1 or raw; bfloat16, float16 and float32."""

    name = "byteplane"
    id = 2

    def encode(self, src: np.ndarray, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> bytes:
        itemsize = itemsize_of(dtype)
        body_len = src.nbytes - src.nbytes % itemsize
        tail = src[body_len:]
        chunks: list[bytes | np.ndarray] = []
        heads = [_HEADER.pack(_MAGIC, _VERSION, itemsize, tail.nbytes, itemsize)]
        for plane in split_planes(src[:body_len], itemsize):
            coded = zstd.compress_plane(plane)
            if len(coded) < plane.nbytes:
                heads.append(_PLANE.pack(_ZSTD, len(coded)))
                chunks.append(coded)
            else:
                heads.append(_PLANE.pack(_RAW, plane.nbytes))
                chunks.append(plane)
        chunks.append(tail)
        return b"".join([*heads, *(memoryview(c) for c in chunks)])

    def decode_into(self, encoded: memoryview, dtype: str, raw_len: int, out: np.ndarray) -> None:
        check_out(self.name, out, raw_len)
        itemsize = itemsize_of(dtype)
        if len(encoded) < _HEADER.size:
            raise CodecError("byteplane: payload shorter than its header")
        magic, version, width, tail_len, nplanes = _HEADER.unpack_from(encoded)
        if magic != _MAGIC or version != _VERSION:
            raise CodecError(f"byteplane: bad magic/version {magic!r}/{version}")
        if width != itemsize or nplanes != itemsize or tail_len != raw_len % itemsize:
            raise CodecError(
                f"byteplane: payload is for itemsize {width} with tail {tail_len}, "
                f"not {dtype} with raw_len {raw_len}"
            )
        plane_len = raw_len // itemsize
        pos = _HEADER.size + nplanes * _PLANE.size
        if len(encoded) < pos:
            raise CodecError("byteplane: truncated plane table")
        planes = []
        for k in range(nplanes):
            mode, length = _PLANE.unpack_from(encoded, _HEADER.size + k * _PLANE.size)
            data = encoded[pos : pos + length]
            if len(data) != length:
                raise CodecError(f"byteplane: plane {k} truncated")
            if mode == _RAW:
                if length != plane_len:
                    raise CodecError(f"byteplane: raw plane {k} has {length} bytes, expected {plane_len}")
                planes.append(np.frombuffer(data, dtype=np.uint8))
            elif mode == _ZSTD:
                planes.append(zstd.decompress(data, plane_len, codec=self.name))
            else:
                raise CodecError(f"byteplane: unknown plane mode {mode}")
            pos += length
        if len(encoded) - pos != tail_len:
            raise CodecError(f"byteplane: {len(encoded) - pos} trailing bytes, expected tail of {tail_len}")
        body_len = plane_len * itemsize
        if body_len:
            join_planes(planes, out[:body_len])
        out[body_len:raw_len] = np.frombuffer(encoded[pos:], dtype=np.uint8)

    def max_encoded_len(self, raw_len: int, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> int:
        itemsize = itemsize_of(dtype)
        return _HEADER.size + itemsize * _PLANE.size + raw_len
