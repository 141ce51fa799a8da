"""Codec registry (by name and by wire id) and the module-level verbs.

``encode``/``decode`` are the public contract of DESIGN 2.4; ``encode_into``
and ``decode_into`` are the zero-copy forms the data path uses to write into a
send buffer, an arena slot or a KV pool block. ``lz4`` is registered only when
the ``lz4`` package is importable.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

import numpy as np

from .base import DEFAULT_HEAD_DIM, Codec, CodecError, EncodeOptions
from .buffers import BufferLike, as_u8, as_writable_u8, is_device_tensor
from .byteplane import BytePlaneCodec
from .fp8 import Fp8Codec, Fp8ZstdCodec
from .raw import NoneCodec
from .zstd import ZstdCodec

_BY_NAME: dict[str, Codec] = {}
_BY_ID: dict[int, Codec] = {}


def register(codec: Codec) -> None:
    """Add ``codec``; its name and id must both be new."""
    if codec.name in _BY_NAME or codec.id in _BY_ID:
        raise ValueError(f"codec {codec.name!r} / id {codec.id} already registered")
    _BY_NAME[codec.name] = codec
    _BY_ID[codec.id] = codec


for _codec in (NoneCodec(), ZstdCodec(), BytePlaneCodec(), Fp8Codec(), Fp8ZstdCodec()):
    register(_codec)
if importlib.util.find_spec("lz4") is not None:
    from .lz4codec import Lz4Codec

    register(Lz4Codec())


def get_codec(codec: str | int | Codec) -> Codec:
    """The codec with this name or wire id; raises CodecError for an unknown one."""
    if isinstance(codec, Codec):
        return codec
    found = _BY_ID.get(codec) if isinstance(codec, int) else _BY_NAME.get(codec)
    if found is None:
        raise CodecError(f"unknown codec {codec!r}; known: {', '.join(_BY_NAME)}")
    return found


def codec_names(*, lossy: bool | None = None) -> list[str]:
    """Registered names in wire-id order; ``lossy=False`` keeps the lossless ones."""
    return [c.name for _, c in sorted(_BY_ID.items()) if lossy is None or c.lossy == lossy]


def codec_id(name: str) -> int:
    return get_codec(name).id


def codec_name(wire_id: int) -> str:
    return get_codec(wire_id).name


def accepted_from_wire(codec_ids: Iterable[int]) -> frozenset[str]:
    """Names of the codecs a ``GetRequest.accepted_codecs`` list allows.

    An empty list means ``none`` only (kvstore.v1); ids this build does not
    know (a newer peer's) are skipped, ``none`` is always included.
    """
    names = {_BY_ID[i].name for i in codec_ids if i in _BY_ID}
    return frozenset(names | {"none"})


def _opts(head_dim: int) -> EncodeOptions:
    return EncodeOptions(head_dim=head_dim)


def encode(codec: str | int, data: BufferLike, dtype: str, *, head_dim: int = DEFAULT_HEAD_DIM) -> bytes:
    """The payload of ``data`` (bytes-like, numpy array or torch tensor) under ``codec``."""
    return get_codec(codec).encode(as_u8(data), dtype, _opts(head_dim))


def max_encoded_len(codec: str | int, raw_len: int, dtype: str, *, head_dim: int = DEFAULT_HEAD_DIM) -> int:
    """The room ``encode_into`` needs for ``raw_len`` bytes."""
    return get_codec(codec).max_encoded_len(raw_len, dtype, _opts(head_dim))


def encode_into(
    codec: str | int, data: BufferLike, dtype: str, out: BufferLike, *, head_dim: int = DEFAULT_HEAD_DIM
) -> int:
    """Write the payload into ``out`` (see ``max_encoded_len``); returns its length."""
    return get_codec(codec).encode_into(as_u8(data), dtype, _opts(head_dim), as_writable_u8(out))


def decode_into(codec: str | int, encoded: BufferLike, dtype: str, raw_len: int, out: BufferLike) -> None:
    """Decode ``encoded`` into ``out[:raw_len]`` (bytes of ``out`` past raw_len are untouched).

    ``out`` is any writable contiguous buffer: bytearray, memoryview, numpy
    array, host torch tensor, or a device tensor (decoded in host memory, then
    copied once).
    """
    impl = get_codec(codec)
    payload = as_u8(encoded).data
    if is_device_tensor(out):
        import torch

        host = np.empty(raw_len, dtype=np.uint8)
        impl.decode_into(payload, dtype, raw_len, host)
        out.reshape(-1).view(torch.uint8)[:raw_len].copy_(torch.from_numpy(host))
        return
    impl.decode_into(payload, dtype, raw_len, as_writable_u8(out))


def decode(codec: str | int, encoded: BufferLike, dtype: str, raw_len: int) -> bytes:
    """The ``raw_len`` decoded bytes of ``encoded``."""
    out = np.empty(raw_len, dtype=np.uint8)
    get_codec(codec).decode_into(as_u8(encoded).data, dtype, raw_len, out)
    return out.tobytes()
