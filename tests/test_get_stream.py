"""The gRPC Get stream's two forms: a block per message (header, then data chunks) and whole small blocks packed
several to a message (``GetRequest.packed``, ``GetResponse.blocks``).

The server's ``Packer`` and the client's ``receive_blocks`` against each other (hypothesis: block sizes around
the chunk, missing blocks, every kind of output), the faults a reader must catch in a packed message, then a real
store: a packed Get and an old reader's per-block Get return the same bytes, and a packed Get of 16 KiB blocks
takes a message per chunk's worth of them, not one per block.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.block_messages import GetMessage, decode_get
from kvstore.checksum import crc32c
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.get_stream import get_call, receive_blocks
from kvstore.payload import Segments
from kvstore.server.block_stream import Packer
from kvstore.v1 import kvstore_pb2 as pb

CHUNK = 4096


def header(data: bytes | None) -> pb.BlockHeader:
    if data is None:
        return pb.BlockHeader(missing=True)
    return pb.BlockHeader(hash=bytes(16), stored_length=len(data), raw_length=len(data), crc32c=crc32c(data))


def packed_stream(blocks: list[bytes | None], chunk: int = CHUNK) -> list[GetMessage]:
    """The messages the server's Packer makes of these blocks, in order, as the client reads them; protobuf
    reads each message's bytes the same way, and each counts the block bytes it carries."""
    packer, encoded = Packer(chunk), []
    for data in blocks:
        encoded += list(packer.add(header(data), memoryview(data or b"")))
    if packer.held:
        encoded.append(packer.take())
    messages = []
    for raw, n in encoded:
        msg, parsed = decode_get(raw), pb.GetResponse.FromString(raw)
        assert bytes(msg.data) == parsed.data and len(parsed.data) == n
        assert list(msg.blocks) == list(parsed.blocks) and (msg.header is not None) == parsed.HasField("header")
        assert msg.header is None or msg.header == parsed.header
        messages.append(msg)
    return messages


