"""Lossy FP8 (``fp8``, wire id 3) and FP8 then zstd-1 (``fp8+zstd``, wire id 4).

Each vector of ``head_dim`` consecutive elements (one token of one head in the
block layout ``[layers][K,V][block_size][kv_heads][head_dim]``) gets its own
scale ``s = m / 448`` with ``m`` the vector's largest magnitude, stored as
bfloat16 rounded up (so ``|x / s| <= 448`` always); the elements are stored as
E4M3 codes of ``x / s`` and decoded to ``s * q(x / s)`` in the block's own
dtype. A block whose element count is not a multiple of ``head_dim`` gets a
shorter last vector; a byte length that is not a multiple of the element size
keeps its last bytes raw. Only bfloat16, float16 and float32 blocks.

Error bound, per element ``x`` of a vector with max magnitude ``m`` and decoded
value ``x'`` (finite inputs)::

    |x' - x| <= 2**-4 * |x|  +  2**-10 * s  +  r(x')
    s <= m / 448 * (1 + 2**-7)        (bfloat16 scale, rounded up)
    r(x') = rounding to the output dtype: 2**-8 |x'| for bfloat16,
            2**-11 |x'| (+ 2**-25 below 2**-14) for float16, 0 for float32

so relative to the vector max the error is at most about 6.7% (bfloat16
output), and elements below ``m * 2**-15`` are kept only to within
``m * 2.2e-6`` absolutely. Decoded values are clamped to the output dtype's
finite range. A vector holding Inf or NaN decodes to NaN throughout.

``fp8`` payload (little-endian)::

    header  2s magic b"F8" | u8 version=1 | u8 dtype (1 bf16, 2 fp16, 3 fp32)
            | u16 head_dim | u8 tail t | u8 pad | u64 elements n
    scales  ceil(n / head_dim) x u16 (bfloat16 bits)
    codes   n x u8 (E4M3FN)
    tail    t raw bytes

``fp8+zstd`` is one zstd-1 frame of the ``fp8`` payload.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from . import e4m3, zstd
from .base import DEFAULT_OPTIONS, Codec, CodecError, EncodeOptions, check_out, itemsize_of
from .scratch import scratch

_MAGIC = b"F8"
_VERSION = 1
_HEADER = struct.Struct("<2sBBHBxQ")
_DTYPE_CODE = {"bfloat16": 1, "float16": 2, "float32": 3}
_FINITE_MAX = {
    "bfloat16": float(np.uint32(0x7F7F0000).view(np.float32)),
    "float16": 65504.0,
    "float32": float(np.finfo(np.float32).max),
}
# float16 -> float32 by table: a 256 KiB lookup is twice as fast as numpy's half cast here.
_F16_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def fp8_payload_len(raw_len: int, dtype: str, head_dim: int) -> int:
    n = raw_len // itemsize_of(dtype)
    return _HEADER.size + 2 * (-(-n // head_dim)) + n + raw_len % itemsize_of(dtype)


def _load_f32(body: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Widen ``body`` (raw bytes of ``dtype``) into float32 ``out``."""
    if dtype == "bfloat16":
        np.left_shift(body.view("<u2"), 16, out=out.view(np.uint32), dtype=np.uint32)
    elif dtype == "float16":
        np.take(_F16_TO_F32, body.view("<u2"), out=out)
    else:
        np.copyto(out, body.view("<f4"))


def _store_from_f32(values: np.ndarray, dtype: str, out: np.ndarray, may_have_nan: bool) -> None:
    """Narrow float32 ``values`` into ``out`` (raw bytes of ``dtype``), round to nearest even."""
    if dtype == "bfloat16":
        e4m3.f32_to_bf16_bits(values, out=out.view("<u2"), may_have_nan=may_have_nan)
    elif dtype == "float16":
        np.copyto(out.view("<f2"), values, casting="same_kind")
    else:
        np.copyto(out.view("<f4"), values)


