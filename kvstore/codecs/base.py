"""The codec interface every per-block codec implements.

A codec turns the raw bytes of one block (elements of ``dtype``) into a
self-contained payload and back. Verbs and their promises:

- ``encode(src, dtype, opts) -> bytes``: a payload that ``decode_into`` turns
  back into ``src`` byte for byte (lossless codecs) or within the codec's
  documented error bound (``lossy`` codecs). ``src`` is a flat uint8 view.
- ``encode_into(src, dtype, opts, out) -> int``: the same payload written into
  ``out[:n]``; returns ``n``. ``out`` must hold ``max_encoded_len`` bytes.
  Codecs whose library can write into a caller buffer do so without an
  intermediate copy.
- ``decode_into(encoded, dtype, raw_len, out)``: writes exactly ``raw_len``
  bytes into ``out[:raw_len]`` (a flat uint8 view) and nothing else; raises
  ``CodecError`` on a payload that is malformed or does not decode to
  ``raw_len`` bytes. Never returns partially decoded data silently.
- ``max_encoded_len(raw_len, dtype, opts) -> int``: an upper bound on the
  payload size.
- ``encode_decoded(src, dtype, opts, out) -> bytes``: ``encode``'s payload,
  and in ``out[:src.nbytes]`` exactly what ``decode_into`` makes of it (a
  lossy sender checksums that). By default it decodes the payload; a codec
  may know it cheaper (fp8+zstd: its fp8 stage, before compression).

Every codec has a ``name`` (the string used in configs and the public API),
an ``id`` matching ``kvstore.v1.Codec`` on the wire, and a ``lossy`` flag; the
controller offers lossy codecs only to namespaces whose policy allows them.
Instances are stateless and thread-safe (per-thread library contexts live in
the codec modules).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

# Element sizes of the dtypes the codecs understand by name.
DTYPE_ITEMSIZE: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
FLOAT_DTYPES = tuple(DTYPE_ITEMSIZE)
DEFAULT_HEAD_DIM = 64


class CodecError(ValueError):
    """A payload is malformed, truncated, or does not match its declared sizes."""


def itemsize_of(dtype: str) -> int:
    """Bytes per element of ``dtype``; raises CodecError for an unknown name."""
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise CodecError(f"unknown dtype {dtype!r}; expected one of {', '.join(FLOAT_DTYPES)}") from None


@dataclass(frozen=True, slots=True)
class EncodeOptions:
    """Encoder parameters; decoders read what they need from the payload header.

    ``head_dim`` is the length of one per-token per-head vector in the block
    layout ``[layers][K,V][block_size][kv_heads][head_dim]`` (DESIGN 2.2); the
    fp8 codec keeps one scale per such vector. 64 suits SmolLM2; a model with
    head_dim 128 may pass 128, or keep 64 and get two scales per head (finer,
    about 1.5% larger).
    """

    head_dim: int = DEFAULT_HEAD_DIM

    def __post_init__(self) -> None:
        if not 1 <= self.head_dim <= 65535:
            raise ValueError(f"head_dim must be in 1..65535, got {self.head_dim}")


DEFAULT_OPTIONS = EncodeOptions()


class Codec(ABC):
    """One per-block codec; see the module docstring for the verbs."""

    name: ClassVar[str]
    id: ClassVar[int]
    lossy: ClassVar[bool] = False
    float_only: ClassVar[bool] = False  # codes elements of a float dtype (FLOAT_DTYPES), not plain bytes

    @abstractmethod
    def encode(self, src: np.ndarray, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> bytes:
        """The payload for the raw bytes ``src`` (flat uint8)."""

    @abstractmethod
    def decode_into(self, encoded: memoryview, dtype: str, raw_len: int, out: np.ndarray) -> None:
        """Write the ``raw_len`` decoded bytes into ``out[:raw_len]``."""

    @abstractmethod
    def max_encoded_len(self, raw_len: int, dtype: str, opts: EncodeOptions = DEFAULT_OPTIONS) -> int:
        """An upper bound on ``len(encode(...))`` for ``raw_len`` input bytes."""

    def encode_into(self, src: np.ndarray, dtype: str, opts: EncodeOptions, out: np.ndarray) -> int:
        """Write the payload into ``out``; returns its length. Default: encode, then copy."""
        payload = self.encode(src, dtype, opts)
        n = len(payload)
        if n > out.nbytes:
            raise CodecError(f"{self.name}: output buffer of {out.nbytes} bytes is smaller than {n}")
        out[:n] = np.frombuffer(payload, dtype=np.uint8)
        return n

    def encode_decoded(self, src: np.ndarray, dtype: str, opts: EncodeOptions, out: np.ndarray) -> bytes:
        """The payload for ``src``, and in ``out[:src.nbytes]`` what a receiver will decode it to (a lossy
        sender checksums that). Default: encode, then decode the payload."""
        payload = self.encode(src, dtype, opts)
        self.decode_into(memoryview(payload), dtype, src.nbytes, out)
        return payload

    def __repr__(self) -> str:
        return f"<codec {self.name} id={self.id}{' lossy' if self.lossy else ''}>"


def check_out(codec: str, out: np.ndarray, raw_len: int) -> None:
    """Raise CodecError unless ``out`` can take ``raw_len`` bytes."""
    if out.nbytes < raw_len:
        raise CodecError(f"{codec}: destination of {out.nbytes} bytes is smaller than raw_len {raw_len}")
