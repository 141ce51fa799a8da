"""GetResponse and PutRequest made and read by hand (kvstore/block_messages.py) against protobuf's own writer and reader: the same
message either way, unknown fields skipped, and bytes that are not a GetResponse refused with ValueError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.block_messages import decode_get, decode_put, encode_get, encode_put, serialize
from kvstore.v1 import kvstore_pb2 as pb

headers = st.builds(
    pb.BlockHeader,
    hash=st.binary(min_size=16, max_size=16),
    codec=st.sampled_from([pb.CODEC_NONE, pb.CODEC_ZSTD]),
    raw_length=st.integers(0, 1 << 40),
    stored_length=st.integers(0, 1 << 40),
    crc32c=st.integers(0, (1 << 32) - 1),
    dtype=st.sampled_from(["", "uint8", "bfloat16"]),
    missing=st.booleans(),
)
parts = st.lists(st.binary(max_size=300), max_size=4)


@settings(max_examples=150, deadline=None)
@given(header=st.none() | headers, data=parts, blocks=st.lists(headers, max_size=5))
def test_encode_is_what_protobuf_writes_and_decode_reads_it_back(header, data, blocks):
    raw = encode_get(header, [memoryview(p) for p in data], blocks)
    want = pb.GetResponse(data=b"".join(data), blocks=blocks)
    if header is not None:
        want.header.CopyFrom(header)
    assert raw == want.SerializeToString()  # byte for byte: fields in number order, as protobuf writes them
    assert pb.GetResponse.FromString(raw) == want
    got = decode_get(raw)
    assert bytes(got.data) == want.data and got.blocks == list(want.blocks)
    assert (got.header is not None) == want.HasField("header") and (got.header is None or got.header == want.header)


@settings(max_examples=100, deadline=None)
@given(header=headers, data=st.binary(max_size=200), unknown=st.binary(max_size=20), number=st.integers(4, 1000))
def test_decode_reads_fields_in_any_order_and_skips_unknown_ones(header, data, unknown, number):
    def tag(n: int, kind: int) -> bytes:
        return _varint(n << 3 | kind)

    extra = tag(number, 2) + _varint(len(unknown)) + unknown + tag(number, 0) + _varint(1 << 40)
    extra += tag(number, 5) + b"\x01\x02\x03\x04" + tag(number, 1) + bytes(8)
    raw = extra + pb.GetResponse(data=data).SerializeToString() + pb.GetResponse(header=header).SerializeToString()
    got = decode_get(raw)
    assert bytes(got.data) == data and got.header == header and got.blocks == []
    assert pb.GetResponse.FromString(raw).header == header  # protobuf reads the same message


@settings(max_examples=150, deadline=None)
@given(
    namespace=st.text(max_size=20),
    header=st.none() | headers,
    data=parts,
    blocks=st.lists(headers, max_size=3),
    unknown=st.binary(max_size=10),
)
def test_put_requests_are_what_protobuf_writes_and_read_back_from_any_writer(namespace, header, data, blocks, unknown):
    raw = encode_put(namespace, header, [memoryview(p) for p in data], blocks)
    want = pb.PutRequest(namespace=namespace, data=b"".join(data), blocks=blocks)
    if header is not None:
        want.header.CopyFrom(header)
    assert raw == want.SerializeToString()
    unknown_field = _varint(9 << 3 | 2) + _varint(len(unknown)) + unknown
    for bytes_in in (raw, unknown_field + raw, want.SerializeToString() + unknown_field):
        got = decode_put(bytes_in)
        assert got.namespace == namespace and bytes(got.data) == want.data and got.blocks == list(want.blocks)
        assert (got.header is not None) == want.HasField("header") and (got.header is None or got.header == want.header)


def test_a_put_namespace_that_is_not_utf8_is_a_value_error_as_protobuf_refuses_it():
    raw = _varint(1 << 3 | 2) + b"\x02\xff\xfe"
    with pytest.raises(ValueError):
        decode_put(raw)
    with pytest.raises(Exception):  # noqa: B017, PT011 - protobuf's own DecodeError
        pb.PutRequest.FromString(raw)


def test_data_is_a_view_of_the_received_bytes_not_a_copy():
    raw = encode_get(None, [b"x" * 100_000])
    got = decode_get(raw)
    assert got.data.obj is raw and bytes(got.data) == b"x" * 100_000


def test_a_repeated_data_field_keeps_the_last_and_a_repeated_header_merges():
    raw = encode_get(None, [b"first"]) + encode_get(None, [b"second"])
    assert bytes(decode_get(raw).data) == b"second" == pb.GetResponse.FromString(raw).data
    raw = encode_get(pb.BlockHeader(stored_length=5)) + encode_get(pb.BlockHeader(crc32c=9))
    assert decode_get(raw).header == pb.BlockHeader(stored_length=5, crc32c=9) == pb.GetResponse.FromString(raw).header


@pytest.mark.parametrize(
    "raw",
    [
        encode_get(None, [b"abcdef"])[:-1],  # data shorter than its length says
        b"\x12",  # a tag and no length
        b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a length past 64 bits
        b"\x08\x01",  # header (field 1) as a varint
        b"\x0b",  # a group start
        b"\x25\x01\x02",  # a fixed32 cut short
    ],
)
def test_bytes_that_are_not_a_get_response_are_a_value_error(raw):
    with pytest.raises(ValueError):
        decode_get(raw)


def test_serialize_passes_encoded_bytes_and_writes_protobuf_objects():
    raw = encode_get(pb.BlockHeader(missing=True))
    assert serialize(raw) is raw
    assert serialize(pb.GetResponse(data=b"ab")) == pb.GetResponse(data=b"ab").SerializeToString()


def _varint(n: int) -> bytes:
    """``n`` as protobuf's own writer encodes a varint (a uint64 field's bytes past its one-byte tag): an encoder
    independent of the one under test."""
    return pb.PutResponse(packed_bytes=n).SerializeToString()[1:] if n else b"\x00"