class Fp8Codec(Codec):
    """E4M3 with one bfloat16 scale per ``head_dim`` vector; see the module docstring."""

    name = "fp8"
    float_only = True
    id = 3
    lossy = True

    def encode(self, src: np.ndarray, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> bytes:
        buf = scratch("fp8.payload", self.max_encoded_len(src.nbytes, dtype, opts))
        return buf[: self.encode_into(src, dtype, opts, buf)].tobytes()

    def encode_into(self, src: np.ndarray, dtype: str, opts: EncodeOptions, out: np.ndarray) -> int:
        total = self.max_encoded_len(src.nbytes, dtype, opts)
        if out.nbytes < total:
            raise CodecError(f"{self.name}: output buffer of {out.nbytes} bytes is smaller than {total}")
        with np.errstate(invalid="ignore", over="ignore"):  # Inf/NaN vectors become NaN by design
            self._encode_into(src, dtype, opts.head_dim, out[:total])
        return total

    def _encode_into(self, src: np.ndarray, dtype: str, head_dim: int, out: np.ndarray) -> None:
        itemsize = itemsize_of(dtype)
        n = src.nbytes // itemsize
        n_vec = -(-n // head_dim)
        x = scratch("fp8.x", n_vec * head_dim, np.float32)
        _load_f32(src[: n * itemsize], dtype, x[:n])
        x[n:] = 0.0  # a short last vector is padded for the arithmetic, not stored
        vectors = x.reshape(n_vec, head_dim)
        # max |x| per vector via the bit patterns: integer max is faster, and NaN wins as it should
        magnitude = scratch("fp8.magnitude", x.size, np.uint32)
        np.bitwise_and(x.view(np.uint32), 0x7FFFFFFF, out=magnitude)
        amax = magnitude.reshape(n_vec, head_dim).max(axis=1).view(np.float32) if n_vec else x[:0]
        scale_bits = e4m3.bf16_bits_round_up(amax / np.float32(e4m3.E4M3_MAX))
        scale_bits[(scale_bits == 0) & (amax > 0)] = 1  # smallest bf16 subnormal
        scale_bits[scale_bits >= 0x7F80] = e4m3.BF16_NAN  # a vector with Inf/NaN decodes to NaN
        scale = e4m3.bf16_bits_to_f32(scale_bits)
        np.divide(vectors, np.where(scale > 0, scale, np.float32(1.0))[:, None], out=vectors)
        _HEADER.pack_into(out.data, 0, _MAGIC, _VERSION, _DTYPE_CODE[dtype], head_dim, src.nbytes - n * itemsize, n)
        pos = _HEADER.size
        out[pos : pos + 2 * n_vec].view("<u2")[...] = scale_bits
        pos += 2 * n_vec
        has_nan = bool(np.isnan(scale).any())
        e4m3.quantize_into(x[:n], out[pos : pos + n], may_have_nan=has_nan)
        out[pos + n :] = src[n * itemsize :]

    def decode_into(self, encoded: memoryview, dtype: str, raw_len: int, out: np.ndarray) -> None:
        check_out(self.name, out, raw_len)
        itemsize = itemsize_of(dtype)
        if len(encoded) < _HEADER.size:
            raise CodecError(f"{self.name}: payload shorter than its header")
        magic, version, dtype_code, head_dim, tail_len, n = _HEADER.unpack_from(encoded)
        if magic != _MAGIC or version != _VERSION:
            raise CodecError(f"{self.name}: bad magic/version {magic!r}/{version}")
        if dtype_code != _DTYPE_CODE[dtype] or head_dim == 0 or n * itemsize + tail_len != raw_len:
            raise CodecError(
                f"{self.name}: payload holds {n} elements of dtype code {dtype_code} "
                f"(+{tail_len} bytes), not raw_len {raw_len} of {dtype}"
            )
        n_vec = -(-n // head_dim)
        if len(encoded) != _HEADER.size + 2 * n_vec + n + tail_len:
            raise CodecError(f"{self.name}: payload length {len(encoded)} does not match its header")
        pos = _HEADER.size
        scales = e4m3.bf16_bits_to_f32(np.frombuffer(encoded, dtype="<u2", count=n_vec, offset=pos))
        pos += 2 * n_vec
        values = scratch("fp8.values", n, np.float32)
        np.take(e4m3.DECODE_TABLE, np.frombuffer(encoded, dtype=np.uint8, count=n, offset=pos), out=values)
        pos += n
        full = n // head_dim
        with np.errstate(invalid="ignore", over="ignore"):
            head = values[: full * head_dim].reshape(full, head_dim)
            np.multiply(head, scales[:full, None], out=head)
            if full < n_vec:
                values[full * head_dim :] *= scales[full]
        limit = _FINITE_MAX[dtype]
        top = float(scales.max(initial=0.0))  # NaN if any vector was non-finite
        if not top * e4m3.E4M3_MAX < limit:
            np.clip(values, -limit, limit, out=values)
        _store_from_f32(values, dtype, out[: n * itemsize], may_have_nan=not top == top)
        out[n * itemsize : raw_len] = np.frombuffer(encoded, dtype=np.uint8, offset=pos)

    def max_encoded_len(self, raw_len: int, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> int:
        """Exact: an fp8 payload's length depends only on raw_len, dtype and head_dim."""
        return fp8_payload_len(raw_len, dtype, opts.head_dim)


class Fp8ZstdCodec(Codec):
    """``fp8``, then one zstd-1 frame over its payload."""

    name = "fp8+zstd"
    float_only = True
    id = 4
    lossy = True

    def __init__(self) -> None:
        self._fp8 = Fp8Codec()

    def _inner(self, src: np.ndarray, dtype: str, opts: EncodeOptions) -> np.ndarray:
        inner = scratch("fp8zstd.inner", self._fp8.max_encoded_len(src.nbytes, dtype, opts))
        self._fp8.encode_into(src, dtype, opts, inner)
        return inner

    def encode(self, src: np.ndarray, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> bytes:
        return zstd.compress(self._inner(src, dtype, opts))

    def encode_into(self, src: np.ndarray, dtype: str, opts: EncodeOptions, out: np.ndarray) -> int:
        return zstd.compress_into(self._inner(src, dtype, opts), out)

    def encode_decoded(self, src: np.ndarray, dtype: str, opts: EncodeOptions, out: np.ndarray) -> bytes:
        """zstd is lossless: decode the fp8 payload before compressing it, not the frame after (saves the
        decompression, about a third of the decode)."""
        inner = self._inner(src, dtype, opts)
        payload = zstd.compress(inner)
        self._fp8.decode_into(inner.data, dtype, src.nbytes, out)
        return payload

    def decode_into(self, encoded: memoryview, dtype: str, raw_len: int, out: np.ndarray) -> None:
        check_out(self.name, out, raw_len)
        try:
            inner_len = zstandard.frame_content_size(encoded)
        except zstandard.ZstdError as exc:
            raise CodecError(f"{self.name}: not a zstd frame ({exc})") from None
        if not 0 < inner_len <= fp8_payload_len(raw_len, dtype, 1):
            raise CodecError(
                f"{self.name}: inner fp8 payload of {inner_len} bytes is implausible for raw_len {raw_len}"
            )
        inner = scratch("fp8zstd.inner", inner_len)
        zstd.decompress_into(encoded, inner, inner_len, codec=self.name)
        self._fp8.decode_into(inner.data, dtype, raw_len, out)

    def max_encoded_len(self, raw_len: int, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> int:
        return zstd.compress_bound(fp8_payload_len(raw_len, dtype, opts.head_dim))
