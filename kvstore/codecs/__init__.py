"""Per-block compression codecs, batching/pipelining helpers and the codec bandit.

Verbs (``kvstore.codecs``):

- ``encode(codec, data, dtype) -> bytes`` / ``decode(codec, encoded, dtype, raw_len) -> bytes``:
  the DESIGN 2.4 contract. ``data`` is bytes-like, a numpy array or a torch
  tensor; ``dtype`` is ``"bfloat16"``, ``"float16"`` or ``"float32"``.
  Lossless codecs round-trip byte for byte; lossy ones stay within their
  documented bound (``kvstore.codecs.fp8``).
- ``encode_into(codec, data, dtype, out) -> n`` and
  ``decode_into(codec, encoded, dtype, raw_len, out)``: the same into caller
  buffers (send buffer, arena slot, KV pool block).
- ``get_codec(name_or_id)``, ``codec_names()``, ``codec_id(name)``,
  ``codec_name(id)``: the registry; ids are the wire enum ``kvstore.v1.Codec``.
  ``accepted_from_wire(ids)``: the names a Get request's accepted list allows.

Codecs: ``none`` (0), ``zstd`` (1), ``byteplane`` (2), ``fp8`` (3, lossy),
``fp8+zstd`` (4, lossy), ``lz4`` (5, when the lz4 package is installed).
Batching and the encoder pipeline live in ``kvstore.codecs.pipeline``, the
controller that picks a codec per transfer in ``kvstore.codecs.controller``.
Importing this package never imports torch.
"""

from __future__ import annotations

from .base import DEFAULT_HEAD_DIM, Codec, CodecError, EncodeOptions
from .registry import (
    accepted_from_wire,
    codec_id,
    codec_name,
    codec_names,
    decode,
    decode_into,
    encode,
    encode_into,
    get_codec,
    max_encoded_len,
)

__all__ = [
    "DEFAULT_HEAD_DIM",
    "accepted_from_wire",
    "Codec",
    "CodecError",
    "EncodeOptions",
    "codec_id",
    "codec_name",
    "codec_names",
    "decode",
    "decode_into",
    "encode",
    "encode_into",
    "get_codec",
    "max_encoded_len",
]
