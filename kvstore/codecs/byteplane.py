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
from .base import DEFAULT_OPTIONS, Codec, CodecError, EncodeOptions, check_out, itemsize_of
from .scratch import scratch

_MAGIC = b"BP"
_VERSION = 1
_HEADER = struct.Struct("<2sBBBB")
_PLANE = struct.Struct("<BQ")
_RAW, _ZSTD = 0, 1


def join_planes(planes: list[np.ndarray], out: np.ndarray) -> None:
    """Interleave ``planes`` (low byte first) into ``out`` (uint8, len(planes) x plane length)."""
    if len(planes) == 2:  # the common case, shift-and-or without temporaries
        words = out.view("<u2")
        np.left_shift(planes[1], 8, out=words, dtype=np.uint16)
        np.bitwise_or(words, planes[0], out=words, dtype=np.uint16)
        return
    for k, plane in enumerate(planes):
        np.copyto(out[k :: len(planes)], plane)


class BytePlaneCodec(Codec):
    """Byte planes, each zstd-1 or raw; bfloat16, float16 and float32."""

    name = "byteplane"
    float_only = True
    id = 2

    def encode(self, src: np.ndarray, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> bytes:
        buf = scratch("byteplane.payload", self.max_encoded_len(src.nbytes, dtype, opts))
        return buf[: self.encode_into(src, dtype, opts, buf)].tobytes()

    def encode_into(self, src: np.ndarray, dtype: str, opts: EncodeOptions, out: np.ndarray) -> int:
        itemsize = itemsize_of(dtype)
        room = self.max_encoded_len(src.nbytes, dtype, opts)
        if out.nbytes < room:
            raise CodecError(f"{self.name}: output buffer of {out.nbytes} bytes is smaller than {room}")
        plane_len = src.nbytes // itemsize
        body_len = plane_len * itemsize
        tail_len = src.nbytes - body_len
        _HEADER.pack_into(out.data, 0, _MAGIC, _VERSION, itemsize, tail_len, itemsize)
        pos = _HEADER.size + itemsize * _PLANE.size
        plane = scratch("byteplane.plane", plane_len)
        for k in range(itemsize):
            np.copyto(plane, src[k:body_len:itemsize])
            # coded only if strictly smaller than raw: give zstd one byte less room than the plane
            coded = zstd.try_compress_into(plane, out[pos : pos + max(plane_len - 1, 0)], plane=True)
            if coded is None:
                out[pos : pos + plane_len] = plane
                mode, length = _RAW, plane_len
            else:
                mode, length = _ZSTD, coded
            _PLANE.pack_into(out.data, _HEADER.size + k * _PLANE.size, mode, length)
            pos += length
        out[pos : pos + tail_len] = src[body_len:]
        return pos + tail_len

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
                f"byteplane: payload is for itemsize {width} with tail {tail_len}, not {dtype} with raw_len {raw_len}"
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
                plane = scratch(f"byteplane.plane{k}", plane_len)
                zstd.decompress_into(data, plane, plane_len, codec=self.name)
                planes.append(plane)
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
