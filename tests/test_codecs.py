"""Lossless codecs round-trip byte for byte; the registry matches the wire enum."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.codecs import (
    CodecError,
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
from kvstore.v1 import kvstore_pb2 as pb

LOSSLESS = codec_names(lossy=False)
DTYPES = ["bfloat16", "float16", "float32"]


def kv_like(n_bytes: int, dtype: str, seed: int) -> bytes:
    """Bytes of normally distributed values (with a few outliers) in ``dtype``, then cut to n_bytes."""
    rng = np.random.default_rng(seed)
    itemsize = 4 if dtype == "float32" else 2
    n = n_bytes // itemsize + 1
    x = rng.standard_normal(n).astype(np.float32) * rng.choice([0.01, 1.0, 30.0], size=n, p=[0.2, 0.75, 0.05])
    if dtype == "bfloat16":
        raw = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    elif dtype == "float16":
        raw = x.astype(np.float16).tobytes()
    else:
        raw = x.tobytes()
    return raw[:n_bytes]


def test_ids_match_wire_enum() -> None:
    wire = {
        "none": pb.CODEC_NONE,
        "zstd": pb.CODEC_ZSTD,
        "byteplane": pb.CODEC_BYTEPLANE,
        "fp8": pb.CODEC_FP8,
        "fp8+zstd": pb.CODEC_FP8_ZSTD,
        "lz4": pb.CODEC_LZ4,
    }
    for name in codec_names():
        assert codec_id(name) == wire[name]
        assert codec_name(wire[name]) == name
        assert get_codec(wire[name]) is get_codec(name)
    assert {"none", "zstd", "byteplane", "fp8", "fp8+zstd"} <= set(codec_names())
    assert [get_codec(n).lossy for n in ("fp8", "fp8+zstd")] == [True, True]
    assert not any(get_codec(n).lossy for n in LOSSLESS)


def test_unknown_codec_and_dtype() -> None:
    with pytest.raises(CodecError):
        encode("brotli", b"abcd", "bfloat16")
    with pytest.raises(CodecError):
        get_codec(42)
    with pytest.raises(CodecError):
        encode("byteplane", b"abcd", "int8")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    codec=st.sampled_from(LOSSLESS),
    dtype=st.sampled_from(DTYPES),
    n_bytes=st.integers(min_value=0, max_value=70_001),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_lossless_round_trip(codec: str, dtype: str, n_bytes: int, seed: int) -> None:
    raw = kv_like(n_bytes, dtype, seed)
    encoded = encode(codec, raw, dtype)
    assert decode(codec, encoded, dtype, len(raw)) == raw


@pytest.mark.parametrize("codec", LOSSLESS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_bytes", [0, 1, 2, 3, 5, 7, 4099, 368_641])
def test_lossless_odd_sizes(codec: str, dtype: str, n_bytes: int) -> None:
    raw = kv_like(n_bytes, dtype, n_bytes)
    assert decode(codec, encode(codec, raw, dtype), dtype, n_bytes) == raw


@pytest.mark.parametrize("codec", LOSSLESS)
def test_compresses_skewed_exponents(codec: str) -> None:
    raw = kv_like(1 << 18, "bfloat16", 1)
    ratio = len(raw) / len(encode(codec, raw, "bfloat16"))
    expected = {"none": 1.0, "lz4": 0.99, "zstd": 1.1, "byteplane": 1.25}[codec]
    assert ratio >= expected


def test_byteplane_beats_zstd_on_16_bit() -> None:
    for dtype in ("bfloat16", "float16"):
        raw = kv_like(1 << 18, dtype, 2)
        assert len(encode("byteplane", raw, dtype)) < len(encode("zstd", raw, dtype))


@pytest.mark.parametrize("codec", codec_names())
def test_buffer_kinds_and_into(codec: str) -> None:
    torch = pytest.importorskip("torch")
    raw = kv_like(6144, "bfloat16", 3)
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).reshape(2, 3, 16, 32)
    expected = encode(codec, raw, "bfloat16")
    for data in (bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint16).reshape(3, -1), tensor):
        assert decode(codec, encode(codec, data, "bfloat16"), "bfloat16", len(raw)) == decode(
            codec, expected, "bfloat16", len(raw)
        )
    # a non-contiguous tensor is made contiguous, as the layout demands
    assert encode(codec, tensor.transpose(0, 1).contiguous(), "bfloat16") == encode(
        codec, tensor.transpose(0, 1), "bfloat16"
    )
    # encode_into a larger buffer, decode_into an offset slot of a larger arena
    room = max_encoded_len(codec, len(raw), "bfloat16")
    send = bytearray(room + 10)
    n = encode_into(codec, raw, "bfloat16", send)
    assert n <= room
    arena = np.full(3 * len(raw), 0xAB, dtype=np.uint8)
    decode_into(codec, memoryview(send)[:n], "bfloat16", len(raw), arena[len(raw) :])
    assert arena[: len(raw)].tobytes() == b"\xab" * len(raw)
    assert arena[2 * len(raw) :].tobytes() == b"\xab" * len(raw)
    out = torch.empty_like(tensor)
    decode_into(codec, send[:n], "bfloat16", len(raw), out)
    if not get_codec(codec).lossy:
        assert arena[len(raw) : 2 * len(raw)].tobytes() == raw
        assert torch.equal(out.view(torch.int16), tensor.view(torch.int16))


@pytest.mark.parametrize("codec", codec_names())
def test_corrupt_or_mismatched_payload_raises(codec: str) -> None:
    raw = kv_like(4096, "bfloat16", 4)
    encoded = encode(codec, raw, "bfloat16")
    with pytest.raises(CodecError):
        decode(codec, encoded, "bfloat16", len(raw) + 2)
    if codec != "none":
        with pytest.raises(CodecError):
            decode(codec, encoded[: len(encoded) // 2], "bfloat16", len(raw))
    with pytest.raises((CodecError, TypeError)):
        decode_into(codec, encoded, "bfloat16", len(raw), bytes(len(raw)))
    with pytest.raises(CodecError):
        decode_into(codec, encoded, "bfloat16", len(raw), bytearray(len(raw) - 1))


def test_package_import_does_not_import_torch() -> None:
    code = (
        "import sys, kvstore.codecs, kvstore.codecs.pipeline, kvstore.codecs.controller; print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("codec", codec_names())
def test_threads_do_not_share_work_buffers(codec: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    blocks = [kv_like(96_000 + 2 * i, "bfloat16", i) for i in range(8)]
    expected = [encode(codec, b, "bfloat16") for b in blocks]

    def round_trip(i: int) -> tuple[bytes, bytes]:
        payload = encode(codec, blocks[i], "bfloat16")
        return payload, decode(codec, payload, "bfloat16", len(blocks[i]))

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(round_trip, list(range(8)) * 4))
    for i, (payload, back) in enumerate(results):
        assert payload == expected[i % 8]
        assert back == decode(codec, expected[i % 8], "bfloat16", len(blocks[i % 8]))


def test_device_destination_goes_through_host() -> None:
    torch = pytest.importorskip("torch")
    raw = kv_like(4096, "bfloat16", 5)
    dest = torch.empty(2048, dtype=torch.bfloat16, device="meta")  # stands in for a cuda tensor: no host view
    with pytest.raises(TypeError):
        from kvstore.codecs.buffers import as_writable_u8

        as_writable_u8(dest)
    decode_into("zstd", encode("zstd", raw, "bfloat16"), "bfloat16", len(raw), dest)


def test_accepted_from_wire() -> None:
    from kvstore.codecs import accepted_from_wire

    assert accepted_from_wire([]) == {"none"}
    assert accepted_from_wire([pb.CODEC_ZSTD, pb.CODEC_FP8, 99]) == {"none", "zstd", "fp8"}
