"""zstd level 1 (``zstd``, wire id 1), plus the zstd helpers other codecs share.

zstd contexts are not thread-safe, so each thread keeps its own compressor and
decompressor (``threading.local``); both release the GIL while they run, which
is what lets the encoder pipeline overlap coding with sending. Level 1 on
purpose: higher levels gain nothing on KV (DESIGN 5). Payload: one zstd frame
with the content size in its header.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from .base import DEFAULT_OPTIONS, Codec, CodecError, EncodeOptions, check_out

LEVEL = 1
_local = threading.local()


def compressor() -> zstandard.ZstdCompressor:
    """This thread's level-1 compressor (writes the content size into each frame)."""
    cctx = getattr(_local, "cctx", None)
    if cctx is None:
        cctx = _local.cctx = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
    return cctx


def plane_compressor() -> zstandard.ZstdCompressor:
    """This thread's level-1 compressor with a minimum match of 7 bytes, for byte planes.

    A byte plane of exponents is mostly entropy with few long repeats: with
    short matches disallowed zstd leaves more to its Huffman stage, which on
    real SmolLM2 bf16 KV codes the high plane 4% smaller (2.54x vs 2.44x) and
    faster. Any zstd decoder reads the frames.
    """
    cctx = getattr(_local, "plane_cctx", None)
    if cctx is None:
        params = zstandard.ZstdCompressionParameters.from_level(LEVEL, min_match=7, write_content_size=True)
        cctx = _local.plane_cctx = zstandard.ZstdCompressor(compression_params=params)
    return cctx


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def compress_bound(n: int) -> int:
    """ZSTD_COMPRESSBOUND(n) plus room for the frame header."""
    small = ((128 << 10) - n) >> 11 if n < (128 << 10) else 0
    return n + (n >> 8) + small + 32


def compress(src: np.ndarray) -> bytes:
    return compressor().compress(src.data)


def compress_into(src: np.ndarray, out: np.ndarray, *, plane: bool = False) -> int:
    """Compress ``src`` straight into ``out``; returns the frame length.

    Raises CodecError if the frame does not fit (``try_compress_into`` returns
    None instead). ``plane=True`` uses ``plane_compressor``.
    """
    n = try_compress_into(src, out, plane=plane)
    if n is None:
        raise CodecError(f"zstd: output buffer of {out.nbytes} bytes too small")
    return n


def try_compress_into(src: np.ndarray, out: np.ndarray, *, plane: bool = False) -> int | None:
    """Like ``compress_into``, but None when the frame would not fit in ``out``."""
    cctx = plane_compressor() if plane else compressor()
    reader = cctx.stream_reader(src.data, size=src.nbytes, read_size=max(src.nbytes, 1))
    try:
        return _drain(reader, out.data, "")
    except CodecError:
        return None


def decompress_into(encoded: memoryview, out: np.ndarray, raw_len: int, codec: str = "zstd") -> None:
    """Decompress one frame of exactly ``raw_len`` bytes into ``out[:raw_len]``."""
    try:
        declared = zstandard.frame_content_size(encoded)
    except zstandard.ZstdError as exc:
        raise CodecError(f"{codec}: not a zstd frame ({exc})") from None
    if declared not in (-1, raw_len):
        raise CodecError(f"{codec}: frame holds {declared} bytes, expected raw_len {raw_len}")
    reader = decompressor().stream_reader(encoded, read_across_frames=False)
    try:
        n = _drain(reader, out.data[:raw_len], f"{codec}: frame decodes to more than raw_len {raw_len}")
    except zstandard.ZstdError as exc:
        raise CodecError(f"{codec}: corrupt frame ({exc})") from None
    if n != raw_len:
        raise CodecError(f"{codec}: frame decodes to {n} bytes, expected raw_len {raw_len}")


def decompress(encoded: memoryview, raw_len: int, codec: str = "zstd") -> np.ndarray:
    """Decompress one frame of exactly ``raw_len`` bytes into a new array."""
    out = np.empty(raw_len, dtype=np.uint8)
    decompress_into(encoded, out, raw_len, codec)
    return out


def _drain(
    reader: zstandard.ZstdCompressionReader | zstandard.ZstdDecompressionReader, view: memoryview, overflow: str
) -> int:
    """readinto until EOF; raises CodecError if the stream does not fit ``view``."""
    filled = 0
    with reader:
        while filled < len(view):
            got = reader.readinto(view[filled:])
            if got == 0:
                return filled
            filled += got
        if reader.read(1):
            raise CodecError(overflow)
    return filled


class ZstdCodec(Codec):
    """zstd-1 over the raw bytes; any dtype."""

    name = "zstd"
    id = 1

    def encode(self, src: np.ndarray, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> bytes:
        return compress(src)

    def encode_into(self, src: np.ndarray, dtype: str, opts: EncodeOptions, out: np.ndarray) -> int:
        return compress_into(src, out)

    def decode_into(self, encoded: memoryview, dtype: str, raw_len: int, out: np.ndarray) -> None:
        check_out(self.name, out, raw_len)
        decompress_into(encoded, out, raw_len)

    def max_encoded_len(self, raw_len: int, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> int:
        return compress_bound(raw_len)