def outputs(kind: str, blocks: list[bytes | None]) -> list | None:
    if kind == "none":
        return None
    sizes = [len(b or b"") + 3 for b in blocks]  # a little room to spare, as a pool's pages have
    if kind == "numpy":
        return [np.zeros(n, np.uint8) for n in sizes]
    if kind == "bytearray":
        return [bytearray(n) for n in sizes]
    return [Segments([np.zeros(n // 2, np.uint8), np.zeros(n - n // 2, np.uint8)]) for n in sizes]


def as_bytes(x) -> bytes:
    if isinstance(x, Segments):
        return b"".join(bytes(np.asarray(v)) for v in x.views)
    return bytes(memoryview(x).cast("B"))


sizes = st.one_of(st.none(), st.integers(0, 3 * CHUNK))


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(sizes, min_size=1, max_size=24),
    kind=st.sampled_from(["none", "numpy", "bytearray", "segments"]),
)
def test_packed_messages_give_back_every_block_in_order(lengths, kind):
    rng = np.random.default_rng(len(lengths))
    blocks = [None if n is None else rng.bytes(n) for n in lengths]
    messages = packed_stream(blocks)
    for msg in messages:  # at most a chunk a message; a message holds whole blocks or a part of one
        assert len(msg.data) <= CHUNK
        assert not (msg.blocks and msg.header is not None)
        assert len(msg.data) == sum(h.stored_length for h in msg.blocks) or not msg.blocks
    for a, b in zip(messages, messages[1:]):  # full: the next packed block would not have fitted
        if a.blocks and b.blocks:
            assert len(a.data) + b.blocks[0].stored_length > CHUNK
    out = outputs(kind, blocks)
    got = receive_blocks(iter(messages), len(blocks), out, verify=True)
    for i, (g, data) in enumerate(zip(got, blocks)):
        if data is None:
            assert g is None
            continue
        if out is None:
            assert bytes(g) == data
        else:
            assert g is out[i] and as_bytes(g)[: len(data)] == data
    per_block = sum(1 if b is None else max(1, -(-len(b) // CHUNK)) for b in blocks)
    assert len(messages) <= per_block  # never more messages than a block a message makes


def test_sixteen_small_blocks_are_one_message():
    blocks = [bytes([i]) * 256 for i in range(16)]
    messages = packed_stream(blocks)
    assert len(messages) == 1 and len(messages[0].blocks) == 16


def test_a_corrupt_block_in_a_packed_message_is_data_loss_naming_it():
    blocks = [b"a" * 100, b"b" * 200, b"c" * 300]
    messages = packed_stream(blocks)
    messages[0].blocks[1].crc32c ^= 1
    with pytest.raises(KVStoreError) as err:
        receive_blocks(iter(messages), 3, None, verify=True)
    assert err.value.code == grpc.StatusCode.DATA_LOSS and "block 1" in str(err.value)
    assert receive_blocks(iter(packed_stream(blocks)), 3, None, verify=False)[1] == b"b" * 200


@pytest.mark.parametrize("change", [-1, 1])
def test_a_packed_message_whose_bytes_do_not_match_its_blocks_is_data_loss(change):
    messages = packed_stream([b"a" * 100, b"b" * 200])
    messages[0].data = messages[0].data[:-1] if change < 0 else memoryview(bytes(messages[0].data) + b"x")
    with pytest.raises(KVStoreError) as err:
        receive_blocks(iter(messages), 2, None, verify=False)
    assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_a_packed_message_inside_a_chunked_block_is_data_loss():
    big = packed_stream([b"x" * (2 * CHUNK)])  # header + first chunk, then a data-only message
    small = packed_stream([b"y" * 10])
    with pytest.raises(KVStoreError) as err:
        receive_blocks(iter([big[0], small[0], big[1]]), 2, None, verify=False)
    assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_a_short_output_buffer_is_a_value_error():
    with pytest.raises(ValueError, match="output buffer 0"):
        receive_blocks(iter(packed_stream([b"a" * 100])), 1, [np.zeros(10, np.uint8)], verify=True)


# -- through a store --------------------------------------------------------------------------------------------
def test_packed_and_per_block_gets_return_the_same_bytes(make_server):
    server = make_server()
    rng = np.random.default_rng(7)
    hashes = [rng.bytes(16) for _ in range(70)]
    blocks = [rng.integers(0, 256, n, dtype=np.uint8) for n in [16 << 10] * 64 + [3 << 20] + [1 << 20] * 5]
    with Client(f"127.0.0.1:{server.port}", lane="grpc", timeout=30) as kv:
        kv.put("ns", hashes, blocks, chained=False)
        wanted = hashes[:40] + [b"\x01" * 16] + hashes[40:]  # one missing, between packed runs
        for packed in (False, True):
            request = pb.GetRequest(namespace="ns", hashes=wanted, allow_missing=True, packed=packed)
            messages = list(get_call(kv._channel)(request, timeout=30))  # noqa: SLF001 - the raw stream
            assert any(m.blocks for m in messages) == packed
            got = receive_blocks(iter(messages), len(wanted), None, verify=True)
            assert got[40] is None
            assert all(bytes(g) == b.tobytes() for g, b in zip(got[:40] + got[41:], blocks))
            if packed:  # 64 blocks of 16 KiB in 1 MiB messages, the 3 MiB block in chunks, the 1 MiB ones alone
                assert len(messages) == 1 + 3 + 5
        out = [np.zeros(len(b), np.uint8) for b in blocks]
        got = kv.get("ns", hashes, out=out)  # the client's own Gets ask for packed messages
        assert all(g is o and np.array_equal(o, b) for g, o, b in zip(got, out, blocks))


def test_blocks_held_in_tensors_go_out_whole_in_either_form():
    """An HBM tier's slots are torch tensors: both forms take their bytes through ``memops.host_bytes`` (a
    memoryview of one failed, and a packed message could not join one)."""
    import torch

    from kvstore.server.block_stream import chunks
    from kvstore.store import Lease

    data = [bytes(range(256)) * 40, b"q" * 3 * CHUNK]  # 10 KiB, then a block over a chunk
    for raw in data:
        tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        lease = Lease(0, bytes(16), pb.CODEC_NONE, "uint8", len(raw), len(raw), crc32c(raw), 2, tensor)
        got = receive_blocks(iter(decode_get(m) for m, _ in chunks(lease, CHUNK)), 1, None, verify=True)
        assert bytes(got[0]) == raw
    packer = Packer(1 << 20)
    tensors = [torch.frombuffer(bytearray(raw), dtype=torch.uint8) for raw in data]
    messages = [m for raw, t in zip(data, tensors) for m in packer.add(header(raw), t)] + [packer.take()]
    got = receive_blocks(iter(decode_get(m) for m, _ in messages), 2, None, verify=True)
    assert [bytes(g) for g in got] == data
